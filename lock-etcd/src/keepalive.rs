//! One keep-alive stream per backend, shared by every lease it holds.
//!
//! etcd answers each keep-alive request on a stream with the lease's id
//! and its remaining ttl (0 when the lease is gone). A task owns the
//! stream: it sends each request and hands each answer to the oldest
//! caller waiting for that lease. A broken stream fails every caller
//! waiting and is opened again at the next request; so is a stream a
//! caller gave up on (a stopped server never answers it).

use std::collections::{HashMap, VecDeque};
use std::time::Duration;

use etcd_client::{Client, LeaseKeepAliveStream, LeaseKeeper};
use lock_core::{BackendError, BackendErrorKind};
use tokio::sync::{mpsc, oneshot};

use crate::error::step_error;

type Reply = oneshot::Sender<Result<bool, BackendError>>;

enum Command {
    /// Keep `lease` alive once; the reply says whether it still lives.
    KeepAlive { lease: i64, reply: Reply },
    /// A caller timed out: the stream may be hung, open another.
    Reset,
}

/// The handle of the keep-alive task; the task ends when it is dropped.
#[derive(Debug)]
pub(crate) struct KeepAlives {
    commands: mpsc::UnboundedSender<Command>,
}

impl KeepAlives {
    /// Starts the task on `client`; opening the stream waits for the first
    /// request.
    pub(crate) fn start(client: &Client, step_timeout: Duration) -> Self {
        let (commands, rx) = mpsc::unbounded_channel();
        tokio::spawn(run(client.clone(), rx, step_timeout));
        Self { commands }
    }

    /// Sends one keep-alive for `lease` and waits for its answer: whether
    /// the lease still lives (and now has its whole ttl again).
    ///
    /// # Cancel safety
    ///
    /// The keep-alive may or may not have been sent. A dropped call asks
    /// for a new stream, since the old one may be hung.
    pub(crate) async fn keep_alive(&self, lease: i64) -> Result<bool, BackendError> {
        let (reply, answer) = oneshot::channel();
        self.commands
            .send(Command::KeepAlive { lease, reply })
            .map_err(|_| closed())?;
        let mut guard = ResetOnDrop {
            commands: &self.commands,
            armed: true,
        };
        let answer = answer.await;
        guard.armed = false;
        answer.map_err(|_| closed())?
    }
}

/// Asks for a new stream when a caller stops waiting before its answer.
struct ResetOnDrop<'a> {
    commands: &'a mpsc::UnboundedSender<Command>,
    armed: bool,
}

impl Drop for ResetOnDrop<'_> {
    fn drop(&mut self) {
        if self.armed {
            let _ = self.commands.send(Command::Reset);
        }
    }
}

fn closed() -> BackendError {
    BackendError::message(BackendErrorKind::Request, "the keep-alive stream closed")
}

struct Stream {
    keeper: LeaseKeeper,
    answers: LeaseKeepAliveStream,
}

async fn next_answer(
    stream: &mut Option<Stream>,
) -> Result<Option<etcd_client::LeaseKeepAliveResponse>, etcd_client::Error> {
    match stream {
        Some(s) => s.answers.message().await,
        None => std::future::pending().await,
    }
}

async fn run(
    client: Client,
    mut commands: mpsc::UnboundedReceiver<Command>,
    step_timeout: Duration,
) {
    let mut leases = client.lease_client();
    let mut stream: Option<Stream> = None;
    let mut waiting: HashMap<i64, VecDeque<Reply>> = HashMap::new();
    loop {
        tokio::select! {
            command = commands.recv() => match command {
                None => return,
                Some(Command::Reset) => {
                    stream = None;
                    fail_all(&mut waiting, "the keep-alive stream was reset");
                }
                Some(Command::KeepAlive { lease, reply }) => {
                    if let Some(open) = &mut stream {
                        // The handle sends its lease id: point it at this lease.
                        open.keeper.id = lease;
                        match open.keeper.keep_alive().await {
                            Ok(()) => waiting.entry(lease).or_default().push_back(reply),
                            Err(error) => {
                                stream = None;
                                fail_all(&mut waiting, "the keep-alive stream broke");
                                let _ = reply.send(Err(step_error(error)));
                            }
                        }
                        continue;
                    }
                    // Opening the stream sends this lease's first
                    // keep-alive and reads its answer.
                    let opened = tokio::time::timeout(step_timeout, leases.keep_alive(lease)).await;
                    let answer = match opened {
                        Ok(Ok((keeper, answers))) => {
                            stream = Some(Stream { keeper, answers });
                            Ok(true)
                        }
                        Ok(Err(etcd_client::Error::LeaseKeepAliveError(message)))
                            if message.contains("not found") => Ok(false),
                        Ok(Err(error)) => Err(step_error(error)),
                        Err(_) => Err(BackendError::timeout("keep-alive", step_timeout)),
                    };
                    let _ = reply.send(answer);
                }
            },
            answer = next_answer(&mut stream) => match answer {
                Ok(Some(answer)) => {
                    let lease = answer.id();
                    if let Some(queue) = waiting.get_mut(&lease) {
                        if let Some(reply) = queue.pop_front() {
                            let _ = reply.send(Ok(answer.ttl() > 0));
                        }
                        if queue.is_empty() {
                            waiting.remove(&lease);
                        }
                    }
                }
                Ok(None) | Err(_) => {
                    stream = None;
                    fail_all(&mut waiting, "the keep-alive stream broke");
                }
            },
        }
    }
}

fn fail_all(waiting: &mut HashMap<i64, VecDeque<Reply>>, why: &'static str) {
    for (_, queue) in waiting.drain() {
        for reply in queue {
            let _ = reply.send(Err(BackendError::message(BackendErrorKind::Request, why)));
        }
    }
}

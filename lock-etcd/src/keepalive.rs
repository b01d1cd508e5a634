//! One keep-alive stream per backend, shared by every lease it holds.
//!
//! etcd answers each keep-alive request on a stream with the lease's id
//! and its remaining ttl (0 when the lease is gone). A task owns the
//! stream: it sends each request and hands each answer to the oldest
//! caller waiting for that lease. The stream is on the endpoint in use:
//! after a failover it is opened again on the new one at the next
//! request. A broken stream fails every caller waiting and is opened
//! again at the next request; so is a stream a caller waited on for the
//! failover timeout, whose endpoint is then passed over. A caller sends
//! its keep-alive again after such a failure, once per endpoint.
//!
//! The task runs on the background runtime \[T1\], so it outlives the
//! runtime the backend was made on. A stream serves no standing state
//! (each keep-alive is asked for by a caller and answered once), so a
//! stream that ended is opened again by the next keep-alive: the
//! driver's extensions, spaced by their own backoff, are its retries.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use etcd_client::{LeaseKeepAliveStream, LeaseKeeper};
use lock_core::{BackendError, BackendErrorKind};
use tokio::sync::{mpsc, oneshot};

use crate::endpoints::{is_endpoint_failure, Endpoints};
use crate::error::step_error;

type Reply = oneshot::Sender<Result<bool, BackendError>>;

enum Command {
    /// Keep `lease` alive once; the reply says whether it still lives.
    KeepAlive { lease: i64, reply: Reply },
    /// A caller waited for the failover timeout on the stream of pin
    /// `generation`, or gave up: its endpoint may be stopped.
    Stalled { generation: u64 },
}

/// The handle of the keep-alive task; the task ends when it is dropped.
pub(crate) struct KeepAlives {
    commands: mpsc::UnboundedSender<Command>,
    endpoints: Arc<Endpoints>,
    /// How many leases have a keep-alive waiting for its answer, as the
    /// task last counted them.
    waiting: Arc<AtomicUsize>,
}

impl KeepAlives {
    /// Starts the task on the background runtime; opening the stream
    /// waits for the first request.
    pub(crate) fn start(endpoints: &Arc<Endpoints>) -> Self {
        let (commands, rx) = mpsc::unbounded_channel();
        let waiting = Arc::new(AtomicUsize::new(0));
        endpoints
            .background()
            .spawn(run(Arc::clone(endpoints), rx, Arc::clone(&waiting)));
        Self {
            commands,
            endpoints: Arc::clone(endpoints),
            waiting,
        }
    }

    /// How many leases have a keep-alive waiting for its answer.
    pub(crate) fn waiting(&self) -> usize {
        self.waiting.load(Ordering::Relaxed)
    }

    /// Sends one keep-alive for `lease` and waits for its answer: whether
    /// the lease still lives (and now has its whole ttl again). One left
    /// unanswered for the failover timeout, or failed with its stream, is
    /// sent again on the next endpoint, up to once per endpoint.
    ///
    /// # Cancel safety
    ///
    /// The keep-alive may or may not have been sent. A dropped call asks
    /// for a new stream, since the old one may be hung.
    pub(crate) async fn keep_alive(&self, lease: i64) -> Result<bool, BackendError> {
        let after = self.endpoints.failover_after();
        let mut tries = 0;
        loop {
            tries += 1;
            let last_try = tries > self.endpoints.len();
            // The task opens its stream on this pin or a later one.
            let generation = self.endpoints.generation();
            let (reply, answer) = oneshot::channel();
            self.commands
                .send(Command::KeepAlive { lease, reply })
                .map_err(|_| closed())?;
            let mut guard = StalledOnDrop {
                commands: &self.commands,
                generation,
                armed: true,
            };
            let answer = tokio::time::timeout(after, answer).await;
            match answer {
                Ok(answer) => {
                    guard.armed = false;
                    match answer.map_err(|_| closed())? {
                        Err(error) if !last_try && !error.is_permanent() => {}
                        answer => return answer,
                    }
                }
                // Dropping the guard reports the stall.
                Err(_) if !last_try => drop(guard),
                Err(_) => return Err(BackendError::timeout("keep-alive", after)),
            }
        }
    }
}

/// Reports a stall when a caller stops waiting before its answer.
struct StalledOnDrop<'a> {
    commands: &'a mpsc::UnboundedSender<Command>,
    generation: u64,
    armed: bool,
}

impl Drop for StalledOnDrop<'_> {
    fn drop(&mut self) {
        if self.armed {
            let _ = self.commands.send(Command::Stalled {
                generation: self.generation,
            });
        }
    }
}

fn closed() -> BackendError {
    BackendError::message(BackendErrorKind::Request, "the keep-alive stream closed")
}

struct Stream {
    keeper: LeaseKeeper,
    answers: LeaseKeepAliveStream,
    generation: u64,
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
    endpoints: Arc<Endpoints>,
    mut commands: mpsc::UnboundedReceiver<Command>,
    count: Arc<AtomicUsize>,
) {
    let after = endpoints.failover_after();
    let mut stream: Option<Stream> = None;
    let mut waiting: HashMap<i64, VecDeque<Reply>> = HashMap::new();
    loop {
        count.store(waiting.len(), Ordering::Relaxed);
        tokio::select! {
            command = commands.recv() => match command {
                None => return,
                Some(Command::Stalled { generation }) => {
                    endpoints.failed(generation, &"a keep-alive went unanswered");
                    if stream.as_ref().is_some_and(|s| s.generation <= generation) {
                        stream = None;
                        fail_all(&mut waiting, "the keep-alive stream stalled");
                    }
                }
                Some(Command::KeepAlive { lease, reply }) => {
                    // A stream on an endpoint passed over is closed.
                    if stream.as_ref().is_some_and(|s| s.generation != endpoints.generation()) {
                        stream = None;
                        fail_all(&mut waiting, "the endpoint changed");
                    }
                    if let Some(open) = &mut stream {
                        // The handle sends its lease id: point it at this lease.
                        open.keeper.id = lease;
                        match open.keeper.keep_alive().await {
                            Ok(()) => waiting.entry(lease).or_default().push_back(reply),
                            Err(error) => {
                                if is_endpoint_failure(&error) {
                                    endpoints.failed(open.generation, &error);
                                }
                                stream = None;
                                fail_all(&mut waiting, "the keep-alive stream broke");
                                let _ = reply.send(Err(step_error(error)));
                            }
                        }
                        continue;
                    }
                    // Opening the stream sends this lease's first
                    // keep-alive and reads its answer.
                    let answer = open(&endpoints, lease, after).await.map(|opened| match opened {
                        Some(opened) => {
                            stream = Some(opened);
                            true
                        }
                        None => false,
                    });
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
                    if let Some(broken) = &stream {
                        endpoints.failed(broken.generation, &"the keep-alive stream broke");
                    }
                    stream = None;
                    fail_all(&mut waiting, "the keep-alive stream broke");
                }
            },
        }
    }
}

/// Opens a stream on the endpoint in use with `lease`'s keep-alive:
/// `None` when the lease is gone.
async fn open(
    endpoints: &Endpoints,
    lease: i64,
    after: std::time::Duration,
) -> Result<Option<Stream>, BackendError> {
    let pin = endpoints.pin().await.map_err(step_error)?;
    let mut leases = pin.client.lease_client();
    match tokio::time::timeout(after, leases.keep_alive(lease)).await {
        Ok(Ok((keeper, answers))) => Ok(Some(Stream {
            keeper,
            answers,
            generation: pin.generation,
        })),
        Ok(Err(etcd_client::Error::LeaseKeepAliveError(message)))
            if message.contains("not found") =>
        {
            Ok(None)
        }
        Ok(Err(error)) => {
            if is_endpoint_failure(&error) {
                endpoints.failed(pin.generation, &error);
            }
            Err(step_error(error))
        }
        Err(_) => {
            endpoints.failed(
                pin.generation,
                &"no keep-alive stream within the failover timeout",
            );
            Err(BackendError::timeout("keep-alive", after))
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

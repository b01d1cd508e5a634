//! The one `LISTEN` connection of a backend, dispatching release
//! notifications and the fair queue's grants to its [`ReleaseHub`].
//!
//! It listens on two channels: the release channel, whose payload is a
//! released key, verbatim; and the grant channel, whose payload names a
//! grant of the fair queue \[F1\] as `<fencing token>:<claim in
//! µs>:<owner length in characters>:<owner><key>` (see [`parse_grant`]).
//! A grant cannot share the release channel: keys may hold any character,
//! so any payload that names a grant could also be a key.
//!
//! It runs on the process's background runtime \[T1\], never on a
//! caller's: a caller's runtime may be dropped, or left idle, after the
//! first wait started the listener there, and waiters would then poll
//! while the listener said it listened.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use lock_core::{BackendError, Background, Grant, ReleaseHub};
use sqlx::postgres::{PgListener, PgPool, PgPoolOptions};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::error::{step_error, step_timeout};

/// The first and the longest pause between two reconnection attempts.
const BACKOFF: (Duration, Duration) = (Duration::from_millis(50), Duration::from_secs(2));

/// Where the listening connection stands.
#[derive(Clone, Debug)]
enum State {
    /// Not (yet, or no longer) listening; the last error, if any.
    Down(Option<BackendError>),
    /// `LISTEN` is active and the task that reads it runs: every release
    /// from now on is heard.
    Listening,
}

/// What the listening task needs, shared with the [`Listener`].
struct Shared {
    pool: PgPool,
    channel: String,
    grant_channel: String,
    hub: ReleaseHub,
    connect_timeout: Duration,
    state: watch::Sender<State>,
    /// Whether `LISTEN` was ever active: every later `LISTEN` wakes every
    /// watch, since releases may have been missed in between.
    listened: AtomicBool,
}

/// Starts its task on first use, on the background runtime, and stops it
/// when dropped (with the backend).
pub(crate) struct Listener {
    shared: Arc<Shared>,
    background: Background,
    /// The supervising task, while one was started.
    task: Mutex<Option<JoinHandle<()>>>,
}

impl Listener {
    /// A listener on `channel`, connecting with the options of `pool` over
    /// a one-connection pool of its own (made on `background`, as is its
    /// connection), so it never takes a connection from the user's pool.
    pub(crate) fn new(
        pool: &PgPool,
        channel: &str,
        grant_channel: &str,
        hub: ReleaseHub,
        connect_timeout: Duration,
        background: Background,
    ) -> Self {
        // sqlx spawns the pool's maintenance task on the current runtime.
        let own = {
            let _inside = background.handle().enter();
            PgPoolOptions::new()
                .max_connections(1)
                .min_connections(0)
                .acquire_timeout(connect_timeout)
                .connect_lazy_with((*pool.connect_options()).clone())
        };
        Self {
            shared: Arc::new(Shared {
                pool: own,
                channel: channel.to_owned(),
                grant_channel: grant_channel.to_owned(),
                hub,
                connect_timeout,
                state: watch::Sender::new(State::Down(None)),
                listened: AtomicBool::new(false),
            }),
            background,
            task: Mutex::new(None),
        }
    }

    /// Starts the task if it does not run, then waits until `LISTEN` is
    /// active.
    ///
    /// # Errors
    ///
    /// The listener's last connection error, or a timeout, when `LISTEN`
    /// is not active within the connect timeout.
    pub(crate) async fn ensure_listening(&self) -> Result<(), BackendError> {
        let mut rx = self.shared.state.subscribe();
        // `Listening` only while the task runs: it says `Down` as it ends.
        if matches!(*rx.borrow_and_update(), State::Listening) {
            return Ok(());
        }
        self.start();
        let waited = tokio::time::timeout(
            self.shared.connect_timeout,
            rx.wait_for(|s| matches!(s, State::Listening)),
        )
        .await;
        match waited {
            Ok(Ok(_)) => Ok(()),
            _ => match &*self.shared.state.borrow() {
                State::Listening => Ok(()),
                State::Down(Some(error)) => Err(error.clone()),
                State::Down(None) => Err(step_timeout("LISTEN", self.shared.connect_timeout)),
            },
        }
    }

    /// Spawns the task on the background runtime unless it runs already.
    fn start(&self) {
        let mut task = self.task.lock().unwrap_or_else(PoisonError::into_inner);
        if task.as_ref().is_some_and(|t| !t.is_finished()) {
            return;
        }
        *task = Some(
            self.background
                .handle()
                .spawn(supervise(Arc::clone(&self.shared))),
        );
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        if let Some(task) = self
            .task
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
        {
            task.abort();
        }
    }
}

/// Aborts its task when dropped: the listening task ends with the
/// supervisor that started it.
struct AbortOnDrop(JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Runs the listening task, and runs it again with backoff should it
/// ever end (a panic in the driver): the listener is then `Down` until
/// the new task listens, which wakes every watch.
async fn supervise(shared: Arc<Shared>) {
    let mut backoff = BACKOFF.0;
    loop {
        let mut task = AbortOnDrop(tokio::spawn(listen(Arc::clone(&shared))));
        match (&mut task.0).await {
            // `listen` never returns; it is cancelled only with this task
            // (the backend dropped) or with the runtime.
            Ok(()) => return,
            Err(error) if error.is_cancelled() => return,
            Err(error) => {
                tracing::warn!(%error, "release listener task ended; starting it again");
            }
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(BACKOFF.1);
    }
}

/// Says `Down` when the listening task ends, however it ends: a listener
/// that does not run does not listen.
struct DownWhenDropped(Arc<Shared>);

impl Drop for DownWhenDropped {
    fn drop(&mut self) {
        self.0.state.send_if_modified(|state| {
            let listening = matches!(state, State::Listening);
            if listening {
                *state = State::Down(None);
            }
            listening
        });
    }
}

/// Connects, listens and dispatches until the connection drops, then does
/// it again, waking every watch after each `LISTEN` but the listener's
/// very first, since releases may have been missed meanwhile. The first
/// wakes nobody: a watch made before it is returned only once LISTEN is
/// active, and the driver tries again right after getting it.
async fn listen(shared: Arc<Shared>) {
    let _down = DownWhenDropped(Arc::clone(&shared));
    let mut backoff = BACKOFF.0;
    loop {
        // This task runs on the background runtime, so the connection's
        // socket is registered there too.
        let channels = [shared.channel.as_str(), shared.grant_channel.as_str()];
        let mut listener = match connect(&shared.pool, &channels, shared.connect_timeout).await {
            Ok(listener) => listener,
            Err(error) => {
                tracing::debug!(error = %lock_core::ErrorChain(&error), "release listener could not connect; retrying");
                shared.state.send_replace(State::Down(Some(error)));
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(BACKOFF.1);
                continue;
            }
        };
        backoff = BACKOFF.0;
        shared.state.send_replace(State::Listening);
        if shared.listened.swap(true, Ordering::SeqCst) {
            shared.hub.notify_all();
        }
        let error = loop {
            match listener.try_recv().await {
                Ok(Some(notification)) if notification.channel() == shared.grant_channel => {
                    match parse_grant(notification.payload()) {
                        Some((key, grant)) => shared.hub.grant(key, grant),
                        None => tracing::debug!(
                            payload = notification.payload(),
                            "a notification on the grant channel that names no grant; ignored"
                        ),
                    }
                }
                Ok(Some(notification)) => shared.hub.notify(notification.payload()),
                Ok(None) => break None,
                Err(error) => break Some(step_error(error)),
            }
        };
        tracing::debug!(
            error = error
                .as_ref()
                .map(|e| tracing::field::display(lock_core::ErrorChain(e))),
            "release listener lost its connection; reconnecting"
        );
        shared.state.send_replace(State::Down(error));
        // Dropped rather than left to reconnect by itself, so that this
        // loop knows when LISTEN is active again.
        drop(listener);
    }
}

async fn connect(
    pool: &PgPool,
    channels: &[&str],
    timeout: Duration,
) -> Result<PgListener, BackendError> {
    let connecting = async {
        let mut listener = PgListener::connect_with(pool).await?;
        listener.eager_reconnect(false);
        listener.listen_all(channels.iter().copied()).await?;
        Ok::<_, sqlx::Error>(listener)
    };
    match tokio::time::timeout(timeout, connecting).await {
        Ok(Ok(listener)) => Ok(listener),
        Ok(Err(error)) => Err(step_error(error)),
        Err(_) => Err(step_timeout("LISTEN", timeout)),
    }
}

/// The key and the grant a payload of the grant channel names:
/// `<fencing token>:<claim in µs>:<n>:<owner><key>`, where `n` is the
/// owner token's length in characters (not bytes, so that a server
/// encoding other than UTF-8 counts it as the client reads it) and the key
/// is the rest, whatever characters it holds. `None` when the payload is
/// not of that form.
pub(crate) fn parse_grant(payload: &str) -> Option<(&str, Grant)> {
    let (fencing_token, rest) = payload.split_once(':')?;
    let (claim_us, rest) = rest.split_once(':')?;
    let (owner_len, rest) = rest.split_once(':')?;
    let number = |digits: &str| {
        (!digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()))
            .then(|| digits.parse::<u64>().ok())
            .flatten()
    };
    let (fencing_token, claim_us) = (number(fencing_token)?, number(claim_us)?);
    let owner_len = usize::try_from(number(owner_len)?).ok()?;
    // The byte offset after `owner_len` characters.
    let split = rest
        .char_indices()
        .map(|(at, _)| at)
        .chain(std::iter::once(rest.len()))
        .nth(owner_len)?;
    let (owner, key) = rest.split_at(split);
    if owner.is_empty() || key.is_empty() {
        return None;
    }
    let claim = Duration::from_micros(claim_us);
    Some((key, Grant::new(owner, fencing_token, claim)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_grant_payload_reads_back_whatever_the_key_and_owner_hold() {
        for (owner, key) in [
            ("node-a/0123456789abcdef0123456789abcdef", "k"),
            ("nœud:1/ff", "key:with:colons\nand\nnewlines"),
            ("a:b", "1:2:3:xy"),
            ("ü", "ünïcödé 🔒 {braces} % _ ' \" \\"),
        ] {
            let payload = format!("42:2000000:{}:{owner}{key}", owner.chars().count());
            let (k, grant) = parse_grant(&payload).unwrap();
            assert_eq!(k, key);
            assert_eq!(&*grant.owner, owner);
            assert_eq!(grant.fencing_token, 42);
            assert_eq!(grant.claim, Duration::from_secs(2));
        }
        for bad in [
            "",
            "k",
            "1:2:3",
            "x:2:1:ok",
            "1:x:1:ok",
            "1:2:x:ok",
            "1:2:5:abc",
            "1:2:3:abc",
            "1:2:0:abc",
            "-1:2:1:ab",
            "+1:2:1:ab",
        ] {
            assert!(parse_grant(bad).is_none(), "{bad:?}");
        }
    }
}

//! The one `LISTEN` connection of a backend, dispatching release
//! notifications to its [`ReleaseHub`].

use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use lock_core::{BackendError, ReleaseHub};
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
    /// `LISTEN` is active: every release from now on is heard.
    Listening,
}

/// Starts its task on first use, in the runtime of that use, and stops it
/// when dropped (with the backend).
pub(crate) struct Listener {
    pool: PgPool,
    channel: String,
    hub: ReleaseHub,
    connect_timeout: Duration,
    state: watch::Sender<State>,
    task: Mutex<Option<JoinHandle<()>>>,
}

impl Listener {
    /// A listener on `channel`, connecting with the options of `pool` over
    /// a one-connection pool of its own, so it never takes a connection
    /// from the user's pool.
    pub(crate) fn new(
        pool: &PgPool,
        channel: &str,
        hub: ReleaseHub,
        connect_timeout: Duration,
    ) -> Self {
        let own = PgPoolOptions::new()
            .max_connections(1)
            .min_connections(0)
            .acquire_timeout(connect_timeout)
            .connect_lazy_with((*pool.connect_options()).clone());
        Self {
            pool: own,
            channel: channel.to_owned(),
            hub,
            connect_timeout,
            state: watch::Sender::new(State::Down(None)),
            task: Mutex::new(None),
        }
    }

    /// Starts the task if needed, then waits until `LISTEN` is active.
    ///
    /// # Errors
    ///
    /// The listener's last connection error, or a timeout, when `LISTEN`
    /// is not active within the connect timeout.
    pub(crate) async fn ensure_listening(&self) -> Result<(), BackendError> {
        let mut rx = self.state.subscribe();
        if matches!(*rx.borrow_and_update(), State::Listening) {
            return Ok(());
        }
        self.start();
        let waited = tokio::time::timeout(
            self.connect_timeout,
            rx.wait_for(|s| matches!(s, State::Listening)),
        )
        .await;
        match waited {
            Ok(Ok(_)) => Ok(()),
            _ => match &*self.state.borrow() {
                State::Listening => Ok(()),
                State::Down(Some(error)) => Err(error.clone()),
                State::Down(None) => Err(step_timeout("LISTEN", self.connect_timeout)),
            },
        }
    }

    /// Spawns the task unless it runs already.
    fn start(&self) {
        let mut task = self.task.lock().unwrap_or_else(PoisonError::into_inner);
        if task.as_ref().is_some_and(|t| !t.is_finished()) {
            return;
        }
        *task = Some(tokio::spawn(run(
            self.pool.clone(),
            self.channel.clone(),
            self.hub.clone(),
            self.connect_timeout,
            self.state.clone(),
        )));
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

/// Connects, listens and dispatches until the connection drops, then does
/// it again, waking every watch after each reconnection since releases may
/// have been missed meanwhile. The first connection wakes nobody: a watch
/// made before it is returned only once LISTEN is active, and the driver
/// tries again right after getting it.
async fn run(
    pool: PgPool,
    channel: String,
    hub: ReleaseHub,
    connect_timeout: Duration,
    state: watch::Sender<State>,
) {
    let mut backoff = BACKOFF.0;
    let mut reconnecting = false;
    loop {
        let mut listener = match connect(&pool, &channel, connect_timeout).await {
            Ok(listener) => listener,
            Err(error) => {
                tracing::debug!(error = %lock_core::ErrorChain(&error), "release listener could not connect; retrying");
                state.send_replace(State::Down(Some(error)));
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(BACKOFF.1);
                continue;
            }
        };
        backoff = BACKOFF.0;
        state.send_replace(State::Listening);
        if reconnecting {
            hub.notify_all();
        }
        reconnecting = true;
        let error = loop {
            match listener.try_recv().await {
                Ok(Some(notification)) => hub.notify(notification.payload()),
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
        state.send_replace(State::Down(error));
        // Dropped rather than left to reconnect by itself, so that this
        // loop knows when LISTEN is active again.
        drop(listener);
    }
}

async fn connect(
    pool: &PgPool,
    channel: &str,
    timeout: Duration,
) -> Result<PgListener, BackendError> {
    let connecting = async {
        let mut listener = PgListener::connect_with(pool).await?;
        listener.eager_reconnect(false);
        listener.listen(channel).await?;
        Ok::<_, sqlx::Error>(listener)
    };
    match tokio::time::timeout(timeout, connecting).await {
        Ok(Ok(listener)) => Ok(listener),
        Ok(Err(error)) => Err(step_error(error)),
        Err(_) => Err(step_timeout("LISTEN", timeout)),
    }
}

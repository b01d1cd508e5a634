//! The runtime that drives every backend's connections, whichever runtime
//! the caller of a step runs on.
//!
//! The `redis` crate spawns a connection's driver task (the one that
//! writes the requests and reads the answers of a multiplexed or pub/sub
//! connection) on the runtime current where the connection is made, and
//! registers its socket with that runtime's reactor. A backend shared by
//! two runtimes would then depend on the one that made each connection:
//! while that runtime's threads are busy every step on the connection
//! waits, and once it is dropped the connection is dead. So a backend
//! makes its connections, and runs its background tasks (the release
//! subscription, the Cluster's slot map reads), on a runtime of its own
//! instead: one thread for the whole process, started by the first
//! connection of the first backend and ended when the last backend that
//! used it is dropped.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, OnceLock, PoisonError, Weak};
use std::task::{Context, Poll};

use tokio::runtime::Handle;
use tokio::sync::oneshot;

/// The thread's name, as debuggers and `top -H` show it.
const THREAD_NAME: &str = "lock-redis-io";

/// The background runtime while some backend holds it.
static RUNNING: Mutex<Weak<Background>> = Mutex::new(Weak::new());

/// The background runtime of one backend (and its clones): joined at the
/// first use, held until the backend is dropped.
#[derive(Default)]
pub(crate) struct Driver {
    background: OnceLock<Arc<Background>>,
}

impl Driver {
    /// The handle of the background runtime, started if none runs.
    pub(crate) fn handle(&self) -> &Handle {
        &self.background.get_or_init(Background::join).handle
    }

    /// Spawns `task` on the background runtime.
    pub(crate) fn spawn<F>(&self, task: F)
    where
        F: Future<Output = ()> + Send + 'static,
    {
        drop(self.handle().spawn(task));
    }

    /// `making` polled inside the background runtime: a connection it
    /// makes has its driver task there and its socket on that runtime's
    /// reactor, not on the caller's. The caller's runtime still awaits it.
    pub(crate) fn making<F: Future>(&self, making: F) -> Making<F> {
        Making {
            handle: self.handle().clone(),
            making: Box::pin(making),
        }
    }
}

/// The one background runtime: its thread runs until every [`Driver`]
/// holding this is dropped.
struct Background {
    handle: Handle,
    /// Dropped with this, which ends the thread (and every connection
    /// driver still on it).
    _stop: oneshot::Sender<()>,
}

impl Background {
    /// The running background runtime, or a new one.
    fn join() -> Arc<Self> {
        let mut running = RUNNING.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(background) = running.upgrade() {
            return background;
        }
        let background = Arc::new(Self::start());
        *running = Arc::downgrade(&background);
        background
    }

    fn start() -> Self {
        // Without I/O and timers a connection cannot be driven at all:
        // failing to build either (out of file descriptors, threads) is
        // not something a step could report and go on from.
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("lock-redis: cannot build the runtime that drives the Redis connections");
        let handle = runtime.handle().clone();
        let (stop, stopped) = oneshot::channel::<()>();
        std::thread::Builder::new()
            .name(THREAD_NAME.into())
            .spawn(move || {
                runtime.block_on(async {
                    let _ = stopped.await;
                });
                // Dropping the runtime drops the tasks still on it (the
                // drivers of connections nobody holds any more).
                drop(runtime);
            })
            .expect("lock-redis: cannot start the thread that drives the Redis connections");
        Self {
            handle,
            _stop: stop,
        }
    }
}

/// A future polled inside the background runtime; see [`Driver::making`].
pub(crate) struct Making<F> {
    handle: Handle,
    /// Boxed: a connection is made seldom, and the box keeps this `Unpin`.
    making: Pin<Box<F>>,
}

impl<F: Future> Future for Making<F> {
    type Output = F::Output;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let this = &mut *self;
        let _inside = this.handle.enter();
        this.making.as_mut().poll(cx)
    }
}

//! The runtime that runs every background task of the driver and of the
//! backends, whichever runtime their callers run on \[T1\].
//!
//! A task spawned on "the current runtime" lives and dies with a runtime
//! the caller may drop, or leave idle (a current-thread runtime polled
//! only inside `block_on`), or block: an extender there stops extending,
//! a listener stops listening, a keep-alive stops keeping alive, and every
//! lock depending on it is lost. So the extender, the releases sent in the
//! background, the backends' connections, subscriptions, listeners,
//! keep-alives and watches all run on one runtime of the process's own:
//! one thread named `withlock-bg`, started by the first [`Background`]
//! that is used and ended once the last one is dropped.
//!
//! The steps themselves (an acquisition, a release a callback awaits) keep
//! running on the caller's task, so an uncontended step costs no task hop.
//! A backend makes its connections inside this runtime
//! ([`Background::making`]), so that their sockets and driver tasks do not
//! depend on the caller's runtime either.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, OnceLock, PoisonError, Weak};
use std::task::{Context, Poll};

use tokio::runtime::Handle;
use tokio::sync::oneshot;

/// The thread's name, as debuggers and `top -H` show it.
pub const THREAD_NAME: &str = "withlock-bg";

/// The background runtime while something holds it.
static RUNNING: Mutex<Weak<Thread>> = Mutex::new(Weak::new());

/// A hold on the process's background runtime, taken at the first use and
/// kept until this is dropped: a backend or a locker keeps one for its
/// life. Cloning shares the hold.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// use lock_core::Background;
///
/// let background = Background::default();
/// let (tx, rx) = tokio::sync::oneshot::channel();
/// background.spawn(async move {
///     let _ = tx.send(std::thread::current().name().map(str::to_owned));
/// });
/// assert_eq!(rx.await.unwrap().as_deref(), Some(lock_core::background::THREAD_NAME));
/// # }
/// ```
#[derive(Clone, Default)]
pub struct Background {
    thread: Arc<OnceLock<Arc<Thread>>>,
}

impl std::fmt::Debug for Background {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Background")
            .field("started", &self.thread.get().is_some())
            .finish()
    }
}

impl Background {
    /// The handle of the background runtime, started if none runs.
    pub fn handle(&self) -> &Handle {
        &self.thread.get_or_init(Thread::join).handle
    }

    /// Spawns `task` on the background runtime. It runs until it returns,
    /// or until the runtime ends with the last hold on it.
    pub fn spawn<F>(&self, task: F)
    where
        F: Future<Output = ()> + Send + 'static,
    {
        drop(self.handle().spawn(task));
    }

    /// `making` polled inside the background runtime: a connection it
    /// makes registers its socket with that runtime's reactor and spawns
    /// its driver task there, not on the caller's. The caller's task still
    /// awaits it.
    pub fn making<F: Future>(&self, making: F) -> Making<F> {
        Making {
            handle: self.handle().clone(),
            making: Box::pin(making),
        }
    }
}

/// The one background thread: it runs until every [`Background`] holding
/// it is dropped.
struct Thread {
    handle: Handle,
    /// Dropped with this, which ends the thread (and every task still on
    /// it).
    _stop: oneshot::Sender<()>,
}

impl Thread {
    /// The running background runtime, or a new one.
    fn join() -> Arc<Self> {
        let mut running = RUNNING.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(thread) = running.upgrade() {
            return thread;
        }
        let thread = Arc::new(Self::start());
        *running = Arc::downgrade(&thread);
        thread
    }

    fn start() -> Self {
        // Without I/O and timers nothing in the background can run at
        // all: failing to build either (out of file descriptors, threads)
        // is not something a step could report and go on from.
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("withlock: cannot build the background runtime");
        let handle = runtime.handle().clone();
        let (stop, stopped) = oneshot::channel::<()>();
        std::thread::Builder::new()
            .name(THREAD_NAME.into())
            .spawn(move || {
                runtime.block_on(async {
                    let _ = stopped.await;
                });
                // Dropping the runtime drops the tasks still on it.
                drop(runtime);
            })
            .expect("withlock: cannot start the background thread");
        Self {
            handle,
            _stop: stop,
        }
    }
}

/// A future polled inside the background runtime; see
/// [`Background::making`].
pub struct Making<F> {
    handle: Handle,
    /// Boxed: a connection is made seldom, and the box keeps this `Unpin`.
    making: Pin<Box<F>>,
}

impl<F> std::fmt::Debug for Making<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Making").finish_non_exhaustive()
    }
}

impl<F: Future> Future for Making<F> {
    type Output = F::Output;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let this = &mut *self;
        let _inside = this.handle.enter();
        this.making.as_mut().poll(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn t1_the_background_runs_while_no_caller_runtime_exists() {
        let background = Background::default();
        let (tx, rx) = std::sync::mpsc::channel();
        {
            let caller = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            caller.block_on(async {
                let tx = tx.clone();
                background.spawn(async move {
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                    let _ = tx.send(());
                });
            });
        }
        // The caller's runtime is gone; the task goes on.
        rx.recv_timeout(std::time::Duration::from_secs(30)).unwrap();
    }

    #[test]
    fn two_holds_share_one_thread() {
        let a = Background::default();
        let b = Background::default();
        assert!(Arc::ptr_eq(
            a.thread.get_or_init(Thread::join),
            b.thread.get_or_init(Thread::join)
        ));
    }
}

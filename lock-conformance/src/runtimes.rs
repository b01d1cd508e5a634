//! \[T1\] A locker and its backend never depend on the runtime that made
//! them: made, with their first lock, on runtime A, they go on extending
//! and notifying on runtime B while A is dropped, idle or blocked.
//!
//! These cases need runtimes of their own, so they are plain functions
//! that a `#[test]` (not a `#[tokio::test]`) calls with a backend factory:
//!
//! ```
//! use std::time::Duration;
//! use lock_conformance::runtimes::{t1_locker_outlives_runtime, RuntimeState};
//! use lock_memory::MemoryBackend;
//!
//! # fn main() {
//! t1_locker_outlives_runtime(RuntimeState::Idle, Duration::from_millis(400), || async {
//!     MemoryBackend::new()
//! });
//! # }
//! ```

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::time::Duration;

use lock_core::{
    AcquireOutcome, BackendError, DynLockBackend, LockBackend, LockConfig, Locker, LockerOptions,
    OwnerToken,
};
use tokio::sync::Notify;

use crate::support::{within, Namespace};

/// How runtime A is left once the backend, the lockers and their first
/// lock were made on it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RuntimeState {
    /// Dropped: a runtime that served one job, or one `#[tokio::test]`.
    Dropped,
    /// Alive but never polled again: a current-thread runtime between two
    /// `block_on` calls.
    Idle,
    /// Its only thread blocked inside a task: blocking code on the async
    /// path.
    Blocked,
}

/// How long a waiter woken by a release notification may take to get the
/// key, on a loaded machine; its retry timer alone would take 30 s.
const WOKEN_WITHIN: Duration = Duration::from_secs(5);

/// \[T1\] On runtime A, a current-thread runtime on a thread of its own:
/// `make` makes the backend, and two lockers on it (a holder and a
/// waiter) take their first locks, the waiter woken by the holder's
/// release, so that everything the backend and the driver start in the
/// background (connections, subscriptions, the extender) is started there.
/// Then A is left in `state`, and on runtime B:
/// - the holder holds a lock for three times `ttl`: its extensions go
///   out, and the lock is kept;
/// - where the backend declares release notifications, the waiter, with a
///   retry delay of 30 s, waits for a key the holder holds with a long ttl
///   and gets it within 5 s of its release.
///
/// `ttl` is the shortest the backend takes with room for a loaded machine
/// (400 ms in memory, a second or two on a network store).
///
/// # Panics
///
/// When the lock is lost, the waiter is not woken in time, or a step
/// fails: this is a test.
pub fn t1_locker_outlives_runtime<M, Fut, B>(state: RuntimeState, ttl: Duration, make: M)
where
    M: FnOnce() -> Fut + Send + 'static,
    Fut: Future<Output = B> + 'static,
    B: LockBackend,
{
    let ns = Namespace::new();
    let first = ns.key("t1-first");
    let (made_tx, made_rx) = mpsc::channel();
    let (end_tx, end_rx) = mpsc::channel::<()>();
    let runtime_a = std::thread::spawn(move || {
        let runtime = runtime();
        let on_a = async move {
            let backend: Arc<DynLockBackend> = Arc::new(make().await);
            let nodes = Nodes::new(backend);
            nodes.first_locks(&first, ttl).await;
            nodes
        };
        match state {
            RuntimeState::Dropped => {
                let nodes = runtime.block_on(on_a);
                drop(runtime);
                made_tx.send(nodes).unwrap();
            }
            RuntimeState::Idle => {
                let nodes = runtime.block_on(on_a);
                made_tx.send(nodes).unwrap();
                // Alive, never polled again until the test ends.
                let _ = end_rx.recv();
                drop(runtime);
            }
            RuntimeState::Blocked => runtime.block_on(async move {
                let nodes = on_a.await;
                made_tx.send(nodes).unwrap();
                // Blocks A's only thread inside a task.
                let _ = end_rx.recv();
            }),
        }
    });
    let nodes = made_rx
        .recv()
        .expect("runtime A made the backend and its first locks");
    runtime().block_on(async {
        nodes
            .holds_for_three_ttls(&ns.key("t1-held"), ttl, state)
            .await;
        nodes.waiter_is_woken(&ns.key("t1-awaited"), state).await;
    });
    drop(end_tx);
    let joined = runtime_a.join();
    if !std::thread::panicking() {
        joined.expect("runtime A's thread");
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a current-thread runtime")
}

/// The two nodes of the case, on one backend; the waiter's steps counted.
struct Nodes {
    holder: Locker,
    waiter: Locker,
    seen: Arc<Seen>,
    notifications: bool,
}

impl Nodes {
    fn new(backend: Arc<DynLockBackend>) -> Self {
        let notifications = backend.capabilities().release_notifications;
        let seen = Arc::new(Seen::default());
        let waiter = Watched {
            backend: Arc::clone(&backend),
            seen: Arc::clone(&seen),
        };
        let node = |backend, name: &str| {
            Locker::with_options(backend, LockerOptions::default().node_id(name)).unwrap()
        };
        Self {
            holder: node(backend, "holder"),
            waiter: Locker::with_options(waiter, LockerOptions::default().node_id("waiter"))
                .unwrap(),
            seen,
            notifications,
        }
    }

    /// On runtime A: the holder takes `key`, and the waiter gets it after
    /// the holder's release (woken by its notification, where the backend
    /// has them).
    async fn first_locks(&self, key: &str, ttl: Duration) {
        let cfg = LockConfig::default().ttl(ttl);
        let (taken_tx, taken_rx) = tokio::sync::oneshot::channel();
        let (go_tx, go_rx) = tokio::sync::oneshot::channel::<()>();
        let holding = self
            .holder
            .with_lock_config(key, &cfg, move |_| async move {
                let _ = taken_tx.send(());
                let _ = go_rx.await;
            });
        let waiting = async {
            let _ = taken_rx.await;
            let waited = self.seen.busy_answers();
            let cfg = cfg.wait_forever();
            let got = self.waiter.with_lock_config(key, &cfg, |_| async {});
            let release = async {
                self.seen.busy_after(waited).await;
                let _ = go_tx.send(());
            };
            let (got, ()) = tokio::join!(got, release);
            got
        };
        let (held, waited) = within(WOKEN_WITHIN * 4, "the first locks on runtime A", async {
            tokio::join!(holding, waiting)
        })
        .await;
        held.expect("the holder's first lock, on runtime A");
        waited.expect("the waiter's first lock, on runtime A");
    }

    /// On runtime B: the holder keeps a lock for three ttls.
    async fn holds_for_three_ttls(&self, key: &str, ttl: Duration, state: RuntimeState) {
        let cfg = LockConfig::default().ttl(ttl);
        let held = self
            .holder
            .with_lock_config(key, &cfg, |ctx| async move {
                tokio::time::sleep(ttl * 3).await;
                ctx.is_lost()
            })
            .await;
        match held {
            Ok(lost) => assert!(!lost, "runtime A {state:?}: the lock was lost"),
            Err(e) => panic!("runtime A {state:?}: the lock held for three ttls: {e}"),
        }
    }

    /// On runtime B: the waiter, with a 30 s retry delay, is woken by the
    /// release of a key the holder held with a long ttl.
    async fn waiter_is_woken(&self, key: &str, state: RuntimeState) {
        if !self.notifications {
            return;
        }
        let held_long = LockConfig::default().ttl(Duration::from_secs(60));
        let patient = LockConfig::default()
            .ttl(Duration::from_secs(60))
            .wait_forever()
            .retry_delay(Duration::from_secs(30));
        let (taken_tx, taken_rx) = tokio::sync::oneshot::channel();
        let (go_tx, go_rx) = tokio::sync::oneshot::channel::<()>();
        let holding = self
            .holder
            .with_lock_config(key, &held_long, move |_| async move {
                let _ = taken_tx.send(());
                let _ = go_rx.await;
            });
        let waiting = async {
            let _ = taken_rx.await;
            // Found busy twice: once before its release watch was in
            // place, once after; only a notification wakes it now.
            let waited = self.seen.busy_answers();
            let got = self.waiter.with_lock_config(key, &patient, |_| async {});
            let release = async {
                self.seen.busy_after(waited + 1).await;
                let _ = go_tx.send(());
            };
            let (got, ()) = tokio::join!(
                within(WOKEN_WITHIN * 3, "the waiter woken by the release", got),
                release
            );
            got
        };
        let (held, got) = tokio::join!(holding, waiting);
        held.unwrap_or_else(|e| panic!("runtime A {state:?}: the holder's lock: {e}"));
        got.unwrap_or_else(|e| panic!("runtime A {state:?}: the waiter: {e}"));
    }
}

/// The waiter's busy answers, counted as they come back.
#[derive(Default)]
struct Seen {
    busy: AtomicUsize,
    changed: Notify,
}

impl Seen {
    fn busy_answers(&self) -> usize {
        self.busy.load(Ordering::SeqCst)
    }

    /// Resolves once more than `n` busy answers came back.
    async fn busy_after(&self, n: usize) {
        loop {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            if self.busy_answers() > n {
                return;
            }
            changed.await;
        }
    }
}

/// The waiter's backend: counts the busy answers.
#[derive(Debug)]
struct Watched {
    backend: Arc<DynLockBackend>,
    seen: Arc<Seen>,
}

impl std::fmt::Debug for Seen {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Seen")
            .field("busy", &self.busy_answers())
            .finish()
    }
}

lock_core::forward_lock_backend!(Watched => backend {
    async fn try_acquire(
        &self,
        key: &str,
        owner: &OwnerToken,
        ttl: Duration,
    ) -> Result<AcquireOutcome, BackendError> {
        let answer = self.backend.try_acquire(key, owner, ttl).await;
        if matches!(answer, Ok(AcquireOutcome::Busy { .. })) {
            self.seen.busy.fetch_add(1, Ordering::SeqCst);
            self.seen.changed.notify_waiters();
        }
        answer
    }
});

//! \[T1\] A backend outlives the runtime that made it: its release
//! listener and its pooled connections do not live on a caller's runtime.
//!
//! A backend is made on runtime A, and a waiter there is woken by a
//! release, so the listener started (and, before the backend ran its
//! listener and made its connections on the background runtime, the
//! listener task and the pool's connections lived on A). Then A is dropped,
//! or left alive but idle (a current-thread runtime nobody polls), and on
//! runtime B a waiter polling only every 30 s must be woken by a release
//! within 5 s: only the listener can do that. Then the same with the
//! shared case of `lock_conformance::runtimes`, which also keeps a lock
//! for three ttls on B, and leaves A blocked too.

mod common;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use common::Observed;
use lock_conformance::node;
use lock_conformance::runtimes::{t1_locker_outlives_runtime, RuntimeState};
use lock_core::LockConfig;
use lock_postgres::testing::TestBackend;
use tokio::time::Instant;
use withlock_test_servers::postgres::database_url;

/// The waiter's retry delay: only a notification wakes it sooner.
const RETRY: Duration = Duration::from_secs(30);
/// The bound on a notified handoff (about a millisecond when idle).
const WOKEN_WITHIN: Duration = Duration::from_secs(5);
/// The bound on everything else that should take milliseconds.
const SOON: Duration = Duration::from_secs(10);

/// A holder takes a fresh key, a waiter polling every [`RETRY`] waits for
/// it, the holder releases it: returns how long the waiter took to run
/// after the release.
async fn handoff(backend: &Arc<Observed>) -> Duration {
    let (holder, waiter) = (
        node(Arc::clone(backend), "holder"),
        node(Arc::clone(backend), "waiter"),
    );
    let key = format!("t1:{:016x}", rand::random::<u64>());
    let mut held = holder.handle(&key, Duration::from_secs(60)).unwrap();
    assert!(
        tokio::time::timeout(SOON, held.acquire())
            .await
            .expect("the holder's acquisition answers")
            .unwrap(),
        "the fresh key is free"
    );
    let slow = LockConfig::default().wait_forever().retry_delay(RETRY);
    let k = key.clone();
    let waiting = tokio::spawn(async move {
        waiter
            .with_lock_config(&k, &slow, |_| async { Instant::now() })
            .await
    });
    backend.waiting(&key, SOON).await;
    let released_at = Instant::now();
    assert!(
        tokio::time::timeout(SOON, held.release())
            .await
            .expect("the release answers")
            .unwrap(),
        "released while held"
    );
    let ran_at = tokio::time::timeout(WOKEN_WITHIN, waiting)
        .await
        .unwrap_or_else(|_| {
            panic!("the waiter was not woken within {WOKEN_WITHIN:?} of the release")
        })
        .unwrap()
        .unwrap();
    ran_at - released_at
}

/// What becomes of runtime A once the backend is made and used there.
#[derive(Clone, Copy, Debug)]
enum After {
    Dropped,
    Idle,
}

fn a_waiter_on_runtime_b_is_woken(after: After) {
    let a = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let backend = a.block_on(async {
        let backend = Arc::new(Observed::new(
            TestBackend::new(&database_url()).await.unwrap(),
        ));
        // The listener starts at this first wait, on A before the fix.
        let first = handoff(&backend).await;
        assert!(first < WOKEN_WITHIN, "{first:?} on A");
        backend
    });
    let idle = match after {
        After::Dropped => {
            drop(a);
            None
        }
        After::Idle => Some(a),
    };
    let b = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    b.block_on(async {
        let took = handoff(&backend).await;
        assert!(took < WOKEN_WITHIN, "{after:?}: woken after {took:?}");
    });
    drop(backend);
    drop(b);
    drop(idle);
}

#[test]
fn t1_a_waiter_is_woken_after_the_runtime_that_started_the_listener_was_dropped() {
    a_waiter_on_runtime_b_is_woken(After::Dropped);
}

#[test]
fn t1_a_waiter_is_woken_while_the_runtime_that_started_the_listener_is_idle() {
    a_waiter_on_runtime_b_is_woken(After::Idle);
}

/// The shared \[T1\] case: a backend and its lockers made, with their
/// first locks, on runtime A; on runtime B a lock is kept for three ttls
/// and a waiter is woken by a release.
fn t1_shared_case(state: RuntimeState) {
    t1_locker_outlives_runtime(state, Duration::from_secs(1), || async {
        TestBackend::new(&database_url()).await.unwrap()
    });
}

#[test]
fn t1_postgres_runtime_dropped() {
    t1_shared_case(RuntimeState::Dropped);
}

#[test]
fn t1_postgres_runtime_idle() {
    t1_shared_case(RuntimeState::Idle);
}

#[test]
fn t1_postgres_runtime_blocked() {
    t1_shared_case(RuntimeState::Blocked);
}

/// \[S1\]\[T1\] A step the driver finishes after its caller dropped it
/// runs on: begun on runtime A (its first poll made its timer and its
/// connection), A dropped, it answers on runtime B. Before the step's
/// timer was the background runtime's, polling it on B panicked ("A
/// Tokio 1.x context was found, but it is being shutdown"): lock-core
/// moves such a step to the background runtime, where it met A's dead
/// timer.
#[test]
fn s1_a_step_begun_on_a_dropped_runtime_answers_on_another() {
    let a = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let backend = Arc::new(a.block_on(TestBackend::new(&database_url())).unwrap());
    let key = format!("s1:{:016x}", rand::random::<u64>());
    let owner = lock_core::OwnerToken::new("s1");
    let step = {
        let (backend, key, owner) = (Arc::clone(&backend), key.clone(), owner.clone());
        async move { lock_core::LockBackend::try_acquire(&*backend, &key, &owner, SOON).await }
    };
    let mut step = Box::pin(step);
    a.block_on(std::future::poll_fn(|cx| {
        assert!(
            step.as_mut().poll(cx).is_pending(),
            "a round trip takes a moment"
        );
        std::task::Poll::Ready(())
    }));
    drop(a);
    let b = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let answer = b.block_on(b.spawn(step)).expect("the step runs on B");
    assert!(
        matches!(answer, Ok(lock_core::AcquireOutcome::Acquired { .. })),
        "{answer:?}"
    );
    drop(b);
    drop(backend);
}

//! \[T2\] Per-key state follows what is held: after 10,000 distinct keys
//! locked once each (one after the other, and all at once with a waiter
//! each), 10,000 locks lost by deleting their keys, and 10,000 attempts
//! refused, every per-key structure of the locker (`Locker::state_counts`)
//! and of the memory backend (`MemoryBackend::state_counts`, its release
//! hub's included) is back within its documented cache bound.

use std::sync::Arc;
use std::time::Duration;

use lock_core::{
    AcquireOutcome, BackendError, LockAdmin, LockConfig, LockError, Locker, LossCause, OwnerToken,
};
use lock_memory::MemoryBackend;

/// A locker whose background work runs on the test's runtime, under its
/// paused clock.
fn paused_locker(backend: impl lock_core::LockBackend) -> Locker {
    Locker::with_options(
        backend,
        lock_core::LockerOptions::default().caller_runtime(true),
    )
    .unwrap()
}
use tokio::sync::Semaphore;
use tokio::time::Instant;

const KEYS: usize = 10_000;

/// The idle gates a locker keeps, and the freed entries the memory
/// backend keeps, for reuse.
const KEPT: usize = 1024;

/// What each structure may keep once nothing is held or waited for.
fn bound(name: &str, peak_held: usize) -> usize {
    match name {
        "gates" | "gates: idle" | "memory: entries" | "memory: free entries" => KEPT,
        // Given back below a quarter full, to twice what is left.
        "gates: table capacity" | "memory: table capacity" => 8 * KEPT,
        "hub: map capacity" | "cleanup: map capacity" => 64,
        // Ids of locks gone, dropped when the extender looks, or at 64.
        "extender: unscheduled" => 64,
        // The slab keeps a slot per lock held at once at the peak.
        "registry: slab slots" | "registry: vacant slots" => peak_held,
        _ => 0,
    }
}

fn assert_within_bounds(after: &str, counts: &[(&'static str, usize)], peak_held: usize) {
    let over: Vec<_> = counts
        .iter()
        .filter(|(name, n)| *n > bound(name, peak_held))
        .collect();
    assert!(
        over.is_empty(),
        "after {after}: {over:?} over their bounds; all: {counts:?}"
    );
    eprintln!("after {after}: {counts:?}");
}

fn named(i: usize) -> String {
    format!("t2:key:{i}")
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn t2_keys_locked_once_each_leave_only_the_caches() {
    let backend = MemoryBackend::new();
    let locker = paused_locker(backend.clone());
    for i in 0..KEYS {
        locker
            .with_lock(&named(i), |_| async {})
            .await
            .expect("the key is free");
    }
    assert_within_bounds(
        "10,000 keys locked one after the other",
        &locker.state_counts(),
        1,
    );
    assert_within_bounds(
        "10,000 keys locked one after the other",
        &backend.state_counts(),
        0,
    );
    // The caches hold what they say, no more.
    let count = |name| {
        let counts = locker.state_counts();
        counts.iter().find(|(n, _)| *n == name).unwrap().1
    };
    assert_eq!(count("gates: idle"), KEPT);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn t2_keys_held_at_once_with_waiters_leave_only_the_caches() {
    let backend = MemoryBackend::new();
    let (a, b) = (
        paused_locker(backend.clone()),
        paused_locker(backend.clone()),
    );
    // `a` holds every key until told; `b` waits for each.
    let release = Arc::new(Semaphore::new(0));
    let held = Arc::new(Semaphore::new(0));
    let mut calls = Vec::new();
    for i in 0..KEYS {
        let (a, release, held) = (a.clone(), Arc::clone(&release), Arc::clone(&held));
        calls.push(tokio::spawn(async move {
            a.with_lock(&named(i), |_| async move {
                held.add_permits(1);
                let _ = release.acquire().await.unwrap();
            })
            .await
        }));
    }
    let _ = held.acquire_many(KEYS as u32).await.unwrap();
    let waits = LockConfig::default().wait_forever();
    let mut waiters = Vec::new();
    for i in 0..KEYS {
        let b = b.clone();
        waiters.push(tokio::spawn(async move {
            b.with_lock_config(&named(i), &waits, |_| async {}).await
        }));
    }
    // Every waiter watches its key before the holders let go.
    while backend
        .state_counts()
        .iter()
        .any(|&(name, n)| name == "hub: watched keys" && n < KEYS)
    {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let busy = a.state_counts();
    assert!(busy.contains(&("registry: held locks", KEYS)), "{busy:?}");
    assert!(busy.contains(&("gates", KEYS)), "{busy:?}");
    release.add_permits(KEYS);
    for call in calls {
        call.await.unwrap().expect("held throughout");
    }
    for waiter in waiters {
        waiter.await.unwrap().expect("the waiter got the key");
    }
    let after = "10,000 keys held at once, each with a waiter";
    assert_within_bounds(after, &a.state_counts(), KEYS);
    assert_within_bounds(after, &b.state_counts(), 1);
    assert_within_bounds(after, &backend.state_counts(), 0);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn t2_locks_lost_to_deleted_keys_leave_only_the_caches() {
    let backend = MemoryBackend::new();
    let locker = paused_locker(backend.clone());
    let held = Arc::new(Semaphore::new(0));
    let mut calls = Vec::new();
    for i in 0..KEYS {
        let (locker, held) = (locker.clone(), Arc::clone(&held));
        calls.push(tokio::spawn(async move {
            locker
                .with_lock(&named(i), |_| async move {
                    held.add_permits(1);
                    std::future::pending::<()>().await;
                })
                .await
        }));
    }
    let _ = held.acquire_many(KEYS as u32).await.unwrap();
    for i in 0..KEYS {
        let freed = backend.force_release(&named(i)).await.unwrap();
        assert!(freed.is_some(), "key {i} was held");
    }
    for call in calls {
        match call.await.unwrap() {
            Err(LockError::Lost {
                cause: LossCause::Taken,
                ..
            }) => {}
            other => panic!("expected a loss to the deleted key, got {other:?}"),
        }
    }
    let after = "10,000 locks lost to their keys' deletion";
    assert_within_bounds(after, &locker.state_counts(), KEYS);
    assert_within_bounds(after, &backend.state_counts(), 0);
}

/// The memory backend, refusing every acquisition as a store refuses a
/// user without the rights.
#[derive(Debug)]
struct Refusing {
    inner: MemoryBackend,
}

#[derive(Debug, thiserror::Error)]
#[error("NOPERM this user has no permissions to run the 'evalsha' command")]
struct NoPermission;

lock_core::forward_lock_backend!(Refusing => inner {
    async fn try_acquire(
        &self,
        _key: &str,
        _owner: &OwnerToken,
        _ttl: Duration,
    ) -> Result<AcquireOutcome, BackendError> {
        Err(BackendError::setup(NoPermission))
    }

    fn try_acquire_now(
        &self,
        _key: &str,
        _owner: &OwnerToken,
        _ttl: Duration,
        _now: Instant,
    ) -> Option<Result<AcquireOutcome, BackendError>> {
        None
    }
});

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn t2_refused_attempts_leave_only_the_caches_within_a_ttl() {
    let backend = MemoryBackend::new();
    let locker = paused_locker(Refusing {
        inner: backend.clone(),
    });
    let ttl = Duration::from_secs(1);
    let cfg = LockConfig::default().ttl(ttl);
    for i in 0..KEYS {
        let refused = locker.with_lock_config(&named(i), &cfg, |_| async {}).await;
        assert!(
            matches!(refused, Err(LockError::NotAcquired { source: Some(ref e), .. }) if e.is_permanent()),
            "{refused:?}"
        );
    }
    // A refused attempt may still have written (a store that failed
    // half-way): its key is freed for one ttl, then forgotten.
    tokio::time::sleep(2 * ttl).await;
    let after = "10,000 attempts refused, and one ttl";
    assert_within_bounds(after, &locker.state_counts(), 0);
    assert_within_bounds(after, &backend.state_counts(), 0);
}

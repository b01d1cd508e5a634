//! The driver under tokio's paused clock, as users' own tests run it with
//! the memory backend: hours of ttls pass in no time.

use std::time::Duration;

use lock_conformance::{CountingBackend, Step};
use lock_core::{LockConfig, LockError, Locker, LockerOptions};
use lock_memory::MemoryBackend;

fn node(backend: impl lock_core::LockBackend, name: &str) -> Locker {
    // The background work on the test's paused clock.
    let options = LockerOptions::default().node_id(name).caller_runtime(true);
    Locker::with_options(backend, options).unwrap()
}

#[tokio::test(start_paused = true)]
async fn h1_a_callback_may_run_for_many_ttls() {
    let backend = CountingBackend::new(MemoryBackend::new());
    let a = node(backend.clone(), "a");
    let b = node(backend.inner().clone(), "b");
    let cfg = LockConfig::default(); // ttl 30 s
    let out = a
        .with_lock_config("import", &cfg, |ctx| async move {
            for _ in 0..20 {
                tokio::time::sleep(Duration::from_secs(30)).await;
                let probe = b
                    .with_lock_config(
                        "import",
                        &LockConfig::default().retry_attempts(0),
                        |_| async {},
                    )
                    .await;
                assert!(matches!(probe, Err(LockError::NotAcquired { .. })));
            }
            ctx.is_lost()
        })
        .await
        .unwrap();
    assert!(!out, "ten minutes under a 30 s ttl without a loss");
    let extensions = backend.calls(Step::Extend);
    assert!(
        (55..=70).contains(&extensions),
        "an extension every 10 s for 600 s, saw {extensions}"
    );
}

#[tokio::test(start_paused = true)]
async fn h2_a_users_test_jumps_past_the_ttl() {
    let backend = MemoryBackend::new();
    let crashed = node(backend.clone(), "crashed");
    let mut h = crashed.handle("job", Duration::from_secs(30)).unwrap();
    assert!(h.acquire().await.unwrap());
    std::mem::forget(h); // the node stops without releasing
    let started = tokio::time::Instant::now();
    let other = node(backend.clone(), "other");
    other
        .with_lock_config("job", &LockConfig::default().wait_forever(), |_| async {})
        .await
        .unwrap();
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_secs(30) && waited < Duration::from_secs(31),
        "taken over after the 30 s ttl of virtual time, took {waited:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn p4_many_held_locks_are_extended_in_batches() {
    let backend = CountingBackend::new(MemoryBackend::new());
    let a = node(backend.clone(), "a");
    let n = 2_000;
    let (release_tx, release_rx) = tokio::sync::watch::channel(false);
    let mut tasks = Vec::new();
    for i in 0..n {
        let (a, mut rx) = (a.clone(), release_rx.clone());
        tasks.push(tokio::spawn(async move {
            a.with_lock(&format!("key-{i}"), move |_| async move {
                let _ = rx.wait_for(|done| *done).await;
            })
            .await
        }));
    }
    while a.held() < n {
        tokio::task::yield_now().await;
    }
    let before = (backend.calls(Step::Extend), backend.extended_leases());
    // Three ttls: nine extension ticks of 10 s.
    tokio::time::sleep(Duration::from_secs(90)).await;
    let calls = backend.calls(Step::Extend) - before.0;
    let leases = backend.extended_leases() - before.1;
    release_tx.send(true).unwrap();
    for t in tasks {
        t.await.unwrap().unwrap();
    }
    let per_lease_per_tick = leases as f64 / n as f64 / 9.0;
    assert!(
        (0.8..=1.2).contains(&per_lease_per_tick),
        "each lease is extended once per ttl / 3, saw {per_lease_per_tick:.2}"
    );
    assert!(
        calls <= 12,
        "{n} leases due together go out in one call per tick, saw {calls} calls in 9 ticks"
    );
    assert_eq!(a.held(), 0);
}

/// A store whose ttls are whole seconds of at least 2 s (as etcd's leases),
/// recording every ttl the driver asks it for.
#[derive(Debug, Clone)]
struct WholeSeconds {
    inner: MemoryBackend,
    asked: std::sync::Arc<std::sync::Mutex<Vec<Duration>>>,
}

impl WholeSeconds {
    fn asked(&self, ttl: Duration) {
        self.asked.lock().unwrap().push(ttl);
    }
}

#[async_trait::async_trait]
impl lock_core::LockBackend for WholeSeconds {
    fn capabilities(&self) -> lock_core::Capabilities {
        self.inner
            .capabilities()
            .with_min_ttl(Duration::from_secs(2))
            .with_ttl_granularity(Duration::from_secs(1))
    }
    async fn try_acquire(
        &self,
        key: &str,
        owner: &lock_core::OwnerToken,
        ttl: Duration,
    ) -> Result<lock_core::AcquireOutcome, lock_core::BackendError> {
        self.asked(ttl);
        self.inner.try_acquire(key, owner, ttl).await
    }
    async fn extend(
        &self,
        lease: &lock_core::Lease,
        ttl: Duration,
    ) -> Result<lock_core::ExtendOutcome, lock_core::BackendError> {
        self.asked(ttl);
        self.inner.extend(lease, ttl).await
    }
    async fn extend_many(
        &self,
        requests: &[lock_core::ExtendRequest],
    ) -> Vec<Result<lock_core::ExtendOutcome, lock_core::BackendError>> {
        for request in requests {
            self.asked(request.ttl);
        }
        self.inner.extend_many(requests).await
    }
    fn failure_domain(&self, key: &str) -> u64 {
        self.inner.failure_domain(key)
    }
    async fn hold(
        &self,
        lease: &lock_core::Lease,
        hold: lock_core::Hold,
    ) -> Result<lock_core::ExtendOutcome, lock_core::BackendError> {
        self.inner.hold(lease, hold).await
    }
    async fn release(
        &self,
        lease: &lock_core::Lease,
    ) -> Result<lock_core::ReleaseOutcome, lock_core::BackendError> {
        self.inner.release(lease).await
    }
    async fn watch_release(
        &self,
        key: &str,
    ) -> Result<lock_core::ReleaseWatch, lock_core::BackendError> {
        self.inner.watch_release(key).await
    }
}

#[tokio::test(start_paused = true)]
async fn a_store_with_whole_second_ttls_is_asked_and_counted_on_what_it_grants() {
    let backend = WholeSeconds {
        inner: MemoryBackend::new(),
        asked: Default::default(),
    };
    let a = node(backend.clone(), "a");
    // Asked for 500 ms, the store grants 2 s: the driver asks for 2 s at
    // every step and extends every third of 2 s, not of 500 ms.
    let cfg = LockConfig::default().ttl(Duration::from_millis(500));
    let lost = a
        .with_lock_config("whole", &cfg, |ctx| async move {
            tokio::time::sleep(Duration::from_millis(3_000)).await;
            ctx.is_lost()
        })
        .await
        .unwrap();
    assert!(!lost);
    let asked = backend.asked.lock().unwrap().clone();
    assert!(asked.len() >= 2, "an acquisition and extensions: {asked:?}");
    assert!(
        asked.iter().all(|ttl| *ttl == Duration::from_secs(2)),
        "every step asks for the granted 2 s: {asked:?}"
    );
    // Extensions every third of 2 s over 3 s: about four, not the 18 a
    // schedule on 500 ms would send.
    assert!(asked.len() <= 7, "{} steps: {asked:?}", asked.len());
    let handle = a.handle("whole", Duration::from_millis(2_100)).unwrap();
    assert_eq!(handle.ttl(), Duration::from_secs(3));
}

//! The driver under tokio's paused clock, as users' own tests run it with
//! the memory backend: hours of ttls pass in no time.

use std::time::Duration;

use lock_conformance::{CountingBackend, Step};
use lock_core::{LockConfig, LockError, Locker, LockerOptions};
use lock_memory::MemoryBackend;

fn node(backend: impl lock_core::LockBackend, name: &str) -> Locker {
    Locker::with_options(backend, LockerOptions::default().node_id(name)).unwrap()
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

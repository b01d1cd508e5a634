//! Shutdown \[S1–S3\].

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use lock_core::{Locker, LockerOptions, LossCause};
use tokio::sync::oneshot;
use tokio::time::Instant;

use crate::counting::CountingBackend;
use crate::faults::{FaultInjector, Step};
use crate::support::{
    assert_free, assert_lost_as, node, patient, within, BackendFactory, Namespace, SOON,
};

/// \[S1\] Shutdown stops new acquisitions, lets running callbacks finish for
/// up to the grace period, then releases every lock the node still holds;
/// the calls whose lock it released get `Lost` with cause `Shutdown`.
pub async fn s1_shutdown_waits_then_releases(factory: Arc<dyn BackendFactory>) {
    let backend = factory.backend().await;
    let ns = Namespace::new();
    let (quick_key, slow_key, handle_key) =
        (ns.key("s1-quick"), ns.key("s1-slow"), ns.key("s1-handle"));
    let a = node(Arc::clone(&backend), "a");

    let (quick_in, quick_in_rx) = oneshot::channel();
    let (slow_in, slow_in_rx) = oneshot::channel();
    let (l, k) = (a.clone(), quick_key.clone());
    let quick = tokio::spawn(async move {
        l.with_lock(&k, move |_| async move {
            let _ = quick_in.send(());
            tokio::time::sleep(Duration::from_millis(100)).await;
            "finished"
        })
        .await
    });
    let (l, k) = (a.clone(), slow_key.clone());
    let slow = tokio::spawn(async move {
        l.with_lock(&k, move |_| async move {
            let _ = slow_in.send(());
            std::future::pending::<()>().await;
        })
        .await
    });
    let mut handle = a.handle(&handle_key, Duration::from_secs(30)).unwrap();
    assert!(handle.acquire().await.unwrap());
    within(SOON, "callbacks start", quick_in_rx).await.unwrap();
    within(SOON, "callbacks start", slow_in_rx).await.unwrap();

    let report = within(SOON, "shutdown", a.shutdown(Duration::from_millis(500))).await;
    assert!(!report.callbacks_finished, "one callback never finishes");
    assert_eq!(
        report.released, 2,
        "the slow callback's lock and the handle's"
    );
    assert_eq!(report.release_failures, 0);
    // The store is checked at once, before any call's result is awaited.
    for key in [&quick_key, &slow_key, &handle_key] {
        assert_free(&backend, key, "right after shutdown returned").await;
    }
    assert_eq!(
        within(SOON, "quick call", quick).await.unwrap().unwrap(),
        "finished"
    );
    let slow = within(SOON, "slow call", slow).await.unwrap();
    assert_lost_as(&slow, &LossCause::Shutdown, "the slow call");
    for key in [&quick_key, &slow_key, &handle_key] {
        assert_free(&backend, key, "after shutdown, at once").await;
    }
    assert!(
        !handle.release().await.unwrap(),
        "shutdown already released it"
    );
    assert_eq!(a.held(), 0);
}

/// \[S1\] An acquisition attempt in flight when shutdown begins is owed:
/// shutdown waits for its answer (within the release timeout) and frees
/// what it took, so the key is free when shutdown returns, whether the
/// call that made the attempt still waits or was dropped; the callback
/// never runs \[S2\].
pub async fn s1_shutdown_frees_what_attempts_in_flight_took(factory: Arc<dyn BackendFactory>) {
    let backend = factory.backend().await;
    let ns = Namespace::new();
    for dropped in [false, true] {
        let key = ns.key(if dropped {
            "s1-attempt-dropped"
        } else {
            "s1-attempt"
        });
        let faulty = FaultInjector::new(Arc::clone(&backend));
        let a = Locker::with_options(
            faulty.clone(),
            LockerOptions::default()
                .node_id("a")
                .release_timeout(Duration::from_secs(10)),
        )
        .unwrap();
        // The store takes the key at once; the answer reaches the node
        // long after, as from a store paused or a network slow on the way
        // back.
        faulty.delay_answers(Step::TryAcquire, 1, Duration::from_millis(300));
        let ran = Arc::new(AtomicBool::new(false));
        let (l, k, r) = (a.clone(), key.clone(), Arc::clone(&ran));
        let call = tokio::spawn(async move {
            l.with_lock(&k, move |_| async move { r.store(true, Ordering::SeqCst) })
                .await
        });
        within(
            SOON,
            "the store took the key for the attempt",
            faulty.applied_late(Step::TryAcquire, 1),
        )
        .await;
        if dropped {
            call.abort();
            let _ = call.await;
        }
        let report = within(SOON, "shutdown", a.shutdown(Duration::ZERO)).await;
        assert_eq!(
            report.release_failures, 0,
            "dropped: {dropped}: the attempt's key was freed: {report:?}"
        );
        assert_free(&backend, &key, "right after shutdown returned").await;
        assert!(!ran.load(Ordering::SeqCst), "the callback never runs [S2]");
    }
}

/// \[S2\] After shutdown, `with_lock` on that node never settles and never
/// runs its callback; calls that were waiting likewise.
pub async fn s2_after_shutdown_calls_never_settle(factory: Arc<dyn BackendFactory>) {
    let backend = factory.backend().await;
    let ns = Namespace::new();
    let key = ns.key("s2");
    let seen = CountingBackend::new(Arc::clone(&backend));
    let a = node(seen.clone(), "a");
    let other = node(Arc::clone(&backend), "other");
    let mut held = other.handle(&key, Duration::from_secs(30)).unwrap();
    assert!(held.acquire().await.unwrap());

    let ran = Arc::new(AtomicBool::new(false));
    let (l, k, r) = (a.clone(), key.clone(), Arc::clone(&ran));
    let waiting = tokio::spawn(async move {
        l.with_lock_config(&k, &patient(), move |_| async move {
            r.store(true, Ordering::SeqCst)
        })
        .await
    });
    // Shut down once the call waits: its first attempt found the key busy.
    within(
        SOON,
        "the call finds the key busy",
        seen.until_answered(Step::TryAcquire, 1),
    )
    .await;
    a.shutdown(Duration::from_millis(50)).await;
    let attempts_at_shutdown = seen.calls(Step::TryAcquire);
    held.release().await.unwrap();

    let r = Arc::clone(&ran);
    let after = a.with_lock(
        &key,
        move |_| async move { r.store(true, Ordering::SeqCst) },
    );
    assert!(
        tokio::time::timeout(Duration::from_millis(300), after)
            .await
            .is_err(),
        "a call after shutdown never settles"
    );
    // The key is free for anyone else: a patient node of its own takes it
    // (a release notification, where the store sends them, has gone out
    // to the shut node's call too by then).
    let probe = node(Arc::clone(&backend), "probe");
    within(
        SOON,
        "another node takes the freed key",
        probe.with_lock_config(&key, &patient(), |_| async {}),
    )
    .await
    .expect("the key is free");
    assert!(
        !waiting.is_finished(),
        "a call waiting at shutdown never settles"
    );
    assert_eq!(
        seen.calls(Step::TryAcquire),
        attempts_at_shutdown,
        "a shut node makes no attempt, neither the waiting call nor the later one"
    );
    assert!(
        !ran.load(Ordering::SeqCst),
        "no callback ran after shutdown"
    );
    waiting.abort();
    assert_free(&backend, &key, "nothing held by the shut node").await;
}

/// \[S3\] Shutdown returns by its deadline even when the backend is down.
pub async fn s3_shutdown_returns_by_deadline_when_backend_down(factory: Arc<dyn BackendFactory>) {
    let backend = factory.backend().await;
    let ns = Namespace::new();
    let key = ns.key("s3");
    let faulty = FaultInjector::new(Arc::clone(&backend));
    let release_timeout = Duration::from_millis(200);
    let a = Locker::with_options(
        faulty.clone(),
        LockerOptions::default()
            .node_id("a")
            .release_timeout(release_timeout),
    )
    .unwrap();
    let (in_tx, in_rx) = oneshot::channel();
    let (l, k) = (a.clone(), key.clone());
    let call = tokio::spawn(async move {
        // A short ttl, so the key the hung release leaves behind expires soon.
        let cfg = lock_core::LockConfig::default().ttl(crate::support::SHORT_TTL);
        l.with_lock_config(&k, &cfg, move |_| async move {
            let _ = in_tx.send(());
            std::future::pending::<()>().await;
        })
        .await
    });
    within(SOON, "callback start", in_rx).await.unwrap();
    faulty.hang(Step::Release, true);
    let grace = Duration::from_millis(100);
    let started = Instant::now();
    let report = within(SOON, "shutdown with the backend down", a.shutdown(grace)).await;
    let took = started.elapsed();
    assert!(
        took < grace + release_timeout + Duration::from_secs(1),
        "shutdown took {took:?}"
    );
    assert_eq!(report.released, 1);
    assert_eq!(report.release_failures, 1);
    let got = within(SOON, "the call", call).await.unwrap();
    assert_lost_as(
        &got,
        &LossCause::Shutdown,
        "a call whose lock shutdown released",
    );
}

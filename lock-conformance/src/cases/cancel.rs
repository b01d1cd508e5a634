//! Cancellation: dropping the `with_lock` future \[C1–C3\].

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use lock_core::LockConfig;
use tokio::sync::oneshot;

use crate::faults::{FaultInjector, Step};
use crate::support::{assert_freed_soon, node, patient, within, BackendFactory, Namespace, SOON};

struct SetOnDrop(Arc<AtomicBool>);

impl Drop for SetOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

/// \[C1\] Dropping the future while it waits leaves nothing held, also when
/// it is dropped with an acquisition attempt in flight.
pub async fn c1_drop_while_waiting_leaves_nothing_held(factory: Arc<dyn BackendFactory>) {
    let backend = factory.backend().await;
    let ns = Namespace::new();
    let key = ns.key("c1");
    let a = node(Arc::clone(&backend), "a");
    let b = node(Arc::clone(&backend), "b");
    let mut held = a.handle(&key, Duration::from_secs(30)).unwrap();
    assert!(held.acquire().await.unwrap());
    let cfg = patient();
    let waiting = b.with_lock_config(&key, &cfg, |_| async {});
    assert!(tokio::time::timeout(Duration::from_millis(100), waiting)
        .await
        .is_err());
    held.release().await.unwrap();
    // Its attempt may have been on the wire when it was dropped.
    assert_freed_soon(&backend, &key, "after a waiter was dropped").await;
    assert_eq!(b.held(), 0);

    // Dropped while its attempt is on the wire: the lock it takes is given back.
    let slow = FaultInjector::new(Arc::clone(&backend));
    slow.delay(Step::TryAcquire, Duration::from_millis(200));
    let c = node(slow, "c");
    let ran = Arc::new(AtomicBool::new(false));
    let r = Arc::clone(&ran);
    let in_flight = c.with_lock(
        &key,
        move |_| async move { r.store(true, Ordering::SeqCst) },
    );
    assert!(tokio::time::timeout(Duration::from_millis(50), in_flight)
        .await
        .is_err());
    // The default ttl is 30 s: only a release frees the key this soon.
    within(
        SOON,
        "the orphaned acquisition is released",
        b.with_lock_config(&key, &patient(), |_| async {}),
    )
    .await
    .unwrap();
    assert!(
        !ran.load(Ordering::SeqCst),
        "the dropped call's callback never ran"
    );
}

/// \[C2\] Dropping the future while the callback runs stops the callback and
/// releases the lock.
pub async fn c2_drop_while_running_stops_callback_and_releases(factory: Arc<dyn BackendFactory>) {
    let backend = factory.backend().await;
    let ns = Namespace::new();
    let key = ns.key("c2");
    let a = node(Arc::clone(&backend), "a");
    let dropped = Arc::new(AtomicBool::new(false));
    let d = Arc::clone(&dropped);
    let (started_tx, started_rx) = oneshot::channel();
    let (l, k) = (a.clone(), key.clone());
    let call = tokio::spawn(async move {
        l.with_lock(&k, move |_| async move {
            let _guard = SetOnDrop(d);
            let _ = started_tx.send(());
            std::future::pending::<()>().await;
        })
        .await
    });
    within(SOON, "callback start", started_rx).await.unwrap();
    call.abort();
    assert!(call.await.unwrap_err().is_cancelled());
    assert!(dropped.load(Ordering::SeqCst), "the callback was stopped");
    let b = node(Arc::clone(&backend), "b");
    within(
        SOON,
        "the lock is released well before its 30 s ttl",
        b.with_lock_config(&key, &patient(), |_| async {}),
    )
    .await
    .unwrap();
    assert_eq!(a.held(), 0);
}

/// \[C3\] `tokio::time::timeout` around `with_lock` behaves as dropping it,
/// while waiting and while running.
pub async fn c3_timeout_behaves_as_drop(factory: Arc<dyn BackendFactory>) {
    let backend = factory.backend().await;
    let ns = Namespace::new();
    let key = ns.key("c3");
    let a = node(Arc::clone(&backend), "a");
    let b = node(Arc::clone(&backend), "b");
    // The timeout must fire once the callback runs: on a busy machine the
    // acquisition alone may outlast it, so a timeout that fired before the
    // callback started is tried again with twice the time.
    let mut limit = Duration::from_millis(200);
    loop {
        let started = Arc::new(AtomicBool::new(false));
        let dropped = Arc::new(AtomicBool::new(false));
        let (s, d) = (Arc::clone(&started), Arc::clone(&dropped));
        let running = tokio::time::timeout(
            limit,
            a.with_lock(&key, move |_| async move {
                let _guard = SetOnDrop(d);
                s.store(true, Ordering::SeqCst);
                std::future::pending::<()>().await;
            }),
        )
        .await;
        assert!(running.is_err(), "the timeout fired");
        if started.load(Ordering::SeqCst) {
            assert!(dropped.load(Ordering::SeqCst), "the callback was stopped");
            break;
        }
        limit *= 2;
        assert!(
            limit <= SOON * 2,
            "the lock was not taken within {:?}",
            limit / 2
        );
    }
    within(
        SOON,
        "the lock is released well before its 30 s ttl",
        b.with_lock_config(&key, &patient(), |_| async {}),
    )
    .await
    .unwrap();

    let mut held = a.handle(&key, Duration::from_secs(30)).unwrap();
    assert!(held.acquire().await.unwrap());
    let waiting = tokio::time::timeout(
        Duration::from_millis(100),
        b.with_lock_config(&key, &LockConfig::default().wait_forever(), |_| async {}),
    )
    .await;
    assert!(waiting.is_err(), "the timeout fired while waiting");
    held.release().await.unwrap();
    assert_freed_soon(&backend, &key, "after a timeout while waiting").await;
    assert_eq!(a.held() + b.held(), 0);
}

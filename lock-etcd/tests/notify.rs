//! Release notifications [A5] [L5]: a holder's watch on its own name
//! wakes for a deletion of the holder's key, not for the busy attempts of
//! waiters; a waiter is woken by the holder's release at once.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::EtcdClusterExt;
use lock_etcd::lock_core::{AcquireOutcome, LockAdmin, LockBackend, OwnerToken};
use withlock_test_servers::etcd::shared_server;

const SOON: Duration = Duration::from_secs(10);

fn key(name: &str) -> String {
    lock_conformance::Namespace::new().key(name)
}

#[tokio::test]
async fn l5_holder_watch_ignores_busy_attempts() {
    let server = shared_server().await;
    let holder = server.backend().await;
    let waiter = server.backend().await;
    let name = key("quiet");
    let owner = OwnerToken::from_value("holder/0123456789abcdef0123456789abcdef");
    let got = holder
        .try_acquire(&name, &owner, Duration::from_secs(10))
        .await
        .unwrap();
    assert!(matches!(got, AcquireOutcome::Acquired { .. }), "{got:?}");
    let mut watch = holder.watch_release(&name).await.unwrap();
    let woken = Arc::new(AtomicUsize::new(0));
    let w = Arc::clone(&woken);
    let counter = tokio::spawn(async move {
        loop {
            watch.released().await;
            w.fetch_add(1, Ordering::SeqCst);
        }
    });
    for i in 0..20 {
        let other = OwnerToken::from_value(format!("waiter/{i:032x}"));
        // Waiters of another backend and of the holder's own, whose watch
        // is the holder's.
        let busy = if i % 2 == 0 { &waiter } else { &holder }
            .try_acquire(&name, &other, Duration::from_secs(10))
            .await
            .unwrap();
        assert!(matches!(busy, AcquireOutcome::Busy { .. }), "{busy:?}");
        tokio::task::yield_now().await;
    }
    holder.force_release(&name).await.unwrap();
    tokio::time::timeout(SOON, async {
        while woken.load(Ordering::SeqCst) == 0 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .expect("the force release is reported");
    counter.abort();
    assert_eq!(woken.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a5_waiter_is_woken_by_the_holders_release() {
    let server = shared_server().await;
    let holder = server.backend().await;
    let waiter = server.backend().await;
    let name = key("woken");
    let owner = OwnerToken::from_value("holder/0123456789abcdef0123456789abcdef");
    let Ok(AcquireOutcome::Acquired { fencing_token }) = holder
        .try_acquire(&name, &owner, Duration::from_secs(10))
        .await
    else {
        panic!("the name is free");
    };
    let mut watch = waiter.watch_release(&name).await.unwrap();
    for i in 0..5 {
        let other = OwnerToken::from_value(format!("waiter/{i:032x}"));
        let busy = waiter
            .try_acquire(&name, &other, Duration::from_secs(10))
            .await
            .unwrap();
        assert!(matches!(busy, AcquireOutcome::Busy { .. }), "{busy:?}");
    }
    let lease = lock_etcd::lock_core::Lease::new(name.as_str(), owner, fencing_token);
    holder.release(&lease).await.unwrap();
    tokio::time::timeout(SOON, watch.released())
        .await
        .expect("the release wakes the waiter");
}

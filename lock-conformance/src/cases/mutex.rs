//! Mutex compatibility: the low-level handle and the deprecated `Mutex`
//! \[M1, M2\].

#![allow(deprecated)]

use std::sync::Arc;
use std::time::Duration;

use lock_core::{LockError, Mutex, MutexConfig};
use tokio::time::Instant;

use crate::support::{
    assert_free, assert_held, node, once, within, BackendFactory, Namespace, SOON,
};

/// \[M1\] A low-level handle acquires, renews and releases by hand; the
/// deprecated `Mutex` keeps Kuzzle's defaults and lock/unlock surface.
pub async fn m1_handle_and_mutex_lock_by_hand(factory: Arc<dyn BackendFactory>) {
    let backend = factory.backend().await;
    let ns = Namespace::new();
    let key = ns.key("m1");
    let a = node(Arc::clone(&backend), "a");
    let b = node(Arc::clone(&backend), "b");

    let mut mine = a.handle(&key, Duration::from_secs(30)).unwrap();
    let mut theirs = b.handle(&key, Duration::from_secs(30)).unwrap();
    assert!(mine.acquire().await.unwrap(), "obtained");
    assert!(mine.fencing_token().is_some());
    assert!(!theirs.acquire().await.unwrap(), "busy for another node");
    assert!(mine.renew().await.unwrap(), "renewed");
    assert!(
        !theirs.release().await.unwrap(),
        "a handle that holds nothing releases nothing"
    );
    assert_held(&backend, &key, "after a foreign release").await;
    assert!(mine.release().await.unwrap(), "released");
    assert!(!mine.release().await.unwrap(), "released once");
    assert!(!mine.renew().await.unwrap(), "nothing to renew");
    assert!(theirs.acquire().await.unwrap(), "free again");
    drop(theirs);
    // Dropping a handle that holds its lock releases it.
    within(SOON, "the dropped handle's release", async {
        while !mine.acquire().await.unwrap() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    mine.release().await.unwrap();

    assert_eq!(
        MutexConfig::default(),
        MutexConfig {
            attempt_delay: Duration::from_millis(200),
            timeout: None,
            ttl: Duration::from_secs(5),
        }
    );
    let mut m1 = Mutex::new(&a, &key, MutexConfig::default()).unwrap();
    assert!(m1.lock().await.unwrap());
    assert!(m1.is_locked());
    let timeout = Duration::from_millis(300);
    let mut m2 = Mutex::new(
        &b,
        &key,
        MutexConfig {
            timeout: Some(timeout),
            ..MutexConfig::default()
        },
    )
    .unwrap();
    let started = Instant::now();
    assert!(!m2.lock().await.unwrap(), "times out while held");
    assert!(started.elapsed() >= timeout);
    m1.unlock().await.unwrap();
    assert!(!m1.is_locked());
    assert!(m2.lock().await.unwrap(), "free after unlock");
    m2.unlock().await.unwrap();
    assert!(matches!(
        Mutex::new(
            &a,
            &key,
            MutexConfig {
                attempt_delay: Duration::ZERO,
                ..MutexConfig::default()
            }
        ),
        Err(LockError::InvalidInput(_))
    ));
    assert_free(&backend, &key, "after every unlock").await;
}

/// \[M2\] On the same key a `Mutex` and `with_lock` exclude each other, and
/// neither can release the other's lock.
pub async fn m2_mutex_and_with_lock_exclude_each_other(factory: Arc<dyn BackendFactory>) {
    let backend = factory.backend().await;
    let ns = Namespace::new();
    let key = ns.key("m2");
    let a = node(Arc::clone(&backend), "a");
    let b = node(Arc::clone(&backend), "b");

    let mut m = Mutex::new(&a, &key, MutexConfig::default()).unwrap();
    assert!(m.lock().await.unwrap());
    let got = b.with_lock_config(&key, &once(), |_| async {}).await;
    assert!(
        matches!(got, Err(LockError::NotAcquired { .. })),
        "with_lock waits for a Mutex: {got:?}"
    );
    // The same node too.
    let got = a.with_lock_config(&key, &once(), |_| async {}).await;
    assert!(
        matches!(got, Err(LockError::NotAcquired { .. })),
        "with_lock on the Mutex's node waits: {got:?}"
    );
    m.unlock().await.unwrap();

    let (m_key, probe) = (key.clone(), Arc::clone(&backend));
    let a2 = a.clone();
    within(
        SOON,
        "with_lock holding",
        b.with_lock(&key, move |_| async move {
            let mut other = Mutex::new(
                &a2,
                &m_key,
                MutexConfig {
                    timeout: Some(Duration::from_millis(100)),
                    ..MutexConfig::default()
                },
            )
            .unwrap();
            assert!(!other.lock().await.unwrap(), "a Mutex waits for with_lock");
            other.unlock().await.unwrap();
            assert_held(&probe, &m_key, "a Mutex cannot release with_lock's lock").await;
        }),
    )
    .await
    .unwrap();
    assert_free(&backend, &key, "after both").await;
}

//! An acquisition attempt that does not take the lock hands back the lease
//! it granted, whatever ends it: refused for permission [A8], dropped
//! after its put was sent [S1]. Neither leaves a contender key, a lease or
//! an entry of the backend's lease map behind [T2].

mod common;

use std::future::Future;
use std::pin::pin;
use std::task::Poll;
use std::time::Duration;

use common::EtcdClusterExt;
use lock_etcd::etcd_client::{EventType, GetOptions, WatchOptions};
use lock_etcd::lock_core::{LockBackend, OwnerToken};
use lock_etcd::EtcdBackend;
use withlock_test_servers::etcd::EtcdCluster;

const SOON: Duration = Duration::from_secs(5);

fn owner(i: usize) -> OwnerToken {
    OwnerToken::from_value(format!("node/{i:032x}"))
}

fn leases_in_map(backend: &EtcdBackend) -> usize {
    backend
        .state_counts()
        .into_iter()
        .find(|(name, _)| *name == "leases")
        .map(|(_, n)| n)
        .unwrap()
}

/// The ids of every lease the cluster has, read with `client`.
async fn leases(backend: &EtcdBackend) -> Vec<i64> {
    let listed = backend.client().lease_client().leases().await.unwrap();
    listed.leases().iter().map(|l| l.id()).collect()
}

#[tokio::test]
async fn a8_an_attempt_refused_for_permission_revokes_its_lease_and_forgets_it() {
    let cluster = EtcdCluster::start(1).await.unwrap();
    cluster.enable_auth().unwrap();
    // May read the names, grant leases, and write nothing.
    cluster
        .add_user("reader", "reader", "read", &["app/"])
        .unwrap();
    let reader = EtcdBackend::connect(cluster.user_config("reader"))
        .await
        .unwrap();
    let root = EtcdBackend::connect(cluster.user_config("root"))
        .await
        .unwrap();
    assert_eq!(leases(&root).await, Vec::<i64>::new());
    for i in 0..10 {
        let error = reader
            .try_acquire(
                &format!("app/refused-{i}"),
                &owner(i),
                Duration::from_secs(30),
            )
            .await
            .unwrap_err();
        assert!(error.is_permanent(), "{error:?}");
    }
    // Revoked before the answer, not left to its 30 s.
    assert_eq!(
        leases(&root).await,
        Vec::<i64>::new(),
        "the refused attempts' leases"
    );
    assert_eq!(leases_in_map(&reader), 0);
}

#[tokio::test]
async fn s1_an_attempt_dropped_after_its_put_leaves_no_contender_key() {
    let cluster = EtcdCluster::start(1).await.unwrap();
    let backend = cluster.backend().await;
    let observer = cluster.backend().await;
    let name = lock_conformance::Namespace::new().key("dropped");
    let (_watcher, mut events) = observer
        .client()
        .watch_client()
        .watch(format!("{name}/"), Some(WatchOptions::new().with_prefix()))
        .await
        .unwrap()
        .split();

    // The attempt is polled only now and then, so that its put reaches
    // etcd while the attempt has not read the answer: once the put is
    // seen, the attempt is dropped unanswered (as a step timeout or a
    // dropped caller drops it).
    {
        let owner = owner(1);
        let mut attempt = pin!(backend.try_acquire(&name, &owner, Duration::from_secs(30)));
        let put = tokio::time::timeout(Duration::from_secs(20), async {
            loop {
                let polled = std::future::poll_fn(|cx| Poll::Ready(attempt.as_mut().poll(cx)));
                if let Poll::Ready(answer) = polled.await {
                    panic!("the attempt answered before its put was seen: {answer:?}");
                }
                let seen = tokio::time::timeout(Duration::from_millis(200), events.message()).await;
                if let Ok(message) = seen {
                    let message = message.unwrap().expect("the watch stream ended");
                    if let Some(put) = message
                        .events()
                        .iter()
                        .find(|e| e.event_type() == EventType::Put)
                    {
                        break put.kv().unwrap().key().to_vec();
                    }
                }
            }
        })
        .await
        .expect("the attempt's put is seen");
        assert!(put.starts_with(name.as_bytes()));
    }

    // Its lease is revoked from the background: the key goes at once,
    // not after its 30 s.
    let started = std::time::Instant::now();
    loop {
        let left = observer
            .client()
            .kv_client()
            .get(format!("{name}/"), Some(GetOptions::new().with_prefix()))
            .await
            .unwrap();
        if left.kvs().is_empty() {
            break;
        }
        assert!(
            started.elapsed() < SOON,
            "the dropped attempt's key still stands: {:?}",
            left.kvs()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(leases(&observer).await, Vec::<i64>::new());
    assert_eq!(leases_in_map(&backend), 0);
}

//! A lock whose lease or key is removed by hand is reported lost, cause
//! `Taken` [L1], and the next holder's token is higher [H4].

mod common;

use std::time::Duration;

use common::EtcdClusterExt;
use lock_etcd::{EtcdBackend, LockConfig, LockError, Locker, LockerOptions, LossCause};
use tokio::sync::oneshot;
use withlock_test_servers::etcd::shared_server;

fn key(name: &str) -> String {
    lock_conformance::Namespace::new().key(name)
}

fn node(backend: EtcdBackend, name: &str) -> Locker {
    Locker::with_options(backend, LockerOptions::default().node_id(name)).unwrap()
}

/// Holds `name` in the background until the lock is lost; gives the
/// contender key and its lease once held, and the call.
async fn hold(
    backend: &EtcdBackend,
    name: &str,
) -> (
    Vec<u8>,
    i64,
    u64,
    tokio::task::JoinHandle<Result<(), LockError>>,
) {
    let locker = node(backend.clone(), "holder");
    let (held_tx, held_rx) = oneshot::channel();
    let k = name.to_owned();
    let call = tokio::spawn(async move {
        let cfg = LockConfig::default().ttl(Duration::from_secs(3));
        locker
            .with_lock_config(&k, &cfg, move |ctx| async move {
                let _ = held_tx.send(ctx.fencing_token());
                ctx.lost().await;
            })
            .await
    });
    let token = tokio::time::timeout(Duration::from_secs(5), held_rx)
        .await
        .unwrap()
        .unwrap();
    let read = backend
        .client()
        .kv_client()
        .get(
            format!("{name}/"),
            Some(lock_etcd::etcd_client::GetOptions::new().with_prefix()),
        )
        .await
        .unwrap();
    let [kv] = read.kvs() else {
        panic!("one contender key expected: {:?}", read.kvs());
    };
    assert_eq!(u64::try_from(kv.create_revision()).unwrap(), token);
    (kv.key().to_vec(), kv.lease(), token, call)
}

async fn lost_with(call: tokio::task::JoinHandle<Result<(), LockError>>) -> LossCause {
    // Found at the next extension, a third of the ttl later.
    let got = tokio::time::timeout(Duration::from_secs(5), call)
        .await
        .expect("the loss is found at the next extension")
        .unwrap();
    match got {
        Err(LockError::Lost { cause, .. }) => cause,
        other => panic!("lost expected, got {other:?}"),
    }
}

async fn next_token(backend: &EtcdBackend, name: &str) -> u64 {
    node(backend.clone(), "next")
        .with_lock_config(
            name,
            &LockConfig::default().retry_attempts(0),
            |ctx| async move { ctx.fencing_token() },
        )
        .await
        .expect("the name is free again")
}

#[tokio::test]
async fn l1_lease_revoked_by_hand_is_lost_as_taken() {
    let backend = shared_server().await.backend().await;
    let name = key("revoked");
    let (_, lease, token, call) = hold(&backend, &name).await;
    backend.client().lease_client().revoke(lease).await.unwrap();
    assert!(matches!(lost_with(call).await, LossCause::Taken));
    assert!(next_token(&backend, &name).await > token);
}

#[tokio::test]
async fn l1_key_deleted_by_hand_is_lost_as_taken() {
    let backend = shared_server().await.backend().await;
    let name = key("deleted");
    let (contender, _, token, call) = hold(&backend, &name).await;
    backend
        .client()
        .kv_client()
        .delete(contender, None)
        .await
        .unwrap();
    assert!(matches!(lost_with(call).await, LossCause::Taken));
    assert!(next_token(&backend, &name).await > token);
}

#[tokio::test]
async fn l1_key_overwritten_by_hand_is_lost_as_taken() {
    let backend = shared_server().await.backend().await;
    let name = key("overwritten");
    let (contender, lease, _, call) = hold(&backend, &name).await;
    // Same key, same lease, another value: not this owner's any more.
    backend
        .client()
        .kv_client()
        .put(
            contender,
            "someone/else",
            Some(lock_etcd::etcd_client::PutOptions::new().with_lease(lease)),
        )
        .await
        .unwrap();
    assert!(matches!(lost_with(call).await, LossCause::Taken));
}

//! The operator's functions on a member that answers nothing [D1]: each
//! ends within the step timeout with a `Timeout` error, and changes
//! nothing on the store.

mod common;

use std::time::{Duration, Instant};

use common::EtcdClusterExt;
use lock_etcd::lock_core::AdminError;
use lock_etcd::lock_core::{AcquireOutcome, BackendErrorKind, LockAdmin, LockBackend, OwnerToken};
use withlock_test_servers::etcd::EtcdCluster;

/// Slack over the step timeout on a loaded machine.
const MARGIN: Duration = Duration::from_secs(2);

#[tokio::test]
async fn d1_admin_functions_time_out_on_a_stopped_member() {
    let cluster = EtcdCluster::start(1).await.unwrap();
    let backend = cluster.backend().await;
    let step = backend.config().step_timeout;
    let name = lock_conformance::Namespace::new().key("stopped");
    let owner = OwnerToken::from_value("holder/0123456789abcdef0123456789abcdef");
    let got = backend
        .try_acquire(&name, &owner, Duration::from_secs(60))
        .await
        .unwrap();
    assert!(matches!(got, AcquireOutcome::Acquired { .. }), "{got:?}");
    // A first answer on this backend's connection, so the admin calls
    // below go out on it.
    assert!(backend.inspect(&name).await.unwrap().is_held());

    cluster.pause(0).unwrap();
    let started = Instant::now();
    let error = backend.force_release(&name).await.unwrap_err();
    let took = started.elapsed();
    let AdminError::Backend(error) = error else {
        panic!("a backend error expected, got {error:?}");
    };
    assert_eq!(error.kind(), BackendErrorKind::Timeout, "{error}");
    assert!(format!("{error:?}").contains("force_release"), "{error:?}");
    assert!(took <= step + MARGIN, "force_release took {took:?}");

    let started = Instant::now();
    let error = backend.inspect(&name).await.unwrap_err();
    let took = started.elapsed();
    assert_eq!(error.kind(), BackendErrorKind::Timeout, "{error}");
    assert!(format!("{error:?}").contains("inspect"), "{error:?}");
    assert!(took <= step + MARGIN, "inspect took {took:?}");

    let started = Instant::now();
    let error = backend.list_locks(&name).await.unwrap_err();
    let took = started.elapsed();
    assert_eq!(error.kind(), BackendErrorKind::Timeout, "{error}");
    assert!(took <= step + MARGIN, "list_locks took {took:?}");

    cluster.resume(0).unwrap();
    // Nothing was changed: the lock is still its owner's.
    let info = tokio::time::timeout(Duration::from_secs(20), async {
        loop {
            match backend.inspect(&name).await {
                Ok(info) => break info,
                Err(_) => tokio::task::yield_now().await,
            }
        }
    })
    .await
    .expect("etcd answers again after SIGCONT");
    assert!(info.is_held(), "{info:?}");
    assert_eq!(
        info.owner.as_ref().map(OwnerToken::as_str),
        Some(owner.as_str())
    );
}

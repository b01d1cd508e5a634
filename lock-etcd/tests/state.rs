//! Per-key state follows what is held [T2]: after 10,000 distinct names
//! locked once each (and waited on), 10,000 locks lost by deleting their
//! keys, and 10,000 attempts refused for permission, every per-key
//! structure of the backend (`EtcdBackend::state_counts`: the lease map,
//! the keep-alives waiting, the watches, the release hub) is back to 0.
//!
//! Each test has an etcd of its own and runs its operations 64 at a time;
//! each takes well under a minute on an idle 2-core machine (about
//! 10,000 × 3 to 5 etcd requests), and prints how long it took.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::EtcdClusterExt;
use lock_etcd::etcd_client::DeleteOptions;
use lock_etcd::lock_core::{AcquireOutcome, ExtendOutcome, Lease, LockBackend, OwnerToken};
use lock_etcd::{EtcdBackend, Locker};
use withlock_test_servers::etcd::EtcdCluster;

const KEYS: usize = 10_000;
const AT_ONCE: usize = 64;

/// A bound that a loaded machine keeps many times over.
const LIMIT: Duration = Duration::from_secs(600);

fn owner(i: usize) -> OwnerToken {
    OwnerToken::from_value(format!("node/{i:032x}"))
}

/// Runs `each(i)` for every `i` in `0..KEYS`, [`AT_ONCE`] at a time.
async fn run_all<F, Fut>(what: &str, each: F)
where
    F: Fn(usize) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    let started = Instant::now();
    let each = Arc::new(each);
    let tasks: Vec<_> = (0..AT_ONCE)
        .map(|task| {
            let each = Arc::clone(&each);
            tokio::spawn(async move {
                for i in (task..KEYS).step_by(AT_ONCE) {
                    each(i).await;
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap();
    }
    let took = started.elapsed();
    eprintln!("{what}: {KEYS} in {took:?}");
    assert!(took < LIMIT, "{what} took {took:?}");
}

fn count(backend: &EtcdBackend, name: &str) -> usize {
    backend
        .state_counts()
        .into_iter()
        .find(|(n, _)| *n == name)
        .map(|(_, n)| n)
        .unwrap_or_else(|| panic!("no count named {name}"))
}

/// Every count is back to 0: the lease map at once, the others (the
/// watches are swept every 2 s) within a few seconds.
async fn back_to_zero(backend: &EtcdBackend) {
    assert_eq!(count(backend, "leases"), 0, "{:?}", backend.state_counts());
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let counts = backend.state_counts();
        if counts.iter().all(|(_, n)| *n == 0) {
            return;
        }
        assert!(Instant::now() < deadline, "{counts:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t2_names_locked_and_waited_on_once_each_leave_no_state() {
    let cluster = EtcdCluster::start(1).await.unwrap();
    let backend = cluster.backend().await;
    let locker = Locker::new(backend.clone());
    let (b, watched) = (backend.clone(), Arc::new(AtomicUsize::new(0)));
    let w = Arc::clone(&watched);
    run_all("locked and waited on once each", move |i| {
        let (locker, backend, watched) = (locker.clone(), b.clone(), Arc::clone(&w));
        async move {
            let name = format!("t2/locked-{i}");
            locker.with_lock(&name, |_| async {}).await.unwrap();
            // A wait's watch, made and given up. On a loaded machine the
            // watch stream may break (a watch unconfirmed for the
            // failover timeout, 300 ms here): the wait then polls, and
            // the names to watch again must not stay behind either.
            if let Ok(watch) = backend.watch_release(&name).await {
                watched.fetch_add(1, Ordering::Relaxed);
                drop(watch);
            }
        }
    })
    .await;
    let watched = watched.load(Ordering::Relaxed);
    eprintln!("{watched} of {KEYS} watches made");
    assert!(watched > 0, "no watch was made");
    back_to_zero(&backend).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t2_locks_lost_by_deleting_their_keys_leave_no_state() {
    let cluster = EtcdCluster::start(1).await.unwrap();
    let backend = cluster.backend().await;
    let b = backend.clone();
    run_all("lost by deleting their keys", move |i| {
        let backend = b.clone();
        async move {
            let name = format!("t2/lost-{i}");
            let owner = owner(i);
            let ttl = Duration::from_secs(30);
            let got = backend.try_acquire(&name, &owner, ttl).await.unwrap();
            let AcquireOutcome::Acquired { fencing_token } = got else {
                panic!("{name}: {got:?}");
            };
            backend
                .client()
                .kv_client()
                .delete(format!("{name}/"), Some(DeleteOptions::new().with_prefix()))
                .await
                .unwrap();
            let lease = Lease::new(name.as_str(), owner, fencing_token);
            let found = backend.extend(&lease, ttl).await.unwrap();
            assert!(
                matches!(found, ExtendOutcome::Expired | ExtendOutcome::Taken),
                "{name}: {found:?}"
            );
        }
    })
    .await;
    back_to_zero(&backend).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t2_attempts_refused_for_permission_leave_no_state() {
    let cluster = EtcdCluster::start(1).await.unwrap();
    cluster.enable_auth().unwrap();
    cluster
        .add_user("reader", "reader", "read", &["t2/"])
        .unwrap();
    let reader = EtcdBackend::connect(cluster.user_config("reader"))
        .await
        .unwrap();
    let b = reader.clone();
    run_all("refused for permission", move |i| {
        let backend = b.clone();
        async move {
            let name = format!("t2/refused-{i}");
            let error = backend
                .try_acquire(&name, &owner(i), Duration::from_secs(30))
                .await
                .unwrap_err();
            assert!(error.is_permanent(), "{name}: {error:?}");
        }
    })
    .await;
    back_to_zero(&reader).await;
    // And the cluster holds none of their leases.
    let root = EtcdBackend::connect(cluster.user_config("root"))
        .await
        .unwrap();
    let left = root.client().lease_client().leases().await.unwrap();
    assert!(
        left.leases().is_empty(),
        "{} leases left",
        left.leases().len()
    );
}

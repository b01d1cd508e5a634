//! \[T2\] State that follows what is held: after 10,000 distinct keys
//! locked once each, and 10,000 locks lost by deleting their keys while
//! waiters watch them, every per-key structure of the backend (read with
//! `state_counts`) is back within its documented bound. On the shared
//! Redis (and the test binary's cluster) in namespaces of the tests' own.

use std::future::Future;
use std::time::Duration;

use futures_util::stream::{self, StreamExt};
use lock_core::{AcquireOutcome, ExtendOutcome, Lease, LockBackend, Locker, OwnerToken};
use lock_redis::testing::{ScratchBackend, ScratchClusterBackend};
use lock_redis::{redis, RedisConfig};
use withlock_test_servers::redis::{redis_url, shared_cluster};

const KEYS: usize = 10_000;
/// Calls in flight at once.
const AT_ONCE: usize = 64;
const TTL: Duration = Duration::from_secs(60);
/// How long the Cluster's subscription may take to drop the shard channels
/// no waiter needs (it sweeps every second), on a loaded machine.
const SWEPT_WITHIN: Duration = Duration::from_secs(10);

fn config() -> RedisConfig {
    RedisConfig::default().step_timeout(Duration::from_secs(10))
}

async fn each<F: Future<Output = ()>>(n: usize, f: impl FnMut(usize) -> F) {
    stream::iter(0..n)
        .map(f)
        .buffer_unordered(AT_ONCE)
        .collect::<Vec<()>>()
        .await;
}

fn count(counts: &[(&'static str, usize)], name: &str) -> usize {
    counts
        .iter()
        .find(|(n, _)| *n == name)
        .unwrap_or_else(|| panic!("no {name} in {counts:?}"))
        .1
}

/// Asserts every per-key count is 0 (the per-node ones are left to the
/// caller).
fn assert_empty(counts: &[(&'static str, usize)], per_node: &[&str]) {
    for (name, n) in counts {
        if !per_node.contains(name) {
            assert_eq!(*n, 0, "{name} in {counts:?}");
        }
    }
}

/// Each key locked once through a `Locker`, then each taken, watched (as
/// a waiter does), its key deleted by another client (`delete`), the
/// lock's extension told it is lost, and the watches dropped. `counts`
/// reads the backend's structures; `watched` names the count that must
/// reach 10,000 while the watches live.
async fn lock_and_lose<B, D, DF>(
    backend: B,
    counts: impl Fn() -> Vec<(&'static str, usize)> + Send + Sync,
    delete: D,
) where
    B: LockBackend + Clone,
    D: Fn(String) -> DF + Send + Sync,
    DF: Future<Output = ()> + Send,
{
    let locker = Locker::new(backend.clone());
    each(KEYS, |i| {
        let locker = locker.clone();
        async move {
            locker
                .with_lock(&format!("once-{i}"), |_| async {})
                .await
                .unwrap();
        }
    })
    .await;
    drop(locker);
    let after_locking = counts();
    eprintln!("after {KEYS} keys locked once: {after_locking:?}");

    let owner = OwnerToken::new("t2");
    let leases: Vec<Lease> = stream::iter(0..KEYS)
        .map(|i| {
            let (backend, owner) = (backend.clone(), owner.clone());
            async move {
                let key = format!("lost-{i}");
                match backend.try_acquire(&key, &owner, TTL).await.unwrap() {
                    AcquireOutcome::Acquired { fencing_token } => {
                        Lease::new(key.as_str(), owner, fencing_token)
                    }
                    other => panic!("{key}: {other:?}"),
                }
            }
        })
        .buffer_unordered(AT_ONCE)
        .collect()
        .await;
    let watches: Vec<_> = stream::iter(&leases)
        .map(|lease| {
            let backend = backend.clone();
            async move { backend.watch_release(lease.key()).await.unwrap() }
        })
        .buffer_unordered(AT_ONCE)
        .collect()
        .await;
    let watching = counts();
    assert_eq!(
        count(&watching, "release_watches"),
        KEYS,
        "the waiters' watches are in the map: {watching:?}"
    );
    stream::iter(&leases)
        .map(|lease| delete(lease.key().to_owned()))
        .buffer_unordered(AT_ONCE)
        .collect::<Vec<()>>()
        .await;
    stream::iter(&leases)
        .map(|lease| {
            let backend = backend.clone();
            async move {
                let outcome = backend.extend(lease, TTL).await.unwrap();
                assert_eq!(outcome, ExtendOutcome::Expired, "{}: lost", lease.key());
            }
        })
        .buffer_unordered(AT_ONCE)
        .collect::<Vec<()>>()
        .await;
    drop(watches);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t2_single_node_structures_follow_what_is_held() {
    let scratch = ScratchBackend::new(&redis_url(), config());
    let backend = lock_redis::RedisBackend::clone(&scratch);
    let prefix = scratch.namespace().prefix().to_owned();
    let raw = redis::Client::open(redis_url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let counts = || backend.state_counts();
    lock_and_lose(backend.clone(), counts, |key| {
        let (mut raw, key) = (raw.clone(), format!("{prefix}{key}"));
        async move {
            let _: i64 = redis::cmd("DEL")
                .arg(&key)
                .query_async(&mut raw)
                .await
                .unwrap();
        }
    })
    .await;
    let after = backend.state_counts();
    eprintln!("after {KEYS} locks lost: {after:?}");
    assert_empty(&after, &[]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t2_cluster_structures_follow_what_is_held() {
    let cluster = shared_cluster();
    let urls = cluster.urls();
    let scratch = ScratchClusterBackend::new(&urls, config());
    let backend = lock_redis::RedisClusterBackend::clone(&scratch);
    let prefix = scratch.namespace().prefix().to_owned();
    let raw = redis::cluster::ClusterClient::new(urls.clone())
        .unwrap()
        .get_async_connection()
        .await
        .unwrap();
    let counts = || backend.state_counts();
    lock_and_lose(backend.clone(), counts, |key| {
        let (mut raw, key) = (raw.clone(), format!("{prefix}{key}"));
        async move {
            let _: i64 = redis::cmd("DEL")
                .arg(&key)
                .query_async(&mut raw)
                .await
                .unwrap();
        }
    })
    .await;
    let per_node = ["batched_masters", "node_links", "subscription_links"];
    let nodes = urls.len().max(cluster.master_ports().unwrap().len() * 2);
    let started = tokio::time::Instant::now();
    let after = loop {
        let now = backend.state_counts();
        if count(&now, "shard_channels") == 0 || started.elapsed() > SWEPT_WITHIN {
            break now;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    eprintln!("after {KEYS} locks lost: {after:?}");
    assert_empty(&after, &per_node);
    for name in per_node {
        assert!(
            count(&after, name) <= nodes,
            "{name}: at most one per node: {after:?}"
        );
    }
}

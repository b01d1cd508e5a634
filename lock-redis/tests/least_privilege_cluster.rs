//! SPEC D3 on a Redis Cluster: the whole conformance suite as an ACL user
//! made on every node (a cluster does not share its ACL) with exactly the
//! rights the README's "Cluster" row lists, and nothing else; the admin
//! cases as an operator user. The cluster (3 masters, 3 replicas) is this
//! test binary's own.

mod common;

use std::sync::LazyLock;

use common::acl::{as_user, set_user, AsUsers, CLUSTER, OPERATOR_EXTRA, PREFIX};
use lock_redis::{RedisClusterBackend, RedisConfig};
use withlock_test_servers::redis::RedisCluster;

static CLUSTER_OF_OUR_OWN: LazyLock<RedisCluster> = LazyLock::new(|| {
    let cluster = RedisCluster::start().expect("a Redis Cluster of this test's own");
    for node in cluster.nodes() {
        let mut conn = node.client().unwrap().get_connection().unwrap();
        set_user(&mut conn, "locker", "lock-secret", &[CLUSTER]);
        set_user(
            &mut conn,
            "operator",
            "op-secret",
            &[CLUSTER, OPERATOR_EXTRA],
        );
    }
    cluster
});

async fn backend_as(user: &str, password: &str) -> RedisClusterBackend {
    let urls: Vec<String> = CLUSTER_OF_OUR_OWN
        .urls()
        .iter()
        .map(|url| as_user(url, user, password))
        .collect();
    RedisClusterBackend::connect_with(urls, RedisConfig::default().prefix(PREFIX))
        .await
        .expect("connect works with the Cluster row's rights")
}

// Ttls of at least 1 s, as in `conformance.rs`: 400 ms leaves a loaded
// machine's extension too little time.
lock_conformance::conformance_tests!(lock_conformance::with_min_ttl(
    std::time::Duration::from_secs(1),
    AsUsers(backend_as)
));

/// The cluster user really is that narrow on every node: `INFO`, a key
/// outside the prefix, a classic `PUBLISH` and `SCAN` are refused.
#[test]
fn d3_the_cluster_lock_user_has_no_more_rights_than_listed() {
    for node in CLUSTER_OF_OUR_OWN.nodes() {
        let url = as_user(&node.url(), "locker", "lock-secret");
        let mut conn = redis::Client::open(url).unwrap().get_connection().unwrap();
        let info: redis::RedisResult<String> = redis::cmd("INFO").query(&mut conn);
        assert!(info.is_err(), "INFO is refused: {info:?}");
        let outside: redis::RedisResult<redis::Value> =
            redis::cmd("GET").arg("other:k").query(&mut conn);
        assert!(
            outside.as_ref().is_err_and(|e| e.code() == Some("NOPERM")),
            "a key outside the prefix is refused: {outside:?}"
        );
        let publish: redis::RedisResult<i64> = redis::cmd("PUBLISH")
            .arg("{1}:jobs:withlock:released")
            .arg("x")
            .query(&mut conn);
        assert!(publish.is_err(), "classic PUBLISH is refused: {publish:?}");
        let scan: redis::RedisResult<redis::Value> = redis::cmd("SCAN").arg(0).query(&mut conn);
        assert!(scan.is_err(), "the lock user cannot list keys: {scan:?}");
    }
}

/// SPEC F6 on a Cluster: a user made by the Cluster row of a release
/// before the fair queue (no queue key patterns, none of its commands)
/// waits unqueued. Its queued attempt is refused (`NOPERM`), the driver
/// waits unqueued from then on, the holder's release, refused the queue's
/// keys, is sent again without them, and the waiter gets the key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f6_a_cluster_user_without_the_queues_rights_waits_unqueued() {
    use std::time::Duration;

    use common::{node, within};
    use lock_core::LockConfig;

    const LIMIT: Duration = Duration::from_secs(20);
    let older: Vec<&str> = CLUSTER
        .iter()
        .copied()
        .filter(|rule| !rule.contains("withlock-queue") && !rule.contains("withlock-waiters"))
        .filter(|rule| {
            !matches!(
                *rule,
                "+pttl"
                    | "+exists"
                    | "+zrange"
                    | "+zadd"
                    | "+zrem"
                    | "+zscore"
                    | "+hget"
                    | "+hset"
                    | "+hdel"
            )
        })
        .collect();
    for cluster_node in CLUSTER_OF_OUR_OWN.nodes() {
        let mut conn = cluster_node.client().unwrap().get_connection().unwrap();
        set_user(&mut conn, "older-locker", "older-secret", &[&older]);
    }
    let key = "fair f6 cluster";
    let holder = node(backend_as("older-locker", "older-secret").await, "holder");
    let counting =
        lock_conformance::CountingBackend::new(backend_as("older-locker", "older-secret").await);
    let waiter = node(counting.clone(), "waiter");
    let mut held = holder.handle(key, Duration::from_secs(30)).unwrap();
    assert!(held.acquire().await.unwrap());
    let waiting = tokio::spawn(async move {
        let cfg = LockConfig::default().wait_forever();
        waiter.with_lock_config(key, &cfg, |_| async {}).await
    });
    // The plain attempt and the queued one (refused: NOPERM) answered,
    // then an unqueued one.
    within(
        LIMIT,
        "the waiter's attempts",
        counting.until_answered(lock_conformance::Step::TryAcquire, 3),
    )
    .await;
    assert!(held.release().await.unwrap());
    within(LIMIT, "the waiter gets the key", waiting)
        .await
        .unwrap()
        .expect("waiting works without the queue's rights");
}

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

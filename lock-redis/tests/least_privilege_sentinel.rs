//! SPEC D3 behind Sentinel: the whole conformance suite as an ACL user on
//! the data nodes (primary and replica) with exactly the rights the
//! README's "Sentinel" row lists, and nothing else; the admin cases as an
//! operator user. The Sentinels are reached as their default user (their
//! own ACL is not part of the row). The group (a primary, a replica, three
//! Sentinels) is this test binary's own.

mod common;

use std::sync::LazyLock;

use common::acl::{set_user, AsUsers, OPERATOR_EXTRA, PREFIX, SENTINEL_EXTRA, SINGLE_NODE};
use lock_redis::{RedisConfig, RedisSentinelBackend, SentinelConfig};
use withlock_test_servers::redis::{SentinelGroup, MASTER_NAME};

static GROUP: LazyLock<SentinelGroup> = LazyLock::new(|| {
    let group = SentinelGroup::start(1).expect("a Sentinel group of this test's own");
    for server in group.servers() {
        let mut conn = server.client().unwrap().get_connection().unwrap();
        set_user(
            &mut conn,
            "locker",
            "lock-secret",
            &[SINGLE_NODE, SENTINEL_EXTRA],
        );
        set_user(
            &mut conn,
            "operator",
            "op-secret",
            &[SINGLE_NODE, SENTINEL_EXTRA, OPERATOR_EXTRA],
        );
    }
    group
});

async fn backend_as(user: &str, password: &str) -> RedisSentinelBackend {
    let sentinel = SentinelConfig::new(MASTER_NAME, GROUP.sentinel_urls())
        .unwrap()
        .data_node_username(user)
        .data_node_password(password);
    RedisSentinelBackend::connect_with_config(sentinel, RedisConfig::default().prefix(PREFIX))
        .await
        .expect("connect works with the Sentinel row's rights")
}

// Ttls of at least 1 s, as in `conformance.rs`: 400 ms leaves a loaded
// machine's extension too little time.
lock_conformance::conformance_tests!(lock_conformance::with_min_ttl(
    std::time::Duration::from_secs(1),
    AsUsers(backend_as)
));

/// The data-node user really is that narrow: `INFO`, a key and a channel
/// outside the prefix, and `SCAN` are refused on the primary.
#[test]
fn d3_the_sentinel_lock_user_has_no_more_rights_than_listed() {
    let url = common::acl::as_user(&GROUP.primary().url(), "locker", "lock-secret");
    let mut conn = redis::Client::open(url).unwrap().get_connection().unwrap();
    let role: redis::RedisResult<redis::Value> = redis::cmd("ROLE").query(&mut conn);
    assert!(role.is_ok(), "ROLE is allowed: {role:?}");
    let info: redis::RedisResult<String> = redis::cmd("INFO").query(&mut conn);
    assert!(info.is_err(), "INFO is refused: {info:?}");
    let outside: redis::RedisResult<()> =
        redis::cmd("SET").arg("other:k").arg("v").query(&mut conn);
    assert!(outside.is_err(), "a key outside the prefix is refused");
    let channel: redis::RedisResult<i64> =
        redis::cmd("PUBLISH").arg("other").arg("x").query(&mut conn);
    assert!(channel.is_err(), "a channel outside the prefix is refused");
    let scan: redis::RedisResult<redis::Value> = redis::cmd("SCAN").arg(0).query(&mut conn);
    assert!(scan.is_err(), "the lock user cannot list keys: {scan:?}");
}

//! SPEC D3 on a single Redis node: the whole conformance suite as an ACL
//! user with exactly the rights the README lists for the lock steps, and
//! nothing else (no `@dangerous`, so no `INFO`; no keys or channels outside
//! the prefix). The server is this test binary's own.

mod common;

use std::sync::LazyLock;

use common::acl::{as_user, set_user, AsUsers, LOCKER, OPERATOR_EXTRA, PREFIX, SINGLE_NODE};
use lock_redis::{RedisBackend, RedisConfig};
use withlock_test_servers::redis::RedisServer;

static SERVER: LazyLock<RedisServer> = LazyLock::new(|| {
    let server = RedisServer::start().expect("a redis-server of this test's own");
    let client = redis::Client::open(server.url()).unwrap();
    let mut conn = client.get_connection().unwrap();
    set_user(&mut conn, "locker", "lock-secret", &[SINGLE_NODE]);
    set_user(
        &mut conn,
        "operator",
        "op-secret",
        &[SINGLE_NODE, OPERATOR_EXTRA],
    );
    server
});

async fn backend_as(user: &str, password: &str) -> RedisBackend {
    let url = as_user(&SERVER.url(), user, password);
    RedisBackend::connect_with(&url, RedisConfig::default().prefix(PREFIX))
        .await
        .expect("connect works without INFO")
}

// Ttls of at least 1 s, as in `conformance.rs`: 400 ms leaves a loaded
// machine's extension too little time.
lock_conformance::conformance_tests!(lock_conformance::with_min_ttl(
    std::time::Duration::from_secs(1),
    AsUsers(backend_as)
));

/// The user really is that narrow: `INFO`, a key outside the prefix and a
/// channel outside it are refused.
#[test]
fn d3_the_lock_user_has_no_more_rights_than_listed() {
    let client = redis::Client::open(as_user(&SERVER.url(), LOCKER.0, LOCKER.1)).unwrap();
    let mut conn = client.get_connection().unwrap();
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

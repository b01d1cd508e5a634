//! SPEC D3 on a single Redis node: the whole conformance suite as an ACL
//! user with exactly the rights the README lists for the lock steps, and
//! nothing else (no `@dangerous`, so no `INFO`; no keys or channels outside
//! the prefix). The server is this test binary's own.

use std::sync::LazyLock;

use lock_redis::testing::RedisServer;
use lock_redis::{RedisBackend, RedisConfig};

/// The prefix the user's keys and channel live under.
const PREFIX: &str = "jobs:";

/// The ACL of a lock user for keys under [`PREFIX`], as the lock-redis
/// docs give it (single node).
const LOCK_USER_ACL: &[&str] = &[
    "on",
    ">lock-secret",
    "resetkeys",
    "~jobs:*",
    "~{*}:withlock-fence:jobs:*",
    "resetchannels",
    "&jobs:withlock:released",
    "-@all",
    "+ping",
    "+hello",
    "+evalsha",
    "+eval",
    "+script|load",
    "+get",
    "+set",
    "+del",
    "+pexpire",
    "+time",
    "+incr",
    "+publish",
    "+subscribe",
    "+unsubscribe",
];

static SERVER: LazyLock<RedisServer> = LazyLock::new(|| {
    let server = RedisServer::start().expect("a redis-server of this test's own");
    let client = redis::Client::open(server.url()).unwrap();
    let mut conn = client.get_connection().unwrap();
    let mut cmd = redis::cmd("ACL");
    cmd.arg("SETUSER").arg("locker");
    for rule in LOCK_USER_ACL {
        cmd.arg(*rule);
    }
    let () = cmd.query(&mut conn).expect("the ACL user is made");
    server
});

fn user_url() -> String {
    SERVER
        .url()
        .replace("redis://", "redis://locker:lock-secret@")
}

async fn lock_user_backend() -> RedisBackend {
    RedisBackend::connect_with(&user_url(), RedisConfig::default().prefix(PREFIX))
        .await
        .expect("connect works without INFO")
}

lock_conformance::conformance_tests!(lock_user_backend);

/// The user really is that narrow: `INFO`, a key outside the prefix and a
/// channel outside it are refused.
#[test]
fn d3_the_lock_user_has_no_more_rights_than_listed() {
    let client = redis::Client::open(user_url()).unwrap();
    let mut conn = client.get_connection().unwrap();
    let info: redis::RedisResult<String> = redis::cmd("INFO").query(&mut conn);
    assert!(info.is_err(), "INFO is refused: {info:?}");
    let outside: redis::RedisResult<()> =
        redis::cmd("SET").arg("other:k").arg("v").query(&mut conn);
    assert!(outside.is_err(), "a key outside the prefix is refused");
    let channel: redis::RedisResult<i64> =
        redis::cmd("PUBLISH").arg("other").arg("x").query(&mut conn);
    assert!(channel.is_err(), "a channel outside the prefix is refused");
}

//! The slot rule this crate implements agrees with Redis' own
//! `CLUSTER KEYSLOT`, for odd keys and for their fencing companions.

use lock_redis::slot::{fence_key, key_slot};
use withlock_test_servers::redis::RedisServer;

fn keys() -> Vec<String> {
    let mut keys: Vec<String> = [
        "plain",
        "{tag}rest",
        "a{b}c",
        "{}",
        "}{",
        "{}{x}",
        "a}b",
        "}}}",
        "{{x}}",
        "ü{🔒}",
        "鍵",
        "with space",
        "glob*?",
        "x{",
        "}",
        "{",
        "foo",
        "123456789",
    ]
    .iter()
    .map(|k| (*k).to_owned())
    .collect();
    for i in 0..200 {
        keys.push(format!("job:{i}}}{}", i % 7));
        keys.push(format!("{{{i}}}:x"));
    }
    keys
}

fn keyslot(conn: &mut redis::Connection, key: &str) -> redis::RedisResult<u16> {
    redis::cmd("CLUSTER").arg("KEYSLOT").arg(key).query(conn)
}

/// Checked on a `redis-server --cluster-enabled yes` child, where
/// `CLUSTER KEYSLOT` answers without any slot assigned.
#[test]
fn slots_and_companions_agree_with_cluster_keyslot() {
    // Not skipped when the server cannot start: a check that did not run
    // must not pass.
    let server =
        RedisServer::start_cluster_enabled().expect("a cluster-enabled redis-server child");
    let client = redis::Client::open(server.url()).unwrap();
    let mut conn = client.get_connection().unwrap();
    for key in keys() {
        let slot = keyslot(&mut conn, &key).unwrap();
        assert_eq!(key_slot(&key), slot, "key {key:?}");
        let fence = fence_key(&key);
        assert_eq!(
            keyslot(&mut conn, &fence).unwrap(),
            slot,
            "companion {fence:?}"
        );
    }
}

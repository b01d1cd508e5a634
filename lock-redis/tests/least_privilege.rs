//! SPEC D3 on a single Redis node: the whole conformance suite as an ACL
//! user with exactly the rights the README lists for the lock steps, and
//! nothing else (no `@dangerous`, so no `INFO`; no keys or channels outside
//! the prefix). The server is this test binary's own.

mod common;

use std::sync::LazyLock;

use common::acl::{
    as_user, set_user, AsUsers, LOCKER, OPERATOR, OPERATOR_EXTRA, PREFIX, SINGLE_NODE,
};
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

/// \[H7, D3\] A lock user made by the rules of a release before the
/// minimum hold's record (no `~{*}:withlock-kept:P*`) still holds a key
/// whose run ended to its minimum: its hold step, refused the record's key,
/// is sent again without it. The operator then sees the lock held, and
/// running (no hold's time left).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h7_a_user_without_the_records_pattern_still_holds_to_the_minimum() {
    let rules: Vec<&str> = SINGLE_NODE
        .iter()
        .copied()
        .filter(|rule| !rule.contains("withlock-kept"))
        .collect();
    assert_eq!(rules.len() + 1, SINGLE_NODE.len());
    {
        let client = redis::Client::open(SERVER.url()).unwrap();
        let mut conn = client.get_connection().unwrap();
        set_user(&mut conn, "older-locker", "older-secret", &[&rules]);
    }
    let locker = lock_core::Locker::new(backend_as("older-locker", "older-secret").await);
    let operator = backend_as(OPERATOR.0, OPERATOR.1).await;
    let key = format!("h7-older-{:016x}", rand::random::<u64>());
    let hold = std::time::Duration::from_secs(30);
    let cfg = lock_core::LockConfig::default()
        .retry_attempts(0)
        .hold_at_least(hold);
    locker
        .with_lock_config(&key, &cfg, |_| async {})
        .await
        .expect("the run and its hold step");
    let info = lock_core::LockAdmin::inspect(&operator, &key)
        .await
        .unwrap();
    assert!(info.is_held(), "kept to its minimum: {info:?}");
    assert!(!info.is_kept(), "no record, so shown running: {info:?}");
    assert!(
        info.ttl.is_some_and(|ttl| ttl <= hold && ttl > hold / 2),
        "the key expires at the end of its hold, not its ttl: {info:?}"
    );
    let busy = locker.with_lock_config(&key, &cfg, |_| async {}).await;
    assert!(busy.is_err(), "the key is held: {busy:?}");
    let freed = lock_core::LockAdmin::force_release(&operator, &key)
        .await
        .unwrap();
    assert!(freed.is_some());
}

/// \[D3\] Releases that go out together as one batch script run (more than
/// two on the wire at once) work for the lock user, whose rules do not
/// list `PUBSUB`: the batch's check for listeners, refused, counts as
/// someone listening.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn d3_batched_releases_work_without_pubsub() {
    use lock_core::{AcquireOutcome, Lease, LockBackend, OwnerToken, ReleaseOutcome};

    let backend = backend_as(LOCKER.0, LOCKER.1).await;
    let owner = OwnerToken::new("batched");
    let ttl = std::time::Duration::from_secs(30);
    let mut leases = Vec::new();
    for i in 0..16 {
        let key = format!("d3-batch-{:016x}-{i}", rand::random::<u64>());
        let AcquireOutcome::Acquired { fencing_token } =
            backend.try_acquire(&key, &owner, ttl).await.unwrap()
        else {
            panic!("{key} is free");
        };
        leases.push(Lease::new(key.as_str(), owner.clone(), fencing_token));
    }
    let released =
        futures_util::future::join_all(leases.iter().map(|lease| backend.release(lease))).await;
    for answer in released {
        assert_eq!(answer.unwrap(), ReleaseOutcome::Released);
    }
}

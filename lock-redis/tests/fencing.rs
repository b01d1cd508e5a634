//! SPEC H4 on Redis: fencing tokens never go backwards, even when the store
//! loses the counter (an empty restart, `FLUSHALL`, the companion key
//! deleted), since each token is at least the server clock in
//! microseconds. And the error kinds the driver relies on: a request that
//! never left (no connection) is `Unavailable`, one sent to a server that
//! then did not answer stays `Timeout`.

mod common;

use std::time::Duration;

use common::{node, raw, redis_error_in, refused_for_its_counter, within};
use lock_core::{
    AcquireOutcome, BackendErrorKind, Lease, LockBackend, LockConfig, LockError, Locker, OwnerToken,
};
use lock_redis::testing::Namespace;
use lock_redis::{RedisBackend, RedisConfig};
use redis::AsyncCommands;
use withlock_test_servers::redis::{server_url, RedisServer};

const LIMIT: Duration = Duration::from_secs(15);

/// One `with_lock` on `key`, patient enough to ride out a reconnection;
/// gives the token the callback saw.
async fn token(locker: &Locker, key: &str) -> u64 {
    let cfg = LockConfig::default()
        .retry_attempts(40)
        .retry_delay(Duration::from_millis(50));
    within(
        LIMIT,
        "with_lock",
        locker.with_lock_config(key, &cfg, |ctx| async move { ctx.fencing_token() }),
    )
    .await
    .unwrap()
}

/// `n` acquisitions in turn; asserts their tokens strictly increase and
/// are all above `floor`; gives the last.
async fn tokens_above(locker: &Locker, key: &str, n: usize, floor: u64, when: &str) -> u64 {
    let mut last = floor;
    for _ in 0..n {
        let next = token(locker, key).await;
        assert!(next > last, "{when}: token {next} after {last}");
        last = next;
    }
    last
}

/// The server's clock (`TIME`) in microseconds since the Unix epoch.
async fn server_micros(url: &str) -> u64 {
    let (secs, micros): (u64, u64) = redis::cmd("TIME")
        .query_async(&mut raw(url).await)
        .await
        .unwrap();
    secs * 1_000_000 + micros
}

/// An own server restarted empty (no persistence), then flushed: the
/// tokens drawn after each loss of the counter are still greater than all
/// before, and at least the server clock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h4_tokens_keep_increasing_across_an_empty_restart_and_flushall() {
    let server = RedisServer::start().unwrap();
    let url = server.url();
    let locker = node(RedisBackend::from_url(&url).unwrap(), "a");
    let key = "fenced {job} ü";
    let last = tokens_above(&locker, key, 3, 0, "before the restart").await;

    server.restart().unwrap();
    let clock = server_micros(&url).await;
    let first = token(&locker, key).await;
    assert!(
        first > last,
        "after an empty restart: token {first} after {last}"
    );
    assert!(
        first >= clock,
        "token {first} below the server clock {clock}"
    );
    let last = tokens_above(&locker, key, 2, first, "after the restart").await;

    let mut conn = raw(&url).await;
    let _: () = redis::cmd("FLUSHALL").query_async(&mut conn).await.unwrap();
    let fence = RedisBackend::from_url(&url).unwrap().fence_key(key);
    let gone: bool = conn.exists(&fence).await.unwrap();
    assert!(!gone, "FLUSHALL took the counter");
    tokens_above(&locker, key, 3, last, "after FLUSHALL").await;
}

/// On the shared server, in a namespace of the test's own: deleting only
/// the counter (the fence key) does not make the next token smaller, and
/// the companion holds each token drawn.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h4_tokens_keep_increasing_when_the_counter_key_is_deleted() {
    let url = server_url().await;
    let ns = Namespace::new(&url);
    let key = ns.key("counter deleted");
    let backend = RedisBackend::from_url(&url).unwrap();
    let fence = backend.fence_key(&key);
    let locker = node(backend, "a");
    let last = tokens_above(&locker, &key, 3, 0, "before the deletion").await;
    let mut conn = raw(&url).await;
    let stored: u64 = conn.get(&fence).await.unwrap();
    assert_eq!(stored, last, "the companion holds the last token");

    let deleted: u64 = conn.del(&fence).await.unwrap();
    assert_eq!(deleted, 1);
    let clock = server_micros(&url).await;
    let next = tokens_above(&locker, &key, 3, last, "after the deletion").await;
    assert!(next >= clock, "token {next} below the server clock {clock}");
    let stored: u64 = conn.get(&fence).await.unwrap();
    assert_eq!(stored, next, "the companion holds the last token again");
}

/// A counter ahead of the clock (as after the clock stepped back) keeps
/// counting by one: the token is the greater of the two terms.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h4_a_counter_ahead_of_the_clock_counts_on_by_one() {
    let url = server_url().await;
    let ns = Namespace::new(&url);
    let key = ns.key("ahead");
    let backend = RedisBackend::from_url(&url).unwrap();
    let fence = backend.fence_key(&key);
    let locker = node(backend, "a");
    // A day ahead of the server clock.
    let ahead = server_micros(&url).await + 86_400 * 1_000_000;
    let mut conn = raw(&url).await;
    let _: () = conn.set(&fence, ahead).await.unwrap();
    assert_eq!(token(&locker, &key).await, ahead + 1);
    assert_eq!(token(&locker, &key).await, ahead + 2);
}

/// A companion that holds anything but a decimal integer below 2^53 fails
/// the acquisition and changes nothing: the lock key is not taken, the
/// companion keeps its value (and its ttl, if it had one); one of another
/// type is left as it was.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h4_a_corrupt_counter_fails_the_acquisition_and_takes_nothing() {
    let url = server_url().await;
    let ns = Namespace::new(&url);
    let backend = RedisBackend::from_url(&url).unwrap();
    let mut conn = raw(&url).await;
    let owner = OwnerToken::new("a");
    let ttl = Duration::from_secs(30);
    for (i, bad) in [
        "not a number",
        "",
        "12.5",
        "+5",
        "007",
        "1e6",
        " 42",
        "9007199254740991",
        "12345678901234567890",
    ]
    .into_iter()
    .enumerate()
    {
        let key = ns.key(&format!("corrupt {i}"));
        let fence = backend.fence_key(&key);
        let _: () = redis::cmd("SET")
            .arg(&fence)
            .arg(bad)
            .arg("PX")
            .arg(600_000)
            .query_async(&mut conn)
            .await
            .unwrap();
        let error = backend
            .try_acquire(&key, &owner, ttl)
            .await
            .expect_err("a corrupt counter fails the acquisition");
        assert!(refused_for_its_counter(&error), "{bad:?}: {error:?}");
        let taken: bool = conn.exists(&key).await.unwrap();
        assert!(!taken, "{bad:?}: the lock key was not taken");
        let stored: String = conn.get(&fence).await.unwrap();
        assert_eq!(stored, bad, "the companion is unchanged");
        let kept: i64 = conn.pttl(&fence).await.unwrap();
        assert!(
            kept > 500_000,
            "{bad:?}: the companion's ttl is kept: {kept}"
        );
    }

    let key = ns.key("corrupt hash");
    let fence = backend.fence_key(&key);
    let _: () = conn.hset(&fence, "field", "value").await.unwrap();
    let error = backend
        .try_acquire(&key, &owner, ttl)
        .await
        .expect_err("a companion of another type fails the acquisition");
    assert!(refused_for_its_counter(&error), "{error:?}");
    let taken: bool = conn.exists(&key).await.unwrap();
    assert!(!taken, "the lock key was not taken");
    let field: String = conn.hget(&fence, "field").await.unwrap();
    assert_eq!(field, "value", "the hash is unchanged");
}

/// The largest counter that still counts on: its successor, 2^53 - 1, is
/// the last token; after it, acquisitions fail and take nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h4_the_counter_counts_up_to_2_pow_53_minus_1() {
    let url = server_url().await;
    let ns = Namespace::new(&url);
    let key = ns.key("limit");
    let backend = RedisBackend::from_url(&url).unwrap();
    let fence = backend.fence_key(&key);
    let mut conn = raw(&url).await;
    let _: () = conn.set(&fence, "9007199254740990").await.unwrap();
    let locker = node(backend.clone(), "a");
    assert_eq!(token(&locker, &key).await, 9_007_199_254_740_991);
    let owner = OwnerToken::new("a");
    let error = backend
        .try_acquire(&key, &owner, Duration::from_secs(30))
        .await
        .expect_err("no token above 2^53 - 1");
    assert!(refused_for_its_counter(&error), "{error:?}");
    let taken: bool = conn.exists(&key).await.unwrap();
    assert!(!taken, "the lock key was not taken");
}

/// Nothing listens at the URL: every step fails with kind `Unavailable`
/// (the request was never sent), with the refused connection as source,
/// and `with_lock` gives up with that error without running its callback.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h4_a_refused_connection_is_unavailable() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let backend = RedisBackend::from_url(&format!("redis://127.0.0.1:{port}")).unwrap();
    let owner = OwnerToken::new("a");
    let ttl = Duration::from_secs(30);
    let error = within(LIMIT, "acquisition", backend.try_acquire("k", &owner, ttl))
        .await
        .expect_err("nothing listens there");
    assert_eq!(error.kind(), BackendErrorKind::Unavailable, "{error:?}");
    assert!(!error.may_have_reached_store());
    assert!(
        redis_error_in(&error).is_some_and(redis::RedisError::is_connection_refusal),
        "the refused connection is the source: {error:?}"
    );
    let lease = Lease::new("k", owner, 1);
    for (step, error) in [
        ("release", backend.release(&lease).await.err()),
        ("extension", backend.extend(&lease, ttl).await.err()),
    ] {
        let error = error.unwrap_or_else(|| panic!("{step} succeeded"));
        assert_eq!(error.kind(), BackendErrorKind::Unavailable, "{step}");
    }

    let got = within(
        LIMIT,
        "with_lock",
        node(backend, "a").with_lock_config(
            "k",
            &LockConfig::default().retry_attempts(0),
            |_| async { panic!("the callback must not run") },
        ),
    )
    .await;
    match got {
        Err(LockError::NotAcquired {
            source: Some(e), ..
        }) => assert_eq!(e.kind(), BackendErrorKind::Unavailable, "{e:?}"),
        other => panic!("expected NotAcquired with a source, got {other:?}"),
    }
}

/// The contrast: a request written to a live connection of a server that
/// then hangs (SIGSTOP) may have reached it, so it stays `Timeout`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h4_a_request_sent_to_a_hung_server_stays_a_timeout() {
    let server = RedisServer::start().unwrap();
    let config = RedisConfig::default()
        .step_timeout(Duration::from_millis(300))
        .release_notifications(false);
    let backend = RedisBackend::from_url_with(&server.url(), config).unwrap();
    let owner = OwnerToken::new("a");
    let ttl = Duration::from_secs(30);
    // Opens the shared connection, so the next request is really written.
    let AcquireOutcome::Acquired { fencing_token } =
        backend.try_acquire("hung", &owner, ttl).await.unwrap()
    else {
        panic!("the key is free");
    };
    backend
        .release(&Lease::new("hung", owner.clone(), fencing_token))
        .await
        .unwrap();
    server.pause().unwrap();
    let error = within(
        LIMIT,
        "acquisition",
        backend.try_acquire("hung", &owner, ttl),
    )
    .await
    .expect_err("the server does not answer");
    server.resume().unwrap();
    assert_eq!(error.kind(), BackendErrorKind::Timeout, "{error:?}");
    assert!(error.may_have_reached_store());
}

/// SPEC A8: a fencing companion that holds no counter is a setup error,
/// said at once: with the default ten retries the call ends after its
/// first attempt, with the refusal as its source, and takes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a8_a_corrupt_companion_is_not_retried() {
    let url = server_url().await;
    let ns = Namespace::new(&url);
    let backend = RedisBackend::from_url(&url).unwrap();
    let mut conn = raw(&url).await;
    for (i, corrupt) in ["string", "hash"].into_iter().enumerate() {
        let key = ns.key(&format!("a8 {i}"));
        let fence = backend.fence_key(&key);
        if corrupt == "string" {
            let _: () = conn.set(&fence, "not a number").await.unwrap();
        } else {
            let _: () = conn.hset(&fence, "field", "value").await.unwrap();
        }
        let locker = Locker::new(backend.clone());
        let got = within(
            LIMIT,
            "with_lock",
            locker.with_lock_config(&key, &LockConfig::default(), |_| async {
                panic!("the callback must not run")
            }),
        )
        .await;
        match got {
            Err(LockError::NotAcquired {
                attempts,
                source: Some(e),
                ..
            }) => {
                assert_eq!(e.kind(), BackendErrorKind::Setup, "{corrupt}: {e:?}");
                assert_eq!(attempts, 1, "{corrupt}: a setup error is not retried");
                assert!(
                    refused_for_its_counter(&e) || e.inner().to_string().contains("WRONGTYPE"),
                    "{e:?}"
                );
            }
            other => panic!("{corrupt}: expected NotAcquired with the refusal, got {other:?}"),
        }
        let taken: bool = conn.exists(&key).await.unwrap();
        assert!(!taken, "{corrupt}: the lock key was not taken");
    }
}

//! Odd keys work and are stored as named; bad keys, unreachable servers
//! and wrong passwords give clear errors and leave nothing held.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::{assert_not_acquired_by_redis_error, node, raw, within};
use lock_core::{InvalidInput, LockConfig, LockError, MAX_KEY_LEN};
use lock_redis::testing::Namespace;
use lock_redis::{RedisBackend, SetupError};
use redis::AsyncCommands;
use withlock_test_servers::redis::{server_url, RedisServer};

const LIMIT: Duration = Duration::from_secs(10);

/// Spaces, unicode, globs, braces, quotes and a 1024-byte key: each is
/// locked as the Redis key of exactly that name, with its fencing
/// companion in the same slot; 1025 bytes is refused before any round trip.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn odd_keys_are_stored_exactly_and_long_keys_are_refused() {
    let url = server_url().await;
    let ns = Namespace::new(&url);
    let backend = RedisBackend::from_url(&url).unwrap();
    let a = node(backend.clone(), "a");
    let mut keys: Vec<String> = [
        "with space",
        "ünïcødé 鍵 🔒",
        "glob*?[a-z]",
        "{braces}",
        "}{",
        "{}",
        "a{b}c{d}",
        "}only",
        "quote'\"",
        "back\\slash",
        "new\nline",
    ]
    .iter()
    .map(|k| ns.key(k))
    .collect();
    let max = ns.key(&"x".repeat(MAX_KEY_LEN - ns.prefix().len()));
    assert_eq!(max.len(), MAX_KEY_LEN);
    keys.push(max.clone());
    let mut conn = raw(&url).await;
    for key in &keys {
        let (k, u) = (key.clone(), url.clone());
        let (seen, token) = a
            .with_lock(key, move |ctx| async move {
                let mut conn = raw(&u).await;
                let value: Option<String> = conn.get(&k).await.unwrap();
                (value, ctx.fencing_token())
            })
            .await
            .unwrap_or_else(|e| panic!("key {key:?}: {e}"));
        assert!(
            seen.is_some_and(|v| v.starts_with("a/")),
            "key {key:?} is the Redis key"
        );
        let exists: bool = conn.exists(key).await.unwrap();
        assert!(!exists, "key {key:?} released");
        let fence = backend.fence_key(key);
        let counter: Option<u64> = conn.get(&fence).await.unwrap();
        assert_eq!(counter, Some(token), "companion {fence:?} of {key:?}");
        assert_eq!(
            lock_redis::slot::key_slot(&fence),
            lock_redis::slot::key_slot(key)
        );
    }
    let too_long = format!("{max}x");
    let ran = Arc::new(AtomicBool::new(false));
    let flag = Arc::clone(&ran);
    let refused = a
        .with_lock(&too_long, move |_| async move {
            flag.store(true, Ordering::SeqCst)
        })
        .await;
    assert!(
        matches!(
            refused,
            Err(LockError::InvalidInput(InvalidInput::KeyTooLong {
                len: 1025,
                max: 1024
            }))
        ),
        "{refused:?}"
    );
    assert!(!ran.load(Ordering::SeqCst));
    let exists: bool = conn.exists(&too_long).await.unwrap();
    assert!(!exists, "a refused key touches nothing");
}

/// Nothing listens at the URL: NotAcquired with the Redis error (connection
/// refused) as source, quickly, and the callback never runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_url_is_not_acquired_with_the_redis_error() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let backend = RedisBackend::from_url(&format!("redis://127.0.0.1:{port}")).unwrap();
    let a = node(backend, "a");
    let cfg = LockConfig::default()
        .retry_attempts(1)
        .retry_delay(Duration::from_millis(20));
    let result = within(
        LIMIT,
        "giving up",
        a.with_lock_config("k", &cfg, |_| async {}),
    )
    .await;
    let message = assert_not_acquired_by_redis_error(result);
    eprintln!("unreachable: {message}");
    assert_eq!(a.held(), 0);
}

/// A URL that does not parse is refused when the backend is made.
#[test]
fn an_invalid_url_is_refused_at_setup() {
    let err = RedisBackend::from_url("http://:hunter2@nowhere").unwrap_err();
    assert!(matches!(err, SetupError::InvalidUrl(_)), "{err:?}");
    assert!(!format!("{err:?} {err}").contains("hunter2"));
}

/// A wrong password: NotAcquired with Redis' authentication error as
/// source, nothing held; the right password works; neither password ever
/// shows in Debug output or error messages.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_password_is_not_acquired_and_no_password_is_ever_shown() {
    let server = RedisServer::start_with(&["--requirepass", "s3cret-pass"]).unwrap();
    let wrong_url = format!("redis://:wrong-pass-123@127.0.0.1:{}", server.port());
    let wrong = RedisBackend::from_url(&wrong_url).unwrap();
    let shown = format!("{wrong:?}");
    assert!(!shown.contains("wrong-pass-123"), "{shown}");
    assert!(shown.contains("<redacted>"), "{shown}");
    let a = node(wrong.clone(), "a");
    let cfg = LockConfig::default()
        .retry_attempts(1)
        .retry_delay(Duration::from_millis(20));
    let result = within(
        LIMIT,
        "giving up",
        a.with_lock_config("k", &cfg, |_| async {}),
    )
    .await;
    let shown = format!("{result:?}");
    let message = assert_not_acquired_by_redis_error(result);
    eprintln!("wrong password: {message}");
    assert!(
        message.contains("WRONGPASS") || message.to_lowercase().contains("auth"),
        "{message}"
    );
    assert!(!message.contains("wrong-pass-123") && !shown.contains("wrong-pass-123"));
    assert_eq!(a.held(), 0);
    // Notifications fail the same way: a waiter falls back to its timer.
    use lock_core::LockBackend;
    let watch = wrong.watch_release("k").await;
    assert!(watch.is_err(), "{watch:?}");

    let right_url = format!("redis://:s3cret-pass@127.0.0.1:{}", server.port());
    let right = RedisBackend::from_url(&right_url).unwrap();
    let shown = format!("{right:?}");
    assert!(!shown.contains("s3cret-pass"), "{shown}");
    let b = node(right, "b");
    assert_eq!(b.with_lock("k", |_| async { 7 }).await.unwrap(), 7);
}

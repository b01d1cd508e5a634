//! What the test files share.
#![allow(dead_code, unreachable_pub)]

pub mod acl;

use std::error::Error as _;
use std::time::Duration;

use lock_core::{BackendError, LockError, Locker, LockerOptions, LossCause};

/// A locker named `name`: one node.
pub fn node(backend: impl lock_core::LockBackend, name: &str) -> Locker {
    Locker::with_options(backend, LockerOptions::default().node_id(name)).unwrap()
}

/// Awaits `fut` for at most `limit`, failing the test with `what`.
pub async fn within<T>(
    limit: Duration,
    what: &str,
    fut: impl std::future::Future<Output = T>,
) -> T {
    tokio::time::timeout(limit, fut)
        .await
        .unwrap_or_else(|_| panic!("{what}: did not happen within {limit:?}"))
}

/// The Redis error somewhere in the source chain of `error`, if any.
pub fn redis_error_in<'e>(
    error: &'e (dyn std::error::Error + 'static),
) -> Option<&'e redis::RedisError> {
    let mut next = Some(error);
    while let Some(e) = next {
        if let Some(redis) = e.downcast_ref::<redis::RedisError>() {
            return Some(redis);
        }
        if let Some(reply) = e.downcast_ref::<lock_redis::ServerReply>() {
            return Some(reply.redis_error());
        }
        if let Some(backend) = e.downcast_ref::<BackendError>() {
            if let Some(redis) = backend.inner().downcast_ref::<redis::RedisError>() {
                return Some(redis);
            }
            if let Some(reply) = backend.inner().downcast_ref::<lock_redis::ServerReply>() {
                return Some(reply.redis_error());
            }
        }
        next = e.source();
    }
    None
}

/// Whether `error` is the acquisition scripts' refusal of a fencing
/// companion that holds no counter (the one-key script's error, or the
/// batch's answer for that step, which gives the same text).
pub fn refused_for_its_counter(error: &BackendError) -> bool {
    redis_error_in(error).is_some_and(|e| e.to_string().contains("fencing companion"))
}

/// The loss cause of a `Lost` error; panics on anything else.
pub fn loss_cause(result: Result<(), LockError>) -> LossCause {
    match result {
        Err(LockError::Lost { cause, .. }) => cause,
        other => panic!("expected a lost lock, got {other:?}"),
    }
}

/// A plain Redis connection, as another client would use.
pub async fn raw(url: &str) -> redis::aio::MultiplexedConnection {
    redis::Client::open(url)
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap()
}

/// Asserts that a `NotAcquired` error carries a Redis error as source.
pub fn assert_not_acquired_by_redis_error<T: std::fmt::Debug>(
    result: Result<T, LockError>,
) -> String {
    match result {
        Err(err @ LockError::NotAcquired { .. }) => {
            assert!(err.source().is_some(), "no source in {err:?}");
            let redis = redis_error_in(&err).unwrap_or_else(|| panic!("no Redis error in {err:?}"));
            redis.to_string()
        }
        other => panic!("expected NotAcquired, got {other:?}"),
    }
}

/// Takes `key` as a client that keeps its locks in a hash does (Redisson:
/// `HSET key <id>:<thread> 1`, then `PEXPIRE`).
pub async fn take_as_a_hash(conn: &mut redis::aio::MultiplexedConnection, key: &str) {
    let _: () = redis::pipe()
        .atomic()
        .hset(key, "8743c9c0-0795-4907-87fd-6c719a6b4586:1", 1)
        .ignore()
        .pexpire(key, 30_000)
        .ignore()
        .query_async(conn)
        .await
        .unwrap();
}

/// The Redis type of `key` (`string`, `hash`, `none`, …).
pub async fn key_type(conn: &mut redis::aio::MultiplexedConnection, key: &str) -> String {
    redis::cmd("TYPE").arg(key).query_async(conn).await.unwrap()
}

/// A plain subscriber of `channel` on the server at `url`, as another
/// node's backend listens for releases.
pub async fn subscriber(url: &str, channel: &str) -> redis::aio::PubSub {
    let mut pubsub = redis::Client::open(url)
        .unwrap()
        .get_async_pubsub()
        .await
        .unwrap();
    pubsub.subscribe(channel).await.unwrap();
    pubsub
}

/// The log lines (at INFO and above) of the test's own thread, while
/// [`capture`](Log::capture)d.
#[derive(Clone, Default)]
pub struct Log(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

impl Log {
    pub fn capture(&self) -> tracing::subscriber::DefaultGuard {
        let log = self.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::INFO)
            .with_writer(move || log.clone())
            .finish();
        tracing::subscriber::set_default(subscriber)
    }

    pub fn count(&self, text: &str) -> usize {
        String::from_utf8_lossy(&self.0.lock().unwrap())
            .matches(text)
            .count()
    }
}

impl std::io::Write for Log {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

//! Setting the backend up: `from_url` is lazy and `connect` checks the
//! server, on every backend alike; a pub/sub client that reaches another
//! server than the pool is detected instead of silently losing wake-ups
//! (tests/same_server.rs).

use std::time::Duration;

use lock_core::{BackendErrorKind, LockBackend, LockConfig, Locker};
use lock_redis::testing::Namespace;
use lock_redis::{deadpool_redis, redis, RedisBackend, SetupError};
use withlock_test_servers::redis::server_url;

fn closed_port_url() -> String {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    format!("redis://127.0.0.1:{port}")
}

fn pool(url: &str) -> deadpool_redis::Pool {
    deadpool_redis::Config::from_url(url)
        .create_pool(Some(deadpool_redis::Runtime::Tokio1))
        .unwrap()
}

#[tokio::test]
async fn from_url_connects_nothing_and_connect_checks_the_server() {
    let url = closed_port_url();
    assert!(RedisBackend::from_url(&url).is_ok(), "from_url is lazy");
    let err = RedisBackend::connect(&url)
        .await
        .expect_err("nothing listens there");
    match &err {
        SetupError::Connect(source) => assert_eq!(source.kind(), BackendErrorKind::Unavailable),
        other => panic!("expected Connect, got {other:?}"),
    }
    assert!(matches!(
        RedisBackend::from_url("not a url"),
        Err(SetupError::InvalidUrl(_))
    ));
    let backend = RedisBackend::connect(&server_url().await).await.unwrap();
    let ns = Namespace::new(&server_url().await);
    Locker::new(backend)
        .with_lock(&ns.key("connected"), |_| async {})
        .await
        .unwrap();
}

/// SPEC A8: a database index the server does not have is a setup error:
/// `connect` says so, and a lock call ends after one attempt with it as
/// the source instead of retrying it as an outage.
#[tokio::test]
async fn a8_a_database_index_out_of_range_is_a_setup_error() {
    let url = server_url().await;
    let (_, rest) = url.split_once("://").expect("a scheme");
    let authority = rest.split('/').next().unwrap_or(rest);
    let url = format!("redis://{authority}/9999");
    let err = RedisBackend::connect(&url).await.expect_err("no db 9999");
    match &err {
        SetupError::Connect(source) => {
            assert_eq!(source.kind(), BackendErrorKind::Setup, "{source}");
            assert!(source.is_permanent());
        }
        other => panic!("expected Connect, got {other:?}"),
    }
    assert!(
        format!("{:?}", std::error::Error::source(&err)).contains("DB index is out of range"),
        "the server's reason is kept: {err:?}"
    );
    let locker = Locker::new(RedisBackend::from_url(&url).unwrap());
    let cfg = LockConfig::default()
        .retry_attempts(10)
        .retry_delay(Duration::from_millis(10));
    match locker
        .with_lock_config("db-out-of-range", &cfg, |_| async {})
        .await
    {
        Err(lock_core::LockError::NotAcquired {
            attempts,
            source: Some(source),
            ..
        }) => {
            assert_eq!(attempts, 1, "a setup error is not retried");
            assert_eq!(source.kind(), BackendErrorKind::Setup);
        }
        other => panic!("expected NotAcquired with a setup error, got {other:?}"),
    }
}

/// The same server through two URLs passes the probe. (A client on
/// another server: tests/same_server.rs.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pub_sub_client_on_the_same_server_passes_the_probe() {
    let shared = server_url().await;
    let ns = Namespace::new(&shared);
    let same = RedisBackend::new(pool(&shared), redis::Client::open(shared.as_str()).unwrap());
    tokio::time::timeout(Duration::from_secs(5), same.watch_release(&ns.key("k")))
        .await
        .unwrap()
        .expect("pool and client reach the same server");
}

#[test]
fn the_config_loads_from_a_file_with_human_durations() {
    let config: lock_redis::RedisConfig = serde_json::from_str(
        r#"{"prefix": "app:", "step_timeout": "500ms", "release_notifications": false}"#,
    )
    .unwrap();
    assert_eq!(
        config,
        lock_redis::RedisConfig::default()
            .prefix("app:")
            .step_timeout(Duration::from_millis(500))
            .release_notifications(false)
    );
    let err = serde_json::from_str::<lock_redis::RedisConfig>(r#"{"command_timeout": "1s"}"#)
        .unwrap_err()
        .to_string();
    assert!(err.contains("unknown field `command_timeout`"), "{err}");
}

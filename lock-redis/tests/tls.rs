//! TLS (feature `tls`) on all three Redis backends, against `redis-server`
//! children that speak only TLS, with a CA and server certificate made at
//! run time: the conformance suite on a single node, a cluster whose nodes
//! talk TLS on the bus too, and a Sentinel group whose Sentinels and data
//! nodes all speak TLS. A CA that did not sign the servers' certificate is a
//! setup error from `connect`, at once.

#[path = "common/certs.rs"]
mod certs;
mod common;

use std::sync::OnceLock;
use std::time::Duration;

use certs::{another_ca, trusting, TestPki};
use common::{node, within};
use lock_core::{BackendErrorKind, LockConfig, LockError};
use lock_redis::redis::TlsCertificates;
use lock_redis::{
    RedisBackend, RedisClusterBackend, RedisConfig, RedisSentinelBackend, SentinelConfig,
    SetupError,
};
use withlock_test_servers::redis::{
    RedisCluster, RedisServer, SentinelAuth, SentinelGroup, MASTER_NAME,
};

const LIMIT: Duration = Duration::from_secs(40);

/// One TLS server for this binary, and its CA. The server read its
/// certificate files at start, so the PKI's directory can go at once.
fn server() -> &'static (RedisServer, Vec<u8>) {
    static SERVER: OnceLock<(RedisServer, Vec<u8>)> = OnceLock::new();
    SERVER.get_or_init(|| {
        let pki = TestPki::new();
        let server = RedisServer::start_tls(&pki.files, &[]).unwrap();
        (server, pki.ca_pem.clone())
    })
}

fn certificates() -> TlsCertificates {
    trusting(server().1.clone())
}

/// A backend on the TLS server, in a key namespace of its own (the server
/// is this binary's: nothing to clean up on it).
fn tls_backend(config: RedisConfig) -> RedisBackend {
    let prefix = format!("withlock-tls-test:{:016x}:", rand::random::<u64>());
    RedisBackend::from_url_with_tls(&server().0.url(), certificates(), config.prefix(prefix))
        .unwrap()
}

/// The whole conformance suite over TLS on one server: acquisition,
/// extension, release and release notifications all go over `rediss://`;
/// its ttls at least 1 s, as in `conformance.rs` (a loaded run lost an
/// extension at 400 ms).
mod single_node_conformance {
    use super::*;

    lock_conformance::conformance_tests!(lock_conformance::with_min_ttl(
        Duration::from_secs(1),
        || async { tls_backend(RedisConfig::default()) }
    ));
}

/// The whole error chain, `Display` of each link.
fn chain(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = error.to_string();
    let mut next = error.source();
    while let Some(e) = next {
        text.push_str(": ");
        text.push_str(&e.to_string());
        next = e.source();
    }
    text
}

/// A server certificate the given CA did not sign: `connect` fails at once
/// with `SetupError::Connect` whose chain names the certificate; a lock
/// call gives up with that error as its source (not busy) [A8]; `connect`
/// with the right CA works. Certificates for a `redis://` URL and a CA
/// PEM without a certificate are refused before anything connects.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a8_a_wrong_ca_is_a_setup_error_and_not_busy() {
    let url = server().0.url();
    let err = within(
        LIMIT,
        "connect with the wrong CA",
        RedisBackend::connect_with_tls(&url, another_ca(), RedisConfig::default()),
    )
    .await
    .expect_err("the CA did not sign the server's certificate");
    let text = chain(&err);
    eprintln!("wrong CA: {text}");
    assert!(matches!(err, SetupError::Connect(_)), "{err:?}");
    assert!(text.contains("certificate"), "{text}");

    let backend =
        RedisBackend::from_url_with_tls(&url, another_ca(), RedisConfig::default()).unwrap();
    let once = LockConfig::default()
        .retry_attempts(1)
        .retry_delay(Duration::from_millis(20));
    let result = within(
        LIMIT,
        "giving up",
        node(backend, "a").with_lock_config("k", &once, |_| async { panic!("must not run") }),
    )
    .await;
    match &result {
        Err(LockError::NotAcquired {
            source: Some(source),
            attempts,
            ..
        }) => {
            eprintln!("lock call with the wrong CA: kind {:?}", source.kind());
            assert_eq!(source.kind(), BackendErrorKind::Setup);
            assert_eq!(*attempts, 1, "a8: a wrong CA is not retried");
            assert!(chain(source).contains("certificate"), "{}", chain(source));
        }
        other => panic!("expected NotAcquired with a source, got {other:?}"),
    }

    let right = within(
        LIMIT,
        "connect with the right CA",
        RedisBackend::connect_with_tls(&url, certificates(), RedisConfig::default()),
    )
    .await
    .unwrap();
    assert!(format!("{right:?}").contains("rediss://"), "{right:?}");

    let plain = format!("redis://127.0.0.1:{}", server().0.port());
    let err = RedisBackend::from_url_with_tls(&plain, certificates(), RedisConfig::default())
        .unwrap_err();
    assert!(matches!(err, SetupError::Tls(_)), "{err:?}");
    let err = RedisBackend::from_url_with_tls(
        &url,
        trusting(b"not a certificate".to_vec()),
        RedisConfig::default(),
    )
    .unwrap_err();
    assert!(matches!(err, SetupError::Tls(_)), "{err:?}");
}

/// A cluster of three TLS masters (TLS on the cluster bus too): `connect`
/// with the CA checks every node, locks land on every master, a waiter is
/// woken over sharded pub/sub, and tokens increase; the wrong CA is a
/// setup error from `connect`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a5_cluster_over_tls_locks_and_wakes_waiters() {
    let pki = TestPki::new();
    let cluster =
        tokio::task::block_in_place(|| RedisCluster::start_tls(3, 0, &pki.files)).unwrap();
    let urls = cluster.urls();
    assert!(urls.iter().all(|u| u.starts_with("rediss://")), "{urls:?}");
    let err = within(
        LIMIT,
        "connect with the wrong CA",
        RedisClusterBackend::connect_with_tls(&urls, another_ca(), RedisConfig::default()),
    )
    .await
    .expect_err("the wrong CA");
    assert!(matches!(err, SetupError::Connect(_)), "{err:?}");
    assert!(chain(&err).contains("certificate"), "{}", chain(&err));

    let backend = within(
        LIMIT,
        "connect",
        RedisClusterBackend::connect_with_tls(&urls, pki.certificates(), RedisConfig::default()),
    )
    .await
    .unwrap();
    let a = node(backend.clone(), "a");
    let mut last = 0;
    for i in 0..12 {
        let token = a
            .with_lock(&format!("tls-spread:{i}"), |ctx| async move {
                ctx.fencing_token()
            })
            .await
            .unwrap();
        last = last.max(token);
    }
    let b_backend =
        RedisClusterBackend::from_urls_with_tls(&urls, pki.certificates(), RedisConfig::default())
            .unwrap();
    let b = node(b_backend.clone(), "b");
    let (first, second) = wake_a_waiter(&a, &b, || b_backend.is_subscribed()).await;
    assert!(first > last, "token {first} after {last}");
    assert!(second > first, "token {second} after {first}");
}

/// A Sentinel group where the Sentinels and the data nodes speak only TLS
/// and have passwords of their own: `rediss://` Sentinel URLs take the data
/// nodes over TLS too, with the CA given; a waiter is woken over the
/// subscription; after `SENTINEL FAILOVER` the backend follows to the new
/// primary over TLS, tokens increasing [H4]. The wrong CA is a setup error
/// from `connect`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h4_sentinel_over_tls_follows_a_failover() {
    let pki = TestPki::new();
    let auth = SentinelAuth {
        data_node_password: Some("tls-data-pw".to_owned()),
        sentinel_password: Some("tls-sentinel-pw".to_owned()),
    };
    let group =
        tokio::task::block_in_place(|| SentinelGroup::start_tls(1, &auth, &pki.files)).unwrap();
    let urls = group.sentinel_urls();
    assert!(urls.iter().all(|u| u.starts_with("rediss://")), "{urls:?}");
    let config = |certificates| {
        SentinelConfig::new(MASTER_NAME, &urls)
            .unwrap()
            .data_node_password("tls-data-pw")
            .tls_certificates(certificates)
    };
    let err = within(
        LIMIT,
        "connect with the wrong CA",
        RedisSentinelBackend::connect_with_config(config(another_ca()), RedisConfig::default()),
    )
    .await
    .expect_err("the wrong CA");
    assert!(matches!(err, SetupError::Connect(_)), "{err:?}");
    assert!(chain(&err).contains("certificate"), "{}", chain(&err));

    let sentinel = config(pki.certificates());
    assert!(format!("{sentinel:?}").contains("data_node_tls: true"));
    let backend = within(
        LIMIT,
        "connect",
        RedisSentinelBackend::connect_with_config(sentinel.clone(), RedisConfig::default()),
    )
    .await
    .unwrap();
    let a = node(backend, "a");
    let b_backend = RedisSentinelBackend::with_config(sentinel, RedisConfig::default()).unwrap();
    let b = node(b_backend.clone(), "b");
    let (first, second) = wake_a_waiter(&a, &b, || b_backend.is_subscribed()).await;
    assert!(second > first, "token {second} after {first}");

    let old = group.primary().port();
    let mut to_sentinel = redis::Client::build_with_tls(urls[0].as_str(), pki.certificates())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let _: () = redis::cmd("SENTINEL")
        .arg("FAILOVER")
        .arg(MASTER_NAME)
        .query_async(&mut to_sentinel)
        .await
        .unwrap();
    tokio::task::block_in_place(|| group.wait_for_failover(old, Duration::from_secs(30))).unwrap();
    let cfg = LockConfig::default()
        .retry_attempts(100)
        .retry_delay(Duration::from_millis(100));
    let after = within(
        LIMIT,
        "after the failover",
        a.with_lock_config("job", &cfg, |ctx| async move { ctx.fencing_token() }),
    )
    .await
    .unwrap();
    assert!(after > second, "token {after} after {second}");
}

/// `holder` takes `job`; `waiter`, whose retry timer would not fire within
/// the test, waits; once `subscribed` says the waiter's subscription is up,
/// the holder releases and the waiter gets the lock. The two tokens.
async fn wake_a_waiter(
    holder: &lock_core::Locker,
    waiter: &lock_core::Locker,
    subscribed: impl Fn() -> bool + Sync,
) -> (u64, u64) {
    let (held, holding) = tokio::sync::oneshot::channel();
    let (release, released) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn({
        let holder = holder.clone();
        async move {
            holder
                .with_lock("job", |ctx| async move {
                    let _ = held.send(ctx.fencing_token());
                    let _ = released.await;
                })
                .await
        }
    });
    let first = within(LIMIT, "first holder", holding).await.unwrap();
    let slow = LockConfig::default()
        .retry_attempts(1)
        .retry_delay(Duration::from_secs(600));
    let waiting = tokio::spawn({
        let waiter = waiter.clone();
        async move {
            waiter
                .with_lock_config("job", &slow, |ctx| async move { ctx.fencing_token() })
                .await
        }
    });
    within(LIMIT, "the waiter's subscription", async {
        while !subscribed() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    let _ = release.send(());
    within(LIMIT, "release", running).await.unwrap().unwrap();
    let second = within(LIMIT, "woken waiter", waiting)
        .await
        .unwrap()
        .unwrap();
    (first, second)
}

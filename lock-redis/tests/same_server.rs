//! A pub/sub client given beside the pool (`RedisBackend::new` and
//! `with_config`) is checked to hear the pool's server by a probe; a probe
//! not heard (a busy machine) is no proof of a second server. Notifications
//! go off only after 3 probes in a row went unheard, the log says so once,
//! the waits get no error of their own, and a probe heard later turns them
//! back on.

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::StreamExt;
use lock_core::{AcquireOutcome, LockBackend, LockConfig, Locker, OwnerToken};
use lock_redis::testing::Namespace;
use lock_redis::{deadpool_redis, redis, RedisBackend, RedisConfig};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use withlock_test_servers::redis::{server_url, RedisServer};

const LIMIT: Duration = Duration::from_secs(10);
const OFF_LOG: &str = "did not hear 3 probes in a row";

fn pool(url: &str) -> deadpool_redis::Pool {
    deadpool_redis::Config::from_url(url)
        .create_pool(Some(deadpool_redis::Runtime::Tokio1))
        .unwrap()
}

/// A TCP proxy to `upstream` that holds back, from the server to the
/// client, the first `hold` reads carrying a probe until let go: the probe
/// reaches the client late, as on a very busy machine.
struct SlowProbes {
    port: u16,
    let_go: watch::Sender<bool>,
    held: Arc<Mutex<u32>>,
}

impl SlowProbes {
    async fn start(upstream: String, hold: u32) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let (let_go, _) = watch::channel(false);
        let held = Arc::new(Mutex::new(0));
        let (go, counted) = (let_go.clone(), Arc::clone(&held));
        tokio::spawn(async move {
            loop {
                let Ok((client, _)) = listener.accept().await else {
                    return;
                };
                let server = TcpStream::connect(&upstream).await.unwrap();
                let (mut client_read, mut client_write) = client.into_split();
                let (mut server_read, mut server_write) = server.into_split();
                tokio::spawn(async move {
                    let _ = tokio::io::copy(&mut client_read, &mut server_write).await;
                });
                let (mut go, counted) = (go.subscribe(), Arc::clone(&counted));
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 64 * 1024];
                    loop {
                        let n = match server_read.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => n,
                        };
                        let probe = buf[..n].windows(14).any(|w| w == b"withlock-probe");
                        let hold_it = probe && {
                            let mut held = counted.lock().unwrap();
                            *held += 1;
                            *held <= hold
                        };
                        if hold_it {
                            let _ = go.wait_for(|g| *g).await;
                        }
                        if client_write.write_all(&buf[..n]).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        Self { port, let_go, held }
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// How many probes came through so far (held or not).
    fn probes(&self) -> u32 {
        *self.held.lock().unwrap()
    }

    fn let_go(&self) {
        self.let_go.send_replace(true);
    }
}

fn authority(url: &str) -> String {
    let (_, rest) = url.split_once("://").unwrap();
    let rest = rest.rsplit_once('@').map_or(rest, |(_, r)| r);
    rest.split('/').next().unwrap().to_owned()
}

/// Whether a watch taken now on a held key fires within `limit` when the
/// key is released.
async fn a_release_wakes_a_watch(backend: &RedisBackend, key: &str, limit: Duration) -> bool {
    let owner = OwnerToken::new("same-server");
    let ttl = Duration::from_secs(30);
    let AcquireOutcome::Acquired { fencing_token } =
        backend.try_acquire(key, &owner, ttl).await.unwrap()
    else {
        panic!("{key} is free");
    };
    let mut watch = backend.watch_release(key).await.unwrap();
    let lease = lock_core::Lease::new(key, owner, fencing_token);
    backend.release(&lease).await.unwrap();
    tokio::time::timeout(limit, watch.released()).await.is_ok()
}

/// On the old code the first miss turned notifications off for the life of
/// the backend, and every wait failed with "another Redis server".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_probe_missed_once_leaves_release_notifications_on() {
    let shared = server_url().await;
    let ns = Namespace::new(&shared);
    let proxy = SlowProbes::start(authority(&shared), 1).await;
    let config = RedisConfig::default()
        .prefix(ns.prefix())
        .step_timeout(Duration::from_millis(500));
    let backend = RedisBackend::with_config(
        pool(&shared),
        redis::Client::open(proxy.url()).unwrap(),
        config,
    )
    .unwrap();
    tokio::time::timeout(LIMIT, backend.watch_release("first"))
        .await
        .unwrap()
        .expect("one probe missed: no error for the wait");
    assert_eq!(proxy.probes(), 1, "the first probe was held back");
    proxy.let_go();
    assert!(
        a_release_wakes_a_watch(&backend, "k", LIMIT).await,
        "notifications are on after one missed probe"
    );
}

/// A pub/sub client on another server: every probe goes unheard, so after
/// 3 of them notifications are off, said once in the log, and the waits
/// after that neither probe nor fail; locks still work, polling. (On the
/// old code the first wait failed.)
#[tokio::test]
async fn a_pub_sub_client_on_another_server_turns_notifications_off_after_3_misses() {
    let log = common::Log::default();
    let _captured = log.capture();
    let shared = server_url().await;
    let other = RedisServer::start().expect("a redis-server of this test's own");
    let ns = Namespace::new(&shared);
    let config = RedisConfig::default()
        .prefix(ns.prefix())
        .step_timeout(Duration::from_millis(300));
    let backend = RedisBackend::with_config(
        pool(&shared),
        redis::Client::open(other.url()).unwrap(),
        config,
    )
    .unwrap();
    // The probes, as published on the pool's server.
    let mut probes = redis::Client::open(shared.as_str())
        .unwrap()
        .get_async_pubsub()
        .await
        .unwrap();
    probes.subscribe(backend.channel()).await.unwrap();
    let mut probes = probes.into_on_message();
    for wait in 1..=3 {
        tokio::time::timeout(LIMIT, backend.watch_release("k"))
            .await
            .unwrap()
            .unwrap_or_else(|e| panic!("wait {wait} got an error: {e:?}"));
    }
    assert_eq!(log.count(OFF_LOG), 1, "said once after the third miss");
    for _ in 0..5 {
        tokio::time::timeout(LIMIT, backend.watch_release("k"))
            .await
            .unwrap()
            .expect("notifications off: no error for the wait");
    }
    assert_eq!(log.count(OFF_LOG), 1, "said once only");
    // Exactly 3 probes went out: a marker published after the waits ends
    // the count.
    let mut publisher = redis::Client::open(shared.as_str())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let _: i64 = redis::cmd("PUBLISH")
        .arg(backend.channel())
        .arg("marker")
        .query_async(&mut publisher)
        .await
        .unwrap();
    let mut seen = 0;
    loop {
        let message = tokio::time::timeout(LIMIT, probes.next())
            .await
            .unwrap()
            .unwrap();
        let payload: String = message.get_payload().unwrap();
        if payload == "marker" {
            break;
        }
        assert!(payload.contains("withlock-probe"), "{payload}");
        seen += 1;
    }
    assert_eq!(seen, 3, "no probe while notifications are off");
    // The backend still locks, waiting on its retry timer.
    Locker::new(backend)
        .with_lock_config(&ns.key("k"), &LockConfig::default(), |_| async {})
        .await
        .unwrap();
}

/// Notifications off after 3 probes held back (a resubscription meanwhile,
/// which wakes every watch, is no hearing); once probes get through
/// again, the probe sent every 6 health-check intervals turns them back on.
#[tokio::test]
async fn notifications_off_come_back_on_once_a_probe_is_heard() {
    let log = common::Log::default();
    let _captured = log.capture();
    let shared = server_url().await;
    let ns = Namespace::new(&shared);
    let proxy = SlowProbes::start(authority(&shared), u32::MAX).await;
    let config = RedisConfig::default()
        .prefix(ns.prefix())
        .step_timeout(Duration::from_millis(300))
        .health_check_interval(Duration::from_millis(100));
    let backend = RedisBackend::with_config(
        pool(&shared),
        redis::Client::open(proxy.url()).unwrap(),
        config,
    )
    .unwrap();
    for _ in 1..=3 {
        tokio::time::timeout(LIMIT, backend.watch_release("k"))
            .await
            .unwrap()
            .unwrap();
    }
    assert_eq!(log.count(OFF_LOG), 1);
    assert!(
        !a_release_wakes_a_watch(&backend, "off", Duration::from_secs(1)).await,
        "notifications are off"
    );
    proxy.let_go();
    // The next probe is due 600 ms after the third miss; it goes out in
    // the background at a wait, and once heard the waits watch again.
    let back_on = async {
        let mut round = 0;
        loop {
            round += 1;
            if a_release_wakes_a_watch(&backend, &format!("again-{round}"), Duration::from_secs(2))
                .await
            {
                return round;
            }
        }
    };
    let rounds = tokio::time::timeout(Duration::from_secs(60), back_on)
        .await
        .expect("notifications came back on");
    eprintln!("back on after {rounds} rounds");
}

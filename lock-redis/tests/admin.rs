//! The operator's functions on Redis beyond the conformance cases: a
//! forced release frees only a lock of withlock's format \[D2\] (on one
//! server, a Redis Cluster and behind Sentinel), leaving anything else
//! byte for byte as it was and announcing nothing, and the owner-token test
//! of its script is lock-core's.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{node, raw, subscriber, within};
use futures_util::StreamExt;
use lock_core::{AdminError, LockAdmin, OwnerToken};
use lock_redis::slot::fence_key;
use lock_redis::testing::{Namespace, ScratchClusterBackend};
use lock_redis::{RedisBackend, RedisConfig, RedisSentinelBackend};
use redis::aio::MultiplexedConnection;
use withlock_test_servers::redis::{server_url, shared_cluster, SentinelGroup, MASTER_NAME};

const LIMIT: Duration = Duration::from_secs(20);
const TOKEN: &str = "other-node/0123456789abcdef0123456789abcdef";

/// A key written by hand, and what force release must say about it.
struct Fixture {
    name: &'static str,
    found: &'static str,
    /// Writes the key (and its companion where it has one).
    write: fn(&mut redis::Pipeline, &str, &str),
}

fn fixtures() -> Vec<Fixture> {
    vec![
        Fixture {
            name: "list",
            found: "a list",
            write: |p, key, fence| {
                p.rpush(key, "job-1")
                    .rpush(key, "job-2")
                    .pexpire(key, 60_000);
                p.set(fence, 7);
            },
        },
        Fixture {
            name: "hash",
            found: "a hash",
            write: |p, key, fence| {
                p.hset(key, "8743c9c0:1", 1).pexpire(key, 60_000);
                p.set(fence, 7);
            },
        },
        Fixture {
            name: "no-expiry",
            found: "a string without an expiry",
            write: |p, key, fence| {
                p.set(key, TOKEN);
                p.set(fence, 7);
            },
        },
        Fixture {
            name: "plain-string",
            found: "a string without an expiry",
            write: |p, key, _| {
                p.set(key, "some cached value");
            },
        },
        Fixture {
            name: "other-format",
            found: "a value not in withlock's owner-token format",
            write: |p, key, fence| {
                p.set(key, "host:web-1 pid:42").pexpire(key, 60_000);
                p.set(fence, 7);
            },
        },
        Fixture {
            name: "no-companion",
            found: "an owner token without withlock's fencing companion",
            write: |p, key, _| {
                p.set(key, TOKEN).pexpire(key, 60_000);
            },
        },
    ]
}

/// `DUMP` of the key (its type and value, byte for byte), whether it has
/// an expiry, and `DUMP` of its companion.
async fn snapshot(
    conn: &mut MultiplexedConnection,
    key: &str,
) -> (Option<Vec<u8>>, bool, Option<Vec<u8>>) {
    let (dump, pttl, fence): (Option<Vec<u8>>, i64, Option<Vec<u8>>) = redis::pipe()
        .cmd("DUMP")
        .arg(key)
        .cmd("PTTL")
        .arg(key)
        .cmd("DUMP")
        .arg(fence_key(key))
        .query_async(conn)
        .await
        .unwrap();
    assert!(dump.is_some(), "{key:?} exists");
    (dump, pttl > 0, fence)
}

/// Each fixture, written on the server `url_of` its Redis key gives (the
/// key `key_of` its name gives, after `redis_prefix`), is refused with its
/// reason and left as it was.
async fn refuses_every_fixture(
    admin: &dyn LockAdmin,
    url_of: impl Fn(&str) -> String,
    key_of: impl Fn(&str) -> String,
    redis_prefix: &str,
) {
    for fixture in fixtures() {
        let key = key_of(fixture.name);
        let redis_key = format!("{redis_prefix}{key}");
        let mut conn = raw(&url_of(&redis_key)).await;
        let mut pipe = redis::pipe();
        (fixture.write)(&mut pipe, &redis_key, &fence_key(&redis_key));
        let _: () = pipe.query_async(&mut conn).await.unwrap();
        let before = snapshot(&mut conn, &redis_key).await;
        let refused = admin.force_release(&key).await;
        match &refused {
            Err(AdminError::NotALock { key: k, found }) => {
                assert_eq!(k, &key);
                assert_eq!(found, fixture.found, "{}", fixture.name);
                let text = refused.as_ref().unwrap_err().to_string();
                assert!(text.contains(fixture.found), "{text}");
            }
            other => panic!("{}: {other:?}", fixture.name),
        }
        assert_eq!(
            snapshot(&mut conn, &redis_key).await,
            before,
            "{} left as it was",
            fixture.name
        );
    }
}

/// \[D2\] On one server: a LIST, a hash, a string without an expiry (an
/// owner token or a cached value), a value of another format and an owner
/// token without its companion are each refused with what they are, and
/// left byte for byte as they were; nothing is announced for them. A
/// withlock lock beside them is freed and announced.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn d2_force_release_refuses_what_is_not_a_withlock_lock() {
    let url = server_url().await;
    let ns = Namespace::new(&url);
    let backend = RedisBackend::from_url(&url).unwrap();
    let mut messages = subscriber(&url, backend.channel()).await;
    refuses_every_fixture(
        &backend,
        |_| url.clone(),
        |name| ns.key(&format!("d2-{name}")),
        "",
    )
    .await;

    let ours = ns.key("d2-ours");
    let mut held = node(backend.clone(), "dead-host")
        .handle(&ours, Duration::from_secs(60))
        .unwrap();
    assert!(held.acquire().await.unwrap());
    let freed = backend.force_release(&ours).await.unwrap().unwrap();
    assert_eq!(freed.node_id(), Some("dead-host"));
    let mut stream = messages.on_message();
    let first = within(LIMIT, "the release announcement", stream.next())
        .await
        .unwrap();
    assert_eq!(
        first.get_payload::<String>().unwrap(),
        ours,
        "the first announcement is the freed lock's: none for the refused keys"
    );
}

/// \[D2\] The script's owner-token test is `OwnerToken::is_well_formed`:
/// a value with an expiry and a companion is freed exactly when lock-core
/// calls it well formed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn d2_the_scripts_owner_token_test_is_lock_cores() {
    let url = server_url().await;
    let ns = Namespace::new(&url);
    let backend = RedisBackend::from_url(&url).unwrap();
    let mut conn = raw(&url).await;
    let hex = "0123456789abcdef0123456789abcdef";
    let values = [
        format!("node/{hex}"),
        format!("n/{}", hex.to_uppercase()),
        format!("a/b/{hex}"),
        format!("host:1 pid:2/{hex}"),
        format!("\n/{hex}"),
        format!("/{hex}"),
        format!("node/{}", &hex[1..]),
        format!("node/{hex}0"),
        format!("node/{}g", &hex[1..]),
        format!("node/{hex}\n"),
        format!("node/{hex}/"),
        format!("node{hex}"),
        "plain".to_owned(),
        String::new(),
    ];
    for (i, value) in values.iter().enumerate() {
        let key = ns.key(&format!("format-{i}"));
        let _: () = redis::pipe()
            .set(&key, value)
            .pexpire(&key, 60_000)
            .set(fence_key(&key), 1)
            .query_async(&mut conn)
            .await
            .unwrap();
        let answer = backend.force_release(&key).await;
        let well_formed = OwnerToken::is_well_formed(value);
        match answer {
            Ok(Some(freed)) => {
                assert!(well_formed, "{value:?} freed");
                assert_eq!(freed.owner.unwrap().as_str(), value);
            }
            Err(AdminError::NotALock { .. }) => assert!(!well_formed, "{value:?} refused"),
            other => panic!("{value:?}: {other:?}"),
        }
    }
}

/// \[D1, D2\] On a Redis Cluster: the fixtures are refused on their
/// masters and left as they were; `list_locks` finds locks on every
/// master, in key order; a forced release frees a lock on its master.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn d2_cluster_force_release_refuses_what_is_not_a_withlock_lock() {
    let cluster = shared_cluster();
    let backend = Arc::new(ScratchClusterBackend::new(
        &cluster.urls(),
        RedisConfig::default(),
    ));
    let prefix = backend.namespace().prefix().to_owned();
    refuses_every_fixture(
        &*backend,
        |key| cluster.master_of_key(key).unwrap().url(),
        |name| format!("d2-{name}"),
        &prefix,
    )
    .await;

    let locker = node(Arc::clone(&backend), "cluster-node");
    let mut handles = Vec::new();
    let mut masters = std::collections::HashSet::new();
    for i in 0..24 {
        let key = format!("listed:{i:02}");
        masters.insert(
            cluster
                .master_of_key(&backend.lock_key(&key))
                .unwrap()
                .port(),
        );
        let mut handle = locker.handle(&key, Duration::from_secs(60)).unwrap();
        assert!(handle.acquire().await.unwrap());
        handles.push((key, handle));
    }
    assert_eq!(masters.len(), 3, "the keys are on every master");
    let listed = backend.list_locks("listed:").await.unwrap();
    let keys: Vec<&str> = listed.iter().map(|i| i.key.as_str()).collect();
    let expected: Vec<&str> = handles.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(keys, expected);
    assert!(listed.iter().all(|i| i.node_id() == Some("cluster-node")));
    for (key, handle) in &handles {
        let info = listed.iter().find(|i| &i.key == key).unwrap();
        assert_eq!(info.fencing_token, handle.fencing_token());
    }
    let (key, handle) = &mut handles[5];
    let freed = backend.force_release(key).await.unwrap().unwrap();
    assert_eq!(freed.fencing_token, handle.fencing_token());
    assert!(!backend.inspect(key).await.unwrap().is_held());
    assert!(!handle.renew().await.unwrap());
    assert_eq!(backend.list_locks("listed:").await.unwrap().len(), 23);
    for (_, handle) in &mut handles {
        let _ = handle.release().await;
    }
}

/// \[D1, D2\] Behind Sentinel: the admin runs on the primary the Sentinels
/// name: list, inspect, a refused LIST and a forced release that wakes a
/// waiter with a 10 s retry delay at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn d1_sentinel_backend_lists_inspects_and_force_releases() {
    let group = tokio::task::block_in_place(|| SentinelGroup::start(1)).unwrap();
    let backend = RedisSentinelBackend::from_urls_with(
        MASTER_NAME,
        group.sentinel_urls(),
        RedisConfig::default(),
    )
    .unwrap();
    let mut conn = raw(&group.primary().url()).await;
    let list = "jobs:queue";
    let _: () = redis::pipe()
        .rpush(list, "job")
        .pexpire(list, 60_000)
        .set(fence_key(list), 3)
        .query_async(&mut conn)
        .await
        .unwrap();
    let before = snapshot(&mut conn, list).await;
    assert!(matches!(
        backend.force_release(list).await,
        Err(AdminError::NotALock { ref found, .. }) if found == "a list"
    ));
    assert_eq!(snapshot(&mut conn, list).await, before);

    let key = "nightly:import";
    let mut held = node(backend.clone(), "dead-host")
        .handle(key, Duration::from_secs(60))
        .unwrap();
    assert!(held.acquire().await.unwrap());
    let info = backend.inspect(key).await.unwrap();
    assert_eq!(info.node_id(), Some("dead-host"));
    assert_eq!(info.fencing_token, held.fencing_token());
    let listed = backend.list_locks("nightly:").await.unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].key, key);

    let waiter = node(backend.clone(), "waiter");
    let slow = lock_core::LockConfig::default()
        .retry_attempts(3)
        .retry_delay(Duration::from_secs(10));
    let waiting =
        tokio::spawn(async move { waiter.with_lock_config(key, &slow, |_| async {}).await });
    // The waiter is subscribed once the primary counts its subscription.
    within(LIMIT, "the waiter subscribes", async {
        loop {
            let (_, n): (String, u64) = redis::cmd("PUBSUB")
                .arg("NUMSUB")
                .arg(lock_redis::CHANNEL)
                .query_async(&mut conn)
                .await
                .unwrap();
            if n > 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    assert!(backend.force_release(key).await.unwrap().is_some());
    within(
        Duration::from_secs(5),
        "the waiter after the forced release",
        waiting,
    )
    .await
    .unwrap()
    .unwrap();
}

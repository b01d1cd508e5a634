//! Wire compatibility with other Redis lock clients: the lock is the key
//! itself, taken with `SET key value NX PX`, valued `<node id>/<32 hex>`.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::{key_type, node, raw, subscriber, take_as_a_hash, within};
use lock_core::{LockConfig, LockError};
use lock_redis::testing::Namespace;
use lock_redis::{AdminError, LockAdmin, RedisBackend};
use redis::AsyncCommands;
use withlock_test_servers::redis::server_url;

const LIMIT: Duration = Duration::from_secs(10);

/// A raw `SET key v NX PX 30000` holds the lock: `with_lock` gives up with
/// one attempt, and a waiting call gets the lock once the raw holder DELs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_raw_set_nx_px_makes_with_lock_wait() {
    let url = server_url().await;
    let ns = Namespace::new(&url);
    let key = ns.key("raw-holder");
    let mut conn = raw(&url).await;
    let set: Option<String> = redis::cmd("SET")
        .arg(&key)
        .arg("other-client/0123")
        .arg("NX")
        .arg("PX")
        .arg(30_000)
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(set.as_deref(), Some("OK"));

    let a = node(RedisBackend::from_url(&url).unwrap(), "a");
    let once = LockConfig::default().retry_attempts(0);
    assert_busy(&a.with_lock_config(&key, &once, |_| async {}).await);

    let deleted = Arc::new(AtomicBool::new(false));
    let seen = Arc::clone(&deleted);
    let patient = LockConfig::default()
        .wait_forever()
        .retry_delay(Duration::from_millis(50));
    let (locker, k) = (a.clone(), key.clone());
    let waiter = tokio::spawn(async move {
        locker
            .with_lock_config(
                &k,
                &patient,
                move |_| async move { seen.load(Ordering::SeqCst) },
            )
            .await
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !waiter.is_finished(),
        "the waiter waits while the raw key is held"
    );
    deleted.store(true, Ordering::SeqCst);
    let _: () = conn.del(&key).await.unwrap();
    let ran_after_delete = within(LIMIT, "waiter after DEL", waiter)
        .await
        .unwrap()
        .unwrap();
    assert!(ran_after_delete, "the waiter ran only after the raw DEL");
}

/// While `with_lock` holds, a raw `SET NX PX` fails; the key is named
/// exactly as asked, its value is `<node id>/<32 hex>`, it has a ttl, and
/// its fencing companion holds the token the callback sees.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_lock_excludes_a_raw_set_nx_px_and_uses_the_shared_format() {
    let url = server_url().await;
    let ns = Namespace::new(&url);
    let key = ns.key("held by {withlock} ü");
    let backend = RedisBackend::from_url(&url).unwrap();
    let fence = backend.fence_key(&key);
    let a = node(backend, "wire-node");
    let (k, u) = (key.clone(), url.clone());
    let result = a
        .with_lock_config(
            &key,
            &LockConfig::default().ttl(Duration::from_secs(20)),
            move |ctx| async move {
                let mut conn = raw(&u).await;
                let set: Option<String> = redis::cmd("SET")
                    .arg(&k)
                    .arg("other-client/0123")
                    .arg("NX")
                    .arg("PX")
                    .arg(30_000)
                    .query_async(&mut conn)
                    .await
                    .unwrap();
                let value: String = conn.get(&k).await.unwrap();
                let pttl: i64 = conn.pttl(&k).await.unwrap();
                let counter: u64 = conn.get(&fence).await.unwrap();
                let fence_ttl: i64 = conn.pttl(&fence).await.unwrap();
                (set, value, pttl, counter, fence_ttl, ctx.fencing_token())
            },
        )
        .await
        .unwrap();
    let (set, value, pttl, counter, fence_ttl, token) = result;
    assert_eq!(set, None, "a raw SET NX fails while with_lock holds");
    let (node_id, hex) = value.rsplit_once('/').unwrap();
    assert_eq!(node_id, "wire-node");
    assert_eq!(hex.len(), 32);
    assert!(hex
        .chars()
        .all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase()));
    assert!(pttl > 0 && pttl <= 20_000, "pttl {pttl}");
    assert_eq!(counter, token, "the companion holds the fencing token");
    assert!(
        fence_ttl > pttl,
        "the companion outlives the held lock: {fence_ttl} ms against {pttl} ms"
    );
    let mut conn = raw(&url).await;
    let exists: bool = conn.exists(&key).await.unwrap();
    assert!(!exists, "released");
}

/// A release is published on `withlock:released` with the key as message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_is_published_with_the_key_as_message() {
    use futures_util::StreamExt;
    let url = server_url().await;
    let ns = Namespace::new(&url);
    let key = ns.key("published");
    let backend = RedisBackend::from_url(&url).unwrap();
    assert_eq!(backend.channel(), "withlock:released");
    let mut pubsub = subscriber(&url, backend.channel()).await;
    let a = node(backend, "a");
    a.with_lock(&key, |_| async {}).await.unwrap();
    let mut messages = pubsub.on_message();
    let got = within(LIMIT, "the release message", async {
        loop {
            let m = messages.next().await.unwrap();
            let payload: String = m.get_payload().unwrap();
            if payload == key {
                return payload;
            }
        }
    })
    .await;
    assert_eq!(got, key);
}

/// A client that keeps its lock in a hash (Redisson) excludes `with_lock`,
/// and a lock of ours that such a client took over is told `Taken`: extend
/// and release answer "not ours" for a key of another type, not an error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_kept_in_a_hash_is_another_owner() {
    let url = server_url().await;
    let ns = Namespace::new(&url);
    let mut conn = raw(&url).await;
    let a = node(RedisBackend::from_url(&url).unwrap(), "a");
    let once = LockConfig::default().retry_attempts(0);

    let held = ns.key("hash-holder");
    take_as_a_hash(&mut conn, &held).await;
    assert_busy(&a.with_lock_config(&held, &once, |_| async {}).await);
    let kind = key_type(&mut conn, &held).await;
    assert_eq!(kind, "hash", "the foreign lock is untouched");

    // Ours, then deleted and taken as a hash while the callback runs: the
    // release finds another owner at once (a long ttl: an error would be
    // sent again until the validity ran out).
    let key = ns.key("taken-over");
    let cfg = LockConfig::default().ttl(Duration::from_secs(20));
    let (k, u) = (key.clone(), url.clone());
    let got = within(
        LIMIT,
        "the release of a key taken as a hash",
        a.with_lock_config(&key, &cfg, move |_| async move {
            let mut conn = raw(&u).await;
            let _: () = conn.del(&k).await.unwrap();
            take_as_a_hash(&mut conn, &k).await;
        }),
    )
    .await;
    assert!(
        matches!(
            &got,
            Err(LockError::Lost {
                cause: lock_core::LossCause::Taken,
                ..
            })
        ),
        "{got:?}"
    );

    // The same for an extension, through a handle.
    let other = ns.key("taken-over-handle");
    let mut handle = a.handle(&other, Duration::from_secs(20)).unwrap();
    assert!(handle.acquire().await.unwrap());
    let _: () = conn.del(&other).await.unwrap();
    take_as_a_hash(&mut conn, &other).await;
    assert!(
        !handle.renew().await.unwrap(),
        "the extension finds it taken"
    );
    let kind = key_type(&mut conn, &other).await;
    assert_eq!(kind, "hash", "the foreign lock is untouched");
    let _: () = conn.del(&[&held, &key, &other]).await.unwrap();
}

/// Asserts that one attempt found the key held by another client.
fn assert_busy(got: &Result<(), LockError>) {
    assert!(
        matches!(
            got,
            Err(LockError::NotAcquired {
                attempts: 1,
                source: None,
                ..
            })
        ),
        "{got:?}"
    );
}

/// The operator's reads see a key another client keeps its lock in as a
/// hash: `inspect` and `list_locks` show it held by `<hash>`, with its ttl,
/// instead of failing on the type; `force_release` refuses it, as it is no
/// lock of withlock's format, and leaves it \[D2\].
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operator_reads_show_a_lock_kept_in_a_hash() {
    let url = server_url().await;
    let ns = Namespace::new(&url);
    let mut conn = raw(&url).await;
    let backend = RedisBackend::from_url(&url).unwrap();
    let a = node(backend.clone(), "a");
    // Used by withlock first, so that its fencing companion lists it, then
    // taken as a hash by another client; a string lock beside it.
    let foreign = ns.key("admin-hash");
    a.with_lock(&foreign, |_| async {}).await.unwrap();
    take_as_a_hash(&mut conn, &foreign).await;
    let ours = ns.key("admin-string");
    let mut handle = a.handle(&ours, Duration::from_secs(20)).unwrap();
    assert!(handle.acquire().await.unwrap());

    let info = backend.inspect(&foreign).await.unwrap();
    assert!(info.is_held(), "{info:?}");
    assert_eq!(info.owner.as_ref().map(|o| o.as_str()), Some("<hash>"));
    let ttl = info.ttl.expect("the hash's expiry");
    assert!(
        ttl > Duration::from_secs(20) && ttl <= Duration::from_secs(30),
        "{ttl:?}"
    );
    assert!(info.fencing_token.is_some(), "{info:?}");

    let listed = backend.list_locks(ns.prefix()).await.unwrap();
    let keys: Vec<&str> = listed.iter().map(|i| i.key.as_str()).collect();
    assert_eq!(keys, [foreign.as_str(), ours.as_str()], "{listed:?}");
    assert_eq!(listed[0].node_id(), Some("<hash>"));
    assert_eq!(listed[1].node_id(), Some("a"));

    let refused = backend.force_release(&foreign).await;
    assert!(
        matches!(&refused, Err(AdminError::NotALock { found, .. }) if found == "a hash"),
        "{refused:?}"
    );
    assert_eq!(key_type(&mut conn, &foreign).await, "hash");
    assert!(backend.inspect(&foreign).await.unwrap().is_held());
    assert!(handle.release().await.unwrap());
}

//! SPEC H4 on Redis, the fencing companion's life: it expires after an
//! idle period ([`RedisConfig::fence_idle`]) but never while its lock is
//! held, so that a key used once does not leave a key behind forever; and
//! a companion lost meanwhile never makes tokens go back (each token is at
//! least the server clock in microseconds), nor hides a held lock from the
//! admin functions, which find locks by their companions.

mod common;

use std::time::Duration;

use common::{node, raw, within};
use futures_util::future::join_all;
use lock_core::{
    AcquireOutcome, ExtendOutcome, ExtendRequest, Lease, LockAdmin, LockBackend, LockConfig,
    OwnerToken, ReleaseOutcome,
};
use lock_redis::testing::Namespace;
use lock_redis::{RedisBackend, RedisConfig, SetupError};
use redis::AsyncCommands;
use withlock_test_servers::redis::server_url;

const LIMIT: Duration = Duration::from_secs(20);

fn token_of(outcome: AcquireOutcome) -> u64 {
    match outcome {
        AcquireOutcome::Acquired { fencing_token } => fencing_token,
        AcquireOutcome::Busy { .. } => panic!("busy"),
    }
}

/// The `PTTL`s of a lock key and its companion.
async fn pttls(conn: &mut redis::aio::MultiplexedConnection, key: &str, fence: &str) -> (i64, i64) {
    let lock: i64 = conn.pttl(key).await.unwrap();
    let companion: i64 = conn.pttl(fence).await.unwrap();
    (lock, companion)
}

/// The absolute expiry times (`PEXPIRETIME`, ms since the epoch) of a lock
/// key and its companion: comparable however long apart they are read.
async fn expiry_times(
    conn: &mut redis::aio::MultiplexedConnection,
    key: &str,
    fence: &str,
) -> (i64, i64) {
    let at = |k: &str| redis::cmd("PEXPIRETIME").arg(k).to_owned();
    let lock: i64 = at(key).query_async(conn).await.unwrap();
    let companion: i64 = at(fence).query_async(conn).await.unwrap();
    (lock, companion)
}

/// Each step alone (acquisition, extension, a pipelined extension,
/// release): while the lock is held its companion's ttl is the lock's ttl
/// plus the idle period, above the lock's own; the release leaves the
/// companion's expiry as the last extension set it, so it lives more than
/// the idle period after the release. Before this, the companion had no
/// expiry at all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h4_the_companion_has_a_ttl_after_each_step_above_the_held_locks() {
    let url = server_url().await;
    let ns = Namespace::new(&url);
    let idle = Duration::from_secs(3600);
    let backend =
        RedisBackend::from_url_with(&url, RedisConfig::default().fence_idle(idle)).unwrap();
    let key = ns.key("companion ttl {tag}");
    let fence = backend.fence_key(&key);
    let mut conn = raw(&url).await;
    let owner = OwnerToken::new("a");
    let ttl = Duration::from_secs(20);
    let idle_ms = i64::try_from(idle.as_millis()).unwrap();
    let ttl_ms = i64::try_from(ttl.as_millis()).unwrap();

    let token = token_of(backend.try_acquire(&key, &owner, ttl).await.unwrap());
    let (lock, companion) = pttls(&mut conn, &key, &fence).await;
    assert!(lock > 0, "held: {lock}");
    assert!(
        companion > lock && companion > idle_ms && companion <= idle_ms + ttl_ms,
        "after the acquisition: companion {companion} ms, lock {lock} ms"
    );

    let lease = Lease::new(key.as_str(), owner.clone(), token);
    let longer = Duration::from_secs(40);
    let longer_ms = i64::try_from(longer.as_millis()).unwrap();
    assert_eq!(
        backend.extend(&lease, longer).await.unwrap(),
        ExtendOutcome::Extended
    );
    let (lock, companion) = pttls(&mut conn, &key, &fence).await;
    assert!(lock > ttl_ms, "extended: {lock}");
    assert!(
        companion > lock && companion > idle_ms + ttl_ms && companion <= idle_ms + longer_ms,
        "after the extension: companion {companion} ms, lock {lock} ms"
    );

    let longest = Duration::from_secs(60);
    let answers = backend
        .extend_many(&[ExtendRequest {
            lease: lease.clone(),
            ttl: longest,
        }])
        .await;
    assert!(
        matches!(answers.as_slice(), [Ok(ExtendOutcome::Extended)]),
        "{answers:?}"
    );
    let (lock, companion) = pttls(&mut conn, &key, &fence).await;
    assert!(lock > longer_ms, "extended in a pipeline: {lock}");
    assert!(
        companion > lock && companion > idle_ms + longer_ms,
        "after the pipelined extension: companion {companion} ms, lock {lock} ms"
    );

    let (_, expires_at) = expiry_times(&mut conn, &key, &fence).await;
    assert_eq!(
        backend.release(&lease).await.unwrap(),
        ReleaseOutcome::Released
    );
    let (lock, companion) = pttls(&mut conn, &key, &fence).await;
    assert_eq!(lock, -2, "released");
    assert!(
        companion > idle_ms,
        "after the release the companion outlives the idle period: {companion} ms"
    );
    assert_eq!(
        expiry_times(&mut conn, &key, &fence).await.1,
        expires_at,
        "the release left the companion's expiry as it was"
    );
    let stored: u64 = conn.get(&fence).await.unwrap();
    assert_eq!(stored, token, "the companion still holds the last token");
}

/// Many steps at once, so that beyond the first two on the wire they go
/// out as batch scripts (`acquire_batch.lua`, `release_batch.lua`): every
/// companion gets the same ttls as from the one-key scripts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h4_batched_steps_give_each_companion_its_ttl() {
    let url = server_url().await;
    let ns = Namespace::new(&url);
    let idle = Duration::from_secs(3600);
    let idle_ms = i64::try_from(idle.as_millis()).unwrap();
    let backend =
        RedisBackend::from_url_with(&url, RedisConfig::default().fence_idle(idle)).unwrap();
    let owner = OwnerToken::new("a");
    let ttl = Duration::from_secs(20);
    let keys: Vec<String> = (0..32).map(|i| ns.key(&format!("batched {i}"))).collect();
    let answers = within(
        LIMIT,
        "acquisitions",
        join_all(keys.iter().map(|key| backend.try_acquire(key, &owner, ttl))),
    )
    .await;
    let leases: Vec<Lease> = keys
        .iter()
        .zip(answers)
        .map(|(key, answer)| Lease::new(key.as_str(), owner.clone(), token_of(answer.unwrap())))
        .collect();
    let mut conn = raw(&url).await;
    let mut expires_at = Vec::new();
    for key in &keys {
        let (lock, companion) = pttls(&mut conn, key, &backend.fence_key(key)).await;
        assert!(
            lock > 0 && companion > lock && companion > idle_ms,
            "{key}: companion {companion} ms, lock {lock} ms"
        );
        expires_at.push(
            expiry_times(&mut conn, key, &backend.fence_key(key))
                .await
                .1,
        );
    }
    let released = within(
        LIMIT,
        "releases",
        join_all(leases.iter().map(|lease| backend.release(lease))),
    )
    .await;
    for ((key, answer), expired_at) in keys.iter().zip(released).zip(expires_at) {
        assert_eq!(answer.unwrap(), ReleaseOutcome::Released, "{key}");
        let (lock, companion) = pttls(&mut conn, key, &backend.fence_key(key)).await;
        assert_eq!(lock, -2, "{key}: released");
        assert!(
            companion > idle_ms,
            "{key}: after the release: {companion} ms"
        );
        assert_eq!(
            expiry_times(&mut conn, key, &backend.fence_key(key))
                .await
                .1,
            expired_at,
            "{key}: the release left the companion's expiry as it was"
        );
    }
}

/// The companion deleted by hand while its lock is held: the next
/// extension puts it back (holding the lease's token), so the operator's
/// `list_locks` finds the lock again and `force_release` frees it; and
/// deleted again after the release, the next token is still above the
/// earlier one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h4_a_companion_deleted_by_hand_comes_back_and_tokens_go_on_increasing() {
    let url = server_url().await;
    let ns = Namespace::new(&url);
    let backend =
        RedisBackend::from_url_with(&url, RedisConfig::default().prefix(ns.prefix())).unwrap();
    let key = "deleted companion";
    let lock_key = backend.lock_key(key).into_owned();
    let fence = backend.fence_key(key);
    let mut conn = raw(&url).await;
    let owner = OwnerToken::new("a");
    let ttl = Duration::from_secs(20);

    let first = token_of(backend.try_acquire(key, &owner, ttl).await.unwrap());
    let lease = Lease::new(key, owner.clone(), first);
    let deleted: u64 = conn.del(&fence).await.unwrap();
    assert_eq!(deleted, 1);
    let listed = backend.list_locks("").await.unwrap();
    assert!(
        listed.is_empty(),
        "without its companion the lock is not listed: {listed:?}"
    );
    assert_eq!(
        backend.extend(&lease, ttl).await.unwrap(),
        ExtendOutcome::Extended
    );
    let stored: u64 = conn.get(&fence).await.unwrap();
    assert_eq!(stored, first, "the extension put the companion back");
    let (lock, companion) = expiry_times(&mut conn, &lock_key, &fence).await;
    assert!(companion > lock, "companion at {companion}, lock at {lock}");
    let listed = backend.list_locks("").await.unwrap();
    assert_eq!(listed.len(), 1, "listed again: {listed:?}");
    assert_eq!(listed[0].key, key);
    let freed = backend.force_release(key).await.unwrap();
    assert!(freed.is_some(), "the operator frees it");
    assert_eq!(
        backend.release(&lease).await.unwrap(),
        ReleaseOutcome::NotHeld
    );

    let deleted: u64 = conn.del(&fence).await.unwrap();
    assert_eq!(deleted, 1);
    let second = token_of(backend.try_acquire(key, &owner, ttl).await.unwrap());
    assert!(
        second > first,
        "token {second} after {first}, with the companion lost in between"
    );
    let lease = Lease::new(key, owner, second);
    assert_eq!(
        backend.release(&lease).await.unwrap(),
        ReleaseOutcome::Released
    );
}

/// A stale companion while its lock is held, as a failover to a replica
/// that missed the acquisition's write but had an older companion leaves
/// it: the next extension raises it to the lease's token, so `inspect`
/// shows the holder's token. A companion that is not a number is not the
/// extension's to overwrite: it keeps its value and only gets its expiry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h4_an_extension_raises_a_stale_companion_and_leaves_a_foreign_one() {
    let url = server_url().await;
    let ns = Namespace::new(&url);
    let backend =
        RedisBackend::from_url_with(&url, RedisConfig::default().prefix(ns.prefix())).unwrap();
    let key = "stale companion";
    let fence = backend.fence_key(key);
    let mut conn = raw(&url).await;
    let owner = OwnerToken::new("a");
    let ttl = Duration::from_secs(20);

    let earlier = token_of(backend.try_acquire(key, &owner, ttl).await.unwrap());
    let lease = Lease::new(key, owner.clone(), earlier);
    backend.release(&lease).await.unwrap();
    let token = token_of(backend.try_acquire(key, &owner, ttl).await.unwrap());
    assert!(token > earlier);
    let lease = Lease::new(key, owner.clone(), token);
    let _: () = conn.set(&fence, earlier).await.unwrap();
    assert_eq!(
        backend.inspect(key).await.unwrap().fencing_token,
        Some(earlier),
        "the stale companion shows the earlier token"
    );
    assert_eq!(
        backend.extend(&lease, ttl).await.unwrap(),
        ExtendOutcome::Extended
    );
    let stored: u64 = conn.get(&fence).await.unwrap();
    assert_eq!(stored, token, "the extension raised the stale companion");
    assert_eq!(
        backend.inspect(key).await.unwrap().fencing_token,
        Some(token)
    );
    let pttl: i64 = conn.pttl(&fence).await.unwrap();
    assert!(pttl > 0, "with its expiry: {pttl}");

    let _: () = conn.set(&fence, "not a number").await.unwrap();
    assert_eq!(
        backend.extend(&lease, ttl).await.unwrap(),
        ExtendOutcome::Extended
    );
    let stored: String = conn.get(&fence).await.unwrap();
    assert_eq!(stored, "not a number", "a foreign value is left as it is");
    let pttl: i64 = conn.pttl(&fence).await.unwrap();
    assert!(pttl > 0, "it only got its expiry: {pttl}");
    let _: () = conn.set(&fence, token).await.unwrap();
    assert_eq!(
        backend.release(&lease).await.unwrap(),
        ReleaseOutcome::Released
    );
}

/// A tiny idle period: a lock held through several extensions keeps its
/// companion all along (its ttl always above the lock's), the operator
/// lists and force-releases it at the end, and once released the
/// companion expires within about the idle period, after which the next
/// token is still above the last.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h4_a_lock_held_through_extensions_with_a_tiny_idle_period_keeps_its_companion() {
    let url = server_url().await;
    let ns = Namespace::new(&url);
    let config = RedisConfig::default()
        .prefix(ns.prefix())
        .fence_idle(Duration::from_millis(1));
    let backend = RedisBackend::from_url_with(&url, config).unwrap();
    let admin = backend.clone();
    let key = "tiny idle";
    let lock_key = backend.lock_key(key).into_owned();
    let fence = backend.fence_key(key);
    let locker = node(backend, "a");
    let ttl = Duration::from_millis(900);
    let cfg = LockConfig::default().ttl(ttl);
    let (lk, f, u) = (lock_key.clone(), fence.clone(), url.clone());
    let held = locker.with_lock_config(key, &cfg, move |ctx| async move {
        let mut conn = raw(&u).await;
        // Extensions seen: the lock's expiry time moving on between two
        // reads.
        let mut extensions = 0;
        let mut last = 0;
        while extensions < 4 {
            let (lock, companion) = expiry_times(&mut conn, &lk, &f).await;
            assert!(lock > 0, "held: {lock}");
            assert!(
                companion > lock,
                "after {extensions} extension(s): the companion expires at {companion}, the lock at {lock}"
            );
            if last > 0 && lock > last {
                extensions += 1;
            }
            last = lock;
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let listed = admin.list_locks("").await.unwrap();
        assert_eq!(listed.len(), 1, "the held lock is listed: {listed:?}");
        ctx.fencing_token()
    });
    let token = within(LIMIT, "the held callback", held).await.unwrap();

    // Released: the companion expires within about the idle period.
    let mut conn = raw(&url).await;
    let deadline = tokio::time::Instant::now() + LIMIT;
    loop {
        let exists: bool = conn.exists(&fence).await.unwrap();
        if !exists {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the idle companion never expired"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let next = within(
        LIMIT,
        "the next acquisition",
        locker.with_lock_config(key, &cfg, |ctx| async move { ctx.fencing_token() }),
    )
    .await
    .unwrap();
    assert!(next > token, "token {next} after {token}");
}

/// An idle period under 1 ms or over 100 years is refused at construction
/// and names the field.
#[test]
fn h4_a_fence_idle_out_of_range_is_refused() {
    for idle in [
        Duration::ZERO,
        Duration::from_micros(999),
        Duration::from_secs(101 * 365 * 24 * 3600),
        Duration::MAX,
    ] {
        let refused = RedisBackend::from_url_with(
            "redis://127.0.0.1:1",
            RedisConfig::default().fence_idle(idle),
        );
        assert!(
            matches!(
                refused,
                Err(SetupError::InvalidConfig {
                    field: "fence_idle",
                    ..
                })
            ),
            "{idle:?}: {refused:?}"
        );
    }
    assert_eq!(
        RedisConfig::default().fence_idle,
        Duration::from_secs(7 * 24 * 3600)
    );
}

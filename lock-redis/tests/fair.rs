//! SPEC F1–F6 and A9 on a single Redis node: the fair queue's steps
//! by hand (`lua/queue.lua`, `acquire_queued.lua`, `leave_queue.lua`, and
//! the grant in `release.lua` and `release_batch.lua`), the grant's message
//! on the grantee's node's grant channel, and lock users whose ACL does not
//! reach the queue's keys or the grant channels.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::acl::{as_user, set_user, PREFIX, SINGLE_NODE};
use common::{node, subscriber, within};
use futures_util::StreamExt;
use lock_core::{
    AcquireOutcome, Lease, LockBackend, LockConfig, OwnerToken, QueueTerms, ReleaseOutcome,
};
use lock_redis::testing::Namespace;
use lock_redis::{RedisBackend, RedisConfig, CHANNEL, GRANT_CHANNEL};
use withlock_test_servers::redis::{server_url, RedisServer};

const LIMIT: Duration = Duration::from_secs(20);
const TTL: Duration = Duration::from_secs(30);
const TERMS: QueueTerms = QueueTerms::DEFAULT;

fn token_of(outcome: AcquireOutcome) -> u64 {
    match outcome {
        AcquireOutcome::Acquired { fencing_token } => fencing_token,
        AcquireOutcome::Busy { .. } => panic!("busy"),
    }
}

fn expires_in(outcome: AcquireOutcome) -> Option<Duration> {
    match outcome {
        AcquireOutcome::Busy { expires_in, .. } => expires_in,
        AcquireOutcome::Acquired { .. } => panic!("acquired"),
    }
}

/// \[F1, F3, A9\] By hand: a holder, then two waiters queued in order. The
/// head's busy answer says how long the holder has left, the second's
/// does not. The release grants the key to the head, with a greater
/// fencing token, announced on the channel to its watch; the second is
/// still queued; the head takes the grant up with the grant's token; its
/// release grants the key to the second. A plain busy answer carries the
/// holder's time left too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f1_a_release_grants_the_key_to_the_queues_head() {
    let url = server_url().await;
    let ns = Namespace::new(&url);
    let backend = RedisBackend::from_url(&url).unwrap();
    let key = ns.key("fair {tag} grant");
    let (holder, first, second) = (
        OwnerToken::new("holder"),
        OwnerToken::new("first"),
        OwnerToken::new("second"),
    );
    let held = token_of(backend.try_acquire(&key, &holder, TTL).await.unwrap());
    let plain = backend
        .try_acquire(&key, &OwnerToken::new("other"), TTL)
        .await
        .unwrap();
    let left = expires_in(plain).expect("a busy answer says the holder's time left [A9]");
    assert!(left <= TTL && left > TTL - LIMIT, "{left:?}");

    let head = backend
        .try_acquire_queued(&key, &first, TTL, TERMS)
        .await
        .unwrap();
    assert!(
        expires_in(head).is_some(),
        "the head is told the holder's time left"
    );
    let behind = backend
        .try_acquire_queued(&key, &second, TTL, TERMS)
        .await
        .unwrap();
    assert_eq!(expires_in(behind), None, "only the head is told");

    let mut watch = backend.watch_release(&key).await.unwrap();
    let lease = Lease::new(key.as_str(), holder, held);
    assert_eq!(
        backend.release(&lease).await.unwrap(),
        ReleaseOutcome::Released
    );
    within(LIMIT, "the grant's message", watch.released()).await;
    let grant = watch.grant().expect("a grant, not a plain release");
    assert_eq!(&*grant.owner, first.as_str());
    assert!(grant.fencing_token > held, "{grant:?} after {held}");
    assert_eq!(grant.claim, TERMS.claim);

    // The second is still queued: the key is the first's.
    let still = backend
        .try_acquire_queued(&key, &second, TTL, TERMS)
        .await
        .unwrap();
    assert!(still.is_busy());
    let taken = token_of(
        backend
            .try_acquire_queued(&key, &first, TTL, TERMS)
            .await
            .unwrap(),
    );
    assert_eq!(
        taken, grant.fencing_token,
        "the grant taken up keeps its token"
    );

    let lease = Lease::new(key.as_str(), first, taken);
    assert_eq!(
        backend.release(&lease).await.unwrap(),
        ReleaseOutcome::Released
    );
    within(LIMIT, "the second grant's message", watch.released()).await;
    let grant = watch.grant().expect("a grant");
    assert_eq!(&*grant.owner, second.as_str());
    assert!(grant.fencing_token > taken);
    let lease = Lease::new(key.as_str(), second, grant.fencing_token);
    assert_eq!(
        backend.release(&lease).await.unwrap(),
        ReleaseOutcome::Released
    );
    // Nobody queued: a plain release; the queue is gone, and the places'
    // hash holds no place (only the run of grants' mark, which ends now,
    // and at most a gap's; it expires with the last ticket ttl).
    within(LIMIT, "the plain release's message", watch.released()).await;
    assert!(watch.grant().is_none());
    let client = redis::Client::open(url.as_str()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let (queue, waiters) = backend.queue_keys(&key);
    let exists: i64 = redis::cmd("EXISTS")
        .arg(&queue)
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(exists, 0, "the queue is gone");
    let fields: Vec<String> = redis::cmd("HKEYS")
        .arg(&waiters)
        .query_async(&mut conn)
        .await
        .unwrap();
    assert!(
        fields.iter().all(|f| !f.contains('/')),
        "no place left: {fields:?}"
    );
    let pttl: i64 = redis::cmd("PTTL")
        .arg(&waiters)
        .query_async(&mut conn)
        .await
        .unwrap();
    assert!(
        pttl <= i64::try_from(TERMS.ticket_ttl.as_millis()).unwrap(),
        "{pttl}"
    );
}

/// \[F2\] A waiter that leaves hands a grant it did not take up on to the
/// next; a place whose ticket ttl ran out is skipped by the release.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f2_leaving_hands_an_untaken_grant_on_and_dead_places_are_skipped() {
    let url = server_url().await;
    let ns = Namespace::new(&url);
    let backend = RedisBackend::from_url(&url).unwrap();
    let key = ns.key("fair leave");
    let holder = OwnerToken::new("holder");
    let (dead, gone, next) = (
        OwnerToken::new("dead"),
        OwnerToken::new("gone"),
        OwnerToken::new("next"),
    );
    let held = token_of(backend.try_acquire(&key, &holder, TTL).await.unwrap());
    let short = QueueTerms::new(QueueTerms::MIN_TICKET_TTL, TERMS.claim);
    assert!(backend
        .try_acquire_queued(&key, &dead, TTL, short)
        .await
        .unwrap()
        .is_busy());
    for owner in [&gone, &next] {
        assert!(backend
            .try_acquire_queued(&key, owner, TTL, TERMS)
            .await
            .unwrap()
            .is_busy());
    }
    // The first place is not renewed past its ticket ttl.
    tokio::time::sleep(QueueTerms::MIN_TICKET_TTL + Duration::from_millis(100)).await;
    let mut watch = backend.watch_release(&key).await.unwrap();
    let lease = Lease::new(key.as_str(), holder, held);
    backend.release(&lease).await.unwrap();
    within(LIMIT, "the grant", watch.released()).await;
    let grant = watch.grant().expect("a grant");
    assert_eq!(&*grant.owner, gone.as_str(), "the dead place is skipped");

    backend.leave_queue(&key, &gone).await.unwrap();
    within(LIMIT, "the grant handed on", watch.released()).await;
    let handed = watch.grant().expect("a grant");
    assert_eq!(&*handed.owner, next.as_str());
    assert!(handed.fencing_token > grant.fencing_token);
    let lease = Lease::new(key.as_str(), next, handed.fencing_token);
    assert_eq!(
        backend.release(&lease).await.unwrap(),
        ReleaseOutcome::Released
    );
    // The dead waiter's place is gone: it comes back at the tail, and with
    // the key free and nobody ahead, it takes it.
    assert!(!backend
        .try_acquire_queued(&key, &dead, TTL, TERMS)
        .await
        .unwrap()
        .is_busy());
}

/// \[F1, F4\] Through the driver: 4 nodes, each on a backend of its own, a
/// holder and 3 waiters queued in a known order; each release grants the
/// key to the next in arrival order, and each waiter makes about one
/// queued attempt per handoff (no herd).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f1_nodes_get_the_key_in_arrival_order() {
    let url = server_url().await;
    let ns = Namespace::new(&url);
    let key = Arc::new(ns.key("fair order"));
    let order = Arc::new(std::sync::Mutex::new(Vec::new()));
    let holder = node(RedisBackend::from_url(&url).unwrap(), "holder");
    let mut held = holder.handle(&key, TTL).unwrap();
    assert!(held.acquire().await.unwrap());
    let probe = RedisBackend::from_url(&url).unwrap();
    let mut waiters = Vec::new();
    for i in 0..3 {
        let (task_key, order) = (Arc::clone(&key), Arc::clone(&order));
        let counting =
            lock_conformance::CountingBackend::new(RedisBackend::from_url(&url).unwrap());
        let locker = node(counting.clone(), &format!("w{i}"));
        waiters.push(tokio::spawn(async move {
            let cfg = LockConfig::default().wait_forever();
            locker
                .with_lock_config(&task_key, &cfg, |ctx| async move {
                    order.lock().unwrap().push((i, ctx.fencing_token()));
                })
                .await
                .unwrap();
            counting.calls(lock_conformance::Step::TryAcquire)
        }));
        // Queued before the next one starts.
        within(LIMIT, "queued", async {
            while waiters_queued(&url, &probe, &key).await < i + 1 {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
        .await;
    }
    assert!(held.release().await.unwrap());
    let mut attempts = Vec::new();
    for waiter in waiters {
        attempts.push(within(LIMIT, "each waiter runs", waiter).await.unwrap());
    }
    let order = order.lock().unwrap().clone();
    let who: Vec<usize> = order.iter().map(|(i, _)| *i).collect();
    assert_eq!(who, [0, 1, 2], "arrival order");
    assert!(order.windows(2).all(|w| w[0].1 < w[1].1), "{order:?}");
    // Each: one plain attempt, one queued, and a heartbeat now and then
    // (every second), not one per release.
    for n in &attempts {
        assert!(*n <= 6, "attempts per waiter: {attempts:?}");
    }
}

/// How many places the key's queue holds.
async fn waiters_queued(url: &str, backend: &RedisBackend, key: &str) -> usize {
    let client = redis::Client::open(url).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let (queue, _) = backend.queue_keys(key);
    redis::cmd("ZCARD")
        .arg(queue)
        .query_async::<usize>(&mut conn)
        .await
        .unwrap()
}

/// \[F6\] A lock user made by the rules of a release before the queue (no
/// `~{*}:withlock-queue:P*`, `~{*}:withlock-waiters:P*` nor the sorted-set
/// and hash commands) still waits, unqueued, and releases: the queued
/// attempt's `NOPERM` makes the driver wait as before, and the release,
/// refused the queue's keys, is sent again without them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f6_a_user_without_the_queues_rights_waits_unqueued() {
    let server = RedisServer::start().expect("a redis-server of this test's own");
    let rules: Vec<&str> = SINGLE_NODE
        .iter()
        .copied()
        .filter(|rule| !rule.contains("withlock-queue") && !rule.contains("withlock-waiters"))
        .filter(|rule| !rule.starts_with("+z") && !rule.starts_with("+h"))
        .collect();
    {
        let client = redis::Client::open(server.url()).unwrap();
        let mut conn = client.get_connection().unwrap();
        set_user(&mut conn, "older-locker", "older-secret", &[&rules]);
    }
    let url = as_user(&server.url(), "older-locker", "older-secret");
    let config = RedisConfig::default().prefix(PREFIX);
    let key = "fair f6";
    let holder = node(
        RedisBackend::connect_with(&url, config.clone())
            .await
            .unwrap(),
        "holder",
    );
    let counting = lock_conformance::CountingBackend::new(
        RedisBackend::connect_with(&url, config).await.unwrap(),
    );
    let waiter = node(counting.clone(), "waiter");
    let mut held = holder.handle(key, TTL).unwrap();
    assert!(held.acquire().await.unwrap());
    let waiting = tokio::spawn(async move {
        let cfg = LockConfig::default().wait_forever();
        waiter.with_lock_config(key, &cfg, |_| async {}).await
    });
    // The plain attempt and the queued one (refused: NOPERM) answered,
    // then an unqueued one.
    within(
        LIMIT,
        "the waiter's attempts",
        counting.until_answered(lock_conformance::Step::TryAcquire, 3),
    )
    .await;
    assert!(held.release().await.unwrap());
    within(LIMIT, "the waiter gets the key", waiting)
        .await
        .unwrap()
        .expect("waiting works without the queue's rights");
}

/// \[F1, F3\] A grantee starts on its grant's claim deadline and its first
/// extension, sent at once, makes the lock its own ttl: a callback that
/// runs three times the claim deadline keeps its lock, and the key is
/// held for the config's ttl meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f3_a_grantee_running_past_its_claim_deadline_keeps_its_lock() {
    let url = server_url().await;
    let ns = Namespace::new(&url);
    let key = ns.key("fair long grantee");
    let claim = Duration::from_millis(300);
    let holder = node(RedisBackend::from_url(&url).unwrap(), "holder");
    let mut held = holder.handle(&key, TTL).unwrap();
    assert!(held.acquire().await.unwrap());
    let counting = lock_conformance::CountingBackend::new(RedisBackend::from_url(&url).unwrap());
    let waiter = node(counting.clone(), "waiter");
    let task_key = key.clone();
    let probe = RedisBackend::from_url(&url).unwrap();
    let (started_tx, started_rx) = tokio::sync::oneshot::channel();
    let waiting = tokio::spawn(async move {
        let cfg = LockConfig::default()
            .wait_forever()
            .fair_queue(QueueTerms::new(QueueTerms::DEFAULT.ticket_ttl, claim));
        waiter
            .with_lock_config(&task_key, &cfg, |ctx| async move {
                let _ = started_tx.send(ctx.fencing_token());
                tokio::time::sleep(claim * 3).await;
            })
            .await
    });
    within(
        LIMIT,
        "the waiter queued",
        counting.until_answered(lock_conformance::Step::TryAcquire, 2),
    )
    .await;
    let held_token = held.fencing_token().unwrap();
    assert!(held.release().await.unwrap());
    let token = within(LIMIT, "the grantee starts", started_rx)
        .await
        .unwrap();
    assert!(token > held_token);
    // Taken up by its first extension: the key's expiry is the ttl's now.
    within(
        LIMIT,
        "the take-up",
        counting.until_answered(lock_conformance::Step::Extend, 1),
    )
    .await;
    let client = redis::Client::open(url.as_str()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let pttl: i64 = redis::cmd("PTTL")
        .arg(probe.lock_key(&key).as_ref())
        .query_async(&mut conn)
        .await
        .unwrap();
    assert!(
        pttl > i64::try_from(claim.as_millis()).unwrap(),
        "the lock's own ttl after the take-up: {pttl} ms"
    );
    within(LIMIT, "the grantee's run", waiting)
        .await
        .unwrap()
        .expect("the grantee kept its lock past the claim deadline");
}

/// \[F5\] A client outside the queue, polling `SET NX PX` every 200 ms as
/// other libraries do, while 3 nodes of the queue keep the key busy
/// without a pause: it gets the key within the documented bound (10 s of
/// grants in a row, then the key left free 600 ms; plus its poll
/// interval and the queue head's heartbeat), and while it holds the key
/// the queue waits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f5_a_client_polling_outside_the_queue_is_not_starved() {
    let url = server_url().await;
    let ns = Namespace::new(&url);
    let key = Arc::new(ns.key("fair f5"));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let inside = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut queued = Vec::new();
    for i in 0..3 {
        let (key, stop, inside) = (Arc::clone(&key), Arc::clone(&stop), Arc::clone(&inside));
        let locker = node(RedisBackend::from_url(&url).unwrap(), &format!("q{i}"));
        queued.push(tokio::spawn(async move {
            let cfg = LockConfig::default().wait_forever();
            let mut turns = 0u32;
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                let inside = Arc::clone(&inside);
                locker
                    .with_lock_config(&key, &cfg, |_| async move {
                        assert_eq!(inside.fetch_add(1, std::sync::atomic::Ordering::SeqCst), 0);
                        tokio::time::sleep(Duration::from_millis(5)).await;
                        inside.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
                    })
                    .await
                    .unwrap();
                turns += 1;
            }
            turns
        }));
    }
    // The queued nodes take turns before the outsider starts.
    let probe = RedisBackend::from_url(&url).unwrap();
    within(LIMIT, "the queued nodes contend", async {
        while waiters_queued(&url, &probe, &key).await < 2 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await;
    let client = redis::Client::open(url.as_str()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let started = std::time::Instant::now();
    let bound = Duration::from_secs(10) + Duration::from_millis(600) + Duration::from_secs(3);
    let outsider = format!("outsider/{:032x}", rand::random::<u128>());
    loop {
        let taken: Option<String> = redis::cmd("SET")
            .arg(key.as_str())
            .arg(&outsider)
            .arg("NX")
            .arg("PX")
            .arg(2000)
            .query_async(&mut conn)
            .await
            .unwrap();
        if taken.is_some() {
            break;
        }
        assert!(
            started.elapsed() < bound,
            "the client outside the queue got no turn in {bound:?}: starved"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let waited = started.elapsed();
    assert_eq!(
        inside.load(std::sync::atomic::Ordering::SeqCst),
        0,
        "the outsider holds the key alone"
    );
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(inside.load(std::sync::atomic::Ordering::SeqCst), 0);
    let _: i64 = redis::cmd("DEL")
        .arg(key.as_str())
        .query_async(&mut conn)
        .await
        .unwrap();
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let mut turns = Vec::new();
    for q in queued {
        turns.push(within(LIMIT, "the queued nodes stop", q).await.unwrap());
    }
    assert!(
        turns.iter().all(|t| *t > 10),
        "the queued nodes kept the key busy: {turns:?} turns (outsider waited {waited:?})"
    );
}

/// With `RedisConfig::durability`, every Redis backend waits unqueued: a
/// grant is taken up without a round trip, so no `WAIT` would cover it
/// (README, "The fair queue"). Without it, each keeps the queue.
#[test]
fn f1_with_durability_waiting_is_unqueued() {
    let durable = RedisConfig::default()
        .durability(lock_redis::Durability::new(1, Duration::from_millis(200)));
    let url = "redis://127.0.0.1:6379";
    let single = |config| {
        RedisBackend::from_url_with(url, config)
            .unwrap()
            .capabilities()
    };
    let cluster = |config| {
        lock_redis::RedisClusterBackend::from_urls_with([url], config)
            .unwrap()
            .capabilities()
    };
    assert!(single(RedisConfig::default()).fair_queue);
    assert!(!single(durable.clone()).fair_queue);
    assert!(cluster(RedisConfig::default()).fair_queue);
    assert!(!cluster(durable).fair_queue);
}

/// Reads `messages` up to `marker`, and says whether one before it named
/// `key` (a release of it, or a grant of it).
async fn named_before_marker(
    messages: &mut (impl futures_util::Stream<Item = redis::Msg> + Unpin),
    key: &str,
    marker: &str,
) -> bool {
    let mut named = false;
    loop {
        let message = within(LIMIT, "the marker", messages.next())
            .await
            .expect("the subscription stays open");
        let payload = String::from_utf8_lossy(message.get_payload_bytes()).into_owned();
        if payload == marker {
            return named;
        }
        named |= payload.contains(key);
    }
}

/// One handoff by hand through two backends, with a plain subscriber of
/// the release channel beside them: the holder's release grants the key to
/// the waiter, whose watch hears the grant, and the subscriber hears the
/// release channel up to a marker published after it; then the waiter
/// takes its grant up and releases with nobody queued. Returns whether the
/// grant was heard on the release channel, whether the plain release was,
/// and the subscribers of the waiter's grant channel after its first
/// queued attempt.
async fn hand_over(url: &str, config: RedisConfig, admin_url: &str) -> (bool, bool, i64) {
    let ns = Namespace::new(admin_url);
    let key = ns.key("fair grant channel");
    let node_id = ns.key("waiter node");
    let channel = format!("{}{CHANNEL}", config.prefix);
    let grant_channel = format!("{}{GRANT_CHANNEL}{node_id}", config.prefix);
    let holder_backend = RedisBackend::connect_with(url, config.clone())
        .await
        .unwrap();
    let waiter_backend = RedisBackend::connect_with(url, config).await.unwrap();
    let (mut listening, mut messages) = subscriber(admin_url, &channel).await.split();
    let mut admin = common::raw(admin_url).await;
    let marker = |n: u32| format!("marker {n} {key}!");

    let holder = OwnerToken::new("f4-holder");
    let held = token_of(
        holder_backend
            .try_acquire(&key, &holder, TTL)
            .await
            .unwrap(),
    );
    let waiter = OwnerToken::new(&node_id);
    let queued = waiter_backend
        .try_acquire_queued(&key, &waiter, TTL, TERMS)
        .await
        .unwrap();
    assert!(queued.is_busy());
    let mut watch = waiter_backend.watch_release(&key).await.unwrap();
    let (_, listeners): (String, i64) = redis::cmd("PUBSUB")
        .arg("NUMSUB")
        .arg(&grant_channel)
        .query_async(&mut admin)
        .await
        .unwrap();

    let lease = Lease::new(key.as_str(), holder, held);
    assert_eq!(
        holder_backend.release(&lease).await.unwrap(),
        ReleaseOutcome::Released,
        "a release whose grant channel is refused still releases"
    );
    within(LIMIT, "the grant's message", watch.released()).await;
    let grant = watch.grant().expect("a grant, not a plain release");
    assert_eq!(&*grant.owner, waiter.as_str());
    let _: i64 = redis::cmd("PUBLISH")
        .arg(&channel)
        .arg(marker(1))
        .query_async(&mut admin)
        .await
        .unwrap();
    let grant_on_release_channel = named_before_marker(&mut messages, &key, &marker(1)).await;

    let taken = token_of(
        waiter_backend
            .try_acquire_queued(&key, &waiter, TTL, TERMS)
            .await
            .unwrap(),
    );
    assert_eq!(taken, grant.fencing_token);
    let lease = Lease::new(key.as_str(), waiter, taken);
    assert_eq!(
        waiter_backend.release(&lease).await.unwrap(),
        ReleaseOutcome::Released
    );
    within(LIMIT, "the plain release's message", watch.released()).await;
    assert!(watch.grant().is_none());
    let _: i64 = redis::cmd("PUBLISH")
        .arg(&channel)
        .arg(marker(2))
        .query_async(&mut admin)
        .await
        .unwrap();
    let release_on_release_channel = named_before_marker(&mut messages, &key, &marker(2)).await;
    listening.unsubscribe(&channel).await.unwrap();
    (
        grant_on_release_channel,
        release_on_release_channel,
        listeners,
    )
}

/// \[F4\] A grant goes to the grantee's node alone: its backend listens on
/// the node's grant channel from before its first queued attempt, and
/// the release channel, which every node's subscription hears, carries no
/// grant; a release with nobody queued is still announced there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f4_a_grant_goes_to_the_grantees_node_alone() {
    let url = server_url().await;
    let (grant_heard, release_heard, listeners) =
        hand_over(&url, RedisConfig::default(), &url).await;
    assert_eq!(
        listeners, 1,
        "the waiter's backend listens on its node's grant channel"
    );
    assert!(!grant_heard, "no grant on the release channel");
    assert!(
        release_heard,
        "a plain release is announced on the release channel"
    );
}

/// \[F4, F6\] A lock user made by the rules of a release before the grant
/// channels (no `&Pwithlock:granted:*`) still hands over at once: its
/// subscription is refused the grant channel and its release the publish
/// there, so the grant goes on the release channel, as before (the
/// release does not fail), and the log says so once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f6_a_user_without_the_grant_channels_hears_grants_on_the_release_channel() {
    let server = RedisServer::start().expect("a redis-server of this test's own");
    let rules: Vec<&str> = SINGLE_NODE
        .iter()
        .copied()
        .filter(|rule| !rule.contains("withlock:granted"))
        .collect();
    assert_eq!(rules.len() + 1, SINGLE_NODE.len());
    {
        let client = redis::Client::open(server.url()).unwrap();
        let mut conn = client.get_connection().unwrap();
        set_user(&mut conn, "older-locker", "older-secret", &[&rules]);
    }
    let url = as_user(&server.url(), "older-locker", "older-secret");
    let config = RedisConfig::default().prefix(PREFIX);
    let log = common::Log::default();
    let (grant_heard, release_heard, listeners) = {
        let _captured = log.capture();
        hand_over(&url, config, &server.url()).await
    };
    assert_eq!(
        listeners, 0,
        "the grant channel is refused to the subscription"
    );
    assert!(grant_heard, "the grant goes on the release channel");
    assert!(release_heard);
    assert_eq!(
        log.count("the ACL refuses the grant channels to this user"),
        1
    );
}

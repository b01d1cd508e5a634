//! Faults of a real server while locks are held or wanted: each test names
//! the outcome the spec gives it. Tests that kill, restart, flush or cut
//! their server run a `redis-server` child of their own.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{assert_not_acquired_by_redis_error, loss_cause, node, raw, redis_error_in, within};
use lock_core::{
    AcquireOutcome, ExtendOutcome, ExtendRequest, Lease, LockBackend, LockConfig, LossCause,
    OwnerToken, ReleaseOutcome,
};
use lock_redis::testing::Namespace;
use lock_redis::RedisBackend;
use redis::AsyncCommands;
use tokio::sync::oneshot;
use withlock_test_servers::redis::{server_url, RedisServer};

const TTL: Duration = Duration::from_millis(600);
const LIMIT: Duration = Duration::from_secs(15);

/// How soon a waiter whose retry delay is 30 s runs after a release when a
/// notification woke it: a third of that delay, so that a slow machine
/// cannot fail it and polling cannot pass it.
const NOTIFIED: Duration = Duration::from_secs(10);

/// Runs a callback that signals when it starts and then runs for a minute,
/// in the background; gives the call and the start signal.
fn hold(
    locker: &lock_core::Locker,
    key: &str,
    ttl: Duration,
) -> (
    tokio::task::JoinHandle<Result<(), lock_core::LockError>>,
    oneshot::Receiver<u64>,
) {
    let (started, running) = oneshot::channel();
    let (locker, key) = (locker.clone(), key.to_owned());
    let call = tokio::spawn(async move {
        locker
            .with_lock_config(&key, &LockConfig::default().ttl(ttl), |ctx| async move {
                let _ = started.send(ctx.fencing_token());
                tokio::time::sleep(Duration::from_secs(60)).await;
            })
            .await
    });
    (call, running)
}

/// SPEC L2: the server dies while a callback runs: extensions fail until the
/// lock's validity runs out, then the call is lost with the Redis error as
/// the cause.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_killed_while_callback_runs_is_lost_with_the_redis_error() {
    let server = RedisServer::start().unwrap();
    let backend = RedisBackend::from_url(&server.url()).unwrap();
    let a = node(backend, "a");
    let (call, running) = hold(&a, "killed", TTL);
    within(LIMIT, "callback start", running).await.unwrap();
    let killed_at = Instant::now();
    server.kill();
    let cause = loss_cause(within(LIMIT, "loss", call).await.unwrap());
    let lost_after = killed_at.elapsed();
    let LossCause::Backend(error) = &cause else {
        panic!("expected a backend cause, got {cause:?}");
    };
    let redis = redis_error_in(error).unwrap_or_else(|| panic!("no Redis error in {error:?}"));
    eprintln!("lost after {lost_after:?}: {redis}");
    assert!(
        lost_after <= TTL + Duration::from_secs(1),
        "lost after {lost_after:?}"
    );
}

/// SPEC L1 and the restart promise: the server comes back empty while a
/// callback runs; the next extension finds the key gone while it was
/// still valid (Taken: it did not expire). Then the
/// same locker takes the key again, and a waiter is woken by pub/sub (its
/// subscription reconnected) rather than its 30 s retry timer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_restarted_empty_is_lost_as_taken_then_works_again() {
    let server = RedisServer::start().unwrap();
    let backend = RedisBackend::from_url(&server.url()).unwrap();
    let a = node(backend.clone(), "a");
    let ttl = Duration::from_millis(1500);
    let (call, running) = hold(&a, "restarted", ttl);
    let first_token = within(LIMIT, "callback start", running).await.unwrap();
    server.restart().unwrap();
    let cause = loss_cause(within(LIMIT, "loss", call).await.unwrap());
    assert!(matches!(cause, LossCause::Taken), "cause {cause:?}");

    // The same locker works again, without a new process or backend.
    let token = within(
        LIMIT,
        "acquisition after restart",
        a.with_lock("restarted", |ctx| async move { ctx.fencing_token() }),
    )
    .await
    .unwrap();
    assert!(
        token > first_token,
        "tokens keep increasing across an empty restart: {token} after {first_token}"
    );

    // Pub/sub reconnected: a waiter with a 30 s retry delay wakes at once.
    let mut held = a.handle("restarted", Duration::from_secs(10)).unwrap();
    assert!(held.acquire().await.unwrap());
    let b = node(backend.clone(), "b");
    let slow = LockConfig::default()
        .wait_forever()
        .retry_delay(Duration::from_secs(30));
    let waiter = tokio::spawn(async move {
        b.with_lock_config("restarted", &slow, |_| async { Instant::now() })
            .await
    });
    within(LIMIT, "subscription", async {
        while !backend.is_subscribed() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let released_at = Instant::now();
    assert!(held.release().await.unwrap());
    // Polling alone would take the waiter's 30 s retry delay: a third of
    // it is only a notification's, however slow the machine.
    let ran_at = within(NOTIFIED, "woken waiter", waiter)
        .await
        .unwrap()
        .unwrap();
    assert!(
        ran_at - released_at < NOTIFIED,
        "woken after {:?}",
        ran_at - released_at
    );
}

/// SPEC L1: another client overwrites the key or deletes it while a
/// callback runs: lost at the next extension, both `Taken` (a key deleted
/// while valid did not expire).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn l1_key_overwritten_or_deleted_is_lost_as_taken() {
    let url = server_url().await;
    let ns = Namespace::new(&url);
    let backend = RedisBackend::from_url(&url).unwrap();
    let a = node(backend, "a");
    let mut conn = raw(&url).await;

    let key = ns.key("overwritten");
    let (call, running) = hold(&a, &key, TTL);
    within(LIMIT, "callback start", running).await.unwrap();
    let _: () = conn.set(&key, "another client").await.unwrap();
    let cause = loss_cause(within(LIMIT, "loss", call).await.unwrap());
    assert!(matches!(cause, LossCause::Taken), "cause {cause:?}");
    let value: String = conn.get(&key).await.unwrap();
    assert_eq!(value, "another client", "the new value is left alone");

    let key = ns.key("deleted");
    let (call, running) = hold(&a, &key, TTL);
    within(LIMIT, "callback start", running).await.unwrap();
    let _: () = conn.del(&key).await.unwrap();
    let cause = loss_cause(within(LIMIT, "loss", call).await.unwrap());
    assert!(matches!(cause, LossCause::Taken), "cause {cause:?}");
    let exists: bool = conn.exists(&key).await.unwrap();
    assert!(!exists, "an extension never re-creates the key");
}

/// SPEC O3: the server is down during acquisition: NotAcquired with the
/// Redis error as source, and the callback never runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_down_during_acquisition_is_not_acquired_with_the_redis_error() {
    let server = RedisServer::start().unwrap();
    let backend = RedisBackend::from_url(&server.url()).unwrap();
    let a = node(backend, "a");
    // A first call puts a connection in the pool; then the server dies.
    a.with_lock("down", |_| async {}).await.unwrap();
    server.kill();
    let ran = Arc::new(AtomicBool::new(false));
    let flag = Arc::clone(&ran);
    let cfg = LockConfig::default()
        .retry_attempts(2)
        .retry_delay(Duration::from_millis(50));
    let result = within(
        LIMIT,
        "giving up",
        a.with_lock_config("down", &cfg, move |_| async move {
            flag.store(true, Ordering::SeqCst);
        }),
    )
    .await;
    let message = assert_not_acquired_by_redis_error(result);
    eprintln!("acquisition failed with: {message}");
    assert!(!ran.load(Ordering::SeqCst), "the callback did not run");
    assert_eq!(a.held(), 0);
}

/// `SCRIPT FLUSH` while a callback runs: the extensions reload the script
/// (pipeline NOSCRIPT path), the run goes on, and later calls work.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn script_flush_mid_run_breaks_nothing() {
    let server = Arc::new(RedisServer::start().unwrap());
    let backend = RedisBackend::from_url(&server.url()).unwrap();
    let a = node(backend.clone(), "a");
    let flusher = Arc::clone(&server);
    let result = within(
        LIMIT,
        "run across a SCRIPT FLUSH",
        a.with_lock_config(
            "flushed",
            &LockConfig::default().ttl(TTL),
            move |ctx| async move {
                tokio::time::sleep(TTL / 2).await;
                tokio::task::spawn_blocking(move || flusher.script_flush())
                    .await
                    .unwrap()
                    .unwrap();
                // Several extensions, each after a flush.
                tokio::time::sleep(TTL * 3).await;
                ctx.is_held()
            },
        ),
    )
    .await;
    assert!(result.unwrap(), "still held after the flush");

    // Every step on its own after another flush.
    server.script_flush().unwrap();
    let owner = OwnerToken::new("a");
    let AcquireOutcome::Acquired { fencing_token } =
        backend.try_acquire("flushed", &owner, TTL).await.unwrap()
    else {
        panic!("the key should be free");
    };
    let lease = Lease::new("flushed", owner, fencing_token);
    server.script_flush().unwrap();
    assert_eq!(
        backend.extend(&lease, TTL).await.unwrap(),
        ExtendOutcome::Extended
    );
    server.script_flush().unwrap();
    let batch = vec![
        ExtendRequest {
            lease: lease.clone(),
            ttl: TTL
        };
        3
    ];
    assert_eq!(
        backend
            .extend_many(&batch)
            .await
            .into_iter()
            .collect::<Result<Vec<_>, _>>()
            .unwrap(),
        vec![ExtendOutcome::Extended; 3]
    );
    server.script_flush().unwrap();
    assert_eq!(
        backend.release(&lease).await.unwrap(),
        ReleaseOutcome::Released
    );
}

/// SPEC H5: a release after the key expired and was taken by another owner
/// leaves the new owner's key untouched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn late_release_leaves_the_new_owners_key_untouched() {
    let url = server_url().await;
    let ns = Namespace::new(&url);
    let backend = RedisBackend::from_url(&url).unwrap();
    let key = ns.key("late");
    let (old, new) = (OwnerToken::new("old"), OwnerToken::new("new"));
    let AcquireOutcome::Acquired { fencing_token } = backend
        .try_acquire(&key, &old, Duration::from_millis(150))
        .await
        .unwrap()
    else {
        panic!("the key should be free");
    };
    let stale = Lease::new(key.as_str(), old, fencing_token);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let AcquireOutcome::Acquired {
        fencing_token: newer,
    } = backend
        .try_acquire(&key, &new, Duration::from_secs(30))
        .await
        .unwrap()
    else {
        panic!("the expired key should be free");
    };
    assert!(newer > fencing_token);
    assert_eq!(
        backend.release(&stale).await.unwrap(),
        ReleaseOutcome::NotHeld
    );
    assert_eq!(
        backend
            .extend(&stale, Duration::from_secs(60))
            .await
            .unwrap(),
        ExtendOutcome::Taken
    );
    let mut conn = raw(&url).await;
    let value: String = conn.get(&key).await.unwrap();
    assert_eq!(value, new.as_str(), "the new owner's value is untouched");
    let pttl: i64 = conn.pttl(&key).await.unwrap();
    assert!(
        pttl > 0 && pttl <= 30_000,
        "the new owner's ttl is untouched: {pttl}"
    );
    backend
        .release(&Lease::new(key.as_str(), new, newer))
        .await
        .unwrap();
}

/// The pub/sub connection is killed (`CLIENT KILL TYPE pubsub`): the backend
/// resubscribes, and a waiter with a 30 s retry delay is still woken by a
/// release at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiter_is_woken_after_the_subscription_is_cut() {
    let server = RedisServer::start().unwrap();
    let backend = RedisBackend::from_url(&server.url()).unwrap();
    let a = node(backend.clone(), "a");
    let b = node(backend.clone(), "b");
    let mut held = a.handle("cut", Duration::from_secs(30)).unwrap();
    assert!(held.acquire().await.unwrap());
    let slow = LockConfig::default()
        .wait_forever()
        .retry_delay(Duration::from_secs(30));
    let waiter = tokio::spawn(async move {
        b.with_lock_config("cut", &slow, |_| async { Instant::now() })
            .await
    });
    let pubsub_ids = |server: &RedisServer| server.client_ids("pubsub").unwrap();
    let before = within(LIMIT, "first subscription", async {
        loop {
            let ids = pubsub_ids(&server);
            if !ids.is_empty() && backend.is_subscribed() {
                return ids;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    assert_eq!(before.len(), 1, "one subscription connection per backend");
    assert_eq!(server.kill_clients("pubsub").unwrap(), 1);
    let after = within(LIMIT, "resubscription", async {
        loop {
            let ids = pubsub_ids(&server);
            if !ids.is_empty() && ids != before {
                return ids;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    assert_eq!(after.len(), 1, "still one subscription connection");
    let released_at = Instant::now();
    assert!(held.release().await.unwrap());
    let ran_at = within(NOTIFIED, "woken waiter", waiter)
        .await
        .unwrap()
        .unwrap();
    let wake = ran_at - released_at;
    assert!(wake < NOTIFIED, "woken {wake:?} after the release");
}

/// SPEC F2 through an empty restart: the queue is lost with the lock.
/// Three nodes wait queued behind a holder; the server comes back empty;
/// the holder is told its lock was taken, and the waiters, their places
/// gone, queue again: one takes the free key, the others stand in the new
/// queue (seen in the store), and each gets the key in turn, never two at
/// once, with tokens above the holder's and increasing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f2_waiters_queue_again_after_an_empty_restart() {
    use std::sync::atomic::AtomicUsize;
    use std::sync::Mutex;

    let server = RedisServer::start().unwrap();
    let backend = RedisBackend::from_url(&server.url()).unwrap();
    let key = "fair restarted";
    let (queue_key, _) = backend.queue_keys(key);
    let holder = node(backend, "holder");
    let (call, running) = hold(&holder, key, Duration::from_secs(2));
    let holder_token = within(LIMIT, "holder's start", running).await.unwrap();

    let inside = Arc::new(AtomicUsize::new(0));
    let tokens = Arc::new(Mutex::new(Vec::new()));
    let mut waiters = Vec::new();
    for name in ["w1", "w2", "w3"] {
        let waiter = node(RedisBackend::from_url(&server.url()).unwrap(), name);
        let (inside, tokens) = (Arc::clone(&inside), Arc::clone(&tokens));
        waiters.push(tokio::spawn(async move {
            let config = LockConfig::default().wait_forever();
            waiter
                .with_lock_config(key, &config, move |ctx| async move {
                    let others = inside.fetch_add(1, Ordering::SeqCst);
                    // Out also when the callback is dropped (a loss).
                    let _out = Out(Arc::clone(&inside));
                    assert_eq!(others, 0, "{name}: two holders");
                    tokens.lock().unwrap().push(ctx.fencing_token());
                    tokio::time::sleep(Duration::from_millis(600)).await;
                })
                .await
        }));
    }
    within(
        LIMIT,
        "three places in the queue",
        places(&server.url(), &queue_key, 3),
    )
    .await;

    server.restart().unwrap();
    // One waiter holds the key afresh; the other two stand in a new queue
    // (the restarted server's: the old one is gone), seen from the restart
    // on: the holder may learn of its loss only after a waiter's turn.
    let queued_again = tokio::spawn({
        let url = server.url();
        async move { places(&url, &queue_key, 2).await }
    });
    let cause = loss_cause(within(LIMIT, "the holder's loss", call).await.unwrap());
    assert!(matches!(cause, LossCause::Taken), "cause {cause:?}");
    within(LIMIT, "the waiters queue again", queued_again)
        .await
        .unwrap();
    for waiter in waiters {
        within(LIMIT, "each waiter's turn", waiter)
            .await
            .unwrap()
            .unwrap();
    }
    let tokens = tokens.lock().unwrap().clone();
    assert_eq!(tokens.len(), 3);
    assert!(tokens[0] > holder_token, "{tokens:?} after {holder_token}");
    assert!(
        tokens.windows(2).all(|w| w[0] < w[1]),
        "tokens increase: {tokens:?}"
    );
}

/// Counts a callback out of the lock when dropped.
struct Out(Arc<std::sync::atomic::AtomicUsize>);

impl Drop for Out {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Returns once the queue `queue_key` on the server at `url` has at least
/// `want` places (polled: the store says nothing when a place is made).
async fn places(url: &str, queue_key: &str, want: usize) {
    let mut conn = raw(url).await;
    loop {
        let n: usize = conn.zcard(queue_key).await.unwrap_or(0);
        if n >= want {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

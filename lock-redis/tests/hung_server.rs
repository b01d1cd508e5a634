//! A hung server: the `redis-server` child is stopped with SIGSTOP, so its
//! connections stay open and nothing answers (as with a cut network). Each
//! test runs a child server of its own, with a short command timeout, and
//! resumes it on every exit path.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{loss_cause, node, redis_error_in, within};
use lock_conformance::{CountingBackend, Step};
use lock_core::{LockConfig, LockError, LossCause};
use lock_redis::{RedisBackend, RedisConfig};
use tokio::sync::oneshot;
use withlock_test_servers::redis::RedisServer;

/// The command timeout of every backend here.
const COMMAND_TIMEOUT: Duration = Duration::from_millis(300);
/// Slack for scheduling on a busy machine.
const SLACK: Duration = Duration::from_millis(700);
const LIMIT: Duration = Duration::from_secs(10);

/// Resumes the server when dropped, so that a failing test never leaves it
/// stopped (the server itself is killed when the `RedisServer` is dropped).
struct Paused<'s>(&'s RedisServer);

impl<'s> Paused<'s> {
    /// Stops `server` (SIGSTOP) until the guard is resumed or dropped.
    fn pause(server: &'s RedisServer) -> Self {
        server.pause().expect("SIGSTOP to the redis-server child");
        Self(server)
    }

    /// Resumes the server now.
    fn resume(self) {
        self.0.resume().expect("SIGCONT to the redis-server child");
    }
}

impl Drop for Paused<'_> {
    fn drop(&mut self) {
        let _ = self.0.resume();
    }
}

/// A backend on `server` with the short command timeout.
fn backend(server: &RedisServer, config: RedisConfig) -> RedisBackend {
    RedisBackend::from_url_with(&server.url(), config.step_timeout(COMMAND_TIMEOUT)).unwrap()
}

/// A config that keeps trying for about `total`, `delay` apart.
fn patient(total: Duration, delay: Duration) -> LockConfig {
    let attempts = u32::try_from(total.as_millis() / delay.as_millis()).unwrap();
    LockConfig::default()
        .retry_attempts(attempts)
        .retry_delay(delay)
}

/// Takes `key` with `locker` (retrying for up to `total`) and says how long
/// it took.
async fn acquires_within(locker: &lock_core::Locker, key: &str, total: Duration) -> Duration {
    let started = Instant::now();
    let result = within(
        total + SLACK,
        "acquisition after resume",
        locker.with_lock_config(key, &patient(total, Duration::from_millis(50)), |_| async {
        }),
    )
    .await;
    if let Err(error) = result {
        panic!("{key:?} not acquired after resume: {error:?}");
    }
    started.elapsed()
}

/// What a plain client sees at `key`: its value and `PTTL`.
fn key_state(server: &RedisServer, key: &str) -> (Option<String>, i64) {
    let client = redis::Client::open(server.url()).unwrap();
    let mut conn = client
        .get_connection_with_timeout(Duration::from_secs(1))
        .unwrap();
    conn.set_read_timeout(Some(Duration::from_secs(1))).unwrap();
    let value: Option<String> = redis::cmd("GET").arg(key).query(&mut conn).unwrap();
    let pttl: i64 = redis::cmd("PTTL").arg(key).query(&mut conn).unwrap();
    (value, pttl)
}

/// Checks what `key_state` shows at `key` once a hung server has resumed
/// after an acquisition of node `a` timed out: the key is free, or it holds
/// a late-landed attempt of `a` (its owner token) with an expiry no longer
/// than the default 30 s ttl. Anything else (another owner, no expiry) is
/// a bug of the orphan handling.
fn assert_free_or_late_attempt_of_a(key: &str, (value, pttl): (Option<String>, i64)) {
    eprintln!("after resume {key:?} holds {value:?} with pttl {pttl} ms");
    match value {
        None => assert_eq!(pttl, -2, "a free key has no ttl"),
        Some(owner) => {
            assert!(
                owner.starts_with("a/"),
                "only node a's attempt can hold {key:?}, found {owner:?}"
            );
            assert!(
                (1..=30_000).contains(&pttl),
                "a late attempt holds {key:?} for at most the 30 s ttl, pttl {pttl} ms"
            );
        }
    }
}

/// The ids of the server's pub/sub client connections.
fn pubsub_ids(server: &RedisServer) -> Vec<String> {
    server.client_ids("pubsub").unwrap()
}

/// Pauses `server` and makes one `with_lock_config` call on `key` with two
/// attempts 50 ms apart: checks that it gives up with `NotAcquired`, the
/// timeout as source, in bounded time, without running the callback. Gives
/// the server back paused.
async fn give_up_on_a_hung_server<'s>(
    server: &'s RedisServer,
    locker: &lock_core::Locker,
    key: &str,
) -> Paused<'s> {
    // A first call opens the shared connection and loads the scripts, so
    // the attempts below are really written to a live connection, as they
    // are when a server in use hangs.
    within(LIMIT, "warm-up", locker.with_lock(key, |_| async {}))
        .await
        .unwrap();

    let paused = Paused::pause(server);
    let ran = Arc::new(AtomicBool::new(false));
    let flag = Arc::clone(&ran);
    let cfg = LockConfig::default()
        .retry_attempts(1)
        .retry_delay(Duration::from_millis(50));
    let started = Instant::now();
    let result = within(
        LIMIT,
        "giving up on a hung server",
        locker.with_lock_config(key, &cfg, move |_| async move {
            flag.store(true, Ordering::SeqCst);
        }),
    )
    .await;
    let gave_up_after = started.elapsed();
    let source = match result {
        Err(LockError::NotAcquired {
            attempts,
            source: Some(source),
            ..
        }) => {
            assert_eq!(attempts, 2, "the first attempt and one retry");
            source
        }
        other => panic!("expected NotAcquired with a backend error, got {other:?}"),
    };
    eprintln!(
        "gave up after {gave_up_after:?}: {source} ({:?})",
        source.inner()
    );
    assert!(source.is_timeout(), "not a timeout: {source:?}");
    // Two attempts, each cut at the command timeout, and (after the first
    // failed) one try at the release subscription, cut there too.
    let bound = COMMAND_TIMEOUT * 3 + cfg.retry_delay + SLACK;
    assert!(
        gave_up_after <= bound,
        "gave up after {gave_up_after:?}, above {bound:?}"
    );
    assert!(
        gave_up_after >= COMMAND_TIMEOUT * 2,
        "gave up after {gave_up_after:?}, before two command timeouts"
    );
    assert!(!ran.load(Ordering::SeqCst), "the callback did not run");
    assert_eq!(locker.held(), 0);
    paused
}

/// SPEC O3 on a hung server: every attempt times out after the command
/// timeout, the call gives up with `NotAcquired` and the timeout as source,
/// in bounded time, and the callback never runs. After the server resumes,
/// the same locker works again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acquisition_against_a_hung_server_gives_up_in_bounded_time() {
    let server = RedisServer::start().unwrap();
    let a = node(backend(&server, RedisConfig::default()), "a");
    let key = "hung-acquire";
    give_up_on_a_hung_server(&server, &a, key).await.resume();
    // No wait for the requests queued while the server was stopped: the
    // check's fresh connection is accepted, then read, in the server's
    // event-loop turns after the one that reads the queued requests.
    assert_free_or_late_attempt_of_a(key, key_state(&server, key));
    let took = acquires_within(&a, "another-key", Duration::from_secs(3)).await;
    eprintln!("the same locker took another key {took:?} after the check");
    assert!(
        took <= Duration::from_secs(3) + SLACK,
        "the same locker works again after resume: took another key after {took:?}"
    );
}

/// SPEC O3 ("the callback did not run", nothing held) and the cancel-safety
/// promise of `try_acquire`: after a hung server resumes, no acquisition
/// attempt that timed out holds the key: the same locker, and then another,
/// take it well within the default 30 s ttl.
///
/// The first attempt's script was written to the connection before the
/// server stopped, so it runs when the server resumes and takes the key for
/// the full ttl. The driver answers every failed attempt with releases of
/// its owner token until that ttl has run out, which frees the key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timed_out_acquisition_leaves_nothing_held_after_resume() {
    let server = RedisServer::start().unwrap();
    let a = node(backend(&server, RedisConfig::default()), "a");
    let key = "hung-acquire-orphan";
    give_up_on_a_hung_server(&server, &a, key).await.resume();
    // No wait for the requests queued while the server was stopped: the
    // check's fresh connection is accepted, then read, in the server's
    // event-loop turns after the one that reads the queued requests.
    assert_free_or_late_attempt_of_a(key, key_state(&server, key));

    // Well below the 30 s ttl an attempt that landed late would have set.
    let took = acquires_within(&a, key, Duration::from_secs(3)).await;
    eprintln!("the same locker took the key {took:?} after the check");
    assert!(
        took <= Duration::from_secs(3) + SLACK,
        "no late attempt kept the key from its own locker: took it after {took:?}"
    );
    let b = node(backend(&server, RedisConfig::default()), "b");
    let took = acquires_within(&b, key, Duration::from_secs(3)).await;
    eprintln!("another locker took the key {took:?} later");
    assert!(
        took <= Duration::from_secs(3) + SLACK,
        "no late attempt kept the key from another locker: took it after {took:?}"
    );
    let (value, pttl) = key_state(&server, key);
    assert_eq!(
        (value.as_deref(), pttl),
        (None, -2),
        "b released the key and nothing of a's is left"
    );
}

/// SPEC L2 on a hung server: extensions time out until the lock's validity
/// runs out, then the call is lost with the backend error as cause, within
/// about the ttl, and the callback sees the loss. After the server resumes
/// the same locker works again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_server_while_holding_loses_the_lock_after_its_validity() {
    let server = RedisServer::start().unwrap();
    let steps = CountingBackend::new(backend(&server, RedisConfig::default()));
    let a = node(steps.clone(), "a");
    let key = "hung-held";
    let ttl = Duration::from_secs(1);
    let (started_tx, started) = oneshot::channel();
    let (seen_tx, seen) = oneshot::channel();
    let call = tokio::spawn({
        let a = a.clone();
        async move {
            a.with_lock_config(key, &LockConfig::default().ttl(ttl), |ctx| async move {
                let _ = started_tx.send(ctx.fencing_token());
                let cause = ctx.lost().await;
                let _ = seen_tx.send(cause);
            })
            .await
        }
    });
    let lost_token = within(LIMIT, "callback start", started).await.unwrap();
    // At least one extension goes through first.
    within(
        LIMIT,
        "the first extension",
        steps.until_answered(Step::Extend, 1),
    )
    .await;

    let paused = Paused::pause(&server);
    let paused_at = Instant::now();
    let cause = loss_cause(within(LIMIT, "loss", call).await.unwrap());
    let lost_after = paused_at.elapsed();
    let LossCause::Backend(error) = &cause else {
        panic!("expected a backend cause, got {cause:?}");
    };
    eprintln!(
        "lost {lost_after:?} after the pause: {error} (kind {:?}, {:?})",
        error.kind(),
        error.inner()
    );
    assert!(
        error.is_timeout() || redis_error_in(error).is_some(),
        "neither a timeout nor a Redis error: {error:?}"
    );
    let upper = Duration::from_secs(5).min(ttl + COMMAND_TIMEOUT + SLACK);
    assert!(
        lost_after <= upper,
        "lost {lost_after:?} after the pause, above {upper:?}"
    );
    assert!(
        lost_after >= ttl / 3,
        "lost {lost_after:?} after the pause: before the validity ran out"
    );
    let seen = within(Duration::from_secs(1), "the callback sees the loss", seen)
        .await
        .unwrap();
    assert!(
        matches!(seen, LossCause::Backend(_)),
        "the callback saw {seen:?}"
    );
    assert_eq!(a.held(), 0);

    paused.resume();
    let took = acquires_within(&a, key, Duration::from_secs(4)).await;
    eprintln!("the same locker took the key again {took:?} after resume");
    assert!(
        took <= Duration::from_secs(4) + SLACK,
        "the lost lock's key is free again: took it after {took:?}"
    );
    let token = within(
        LIMIT,
        "with_lock after resume",
        a.with_lock(key, |ctx| async move { ctx.fencing_token() }),
    )
    .await
    .unwrap();
    assert!(
        token > lost_token,
        "the token after resume ({token}) is above the lost lock's ({lost_token}) [H4]"
    );
}

/// The subscription connection hangs for longer than the health check
/// interval: the backend notices (a ping times out), resubscribes once the
/// server answers again, and a waiter with a 30 s retry delay is still woken
/// by a release at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_survives_a_hung_subscription() {
    let server = RedisServer::start().unwrap();
    let config = RedisConfig::default()
        .health_check_interval(Duration::from_millis(500))
        .max_reconnect_delay(Duration::from_millis(250));
    let backend = backend(&server, config);
    let a = node(backend.clone(), "a");
    let b = node(backend.clone(), "b");
    let key = "hung-subscription";
    let mut held = a.handle(key, Duration::from_secs(30)).unwrap();
    assert!(within(LIMIT, "holding", held.acquire()).await.unwrap());
    let slow = LockConfig::default()
        .wait_forever()
        .retry_delay(Duration::from_secs(30));
    let waiter = tokio::spawn(async move {
        b.with_lock_config(key, &slow, |_| async { Instant::now() })
            .await
    });
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

    let paused = Paused::pause(&server);
    let paused_at = Instant::now();
    // A ping every 500 ms, each given the 300 ms command timeout.
    within(
        Duration::from_secs(3),
        "the hung subscription noticed",
        async {
            while backend.is_subscribed() {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        },
    )
    .await;
    let noticed_after = paused_at.elapsed();
    eprintln!("subscription down {noticed_after:?} after the pause");
    // One health-check interval, one ping's command timeout, and slack.
    assert!(
        noticed_after <= Duration::from_millis(500 + 300) + SLACK,
        "the hung subscription was noticed {noticed_after:?} after the pause"
    );
    // Stay hung through two failed resubscriptions.
    let failed = backend.subscription_failures();
    within(LIMIT, "two failed resubscriptions", async {
        while backend.subscription_failures() < failed + 2 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    paused.resume();
    let resumed_at = Instant::now();
    let after = within(LIMIT, "resubscription", async {
        loop {
            let ids = pubsub_ids(&server);
            if backend.is_subscribed() && ids.len() == 1 && ids != before {
                return ids;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    eprintln!(
        "resubscribed {:?} after resume ({before:?} -> {after:?})",
        resumed_at.elapsed()
    );
    assert!(!waiter.is_finished(), "the key is still held");

    let released_at = Instant::now();
    assert!(within(LIMIT, "release", held.release()).await.unwrap());
    // Polling alone would take the waiter's 30 s retry delay: a third of
    // it is only a notification's, however slow the machine.
    let notified = Duration::from_secs(10);
    let ran_at = within(notified, "woken waiter", waiter)
        .await
        .unwrap()
        .unwrap();
    let wake = ran_at - released_at;
    eprintln!("waiter woken {wake:?} after the release");
    assert!(wake < notified, "woken {wake:?} after the release");
}

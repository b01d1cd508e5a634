//! Concurrent steps on one backend go out together: beyond a few on the
//! wire, the acquisitions (and releases) waiting are sent as one batch
//! script run, each keeping the one-key script's answer. Each test runs on
//! a Redis server of its own, whose command counts say how the steps went
//! out.

mod common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{key_type, node, raw, refused_for_its_counter, subscriber, within};
use futures_util::future::join_all;
use lock_conformance::{CountingBackend, Step};
use lock_core::{AcquireOutcome, Lease, LockBackend, LockConfig, OwnerToken, ReleaseOutcome};
use lock_redis::RedisBackend;
use redis::AsyncCommands;
use withlock_test_servers::redis::RedisServer;

const LIMIT: Duration = Duration::from_secs(20);
const TTL: Duration = Duration::from_secs(30);

/// How many times the server ran `EVALSHA` so far.
async fn script_runs(url: &str) -> u64 {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(&mut raw(url).await)
        .await
        .unwrap();
    info.lines()
        .find_map(|l| l.strip_prefix("cmdstat_evalsha:calls="))
        .and_then(|rest| rest.split(',').next())
        .map_or(0, |n| n.parse().unwrap())
}

fn acquired(outcome: &AcquireOutcome) -> u64 {
    match outcome {
        AcquireOutcome::Acquired { fencing_token } => *fencing_token,
        AcquireOutcome::Busy { .. } => panic!("busy"),
    }
}

/// Takes every key at once for `owner` (beyond the first two, they go out
/// in batches); gives their leases.
async fn take_all(backend: &RedisBackend, keys: &[String], owner: &OwnerToken) -> Vec<Lease> {
    let answers = within(
        LIMIT,
        "acquisitions",
        join_all(keys.iter().map(|key| backend.try_acquire(key, owner, TTL))),
    )
    .await;
    keys.iter()
        .zip(answers)
        .map(|(key, answer)| Lease::new(key.as_str(), owner.clone(), acquired(&answer.unwrap())))
        .collect()
}

/// Releases every lease at once; each must find its key still held.
async fn release_all(backend: &RedisBackend, leases: &[Lease]) {
    let released = within(
        LIMIT,
        "releases",
        join_all(leases.iter().map(|lease| backend.release(lease))),
    )
    .await;
    for answer in released {
        assert_eq!(answer.unwrap(), ReleaseOutcome::Released);
    }
}

/// 64 acquisitions polled at once: the first few go out alone, the rest in
/// batches; each gets its own token, the one with a corrupt companion alone
/// fails (taking nothing), and the server ran far fewer scripts than steps.
/// Then the 64 releases, one of them with a foreign owner token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_steps_go_out_in_batches_with_their_own_answers() {
    let server = RedisServer::start().unwrap();
    let url = server.url();
    let backend = RedisBackend::from_url(&url).unwrap();
    let mut conn = raw(&url).await;
    let keys: Vec<String> = (0..64).map(|i| format!("batch {i}")).collect();
    let corrupt = 40;
    let fence = backend.fence_key(&keys[corrupt]);
    let _: () = conn.set(&fence, "not a number").await.unwrap();
    let owners: Vec<OwnerToken> = (0..64).map(|_| OwnerToken::new("a")).collect();

    let before = script_runs(&url).await;
    let answers = within(
        LIMIT,
        "acquisitions",
        join_all(
            keys.iter()
                .zip(&owners)
                .map(|(key, owner)| backend.try_acquire(key, owner, TTL)),
        ),
    )
    .await;
    let runs = script_runs(&url).await - before;
    assert!(runs < 20, "64 acquisitions in {runs} script runs");

    let mut leases = Vec::new();
    for (i, answer) in answers.into_iter().enumerate() {
        if i == corrupt {
            let error = answer.expect_err("a corrupt companion fails its acquisition");
            assert!(refused_for_its_counter(&error), "{error:?}");
            let taken: bool = conn.exists(&keys[i]).await.unwrap();
            assert!(!taken, "the corrupt one's key is not taken");
            let stored: String = conn.get(&fence).await.unwrap();
            assert_eq!(stored, "not a number");
            continue;
        }
        let token = acquired(&answer.unwrap());
        let holder: String = conn.get(&keys[i]).await.unwrap();
        assert_eq!(holder, owners[i].as_str(), "key {i} holds its own owner");
        let counter: u64 = conn.get(backend.fence_key(&keys[i])).await.unwrap();
        assert_eq!(counter, token, "key {i}'s companion holds its token");
        leases.push(Lease::new(keys[i].as_str(), owners[i].clone(), token));
    }
    // One release with another owner token, and one of a key another
    // client keeps its lock in as a hash: not held, nothing freed.
    let foreign = Lease::new(keys[0].as_str(), OwnerToken::new("b"), 1);
    let _: () = conn
        .hset("batch hash", "8743c9c0-0795-4907-87fd-6c719a6b4586:1", 1)
        .await
        .unwrap();
    let hashed = Lease::new("batch hash", OwnerToken::new("a"), 1);

    let before = script_runs(&url).await;
    let released = within(
        LIMIT,
        "releases",
        join_all(
            leases
                .iter()
                .chain([&foreign, &hashed])
                .map(|lease| backend.release(lease)),
        ),
    )
    .await;
    let runs = script_runs(&url).await - before;
    assert!(runs < 20, "64 releases in {runs} script runs");
    let (own, others) = released.split_at(leases.len());
    // The foreign release may come before or after key 0's own.
    for answer in others {
        assert_eq!(*answer.as_ref().unwrap(), ReleaseOutcome::NotHeld);
    }
    let kind = key_type(&mut conn, "batch hash").await;
    assert_eq!(kind, "hash", "the foreign lock is untouched");
    for answer in own {
        assert_eq!(*answer.as_ref().unwrap(), ReleaseOutcome::Released);
    }
    assert_none_held(&mut conn, &keys, "released").await;
}

/// Many lockers on one backend, a few keys: batches under contention keep
/// exclusion, and each key's tokens strictly increase from holder to
/// holder.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batched_contention_keeps_exclusion_and_increasing_tokens() {
    let server = RedisServer::start().unwrap();
    let url = server.url();
    let backend = CountingBackend::new(RedisBackend::from_url(&url).unwrap());
    let holders: Arc<Mutex<HashMap<String, (bool, u64)>>> = Arc::default();
    let cfg = LockConfig::default()
        .retry_attempts(200)
        .retry_delay(Duration::from_millis(5));
    let before = script_runs(&url).await;
    let mut tasks = Vec::new();
    for t in 0..48 {
        let (locker, holders) = (
            node(backend.clone(), &format!("n{t}")),
            Arc::clone(&holders),
        );
        tasks.push(tokio::spawn(async move {
            for round in 0..20 {
                let key = format!("contended {}", (t + round) % 6);
                let (k, h) = (key.clone(), Arc::clone(&holders));
                locker
                    .with_lock_config(&key, &cfg, move |ctx| async move {
                        let token = ctx.fencing_token();
                        {
                            let mut holders = h.lock().unwrap();
                            let entry = holders.entry(k.clone()).or_insert((false, 0));
                            assert!(!entry.0, "{k} has two holders");
                            assert!(token > entry.1, "{k}: token {token} after {}", entry.1);
                            *entry = (true, token);
                        }
                        tokio::task::yield_now().await;
                        h.lock().unwrap().get_mut(&k).unwrap().0 = false;
                    })
                    .await
                    .unwrap();
            }
        }));
    }
    within(LIMIT * 3, "the contended rounds", join_all(tasks))
        .await
        .into_iter()
        .for_each(|t| t.unwrap());
    let runs = script_runs(&url).await - before;
    let steps = backend.calls(Step::TryAcquire) + backend.calls(Step::Release);
    assert!(
        runs < steps,
        "fewer script runs ({runs}) than steps ({steps}): some went out together"
    );
}

/// Steps dropped while they wait in the queue change nothing for the
/// others, and leave nothing counted: the next steps go out at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_waiting_steps_leave_the_backend_working() {
    let server = RedisServer::start().unwrap();
    let url = server.url();
    let backend = RedisBackend::from_url(&url).unwrap();
    let ttl = Duration::from_millis(1500);
    let owner = OwnerToken::new("a");
    let keys: Vec<String> = (0..32).map(|i| format!("dropped {i}")).collect();
    // Polled once, then dropped: the first ones are on the wire, the
    // others in the queue or in a batch.
    let all = join_all(keys.iter().map(|key| backend.try_acquire(key, &owner, ttl)));
    let _ = tokio::time::timeout(Duration::from_micros(1), all).await;

    // The backend still answers, alone and in batches.
    let others: Vec<String> = (0..32).map(|i| format!("after {i}")).collect();
    let answers = within(
        LIMIT,
        "acquisitions after the drop",
        join_all(
            others
                .iter()
                .map(|key| backend.try_acquire(key, &owner, ttl)),
        ),
    )
    .await;
    for answer in answers {
        acquired(&answer.unwrap());
    }
    // Whatever the dropped steps took expires with its ttl.
    tokio::time::sleep(ttl + Duration::from_millis(300)).await;
    let mut conn = raw(&url).await;
    assert_none_held(&mut conn, &keys, "expired").await;
}

/// Batched releases announce each freed key on the release channel when
/// something listens there (here a plain subscriber, as another node's
/// backend is), one message per key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batched_releases_announce_every_key_to_a_listener() {
    use futures_util::StreamExt;

    let server = RedisServer::start().unwrap();
    let url = server.url();
    let backend = RedisBackend::from_url(&url).unwrap();
    let mut listener = subscriber(&url, backend.channel()).await;
    let owner = OwnerToken::new("a");
    let keys: Vec<String> = (0..24).map(|i| format!("announced {i}")).collect();
    let leases = take_all(&backend, &keys, &owner).await;
    let before = script_runs(&url).await;
    release_all(&backend, &leases).await;
    assert!(
        script_runs(&url).await - before < 12,
        "the releases went out in batches"
    );
    let mut messages = listener.on_message();
    let mut announced = Vec::new();
    while announced.len() < keys.len() {
        let message = within(LIMIT, "a release message", messages.next())
            .await
            .unwrap();
        announced.push(message.get_payload::<String>().unwrap());
    }
    announced.sort();
    let mut expected = keys.clone();
    expected.sort();
    assert_eq!(announced, expected);
}

/// With batching off (as behind a proxy that routes by slot), every step is
/// one script run of its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_batching_off_every_step_goes_out_alone() {
    let server = RedisServer::start().unwrap();
    let url = server.url();
    let config = lock_redis::RedisConfig::default().batch_steps(false);
    let backend = RedisBackend::from_url_with(&url, config).unwrap();
    let owner = OwnerToken::new("a");
    // Both scripts loaded first: a call that meets NOSCRIPT counts twice.
    let warm = acquired(&backend.try_acquire("warm", &owner, TTL).await.unwrap());
    backend
        .release(&Lease::new("warm", owner.clone(), warm))
        .await
        .unwrap();
    let keys: Vec<String> = (0..32).map(|i| format!("alone {i}")).collect();
    let before = script_runs(&url).await;
    let leases = take_all(&backend, &keys, &owner).await;
    release_all(&backend, &leases).await;
    assert_eq!(
        script_runs(&url).await - before,
        64,
        "one script run per step"
    );
}

/// The batch script's step is the one-key script's: a counter ahead of the
/// clock counts on by one, up to 2^53 - 1; a corrupt or exhausted counter
/// fails its own step only; a missing one gives the server clock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batched_acquisitions_draw_tokens_as_the_one_key_script() {
    let server = RedisServer::start().unwrap();
    let url = server.url();
    let backend = RedisBackend::from_url(&url).unwrap();
    let mut conn = raw(&url).await;
    let (secs, micros): (u64, u64) = redis::cmd("TIME").query_async(&mut conn).await.unwrap();
    let clock = secs * 1_000_000 + micros;
    let ahead = clock + 86_400 * 1_000_000;
    // Fillers first, so that the cases below wait in the queue and go out
    // in a batch.
    let mut cases: Vec<(String, Option<String>)> =
        (0..4).map(|i| (format!("filler {i}"), None)).collect();
    cases.push(("ahead".into(), Some(ahead.to_string())));
    cases.push(("last".into(), Some("9007199254740990".into())));
    cases.push(("exhausted".into(), Some("9007199254740991".into())));
    cases.push(("leading zero".into(), Some("007".into())));
    cases.push(("missing".into(), None));
    for i in 0..8 {
        cases.push((format!("more {i}"), None));
    }
    for (key, stored) in &cases {
        if let Some(stored) = stored {
            let _: () = conn.set(backend.fence_key(key), stored).await.unwrap();
        }
    }
    let owner = OwnerToken::new("a");
    let before = script_runs(&url).await;
    // Scripts wait for a second on the server, so that the first steps are
    // still on the wire when the others are made: those wait in the queue
    // and go out in batches. (On a loaded machine the connection's driver
    // can run a step's round trip before the step is polled again, and
    // every step then goes out alone, answered in its first poll.)
    let _: () = redis::cmd("CLIENT")
        .arg("PAUSE")
        .arg(1000)
        .arg("WRITE")
        .query_async(&mut conn)
        .await
        .unwrap();
    let answers = within(
        LIMIT,
        "acquisitions",
        join_all(
            cases
                .iter()
                .map(|(key, _)| backend.try_acquire(key, &owner, TTL)),
        ),
    )
    .await;
    let runs = script_runs(&url).await - before;
    assert!(
        runs < cases.len() as u64,
        "some went out together: {runs} script runs for {} steps",
        cases.len()
    );
    for ((key, _), answer) in cases.iter().zip(answers) {
        match key.as_str() {
            "ahead" => assert_eq!(acquired(&answer.unwrap()), ahead + 1),
            "last" => assert_eq!(acquired(&answer.unwrap()), 9_007_199_254_740_991),
            "exhausted" | "leading zero" => {
                let error = answer.expect_err("no token from a corrupt counter");
                assert!(refused_for_its_counter(&error), "{key}: {error:?}");
                let taken: bool = conn.exists(key).await.unwrap();
                assert!(!taken, "{key}: the lock key was not taken");
            }
            _ => {
                let token = acquired(&answer.unwrap());
                assert!(
                    token >= clock,
                    "{key}: token {token} below the clock {clock}"
                );
                let stored: u64 = conn.get(backend.fence_key(key)).await.unwrap();
                assert_eq!(stored, token, "{key}: the companion holds the token");
            }
        }
    }
}

/// Asserts that no key of `keys` exists on the server.
async fn assert_none_held(
    conn: &mut redis::aio::MultiplexedConnection,
    keys: &[String],
    why: &str,
) {
    for key in keys {
        let held: bool = conn.exists(key).await.unwrap();
        assert!(!held, "{key} is still there, though {why}");
    }
}

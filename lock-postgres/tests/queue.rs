//! The fair queue on PostgreSQL \[F1–F3, F6\] and the busy answer's time
//! left \[A9\]: the queue's steps by hand against the waiters table (a
//! place, its heartbeat, a grant at release with a greater fencing token
//! announced to a release watch, the grant taken up, a leave that hands
//! an untaken grant on, a dead place skipped, a lapsed grant), the Ruby
//! gem refused a granted row, waiters of several nodes served in their
//! arrival order, and the fallback to unqueued waiting when the waiters
//! table or the rights on it are missing.
//!
//! Each case works in a schema of its own on `DATABASE_URL` (default
//! `postgres://postgres@127.0.0.1:5432/test`), dropped afterwards, and a
//! role it made, dropped afterwards.

mod common;

use common::{admin, Role, Ruby};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use lock_core::{
    AcquireOutcome, BackendErrorKind, Grant, Lease, LockBackend, LockConfig, Locker, LockerOptions,
    OwnerToken, QueueTerms, ReleaseOutcome, ReleaseWatch,
};
use lock_postgres::testing::TestBackend;
use lock_postgres::{quote_identifier, PostgresBackend, PostgresConfig};
use sqlx::Row;
use tokio::time::Instant;
use withlock_test_servers::postgres::database_url;

/// The bound on anything that takes milliseconds when the machine is idle.
const SOON: Duration = Duration::from_secs(10);
const TTL: Duration = Duration::from_secs(30);
const TERMS: QueueTerms = QueueTerms::DEFAULT;
/// The owner id Ruby's Locker gem writes (`host:<host> pid:<pid> guid:<uuid>`).
const GEM: &str = "host:ruby pid:1 guid:0123456789abcdef0123456789abcdef";

fn key(name: &str) -> String {
    format!("{name}:{:016x}", rand::random::<u64>())
}

async fn acquired(backend: &impl LockBackend, key: &str, owner: &OwnerToken) -> u64 {
    match backend.try_acquire(key, owner, TTL).await.unwrap() {
        AcquireOutcome::Acquired { fencing_token } => fencing_token,
        busy => panic!("{key} should be free: {busy:?}"),
    }
}

async fn queued(
    backend: &impl LockBackend,
    key: &str,
    owner: &OwnerToken,
    terms: QueueTerms,
) -> AcquireOutcome {
    backend
        .try_acquire_queued(key, owner, TTL, terms)
        .await
        .unwrap()
}

/// The places of `key`'s queue, in ticket order: (owner, ticket).
async fn places(backend: &TestBackend, key: &str) -> Vec<(String, i64)> {
    let waiters = backend.config().qualified_waiters_table().unwrap();
    sqlx::query_as(&format!(
        "SELECT owner, ticket FROM {waiters} WHERE key = $1 ORDER BY ticket"
    ))
    .bind(key)
    .fetch_all(backend.pool())
    .await
    .unwrap()
}

/// The quoted, qualified name of the queue's runs table \[F5\].
fn streaks_table(backend: &TestBackend) -> String {
    let config = backend.config();
    format!(
        "{}.{}",
        quote_identifier(&config.schema),
        quote_identifier(&config.streaks_table())
    )
}

/// The record of `key`'s run of grants \[F5\]: (its start in ms before
/// now, the fencing token of its last grant, the gap's end in ms from
/// now); `None` when there is none.
async fn run_of(
    backend: &TestBackend,
    key: &str,
) -> Option<(Option<f64>, Option<i64>, Option<f64>)> {
    let streaks = streaks_table(backend);
    sqlx::query_as(&format!(
        "SELECT (extract(epoch FROM (clock_timestamp() AT TIME ZONE 'UTC' - began)) * 1000)::float8, \
         last_token, \
         (extract(epoch FROM (gap_until - clock_timestamp() AT TIME ZONE 'UTC')) * 1000)::float8 \
         FROM {streaks} WHERE key = $1"
    ))
    .bind(key)
    .fetch_optional(backend.pool())
    .await
    .unwrap()
}

/// Moves the start of `key`'s run of grants back by `by`, as if its
/// grants in a row had lasted that much longer.
async fn backdate_run(backend: &TestBackend, key: &str, by: Duration) {
    let moved = sqlx::query(&format!(
        "UPDATE {} SET began = began - $2 * interval '1 microsecond' \
         WHERE key = $1 AND began IS NOT NULL",
        streaks_table(backend)
    ))
    .bind(key)
    .bind(i64::try_from(by.as_micros()).unwrap())
    .execute(backend.pool())
    .await
    .unwrap();
    assert_eq!(moved.rows_affected(), 1, "a run of grants is recorded");
}

/// The lock row of `key`: (locked_by, sequence, locked_until - now in ms).
async fn row(backend: &TestBackend, key: &str) -> (Option<String>, i64, f64) {
    let table = backend.qualified_table();
    let row = sqlx::query(&format!(
        "SELECT locked_by, sequence, \
         (extract(epoch FROM (locked_until - clock_timestamp() AT TIME ZONE 'UTC')) * 1000)::float8 \
         FROM {table} WHERE key = $1"
    ))
    .bind(key)
    .fetch_one(backend.pool())
    .await
    .unwrap();
    let left: Option<f64> = row.get(2);
    (row.get(0), row.get(1), left.unwrap_or(f64::NAN))
}

/// The next wake-up of `watch`, and the grant it carried.
async fn woken(watch: &mut ReleaseWatch) -> Option<Grant> {
    tokio::time::timeout(SOON, watch.released())
        .await
        .expect("the watch wakes within the bound");
    watch.grant()
}

fn expires_in(outcome: AcquireOutcome) -> Option<Duration> {
    match outcome {
        AcquireOutcome::Busy { expires_in, .. } => expires_in,
        acquired => panic!("expected busy, got {acquired:?}"),
    }
}

/// \[A9\] A busy answer says how long the holder has left, by the
/// database clock; a free key is taken as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a9_a_busy_answer_says_the_holders_time_left() {
    let backend = TestBackend::new(&database_url()).await.unwrap();
    let k = key("a9");
    let holder = OwnerToken::new("holder");
    let token = acquired(&backend, &k, &holder).await;
    let left = expires_in(
        backend
            .try_acquire(&k, &OwnerToken::new("other"), TTL)
            .await
            .unwrap(),
    )
    .expect("the holder's time left");
    assert!(left <= TTL && left > TTL - SOON, "{left:?}");
    // Released (the row kept, free): taken, with a greater token.
    let lease = Lease::new(k.as_str(), holder, token);
    assert_eq!(
        backend.release(&lease).await.unwrap(),
        ReleaseOutcome::Released
    );
    let short = OwnerToken::new("short");
    let AcquireOutcome::Acquired { fencing_token } = backend
        .try_acquire(&k, &short, Duration::from_millis(1500))
        .await
        .unwrap()
    else {
        panic!("a released key is free");
    };
    assert!(fencing_token > token);
    let left = expires_in(
        backend
            .try_acquire(&k, &OwnerToken::new("other"), TTL)
            .await
            .unwrap(),
    )
    .unwrap();
    assert!(left <= Duration::from_millis(1500), "{left:?}");
    // An expired holder's row is free again.
    tokio::time::sleep(left + Duration::from_millis(50)).await;
    let later = acquired(&backend, &k, &OwnerToken::new("later")).await;
    assert!(later > fencing_token);
}

/// \[F1, F2, A9\] The queue's steps by hand: places in arrival order, a
/// heartbeat that keeps the ticket, the holder's time left to the head
/// only, a grant at release (a greater fencing token, the head's place
/// removed, announced to a release watch with the grant), the grant taken
/// up by the grantee's queued attempt, and the next grant to the next.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f1_a_release_grants_the_key_to_the_head_and_says_so() {
    let backend = TestBackend::new(&database_url()).await.unwrap();
    let k = key("f1 grant\nwith: a newline");
    let holder = OwnerToken::new("holder");
    let first = acquired(&backend, &k, &holder).await;
    let (a, b) = (OwnerToken::new("node-a"), OwnerToken::new("node-b"));

    let answer = queued(&backend, &k, &a, TERMS).await;
    assert!(
        matches!(answer, AcquireOutcome::Busy { last_token: Some(t), .. } if t == first),
        "a queued answer says the last token drawn: {answer:?}"
    );
    let head = expires_in(answer).expect("the head is told");
    assert!(head <= TTL && head > TTL - SOON, "{head:?}");
    assert_eq!(
        expires_in(queued(&backend, &k, &b, TERMS).await),
        None,
        "only the head is told the holder's time left"
    );
    let before = places(&backend, &k).await;
    assert_eq!(
        before.iter().map(|(o, _)| o.as_str()).collect::<Vec<_>>(),
        [a.as_str(), b.as_str()]
    );
    // A heartbeat keeps the place and its ticket.
    assert!(expires_in(queued(&backend, &k, &a, TERMS).await).is_some());
    assert!(expires_in(queued(&backend, &k, &b, TERMS).await).is_none());
    assert_eq!(places(&backend, &k).await, before);
    // A plain attempt of another node does not queue, and is busy.
    assert!(backend
        .try_acquire(&k, &OwnerToken::new("plain"), TTL)
        .await
        .unwrap()
        .is_busy());
    assert_eq!(places(&backend, &k).await.len(), 2);

    // The release grants the key to `a`, for a's claim deadline, with a
    // greater token, and the watch hears of the grant.
    let mut watch = backend.watch_release(&k).await.unwrap();
    let lease = Lease::new(k.as_str(), holder.clone(), first);
    assert_eq!(
        backend.release(&lease).await.unwrap(),
        ReleaseOutcome::Released
    );
    let grant = woken(&mut watch).await.expect("a grant");
    assert_eq!(&*grant.owner, a.as_str());
    assert!(grant.fencing_token > first, "{grant:?}");
    assert_eq!(grant.claim, TERMS.claim);
    let (by, sequence, left) = row(&backend, &k).await;
    assert_eq!(by.as_deref(), Some(a.as_str()));
    assert_eq!(u64::try_from(sequence).unwrap(), grant.fencing_token);
    assert!(
        left <= 2_000.0 && left > 1_000.0,
        "the claim deadline: {left} ms"
    );
    assert_eq!(
        places(&backend, &k)
            .await
            .iter()
            .map(|(o, _)| o.as_str())
            .collect::<Vec<_>>(),
        [b.as_str()]
    );
    // The released lease no longer holds it; nobody barges in.
    assert_eq!(
        backend.release(&lease).await.unwrap(),
        ReleaseOutcome::NotHeld
    );
    assert!(backend
        .try_acquire(&k, &holder, TTL)
        .await
        .unwrap()
        .is_busy());
    // `b` is now the head: it is told the grant's time left, and the
    // grant's token as the last one drawn.
    let answer = queued(&backend, &k, &b, TERMS).await;
    assert!(
        matches!(answer, AcquireOutcome::Busy { last_token: Some(t), .. } if t == grant.fencing_token),
        "{answer:?}"
    );
    let claim_left = expires_in(answer).unwrap();
    assert!(claim_left <= TERMS.claim, "{claim_left:?}");

    // `a` takes the grant up with its queued attempt: the grant's token,
    // its own ttl.
    assert_eq!(
        queued(&backend, &k, &a, TERMS).await,
        AcquireOutcome::Acquired {
            fencing_token: grant.fencing_token
        }
    );
    let (_, _, left) = row(&backend, &k).await;
    assert!(left > 20_000.0, "the ttl from the take-up: {left} ms");
    // Its lease releases it to `b`, again with a greater token.
    let lease = Lease::new(k.as_str(), a.clone(), grant.fencing_token);
    assert_eq!(
        backend.release(&lease).await.unwrap(),
        ReleaseOutcome::Released
    );
    let next = woken(&mut watch).await.expect("a grant");
    assert_eq!(&*next.owner, b.as_str());
    assert!(next.fencing_token > grant.fencing_token);
    assert!(places(&backend, &k).await.is_empty());
    // `b` starts on the grant (as the driver does, without a round trip):
    // its extension takes it up.
    let lease = Lease::new(k.as_str(), b.clone(), next.fencing_token);
    assert_eq!(
        backend.extend(&lease, TTL).await.unwrap(),
        lock_core::ExtendOutcome::Extended
    );
    // With nobody queued, the release frees the key and announces it.
    assert_eq!(
        backend.release(&lease).await.unwrap(),
        ReleaseOutcome::Released
    );
    assert_eq!(woken(&mut watch).await, None, "a plain release");
    assert_eq!(row(&backend, &k).await.0, None);
    let last = acquired(&backend, &k, &OwnerToken::new("last")).await;
    assert!(last > next.fencing_token);
}

/// \[F1\] The free row goes to the queue's head only; a waiter with a live
/// place ahead of it stays busy. A queued attempt on a free key with no
/// queue takes it at once, leaving nothing behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f1_a_free_key_goes_to_the_head_of_its_queue() {
    let backend = TestBackend::new(&database_url()).await.unwrap();
    let k = key("f1-free");
    let alone = OwnerToken::new("alone");
    let AcquireOutcome::Acquired { fencing_token } = queued(&backend, &k, &alone, TERMS).await
    else {
        panic!("a new key is free");
    };
    assert!(places(&backend, &k).await.is_empty());
    // A row freed without a grant (Ruby's Locker's release) while two
    // waiters are queued: the second is refused, the head takes it.
    let (a, b) = (OwnerToken::new("a"), OwnerToken::new("b"));
    assert!(queued(&backend, &k, &a, TERMS).await.is_busy());
    assert!(queued(&backend, &k, &b, TERMS).await.is_busy());
    let table = backend.qualified_table();
    sqlx::query(&format!(
        "UPDATE {table} SET locked_by = NULL WHERE key = $1"
    ))
    .bind(&k)
    .execute(backend.pool())
    .await
    .unwrap();
    assert_eq!(expires_in(queued(&backend, &k, &b, TERMS).await), None);
    let AcquireOutcome::Acquired {
        fencing_token: next,
    } = queued(&backend, &k, &a, TERMS).await
    else {
        panic!("the head takes the free key");
    };
    assert!(next > fencing_token);
    assert_eq!(places(&backend, &k).await.len(), 1);
}

/// \[F2\] A place whose waiter stopped renewing it is skipped by the
/// release and removed; the waiter, back, joins at the tail.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f2_a_dead_place_is_skipped_and_its_waiter_rejoins_at_the_tail() {
    let backend = TestBackend::new(&database_url()).await.unwrap();
    let k = key("f2");
    let holder = OwnerToken::new("holder");
    let first = acquired(&backend, &k, &holder).await;
    let brief = QueueTerms::new(QueueTerms::MIN_TICKET_TTL, TERMS.claim);
    let (stalled, live) = (OwnerToken::new("stalled"), OwnerToken::new("live"));
    assert!(queued(&backend, &k, &stalled, brief).await.is_busy());
    assert!(queued(&backend, &k, &live, TERMS).await.is_busy());
    tokio::time::sleep(QueueTerms::MIN_TICKET_TTL + Duration::from_millis(100)).await;

    let mut watch = backend.watch_release(&k).await.unwrap();
    let lease = Lease::new(k.as_str(), holder, first);
    assert_eq!(
        backend.release(&lease).await.unwrap(),
        ReleaseOutcome::Released
    );
    let grant = woken(&mut watch).await.expect("a grant");
    assert_eq!(&*grant.owner, live.as_str(), "the dead place is skipped");
    // The stalled waiter returns: its dead place is gone, and it gets a
    // new one behind everyone, with a greater ticket.
    let other = OwnerToken::new("other");
    assert!(queued(&backend, &k, &other, TERMS).await.is_busy());
    assert!(queued(&backend, &k, &stalled, TERMS).await.is_busy());
    let now = places(&backend, &k).await;
    assert_eq!(
        now.iter().map(|(o, _)| o.as_str()).collect::<Vec<_>>(),
        [other.as_str(), stalled.as_str()]
    );
}

/// \[F3\] A grant not taken up within its claim deadline lapses: the next
/// waiter, now the head, is told when it ends and takes the key then,
/// with a greater token; the grantee's late attempt joins at the tail.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f3_an_untaken_grant_lapses_and_the_next_waiter_takes_the_key() {
    let backend = TestBackend::new(&database_url()).await.unwrap();
    let k = key("f3");
    let holder = OwnerToken::new("holder");
    let first = acquired(&backend, &k, &holder).await;
    let quick = QueueTerms::new(TERMS.ticket_ttl, Duration::from_millis(300));
    let (dead, next) = (OwnerToken::new("dead"), OwnerToken::new("next"));
    assert!(queued(&backend, &k, &dead, quick).await.is_busy());
    assert!(queued(&backend, &k, &next, TERMS).await.is_busy());
    let lease = Lease::new(k.as_str(), holder, first);
    assert_eq!(
        backend.release(&lease).await.unwrap(),
        ReleaseOutcome::Released
    );
    let (by, granted, _) = row(&backend, &k).await;
    assert_eq!(by.as_deref(), Some(dead.as_str()));
    let left = expires_in(queued(&backend, &k, &next, TERMS).await).expect("the head is told");
    assert!(left <= Duration::from_millis(300), "{left:?}");
    tokio::time::sleep(left + Duration::from_millis(20)).await;
    let AcquireOutcome::Acquired { fencing_token } = queued(&backend, &k, &next, TERMS).await
    else {
        panic!("the lapsed grant's key is the head's");
    };
    assert!(fencing_token > u64::try_from(granted).unwrap());
    // The grantee, late: busy, and at the tail.
    assert!(queued(&backend, &k, &dead, quick).await.is_busy());
    assert_eq!(places(&backend, &k).await.len(), 1);
}

/// \[F2\] A waiter that leaves with a grant it did not take up hands it
/// on to the next place, announced as a grant; with nobody left, the key
/// is freed and announced.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f2_a_leave_hands_an_untaken_grant_on() {
    let backend = TestBackend::new(&database_url()).await.unwrap();
    let k = key("f2-leave");
    let holder = OwnerToken::new("holder");
    let first = acquired(&backend, &k, &holder).await;
    let (a, b) = (OwnerToken::new("a"), OwnerToken::new("b"));
    assert!(queued(&backend, &k, &a, TERMS).await.is_busy());
    assert!(queued(&backend, &k, &b, TERMS).await.is_busy());
    // A leave of a waiter without a grant only removes its place.
    let c = OwnerToken::new("c");
    assert!(queued(&backend, &k, &c, TERMS).await.is_busy());
    backend.leave_queue(&k, &c).await.unwrap();
    backend.leave_queue(&k, &c).await.unwrap();
    assert_eq!(places(&backend, &k).await.len(), 2);

    let mut watch = backend.watch_release(&k).await.unwrap();
    let lease = Lease::new(k.as_str(), holder, first);
    backend.release(&lease).await.unwrap();
    let to_a = woken(&mut watch).await.expect("a grant");
    assert_eq!(&*to_a.owner, a.as_str());
    backend.leave_queue(&k, &a).await.unwrap();
    let to_b = woken(&mut watch).await.expect("handed on as a grant");
    assert_eq!(&*to_b.owner, b.as_str());
    assert!(to_b.fencing_token > to_a.fencing_token);
    assert_eq!(row(&backend, &k).await.0.as_deref(), Some(b.as_str()));
    // `b` leaves too: nobody is left, the key is freed and announced.
    backend.leave_queue(&k, &b).await.unwrap();
    assert_eq!(woken(&mut watch).await, None);
    assert_eq!(row(&backend, &k).await.0, None);
    assert!(places(&backend, &k).await.is_empty());
}

/// \[F5\] Ruby's Locker gem polls outside the queue: its `get` (the
/// gem's own statement) is refused a granted row, as any held row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f5_the_gem_cannot_take_a_granted_row() {
    let backend = TestBackend::new(&database_url()).await.unwrap();
    let k = key("f5");
    let holder = OwnerToken::new("holder");
    let first = acquired(&backend, &k, &holder).await;
    let waiter = OwnerToken::new("waiter");
    assert!(queued(&backend, &k, &waiter, TERMS).await.is_busy());
    let lease = Lease::new(k.as_str(), holder, first);
    backend.release(&lease).await.unwrap();
    assert_eq!(row(&backend, &k).await.0.as_deref(), Some(waiter.as_str()));
    let ruby = Ruby::new(backend.qualified_table()).await;
    assert!(
        !ruby.run(&ruby.get, &k, GEM).await,
        "the gem is refused the granted row"
    );
    assert_eq!(row(&backend, &k).await.0.as_deref(), Some(waiter.as_str()));
}

/// \[F5\] By hand: a release that would go on with a run of grants begun
/// 10 s before grants nothing: the row is freed, with no new token and
/// no announcement; the queue's head keeps its place and is told the
/// gap's time left, a waiter behind it nothing; a client outside the
/// queue takes the key in the gap, and its release grants the key to the
/// head, beginning a new run. Left alone, a gap ends and the head takes
/// the key then, ending the run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f5_a_release_after_10_s_of_grants_leaves_the_key_free_for_a_gap() {
    let backend = TestBackend::new(&database_url()).await.unwrap();
    let k = key("f5-gap");
    let holder = OwnerToken::new("holder");
    let first = acquired(&backend, &k, &holder).await;
    let (a, b) = (OwnerToken::new("node-a"), OwnerToken::new("node-b"));
    assert!(queued(&backend, &k, &a, TERMS).await.is_busy());
    assert!(queued(&backend, &k, &b, TERMS).await.is_busy());
    let mut watch = backend.watch_release(&k).await.unwrap();
    // The first grant begins a run.
    backend
        .release(&Lease::new(k.as_str(), holder, first))
        .await
        .unwrap();
    let to_a = woken(&mut watch).await.expect("a grant");
    assert_eq!(&*to_a.owner, a.as_str());
    let (began, last, gap) = run_of(&backend, &k).await.expect("the run is recorded");
    assert!(began.is_some_and(|ms| ms < SOON.as_secs_f64() * 1000.0));
    assert_eq!(last, Some(i64::try_from(to_a.fencing_token).unwrap()));
    assert_eq!(gap, None);
    assert_eq!(
        queued(&backend, &k, &a, TERMS).await,
        AcquireOutcome::Acquired {
            fencing_token: to_a.fencing_token
        }
    );

    // 10 s of grants in a row: a's release leaves the key free.
    backdate_run(&backend, &k, Duration::from_secs(10)).await;
    assert_eq!(
        backend
            .release(&Lease::new(k.as_str(), a.clone(), to_a.fencing_token))
            .await
            .unwrap(),
        ReleaseOutcome::Released
    );
    let (by, sequence, _) = row(&backend, &k).await;
    assert_eq!(by, None, "the key is left free");
    assert_eq!(u64::try_from(sequence).unwrap(), to_a.fencing_token);
    let (began, last, gap) = run_of(&backend, &k).await.unwrap();
    assert_eq!((began, last), (None, None), "the run ended");
    assert!(gap.is_some_and(|ms| ms <= 600.0), "{gap:?}");
    // The head keeps its place and waits the gap out; the waiter behind
    // it is told nothing.
    let gap = expires_in(queued(&backend, &k, &b, TERMS).await).expect("the gap's time left");
    assert!(gap <= Duration::from_millis(600), "{gap:?}");
    let c = OwnerToken::new("node-c");
    assert_eq!(expires_in(queued(&backend, &k, &c, TERMS).await), None);
    assert_eq!(row(&backend, &k).await.0, None, "nobody queued took it");
    assert_eq!(
        places(&backend, &k)
            .await
            .iter()
            .map(|(o, _)| o.as_str())
            .collect::<Vec<_>>(),
        [b.as_str(), c.as_str()]
    );
    // A client outside the queue takes it, with a greater token; its
    // release grants the key to the head: the first announcement since
    // the grant to `a` (the gap announced nothing).
    let outside = OwnerToken::new("outside");
    let taken = acquired(&backend, &k, &outside).await;
    assert!(taken > to_a.fencing_token);
    backend
        .release(&Lease::new(k.as_str(), outside, taken))
        .await
        .unwrap();
    let to_b = woken(&mut watch)
        .await
        .expect("a grant, and nothing before it");
    assert_eq!(&*to_b.owner, b.as_str());
    assert!(to_b.fencing_token > taken);
    let (began, last, gap) = run_of(&backend, &k).await.unwrap();
    assert!(
        began.is_some_and(|ms| ms < SOON.as_secs_f64() * 1000.0),
        "a new run"
    );
    assert_eq!(last, Some(i64::try_from(to_b.fencing_token).unwrap()));
    assert_eq!(gap, None);

    // Another gap, which nobody outside takes: the head (`c`) is told
    // its time left, tries again then, as the driver does [A9], and
    // takes the key, with a greater token; the run's record goes.
    assert_eq!(
        queued(&backend, &k, &b, TERMS).await,
        AcquireOutcome::Acquired {
            fencing_token: to_b.fencing_token
        }
    );
    backdate_run(&backend, &k, Duration::from_secs(10)).await;
    backend
        .release(&Lease::new(k.as_str(), b, to_b.fencing_token))
        .await
        .unwrap();
    let deadline = Instant::now() + SOON;
    let mut told = Vec::new();
    let token = loop {
        match queued(&backend, &k, &c, TERMS).await {
            AcquireOutcome::Acquired { fencing_token } => break fencing_token,
            AcquireOutcome::Busy { expires_in, .. } => {
                let left = expires_in.expect("the head is told the gap's time left");
                told.push(left);
                assert!(Instant::now() < deadline, "the gap never ended: {told:?}");
                tokio::time::sleep(left + Duration::from_millis(5)).await;
            }
        }
    };
    assert!(
        told.first()
            .is_some_and(|left| *left <= Duration::from_millis(600)),
        "the head waited the gap out: {told:?}"
    );
    assert!(token > to_b.fencing_token);
    assert_eq!(run_of(&backend, &k).await, None);
    assert!(places(&backend, &k).await.is_empty());
}

/// \[F5\] Ruby's Locker gem polls a hot key outside the queue, with its
/// own `get` every 0.5 s as the gem does, while four nodes (each its own
/// backend) keep the key busy through the queue, calling `with_lock`
/// again as soon as each call ends. The gem gets the key within the
/// bound the README documents: 10 s of grants in a row, the hold that
/// ends the run (5 ms here), the 600 ms gap and one poll interval, plus a
/// margin for a loaded machine. The queue still holds places when it
/// does (the gap, not a queue run dry); no two holders at once, the gem
/// included; and the nodes go on once the gem has released.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f5_the_gems_poller_gets_a_hot_key_within_the_bound() {
    const NODES: usize = 4;
    const STREAK: Duration = Duration::from_secs(10);
    const GAP: Duration = Duration::from_millis(600);
    const POLL: Duration = Duration::from_millis(500);
    const SECTION: Duration = Duration::from_millis(5);
    // A gap the poller missed on a loaded machine (its poll late by more
    // than the 100 ms the gap leaves it) costs one more run.
    const MARGIN: Duration = Duration::from_secs(12);
    let bound = STREAK + SECTION + GAP + POLL + MARGIN;
    let first = TestBackend::new(&database_url()).await.unwrap();
    let k = key("f5-hot");
    // Holders of the key now, the gem included.
    let holders = Arc::new(AtomicUsize::new(0));
    let turns = Arc::new(AtomicUsize::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for n in 0..NODES {
        let backend =
            PostgresBackend::from_url_with(&database_url(), first.config().clone()).unwrap();
        let locker =
            Locker::with_options(backend, LockerOptions::default().node_id(format!("n{n}")))
                .unwrap();
        let (k, holders, turns, stop) = (
            k.clone(),
            Arc::clone(&holders),
            Arc::clone(&turns),
            Arc::clone(&stop),
        );
        tasks.push(tokio::spawn(async move {
            let forever = LockConfig::default().wait_forever();
            while !stop.load(Ordering::SeqCst) {
                let (holders, turns) = (Arc::clone(&holders), Arc::clone(&turns));
                let call = locker.with_lock_config(&k, &forever, |_| async move {
                    assert_eq!(holders.fetch_add(1, Ordering::SeqCst), 0, "two holders");
                    tokio::time::sleep(SECTION).await;
                    turns.fetch_add(1, Ordering::SeqCst);
                    holders.fetch_sub(1, Ordering::SeqCst);
                });
                tokio::time::timeout(Duration::from_secs(60), call)
                    .await
                    .expect("every call is served")
                    .unwrap();
            }
        }));
    }
    // The queue is going: a node waits in it.
    let deadline = Instant::now() + SOON;
    while places(&first, &k).await.is_empty() {
        assert!(Instant::now() < deadline, "nobody ever queued");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }

    let ruby = Ruby::new(first.qualified_table()).await;
    let started = Instant::now();
    let (polls, waited) = {
        let mut polls = 1;
        while !ruby.run(&ruby.get, &k, GEM).await {
            assert!(
                started.elapsed() < bound,
                "the gem polled {polls} times in {:?} without getting the key \
                 ({} turns of the nodes meanwhile)",
                started.elapsed(),
                turns.load(Ordering::SeqCst)
            );
            tokio::time::sleep(POLL).await;
            polls += 1;
        }
        (polls, started.elapsed())
    };
    assert_eq!(
        holders.fetch_add(1, Ordering::SeqCst),
        0,
        "the gem got the key while a node held it"
    );
    let queued_then = places(&first, &k).await.len();
    let turns_then = turns.load(Ordering::SeqCst);
    // Held a moment: no node enters meanwhile (the nodes' callbacks say
    // so). Then the gem's release, which tells nobody: the head finds
    // the key free at its next heartbeat.
    tokio::time::sleep(Duration::from_millis(200)).await;
    holders.fetch_sub(1, Ordering::SeqCst);
    assert!(ruby.run(&ruby.release, &k, GEM).await, "still the gem's");
    let deadline = Instant::now() + SOON;
    while turns.load(Ordering::SeqCst) < turns_then + NODES {
        assert!(Instant::now() < deadline, "the nodes never went on");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    stop.store(true, Ordering::SeqCst);
    for task in tasks {
        tokio::time::timeout(SOON * 6, task)
            .await
            .expect("the nodes stop")
            .unwrap();
    }
    eprintln!("the gem got the key after {waited:?} ({polls} polls, {turns_then} turns)");
    assert!(
        queued_then >= 1,
        "the queue held places when the gem got the key"
    );
    assert!(
        turns_then >= 50,
        "the nodes kept the key busy: {turns_then} turns"
    );
}

/// \[F1\] Waiters of four nodes on one key, each its own backend (as
/// separate processes would have), are served in the order they arrived,
/// each on its grant, with increasing fencing tokens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f1_nodes_are_served_in_their_arrival_order() {
    let first = TestBackend::new(&database_url()).await.unwrap();
    let k = key("f1-order");
    let holder = Locker::with_options(
        first.backend().clone(),
        LockerOptions::default().node_id("holder"),
    )
    .unwrap();
    let mut held = holder.handle(&k, TTL).unwrap();
    assert!(held.acquire().await.unwrap());
    let (order_tx, mut order_rx) = tokio::sync::mpsc::unbounded_channel();
    let mut tasks = Vec::new();
    for n in 0..4 {
        // A backend of its own on the same table, as another process.
        let backend =
            PostgresBackend::from_url_with(&database_url(), first.config().clone()).unwrap();
        let locker =
            Locker::with_options(backend, LockerOptions::default().node_id(format!("n{n}")))
                .unwrap();
        let (key, tx) = (k.clone(), order_tx.clone());
        tasks.push(tokio::spawn(async move {
            locker
                .with_lock_config(
                    &key,
                    &LockConfig::default().wait_forever(),
                    |ctx| async move {
                        tx.send((n, ctx.fencing_token())).unwrap();
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    },
                )
                .await
                .unwrap();
        }));
        // Each waits in the queue before the next arrives.
        let deadline = Instant::now() + SOON;
        while places(&first, &k).await.len() < n + 1 {
            assert!(Instant::now() < deadline, "node {n} never queued");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    assert!(held.release().await.unwrap());
    let mut served = Vec::new();
    for _ in 0..4 {
        served.push(
            tokio::time::timeout(SOON, order_rx.recv())
                .await
                .expect("every waiter is served")
                .unwrap(),
        );
    }
    for task in tasks {
        task.await.unwrap();
    }
    assert_eq!(
        served.iter().map(|(n, _)| *n).collect::<Vec<_>>(),
        [0, 1, 2, 3]
    );
    assert!(served.windows(2).all(|w| w[0].1 < w[1].1), "{served:?}");
    assert!(places(&first, &k).await.is_empty());
}

/// \[F1\] Six nodes (each its own backend) loop `with_lock` on one key
/// with no pause between their calls: each acquisition goes to the node
/// at the head of the store's queue when the previous holder released
/// (the store's arrival order: a releaser that calls again joins at the
/// tail), never two at once, with increasing fencing tokens; so no node
/// is served twice in a row while another waits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f1_nodes_that_loop_without_a_pause_are_served_in_queue_order() {
    const NODES: usize = 6;
    const ROUNDS: usize = 30;
    let first = TestBackend::new(&database_url()).await.unwrap();
    let k = key("f1-turns");
    let waiters = first.config().qualified_waiters_table().unwrap();
    let head_sql = Arc::new(format!(
        "SELECT owner FROM {waiters} WHERE key = $1 \
         AND alive_until >= clock_timestamp() AT TIME ZONE 'UTC' ORDER BY ticket LIMIT 1"
    ));
    let inside = Arc::new(std::sync::atomic::AtomicBool::new(false));
    // (node, fencing token, the node at the queue's head as it released)
    let served = Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for n in 0..NODES {
        let backend =
            PostgresBackend::from_url_with(&database_url(), first.config().clone()).unwrap();
        let locker =
            Locker::with_options(backend, LockerOptions::default().node_id(format!("n{n}")))
                .unwrap();
        let (key, inside, served) = (k.clone(), Arc::clone(&inside), Arc::clone(&served));
        let (pool, head_sql) = (first.pool().clone(), Arc::clone(&head_sql));
        tasks.push(tokio::spawn(async move {
            let forever = LockConfig::default().wait_forever();
            for _ in 0..ROUNDS {
                let (inside, served) = (Arc::clone(&inside), Arc::clone(&served));
                let (pool, head_sql, k) = (pool.clone(), Arc::clone(&head_sql), key.clone());
                let call = locker.with_lock_config(&key, &forever, |ctx| async move {
                    assert!(!inside.swap(true, Ordering::SeqCst), "two holders");
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    // A place made from now on is behind this head.
                    let head: Option<String> = sqlx::query_scalar(&head_sql)
                        .bind(&k)
                        .fetch_optional(&pool)
                        .await
                        .unwrap();
                    let head = head.map(|owner| {
                        let node = OwnerToken::from_value(owner);
                        node.node_id()[1..].parse::<usize>().unwrap()
                    });
                    served.lock().unwrap().push((n, ctx.fencing_token(), head));
                    inside.store(false, Ordering::SeqCst);
                });
                tokio::time::timeout(Duration::from_secs(60), call)
                    .await
                    .expect("every call is served")
                    .unwrap();
            }
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
    let served = served.lock().unwrap().clone();
    assert_eq!(served.len(), NODES * ROUNDS);
    assert!(
        served.windows(2).all(|w| w[0].1 < w[1].1),
        "tokens increase"
    );
    let out_of_order: Vec<_> = served
        .windows(2)
        .enumerate()
        .filter(|(_, w)| w[0].2.is_some_and(|head| head != w[1].0))
        .map(|(i, w)| (i, w[0].2, w[1].0))
        .collect();
    assert!(
        out_of_order.is_empty(),
        "not the head: {out_of_order:?} in {served:?}"
    );
    let twice: Vec<_> = served
        .windows(2)
        .enumerate()
        .filter(|(_, w)| w[0].0 == w[1].0 && w[0].2.is_some())
        .collect();
    assert!(
        twice.is_empty(),
        "served twice while others waited: {twice:?}"
    );
    assert!(places(&first, &k).await.is_empty());
}

/// A role with the rights of a lock user before the queue: `USAGE` on
/// the schema, `SELECT`, `INSERT`, `UPDATE` on the lock table and `USAGE`
/// on its `id` sequence (none on the waiters table's identity sequence).
async fn role_before_the_queue(owner: &TestBackend) -> Role {
    let (schema, table) = (owner.schema().name(), owner.qualified_table());
    let id_sequence: String = sqlx::query_scalar("SELECT pg_get_serial_sequence($1, 'id')")
        .bind(table)
        .fetch_one(owner.pool())
        .await
        .unwrap();
    Role::with_grants(&format!(
        "GRANT USAGE ON SCHEMA \"{schema}\" TO {{role}}; \
         GRANT SELECT, INSERT, UPDATE ON {table} TO {{role}}; \
         GRANT USAGE ON SEQUENCE {id_sequence} TO {{role}}"
    ))
    .await
}

/// What a backend refused the queue must still do \[F6\]: its queued
/// attempt fails with a setup error in the database's words (`words`);
/// its releases work (and grant nothing); a locker on it waits unqueued
/// and gets the key when another node releases it.
/// Returns the key it used.
async fn refused_but_working(owner: &TestBackend, refused: PostgresBackend, words: &str) -> String {
    let k = key("f6");
    let error = refused
        .try_acquire_queued(&k, &OwnerToken::new("refused"), TTL, TERMS)
        .await
        .expect_err("the queue is refused");
    assert_eq!(error.kind(), BackendErrorKind::Setup, "{error:?}");
    assert!(
        format!("{error:?}").contains(words),
        "the database's words: {error:?}"
    );
    // Its own lock: taken and released as before.
    let mine = OwnerToken::new("refused");
    let token = acquired(&refused, &k, &mine).await;
    assert_eq!(
        refused
            .release(&Lease::new(k.as_str(), mine.clone(), token))
            .await
            .unwrap(),
        ReleaseOutcome::Released
    );
    assert_eq!(
        refused
            .release(&Lease::new(k.as_str(), mine, token))
            .await
            .unwrap(),
        ReleaseOutcome::NotHeld
    );
    // A locker on it waits (unqueued) for a key another node holds.
    let other = Locker::new(owner.backend().clone());
    let mut held = other.handle(&k, TTL).unwrap();
    assert!(held.acquire().await.unwrap());
    let locker = Locker::new(refused.clone());
    let kk = k.clone();
    let waiting = tokio::spawn(async move {
        locker
            .with_lock_config(
                &kk,
                &LockConfig::default().wait_forever(),
                |ctx| async move { ctx.fencing_token() },
            )
            .await
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!waiting.is_finished());
    assert!(held.release().await.unwrap());
    let token = tokio::time::timeout(SOON, waiting)
        .await
        .expect("the unqueued waiter gets the key")
        .unwrap()
        .unwrap();
    assert!(token > 0);
    k
}

/// \[F6\] A role without rights on the waiters table (a least-privilege
/// role of before the queue): the queue is refused with the database's
/// `permission denied`, and everything else works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f6_a_role_without_rights_on_the_waiters_table_waits_unqueued() {
    let owner = TestBackend::new(&database_url()).await.unwrap();
    let role = role_before_the_queue(&owner).await;
    let refused = PostgresBackend::from_url_with(&role.url(), owner.config().clone()).unwrap();
    let k = refused_but_working(&owner, refused, "permission denied").await;
    assert!(places(&owner, &k).await.is_empty());
    drop(role);
}

/// \[F6\] The rights a least-privilege role needs for the queue, as the
/// README lists them: with them, it queues and is granted the key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f6_a_role_with_the_readmes_rights_queues() {
    let owner = TestBackend::new(&database_url()).await.unwrap();
    let role = role_before_the_queue(&owner).await;
    let waiters = owner.config().qualified_waiters_table().unwrap();
    let streaks = streaks_table(&owner);
    admin(&format!(
        "GRANT SELECT, INSERT, UPDATE, DELETE ON {waiters}, {streaks} TO \"{}\"",
        role.name
    ))
    .await;
    let granted = PostgresBackend::from_url_with(&role.url(), owner.config().clone()).unwrap();
    let k = key("f6-rights");
    let holder = OwnerToken::new("holder");
    let first = acquired(&granted, &k, &holder).await;
    let waiter = OwnerToken::new("waiter");
    assert!(queued(&granted, &k, &waiter, TERMS).await.is_busy());
    let mut watch = granted.watch_release(&k).await.unwrap();
    granted
        .release(&Lease::new(k.as_str(), holder, first))
        .await
        .unwrap();
    let grant = woken(&mut watch).await.expect("a grant");
    assert_eq!(&*grant.owner, waiter.as_str());
    assert_eq!(
        queued(&granted, &k, &waiter, TERMS).await,
        AcquireOutcome::Acquired {
            fencing_token: grant.fencing_token
        }
    );
    granted.leave_queue(&k, &waiter).await.unwrap();
    drop(granted);
    drop(role);
}

/// \[F6\] A table migrated before the queue existed (an upgrade without
/// `migrate`): the queue is refused with the database's `does not exist`,
/// everything else works; `migrate` brings the queue back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f6_without_the_waiters_table_a_node_waits_unqueued_until_migrate() {
    let owner = TestBackend::new(&database_url()).await.unwrap();
    let waiters = owner.config().qualified_waiters_table().unwrap();
    let schema = owner.schema().name().to_owned();
    admin(&format!(
        "DROP TABLE {waiters}, {streaks}; \
         DROP FUNCTION \"{schema}\".\"locks_queue_v1\", \"{schema}\".\"locks_release_v1\", \
                       \"{schema}\".\"locks_leave_v1\", \"{schema}\".\"locks_queue_v2\", \
                       \"{schema}\".\"locks_release_v2\", \"{schema}\".\"locks_leave_v2\"",
        streaks = streaks_table(&owner),
    ))
    .await;
    let old = PostgresBackend::from_url_with(&database_url(), owner.config().clone()).unwrap();
    refused_but_working(&owner, old.clone(), "does not exist").await;
    // Migrated: the queue is back, releases grant again.
    old.migrate().await.unwrap();
    let k = key("f6-migrated");
    let holder = OwnerToken::new("holder");
    let first = acquired(&old, &k, &holder).await;
    let waiter = OwnerToken::new("waiter");
    assert!(queued(&old, &k, &waiter, TERMS).await.is_busy());
    old.release(&Lease::new(k.as_str(), holder, first))
        .await
        .unwrap();
    assert_eq!(row(&owner, &k).await.0.as_deref(), Some(waiter.as_str()));
}

/// \[F6\] A role with the rights the queue needed before its runs table
/// (those on the waiters table): its queued attempt is refused with the
/// database's `permission denied` for the runs table, and everything else
/// works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f6_a_role_without_rights_on_the_runs_table_waits_unqueued() {
    let owner = TestBackend::new(&database_url()).await.unwrap();
    let role = role_before_the_queue(&owner).await;
    let waiters = owner.config().qualified_waiters_table().unwrap();
    admin(&format!(
        "GRANT SELECT, INSERT, UPDATE, DELETE ON {waiters} TO \"{}\"",
        role.name
    ))
    .await;
    let refused = PostgresBackend::from_url_with(&role.url(), owner.config().clone()).unwrap();
    let k = refused_but_working(&owner, refused, "permission denied for table locks_streaks").await;
    assert!(places(&owner, &k).await.is_empty());
    drop(role);
}

/// \[F6\] A table migrated only up to 0002 (the queue's earlier version,
/// without the runs table and the `_v2` functions: an upgrade that did
/// not run `migrate`): the queue is refused with the database's `does not
/// exist`, everything else works, and each warning is said once per
/// backend (or locker) and names the migration; `migrate` brings the
/// queue back.
#[tokio::test]
async fn f6_a_table_migrated_only_to_0002_waits_unqueued_until_migrate() {
    // A current-thread runtime: every task of the test logs on its thread.
    let log = Log::default();
    let _capture = log.capture();
    let owner = TestBackend::new(&database_url()).await.unwrap();
    let schema = owner.schema().name().to_owned();
    admin(&format!(
        "DROP TABLE {streaks}; \
         DROP FUNCTION \"{schema}\".\"locks_queue_v2\", \"{schema}\".\"locks_release_v2\", \
                       \"{schema}\".\"locks_leave_v2\"",
        streaks = streaks_table(&owner),
    ))
    .await;
    let old = PostgresBackend::from_url_with(&database_url(), owner.config().clone()).unwrap();
    refused_but_working(&owner, old.clone(), "does not exist").await;
    let warnings = log.lines("WARN");
    assert!(
        !warnings.is_empty() && warnings.iter().all(|line| line.contains("migrat")),
        "{warnings:#?}"
    );
    // The waiting locker's, once; each backend's about its releases, once.
    let said = |words: &str| warnings.iter().filter(|l| l.contains(words)).count();
    assert_eq!(
        said("this node waits unqueued from now on"),
        1,
        "{warnings:#?}"
    );
    let releases = said("refused the fair queue's release");
    assert!((1..=2).contains(&releases), "{warnings:#?}");
    assert_eq!(warnings.len(), 1 + releases, "{warnings:#?}");
    // Migrated: the queue is back, releases grant again.
    old.migrate().await.unwrap();
    let k = key("f6-migrated");
    let holder = OwnerToken::new("holder");
    let first = acquired(&old, &k, &holder).await;
    let waiter = OwnerToken::new("waiter");
    assert!(queued(&old, &k, &waiter, TERMS).await.is_busy());
    old.release(&Lease::new(k.as_str(), holder, first))
        .await
        .unwrap();
    assert_eq!(row(&owner, &k).await.0.as_deref(), Some(waiter.as_str()));
}

/// The log lines of the test's own thread: `<LEVEL> <message> <field>=<value>…`.
#[derive(Clone, Default)]
struct Log(Arc<std::sync::Mutex<Vec<String>>>);

impl Log {
    fn capture(&self) -> tracing::subscriber::DefaultGuard {
        tracing::subscriber::set_default(self.clone())
    }

    /// The lines of `level` (`WARN`, ...).
    fn lines(&self, level: &str) -> Vec<String> {
        let lines = self.0.lock().unwrap();
        let level = format!("{level} ");
        lines
            .iter()
            .filter(|line| line.starts_with(&level))
            .cloned()
            .collect()
    }
}

/// Writes each field of an event after the line so far.
struct Line<'a>(&'a mut String);

impl tracing::field::Visit for Line<'_> {
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        match field.name() {
            "message" => self.0.push_str(&format!(" {value:?}")),
            name => self.0.push_str(&format!(" {name}={value:?}")),
        }
    }
}

/// Events only: spans get an id and are otherwise ignored.
impl tracing::Subscriber for Log {
    fn enabled(&self, _: &tracing::Metadata<'_>) -> bool {
        true
    }

    fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        tracing::span::Id::from_u64(1)
    }

    fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}

    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}

    fn event(&self, event: &tracing::Event<'_>) {
        let mut line = event.metadata().level().to_string();
        event.record(&mut Line(&mut line));
        self.0.lock().unwrap().push(line);
    }

    fn enter(&self, _: &tracing::span::Id) {}

    fn exit(&self, _: &tracing::span::Id) {}
}

/// The migration is idempotent, also for a second role that may create
/// in the schema but owns none of the queue's objects; it leaves the
/// lock table's columns as they were.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_migration_runs_again_for_another_role() {
    let owner = TestBackend::new(&database_url()).await.unwrap();
    owner.migrate().await.unwrap();
    let role = role_before_the_queue(&owner).await;
    admin(&format!(
        "GRANT CREATE ON SCHEMA \"{}\" TO \"{}\"",
        owner.schema().name(),
        role.name
    ))
    .await;
    let other = PostgresBackend::from_url_with(&role.url(), owner.config().clone()).unwrap();
    other.migrate().await.unwrap();
    let columns: Vec<String> = sqlx::query_scalar(
        "SELECT column_name::text FROM information_schema.columns \
         WHERE table_schema = $1 AND table_name = $2 ORDER BY ordinal_position",
    )
    .bind(owner.schema().name())
    .bind(&owner.config().table)
    .fetch_all(owner.pool())
    .await
    .unwrap();
    assert_eq!(
        columns,
        [
            "id",
            "key",
            "locked_by",
            "locked_at",
            "locked_until",
            "sequence"
        ]
    );
    drop(other);
    drop(role);
}

/// Long and odd names: the queue's objects get names that fit (cut and
/// hashed), quoted, and the migration and the queue work with them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_queue_works_beside_a_table_of_a_long_odd_name() {
    // A quote, a dollar-quote tag and a line break (which would end an SQL
    // comment): each taken literally.
    let table = format!("Locks \"$withlock_body$\"\nSELECT 1/0; {}", "x".repeat(23));
    let config = PostgresConfig::default().table(table);
    let backend = Arc::new(
        TestBackend::with_config(&database_url(), config)
            .await
            .unwrap(),
    );
    assert!(backend.config().waiters_table().len() <= 63);
    let k = key("odd");
    let holder = OwnerToken::new("holder");
    let first = acquired(&*backend, &k, &holder).await;
    let waiter = OwnerToken::new("waiter");
    assert!(queued(&*backend, &k, &waiter, TERMS).await.is_busy());
    let mut watch = backend.watch_release(&k).await.unwrap();
    backend
        .release(&Lease::new(k.as_str(), holder, first))
        .await
        .unwrap();
    let grant = woken(&mut watch).await.expect("a grant");
    assert_eq!(&*grant.owner, waiter.as_str());
}

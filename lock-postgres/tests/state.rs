//! \[T2\] Per-key state follows what is held: after 10,000 distinct keys
//! were each locked (with a waiter woken by the release), 10,000 locks
//! were lost (rows deleted or taken over while held) and 10,000 attempts
//! were refused for permission, every per-key structure of the backend
//! ([`PostgresBackend::state_counts`]) is back within its bound (0: the
//! release hub keeps an entry only while a watch on its key lives).
//!
//! The 10,000-key cases are `#[ignore]`d for the CI budget and run before
//! a release (`cargo test -p lock-postgres --test state -- --ignored`):
//! measured on the 2-core dev machine under other builds' load (load
//! average 3-7), 45-78 s for the keys locked and waited for, 17-23 s for
//! the lost locks, 54-65 s for the refused attempts, one case at a time
//! (about 4 minutes for the three). CI runs each with 1,000 keys. Run
//! together they overloaded the shared server, so they take turns.
//!
//! These passed before the T2 audit too: they are regression tests. The
//! first two check that the hub was in use meanwhile (every waiter, every
//! held lock watched its key), so they cannot pass vacuously.
//!
//! [`PostgresBackend::state_counts`]: lock_postgres::PostgresBackend::state_counts

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::{Observed, Role};
use lock_conformance::node;
use lock_core::{BackendErrorKind, LockConfig, LockError, LossCause};
use lock_postgres::testing::{TestBackend, TestSchema};
use lock_postgres::{PostgresBackend, PostgresConfig};
use tokio::time::Instant;
use withlock_test_servers::postgres::database_url;

const KEYS: usize = 10_000;
/// Keys worked on at once, as a busy service would.
const AT_ONCE: usize = 32;
/// The bound on anything that takes milliseconds when the machine is idle.
const SOON: Duration = Duration::from_secs(10);

/// The cases of this file one at a time: each loads the machine and the
/// shared server on its own, and together they made calls time out.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Every per-key count of `backend` is 0.
fn assert_at_rest(backend: &PostgresBackend, after: &str) {
    for (name, count) in backend.state_counts() {
        assert_eq!(count, 0, "{name} after {after}");
    }
}

fn watched_keys(backend: &PostgresBackend) -> usize {
    backend
        .state_counts()
        .into_iter()
        .find(|(name, _)| *name == "watched_keys")
        .map(|(_, n)| n)
        .expect("the backend counts its watched keys")
}

/// Runs `work(i)` for every `i` below `n`, `AT_ONCE` at a time.
async fn each<F, Fut>(n: usize, work: F)
where
    F: Fn(usize) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    let next = Arc::new(AtomicUsize::new(0));
    let work = Arc::new(work);
    let workers: Vec<_> = (0..AT_ONCE)
        .map(|_| {
            let (next, work) = (Arc::clone(&next), Arc::clone(&work));
            tokio::spawn(async move {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= n {
                        break;
                    }
                    work(i).await;
                }
            })
        })
        .collect();
    for worker in workers {
        worker.await.unwrap();
    }
}

/// Each key is taken by a holder while a waiter (polling every 30 s, so
/// only a notification wakes it in time) waits on its release watch, then
/// released: the waiter is woken and takes it in turn.
async fn keys_locked_and_waited_for(keys: usize) {
    let _alone = ONE_AT_A_TIME.lock().await;
    let started = Instant::now();
    let backend = Arc::new(Observed::new(
        TestBackend::new(&database_url()).await.unwrap(),
    ));
    let (holder, waiter) = (
        node(Arc::clone(&backend), "holder"),
        node(Arc::clone(&backend), "waiter"),
    );
    let seen_watched = Arc::new(AtomicUsize::new(0));
    let run = format!("{:016x}", rand::random::<u64>());
    let b = Arc::clone(&backend);
    let seen = Arc::clone(&seen_watched);
    each(keys, move |i| {
        let (backend, holder, waiter, seen) = (
            Arc::clone(&b),
            holder.clone(),
            waiter.clone(),
            Arc::clone(&seen),
        );
        let key = format!("t2:{run}:{i}");
        async move {
            let mut held = holder.handle(&key, Duration::from_secs(60)).unwrap();
            assert!(held.acquire().await.unwrap(), "{key} is free");
            let slow = LockConfig::default()
                .wait_forever()
                .retry_delay(Duration::from_secs(30));
            let k = key.clone();
            let waiting =
                tokio::spawn(async move { waiter.with_lock_config(&k, &slow, |_| async {}).await });
            backend.waiting(&key, SOON).await;
            seen.fetch_max(watched_keys(backend.inner.backend()), Ordering::Relaxed);
            assert!(held.release().await.unwrap());
            tokio::time::timeout(SOON, waiting)
                .await
                .unwrap_or_else(|_| panic!("the waiter on {key} was not woken"))
                .unwrap()
                .unwrap();
        }
    })
    .await;
    assert!(
        seen_watched.load(Ordering::Relaxed) >= 1,
        "no key was ever watched"
    );
    assert_at_rest(backend.inner.backend(), "keys locked and waited for");
    eprintln!(
        "{keys} keys locked and waited for in {:?}",
        started.elapsed()
    );
}

/// Locks held by callbacks that wait for their loss, 1,000 at once, long
/// enough for each to watch its own key \[L5\]; then half the rows are
/// deleted and half taken over by another owner, a notification on each
/// key has the holders check at once (with a 30 s ttl nothing else
/// would, for 10 s), and every call ends `Lost`.
async fn lost_locks(keys: usize) {
    let _alone = ONE_AT_A_TIME.lock().await;
    const BATCH: usize = 1_000;
    let started = Instant::now();
    let backend = Arc::new(TestBackend::new(&database_url()).await.unwrap());
    let locker = node(Arc::clone(&backend), "holder");
    let run = format!("{:016x}", rand::random::<u64>());
    let config = LockConfig::default();
    for batch in 0..keys.div_ceil(BATCH) {
        let batch_keys: Vec<String> = (batch * BATCH..keys.min((batch + 1) * BATCH))
            .map(|i| format!("t2-lost:{run}:{i}"))
            .collect();
        let (held_tx, mut held_rx) = tokio::sync::mpsc::unbounded_channel();
        let calls: Vec<_> = batch_keys
            .iter()
            .map(|key| {
                let (locker, key, held_tx) = (locker.clone(), key.clone(), held_tx.clone());
                tokio::spawn(async move {
                    locker
                        .with_lock_config(&key, &config, move |ctx| async move {
                            let _ = held_tx.send(());
                            ctx.lost().await
                        })
                        .await
                })
            })
            .collect();
        for _ in 0..batch_keys.len() {
            tokio::time::timeout(SOON * 3, held_rx.recv())
                .await
                .expect("every lock of the batch is taken")
                .unwrap();
        }
        // Each callback watches its own key once it held it for a moment.
        let deadline = Instant::now() + SOON;
        while watched_keys(backend.backend()) < batch_keys.len() {
            assert!(
                Instant::now() < deadline,
                "only {} of {} held keys watched",
                watched_keys(backend.backend()),
                batch_keys.len()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let (deleted, taken) = batch_keys.split_at(batch_keys.len() / 2);
        let table = backend.qualified_table();
        sqlx::query(&format!("DELETE FROM {table} WHERE key = ANY($1)"))
            .bind(deleted)
            .execute(backend.pool())
            .await
            .unwrap();
        sqlx::query(&format!(
            "UPDATE {table} SET locked_by = 'intruder/' || md5(key) WHERE key = ANY($1)"
        ))
        .bind(taken)
        .execute(backend.pool())
        .await
        .unwrap();
        sqlx::query("SELECT pg_notify($1, key) FROM unnest($2::text[]) AS key")
            .bind(&backend.config().channel)
            .bind(&batch_keys)
            .execute(backend.pool())
            .await
            .unwrap();
        for call in calls {
            let ended = tokio::time::timeout(SOON, call)
                .await
                .expect("the loss is found within the ttl")
                .unwrap();
            assert!(
                matches!(
                    ended,
                    Err(LockError::Lost {
                        cause: LossCause::Taken | LossCause::Expired,
                        ..
                    })
                ),
                "{ended:?}"
            );
        }
    }
    assert_at_rest(backend.backend(), "locks lost");
    eprintln!("{keys} locks lost in {:?}", started.elapsed());
}

/// A role with `USAGE` on the schema of `schema` and nothing else.
async fn bare_role(schema: &TestSchema) -> Role {
    Role::with_grants(&format!(
        "GRANT USAGE ON SCHEMA \"{}\" TO {{role}}",
        schema.name()
    ))
    .await
}

/// Attempts by a role without rights on the lock table: each ends at its
/// first attempt with the refusal in the store's words, and nothing is
/// left per key. (A refused attempt never finds the key busy, so it never
/// watches: this one guards against a refusal path that starts keeping
/// something.)
async fn refused_attempts(keys: usize) {
    let _alone = ONE_AT_A_TIME.lock().await;
    let started = Instant::now();
    let owner = TestBackend::new(&database_url()).await.unwrap();
    let role = bare_role(owner.schema()).await;
    let refused = Arc::new(
        PostgresBackend::from_url_with(
            &role.url(),
            owner.schema().config(PostgresConfig::default()),
        )
        .unwrap(),
    );
    let locker = node(Arc::clone(&refused), "refused");
    let run = format!("{:016x}", rand::random::<u64>());
    each(keys, move |i| {
        let locker = locker.clone();
        let key = format!("t2-refused:{run}:{i}");
        async move {
            let got = tokio::time::timeout(
                SOON,
                locker.with_lock(&key, |_| async { panic!("the callback must not run") }),
            )
            .await
            .expect("a refusal is said at once");
            // One attempt when the machine keeps up; a pool timeout under
            // load is retried first [A8].
            match got {
                Err(LockError::NotAcquired {
                    source: Some(error),
                    ..
                }) => {
                    assert_eq!(error.kind(), BackendErrorKind::Setup, "{error:?}");
                    assert!(
                        format!("{:?}", error).contains("permission denied"),
                        "the store's words: {error:?}"
                    );
                }
                other => panic!("expected the refusal, got {other:?}"),
            }
        }
    })
    .await;
    assert_at_rest(&refused, "refused attempts");
    drop(refused);
    drop(role);
    eprintln!("{keys} refused attempts in {:?}", started.elapsed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t2_a_thousand_keys_each_locked_and_waited_for_leave_no_watch() {
    keys_locked_and_waited_for(1_000).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "about a minute on 2 cores: run before a release (cargo test -p lock-postgres --test state -- --ignored)"]
async fn t2_ten_thousand_keys_each_locked_and_waited_for_leave_no_watch() {
    keys_locked_and_waited_for(KEYS).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t2_a_thousand_lost_locks_leave_no_watch() {
    lost_locks(1_000).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "about a minute on 2 cores: run before a release (cargo test -p lock-postgres --test state -- --ignored)"]
async fn t2_ten_thousand_lost_locks_leave_no_watch() {
    lost_locks(KEYS).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t2_a_thousand_attempts_refused_for_permission_leave_nothing() {
    refused_attempts(1_000).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "about a minute on 2 cores: run before a release (cargo test -p lock-postgres --test state -- --ignored)"]
async fn t2_ten_thousand_attempts_refused_for_permission_leave_nothing() {
    refused_attempts(KEYS).await;
}

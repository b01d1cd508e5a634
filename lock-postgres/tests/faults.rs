//! Faults on real PostgreSQL servers, each asserting the outcome the spec
//! names: connections cut while a callback runs (survived, or lost with the
//! sqlx error as cause when the server stays down), the row taken, freed
//! or deleted by hand, the database unreachable during acquisition, and
//! the fair queue through a restart.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use lock_core::{LockConfig, LockError, Locker, LockerOptions, LossCause, OwnerToken, QueueTerms};
use lock_postgres::testing::{terminate_connections, TestBackend};
use lock_postgres::{PostgresBackend, PostgresConfig};
use tokio::sync::oneshot;
use withlock_test_servers::postgres::{database_url, TestServer};

const SOON: Duration = Duration::from_secs(10);

fn node(backend: Arc<TestBackend>, name: &str) -> Locker {
    Locker::with_options(backend, LockerOptions::default().node_id(name)).unwrap()
}

fn key(name: &str) -> String {
    format!("faults:{:016x}:{name}", rand::random::<u64>())
}

async fn own_server() -> TestServer {
    tokio::task::spawn_blocking(TestServer::start)
        .await
        .unwrap()
        .expect("a PostgreSQL server of the test's own")
}

async fn on_blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    tokio::task::spawn_blocking(f).await.unwrap()
}

/// `pg_terminate_backend` on every connection of the backend (pool and
/// listener, found by their application_name) while a callback runs: the
/// extensions reconnect well within the ttl, the lock survives, and no other
/// node gets it meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn terminated_connections_reconnect_and_the_lock_survives() {
    let backend = Arc::new(TestBackend::new(&database_url()).await.unwrap());
    let app = backend.application_name().to_owned();
    let a = node(Arc::clone(&backend), "a");
    let b = node(Arc::clone(&backend), "b");
    let key = key("terminated");
    let ttl = Duration::from_millis(1500);
    let (k, url) = (key.clone(), database_url());
    let out = tokio::time::timeout(
        SOON,
        a.with_lock_config(&key, &LockConfig::default().ttl(ttl), |ctx| async move {
            let mut terminated = 0;
            // Several rounds over two ttls, so extensions hit dead
            // connections more than once.
            for _ in 0..4 {
                terminated += terminate_connections(&url, &app, false).await.unwrap();
                tokio::time::sleep(ttl / 2).await;
                let other = b
                    .with_lock_config(&k, &LockConfig::default().retry_attempts(0), |_| async {})
                    .await;
                assert!(other.is_err_and(|e| e.is_not_acquired()));
            }
            (terminated, ctx.is_lost())
        }),
    )
    .await
    .expect("the callback finished");
    let (terminated, lost) = out.expect("the lock survived");
    assert!(terminated >= 1, "the test cut connections");
    assert!(!lost, "no loss was seen");
}

/// The server stopped while a callback runs and kept down past the lock's
/// validity: the lock is lost with a backend cause, and each step the
/// backend makes meanwhile fails with the sqlx error as its source.
///
/// The loss's cause is the driver's own timeout rather than the sqlx error
/// whenever the driver's last extension attempt runs into the validity
/// deadline (lock-core schedules a final attempt at the deadline itself, so
/// with a real server this is the usual case; see the crate's report). The
/// test therefore checks the sqlx error on a step of its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_down_past_validity_loses_with_a_backend_cause() {
    let server = Arc::new(own_server().await);
    let backend = Arc::new(TestBackend::new(&server.url()).await.unwrap());
    let a = node(Arc::clone(&backend), "a");
    let key = key("down");
    let (started_tx, started_rx) = oneshot::channel();
    let ttl = Duration::from_secs(3);
    let k = key.clone();
    let call = tokio::spawn(async move {
        a.with_lock_config(&k, &LockConfig::default().ttl(ttl), |ctx| async move {
            let _ = started_tx.send(ctx.fencing_token());
            ctx.lost().await
        })
        .await
    });
    let lost_token = tokio::time::timeout(SOON, started_rx)
        .await
        .unwrap()
        .unwrap();
    let stopping = Arc::clone(&server);
    on_blocking(move || stopping.stop()).await.unwrap();
    let err = tokio::time::timeout(SOON, call)
        .await
        .expect("loss reported in time")
        .unwrap()
        .expect_err("the lock was lost");
    match err {
        LockError::Lost {
            cause: LossCause::Backend(e),
            ..
        } => {
            // The store's own answer, not the driver's validity deadline:
            // the sqlx error, or the backend's statement timeout.
            let from_sqlx = e.inner().downcast_ref::<sqlx::Error>().is_some();
            let deadline = e
                .inner()
                .to_string()
                .starts_with("extension did not finish");
            assert!(
                from_sqlx || (e.is_timeout() && !deadline),
                "the cause is the store's error: {e:?}"
            );
        }
        other => panic!("expected a loss with a backend cause, got {other:?}"),
    }
    // A step of the backend itself while the server is down: the sqlx
    // error, within the statement timeout.
    let owner = lock_core::OwnerToken::new("probe");
    let step = tokio::time::timeout(
        SOON,
        lock_core::LockBackend::try_acquire(&*backend, &key, &owner, ttl),
    )
    .await
    .expect("the step answers within its timeout")
    .expect_err("the server is down");
    assert!(
        step.inner().downcast_ref::<sqlx::Error>().is_some(),
        "the step's source is the sqlx error: {step:?}"
    );
    // Back up: the same backend works again, no process restart needed.
    let starting = Arc::clone(&server);
    on_blocking(move || starting.start_again()).await.unwrap();
    let b = node(Arc::clone(&backend), "b");
    let cfg = LockConfig::default().wait_forever();
    let token = tokio::time::timeout(
        SOON,
        b.with_lock_config(&key, &cfg, |c| async move { c.fencing_token() }),
    )
    .await
    .expect("the key is taken again after the restart")
    .unwrap();
    assert!(
        token > lost_token,
        "the token after the restart ({token}) is above the lost lock's ({lost_token})"
    );
}

/// SPEC L1: while a callback runs, the row is changed by hand: taken by
/// another owner, set free, or deleted. Each is lost at the next extension
/// with cause `Taken` (the lock was still valid, so it cannot have
/// expired), and the loser's release leaves the row as the hand left it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn l1_row_taken_freed_or_deleted_by_hand_is_lost_as_taken() {
    let backend = Arc::new(TestBackend::new(&database_url()).await.unwrap());
    let a = node(Arc::clone(&backend), "a");
    let table = backend.qualified_table();
    let edits = [
        (
            "taken",
            format!(
                "UPDATE {table} SET locked_by = 'intruder', \
                 locked_until = clock_timestamp() AT TIME ZONE 'UTC' + interval '1 hour', \
                 sequence = sequence + 1 WHERE key = $1"
            ),
            Some("intruder"),
        ),
        (
            "freed",
            format!("UPDATE {table} SET locked_by = NULL WHERE key = $1"),
            None,
        ),
        (
            "deleted",
            format!("DELETE FROM {table} WHERE key = $1"),
            None,
        ),
    ];
    for (what, edit, left_holder) in edits {
        let key = key(what);
        let pool = backend.pool().clone();
        let k = key.clone();
        // A ttl long enough that a busy machine sends the next extension
        // well within the validity: the cause is then the store's answer.
        let cfg = LockConfig::default().ttl(Duration::from_secs(3));
        let got = tokio::time::timeout(
            SOON,
            a.with_lock_config(&key, &cfg, |ctx| async move {
                let changed = sqlx::query(&edit).bind(&k).execute(&pool).await.unwrap();
                assert_eq!(changed.rows_affected(), 1, "{what}: the row was there");
                ctx.lost().await
            }),
        )
        .await
        .unwrap_or_else(|_| panic!("{what}: loss reported in time"));
        assert!(
            matches!(
                got,
                Err(LockError::Lost {
                    cause: LossCause::Taken,
                    ..
                })
            ),
            "{what}: got {got:?}"
        );
        let row: Option<Option<String>> =
            sqlx::query_scalar(&format!("SELECT locked_by FROM {table} WHERE key = $1"))
                .bind(&key)
                .fetch_optional(backend.pool())
                .await
                .unwrap();
        match what {
            "deleted" => assert_eq!(row, None, "an extension never re-creates the row"),
            _ => assert_eq!(
                row,
                Some(left_holder.map(str::to_owned)),
                "{what}: the row is as the hand left it"
            ),
        }
    }
}

/// The database unreachable during acquisition: NotAcquired with the sqlx
/// error as source, the callback never runs, and once the server is back
/// nothing is held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_during_acquisition_is_not_acquired_with_the_sqlx_error() {
    let server = Arc::new(own_server().await);
    let backend = Arc::new(
        TestBackend::with_config(&server.url(), PostgresConfig::default())
            .await
            .unwrap(),
    );
    let a = node(Arc::clone(&backend), "a");
    let stopping = Arc::clone(&server);
    on_blocking(move || stopping.stop()).await.unwrap();
    let ran = Arc::new(AtomicBool::new(false));
    let flag = Arc::clone(&ran);
    let key = key("unreachable");
    let cfg = LockConfig::default()
        .retry_attempts(1)
        .retry_delay(Duration::from_millis(50));
    let got = tokio::time::timeout(
        SOON,
        a.with_lock_config(&key, &cfg, |_| async move {
            flag.store(true, Ordering::SeqCst);
        }),
    )
    .await
    .expect("gave up in time");
    match got {
        Err(LockError::NotAcquired {
            attempts,
            source: Some(e),
            ..
        }) => {
            assert_eq!(attempts, 2);
            assert!(
                e.inner().downcast_ref::<sqlx::Error>().is_some(),
                "the source is the sqlx error: {e:?}"
            );
        }
        other => panic!("expected NotAcquired with a source, got {other:?}"),
    }
    assert!(!ran.load(Ordering::SeqCst), "the callback did not run");
    let starting = Arc::clone(&server);
    on_blocking(move || starting.start_again()).await.unwrap();
    let held: i64 = sqlx::query_scalar(&format!(
        "SELECT count(*) FROM {} WHERE locked_by IS NOT NULL",
        backend.qualified_table()
    ))
    .fetch_one(backend.pool())
    .await
    .unwrap();
    assert_eq!(held, 0, "nothing is held");
}

/// \[F2, H4\] The fair queue through a PostgreSQL restart: four nodes
/// (each its own backend) wait in the queue on a key a fifth holds; the
/// server is stopped at once, as a crash would stop it, kept down longer
/// than the waiters' ticket ttl (so their places die) and started again
/// on the same data. Afterwards every waiter is in the queue again (a
/// new place, behind the dead ones' tickets), the holder keeps its lock,
/// and once it releases every waiter gets the key in turn (the queue's
/// order), never two holders at once, each with a fencing token above the one before it,
/// across the restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f2_waiters_queue_again_after_a_restart() {
    const WAITERS: usize = 4;
    // Short, so that an outage outlives the places made before it.
    let terms = QueueTerms::new(Duration::from_secs(1), QueueTerms::DEFAULT.claim);
    let server = Arc::new(own_server().await);
    let first = TestBackend::new(&server.url()).await.unwrap();
    let config = first.config().clone();
    let waiters_table = config.qualified_waiters_table().unwrap();
    let key = key("restart-queue");
    // Holders of the key now, and each holder's node and token in the
    // order they held it.
    let holders = Arc::new(AtomicUsize::new(0));
    let served = Arc::new(Mutex::new(Vec::new()));
    // The key's places: (node, ticket), in ticket order; none while the
    // server is down.
    let places = || {
        let (pool, table, k) = (first.pool().clone(), waiters_table.clone(), key.clone());
        async move {
            let rows: Vec<(String, i64)> = sqlx::query_as(&format!(
                "SELECT owner, ticket FROM {table} WHERE key = $1 ORDER BY ticket"
            ))
            .bind(&k)
            .fetch_all(&pool)
            .await
            .unwrap_or_default();
            rows.into_iter()
                .map(|(owner, ticket)| (OwnerToken::from_value(owner).node_id().to_owned(), ticket))
                .collect::<Vec<_>>()
        }
    };

    let holder = Locker::with_options(
        PostgresBackend::from_url_with(&server.url(), config.clone()).unwrap(),
        LockerOptions::default().node_id("holder"),
    )
    .unwrap();
    let (held_tx, held_rx) = oneshot::channel();
    let (let_go_tx, let_go_rx) = oneshot::channel::<()>();
    let holding = {
        let (k, holders, served) = (key.clone(), Arc::clone(&holders), Arc::clone(&served));
        tokio::spawn(async move {
            holder
                .with_lock(&k, |ctx| async move {
                    assert_eq!(holders.fetch_add(1, Ordering::SeqCst), 0, "two holders");
                    served
                        .lock()
                        .unwrap()
                        .push(("holder".to_owned(), ctx.fencing_token()));
                    held_tx.send(()).unwrap();
                    let_go_rx.await.unwrap();
                    holders.fetch_sub(1, Ordering::SeqCst);
                })
                .await
        })
    };
    tokio::time::timeout(SOON, held_rx)
        .await
        .expect("the holder holds")
        .unwrap();
    let mut waiting = Vec::new();
    for n in 0..WAITERS {
        let node = format!("w{n}");
        let locker = Locker::with_options(
            PostgresBackend::from_url_with(&server.url(), config.clone()).unwrap(),
            LockerOptions::default().node_id(node.as_str()),
        )
        .unwrap();
        let (k, holders, served) = (key.clone(), Arc::clone(&holders), Arc::clone(&served));
        // Queued or not at all: a waiter that fell back to unqueued
        // waiting would fail its call.
        let cfg = LockConfig::default()
            .wait_forever()
            .fair_queue(terms)
            .require_fair_queue();
        waiting.push(tokio::spawn(async move {
            locker
                .with_lock_config(&k, &cfg, |ctx| async move {
                    assert_eq!(holders.fetch_add(1, Ordering::SeqCst), 0, "two holders");
                    served.lock().unwrap().push((node, ctx.fencing_token()));
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    holders.fetch_sub(1, Ordering::SeqCst);
                })
                .await
        }));
    }
    let deadline = tokio::time::Instant::now() + SOON;
    let before = loop {
        let before = places().await;
        if before.len() == WAITERS {
            break before;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the nodes never all queued: {before:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    let last_ticket = before.iter().map(|(_, ticket)| *ticket).max().unwrap();

    // The restart: stopped at once, down for longer than a place lives,
    // started again on the same data.
    let stopping = Arc::clone(&server);
    on_blocking(move || stopping.stop()).await.unwrap();
    tokio::time::sleep(terms.ticket_ttl * 2).await;
    let starting = Arc::clone(&server);
    on_blocking(move || starting.start_again()).await.unwrap();
    // Every waiter queues again: a new place each (its own, dead, was
    // removed by the queue's next step), behind the tickets of before.
    let deadline = tokio::time::Instant::now() + SOON * 3;
    let after = loop {
        let after = places().await;
        if after.len() == WAITERS && after.iter().all(|(_, ticket)| *ticket > last_ticket) {
            break after;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "not every waiter queued again: {after:?} (before the restart: {before:?})"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let mut nodes: Vec<_> = after.iter().map(|(node, _)| node.as_str()).collect();
    nodes.sort_unstable();
    assert_eq!(nodes, ["w0", "w1", "w2", "w3"], "one place each");
    assert!(
        waiting.iter().all(|task| !task.is_finished()),
        "nobody took the held key"
    );

    // The holder lets go: every waiter gets the key in turn.
    let_go_tx.send(()).unwrap();
    tokio::time::timeout(SOON * 3, holding)
        .await
        .expect("the holder's call ends")
        .unwrap()
        .expect("the holder kept its lock through the restart");
    for task in waiting {
        tokio::time::timeout(SOON * 3, task)
            .await
            .expect("every waiter gets the key")
            .unwrap()
            .expect("each waiter's call succeeds");
    }
    let served = served.lock().unwrap().clone();
    assert_eq!(served.len(), WAITERS + 1, "{served:?}");
    let mut nodes: Vec<_> = served.iter().map(|(node, _)| node.as_str()).collect();
    nodes.sort_unstable();
    assert_eq!(nodes, ["holder", "w0", "w1", "w2", "w3"], "each once");
    // In turn: in the order of the places made after the restart.
    assert_eq!(
        served[1..].iter().map(|(node, _)| node).collect::<Vec<_>>(),
        after.iter().map(|(node, _)| node).collect::<Vec<_>>(),
        "served in the queue's order"
    );
    assert!(
        served.windows(2).all(|pair| pair[0].1 < pair[1].1),
        "fencing tokens increase across the restart: {served:?}"
    );
    assert!(places().await.is_empty(), "the queue is empty");
}

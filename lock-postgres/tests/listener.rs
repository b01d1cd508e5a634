//! The one listening connection: releases wake waiters at once, also after
//! the connection was terminated (it reconnects and listens again), and a
//! backend without notifications says so.

use std::sync::Arc;
use std::time::Duration;

use lock_core::{LockBackend, LockConfig, Locker, LockerOptions};
use lock_postgres::testing::{terminate_connections, TestBackend};
use lock_postgres::PostgresConfig;
use tokio::time::Instant;
use withlock_test_servers::postgres::database_url;

const SOON: Duration = Duration::from_secs(10);

fn node(backend: Arc<TestBackend>, name: &str) -> Locker {
    Locker::with_options(backend, LockerOptions::default().node_id(name)).unwrap()
}

/// The server pids of the backend's connections that are listening.
async fn listening(backend: &TestBackend) -> Vec<i32> {
    sqlx::query_scalar(
        "SELECT pid FROM pg_stat_activity \
         WHERE application_name = $1 AND query LIKE 'LISTEN %'",
    )
    .bind(backend.application_name())
    .fetch_all(backend.pool())
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_is_woken_after_the_listener_was_terminated() {
    let backend = Arc::new(TestBackend::new(&database_url()).await.unwrap());
    let (a, b) = (
        node(Arc::clone(&backend), "a"),
        node(Arc::clone(&backend), "b"),
    );
    let key = format!("listener:{:016x}", rand::random::<u64>());
    let mut held = a.handle(&key, Duration::from_secs(30)).unwrap();
    assert!(held.acquire().await.unwrap());

    // The waiter polls only every 20 s: only a notification wakes it sooner.
    let slow = LockConfig::default()
        .wait_forever()
        .retry_delay(Duration::from_secs(20));
    let k = key.clone();
    let waiter = tokio::spawn(async move {
        b.with_lock_config(&k, &slow, |_| async { Instant::now() })
            .await
    });
    let deadline = Instant::now() + SOON;
    let first = loop {
        if let [pid] = listening(&backend).await[..] {
            break pid;
        }
        assert!(Instant::now() < deadline, "the listener never listened");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let cut = terminate_connections(&database_url(), backend.application_name(), true)
        .await
        .unwrap();
    assert_eq!(cut, 1, "exactly the listening connection was terminated");
    // Wait for the new LISTEN (a new connection, so a new pid).
    while !listening(&backend).await.iter().any(|&pid| pid != first) {
        assert!(
            Instant::now() < deadline,
            "the listener never listened again"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The reconnection woke the waiter once (busy); let it settle.
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!waiter.is_finished());
    let released_at = Instant::now();
    assert!(held.release().await.unwrap());
    let ran_at = tokio::time::timeout(SOON, waiter)
        .await
        .expect("woken well before the retry delay")
        .unwrap()
        .unwrap();
    let handoff = ran_at - released_at;
    // A third of the 20 s retry delay: only a notification is sooner.
    assert!(
        handoff < Duration::from_secs(20) / 3,
        "woken after {handoff:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn notifications_off_is_declared_and_nothing_listens() {
    let config = PostgresConfig::default().release_notifications(false);
    let backend = Arc::new(
        TestBackend::with_config(&database_url(), config)
            .await
            .unwrap(),
    );
    assert!(!backend.capabilities().release_notifications);
    let a = node(Arc::clone(&backend), "a");
    let key = format!("quiet:{:016x}", rand::random::<u64>());
    a.with_lock(&key, |_| async {}).await.unwrap();
    assert!(listening(&backend).await.is_empty());
    assert!(backend
        .statements()
        .iter()
        .all(|s| !s.contains("pg_notify")));
}

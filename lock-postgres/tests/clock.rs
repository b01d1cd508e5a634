//! Time comes from the database only: a client whose clock is an hour off
//! changes nothing, `locked_until - locked_at` is exactly the ttl as the
//! server measures it, and the statements carry no client timestamp.

use std::sync::Arc;
use std::time::Duration;

use lock_core::{LockConfig, Locker};
use lock_postgres::testing::TestBackend;
use withlock_test_servers::postgres::database_url;

#[test]
fn a_client_clock_an_hour_off_changes_nothing() {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let backend = Arc::new(TestBackend::new(&database_url()).await.unwrap());
        // The client's (tokio's) clock jumps an hour ahead, then runs on.
        tokio::time::pause();
        tokio::time::advance(Duration::from_secs(3600)).await;
        tokio::time::resume();

        // The extender on this runtime's clock, the one that jumped.
        let options = lock_core::LockerOptions::default().caller_runtime(true);
        let locker = Locker::with_options(Arc::clone(&backend), options).unwrap();
        let key = format!("clock:{:016x}", rand::random::<u64>());
        let ttl = Duration::from_millis(2500);
        let sql = format!(
            "SELECT (locked_until - locked_at) = $2::bigint * interval '1 microsecond', \
                    abs(extract(epoch FROM locked_at - (clock_timestamp() AT TIME ZONE 'UTC'))) < 5 \
             FROM {} WHERE key = $1",
            backend.qualified_table()
        );
        let inside = Arc::clone(&backend);
        let (k, q) = (key.clone(), sql.clone());
        let (exact_ttl, server_now) = tokio::time::timeout(
            Duration::from_secs(10),
            locker.with_lock_config(&key, &LockConfig::default().ttl(ttl), |_| async move {
                sqlx::query_as::<_, (bool, bool)>(&q)
                    .bind(&k)
                    .bind(2_500_000_i64)
                    .fetch_one(inside.pool())
                    .await
                    .unwrap()
            }),
        )
        .await
        .unwrap()
        .unwrap();
        assert!(exact_ttl, "locked_until - locked_at is the ttl, to the microsecond");
        assert!(server_now, "locked_at is the server's time in UTC");
    });
}

#[tokio::test]
async fn the_statements_read_time_from_the_database_only() {
    let backend = TestBackend::new(&database_url()).await.unwrap();
    for sql in backend.statements() {
        assert!(
            sql.contains("clock_timestamp() AT TIME ZONE 'UTC'"),
            "{sql}"
        );
        // The only values bound are the key, the owner, the ttl in
        // microseconds and the channels (the release's and the fair
        // queue's grants'); no timestamp parameter exists.
        assert!(!sql.contains("::timestamp"), "{sql}");
        assert!(!sql.contains("now()"), "{sql}");
        assert!(!sql.contains("$5"), "{sql}");
    }
}

/// \[H7\] The minimum hold counts from the row's own record of the
/// acquisition: after a callback that settled at once, `locked_until -
/// locked_at` is exactly the minimum, to the microsecond, however long the
/// driver took to send the hold step.
#[tokio::test]
async fn h7_the_minimum_hold_counts_from_locked_at() {
    let backend = Arc::new(TestBackend::new(&database_url()).await.unwrap());
    let locker = Locker::new(Arc::clone(&backend));
    let key = format!("hold:{:016x}", rand::random::<u64>());
    let hold = Duration::from_millis(1_500);
    let config = LockConfig::default().retry_attempts(0).hold_at_least(hold);
    locker
        .with_lock_config(&key, &config, |_| {
            // A callback that takes some of its minimum: the hold step's
            // own clock reading would give a later end.
            tokio::time::sleep(Duration::from_millis(200))
        })
        .await
        .unwrap();
    let sql = format!(
        "SELECT (locked_until - locked_at) = $2::bigint * interval '1 microsecond', \
                locked_by IS NOT NULL \
         FROM {} WHERE key = $1",
        backend.qualified_table()
    );
    let (exact, held) = sqlx::query_as::<_, (bool, bool)>(&sql)
        .bind(&key)
        .bind(1_500_000_i64)
        .fetch_one(backend.pool())
        .await
        .unwrap();
    assert!(held, "the row is left held, not released");
    assert!(exact, "locked_until - locked_at is the minimum hold");
}

//! SPEC H4 on PostgreSQL: `sequence`, the fencing token, never goes
//! backwards, even when the row is deleted (Ruby Locker's prune), since each
//! token is at least the database clock in microseconds; Ruby Locker's own
//! `sequence + 1` on the same table keeps it increasing; a table whose
//! `sequence` is too narrow for that (Ruby's test schema has `integer`) is
//! refused before anything is taken. And the error kinds the driver relies
//! on: no pooled connection is `Unavailable`, a statement sent and then
//! timed out stays `Timeout`.

use std::sync::Arc;
use std::time::Duration;

use lock_core::{
    AcquireOutcome, BackendErrorKind, Lease, LockBackend, LockConfig, LockError, Locker,
    OwnerToken, ReleaseOutcome,
};
use lock_postgres::testing::{TestBackend, TestSchema};
use lock_postgres::{PostgresBackend, PostgresConfig, SetupError};
use sqlx::postgres::PgPoolOptions;
use sqlx::PgPool;
use withlock_test_servers::postgres::database_url;

const SOON: Duration = Duration::from_secs(10);

/// The lock id of a Ruby Locker process, as its `locked_by`.
const RUBY_ID: &str = "ruby-host-42-0x7f";

fn key(name: &str) -> String {
    format!("fencing:{:016x}:{name}", rand::random::<u64>())
}

/// One `with_lock` on `key`; gives the token the callback saw.
async fn token(locker: &Locker, key: &str) -> u64 {
    tokio::time::timeout(
        SOON,
        locker.with_lock_config(
            key,
            &LockConfig::default().retry_attempts(0),
            |ctx| async move { ctx.fencing_token() },
        ),
    )
    .await
    .expect("with_lock answers in time")
    .unwrap()
}

/// The database clock in microseconds since the Unix epoch.
async fn db_micros(pool: &PgPool) -> u64 {
    let micros: i64 =
        sqlx::query_scalar("SELECT (extract(epoch FROM clock_timestamp()) * 1000000)::bigint")
            .fetch_one(pool)
            .await
            .unwrap();
    u64::try_from(micros).unwrap()
}

/// The row of `key`: `(locked_by, sequence)`, if there is one.
async fn row(pool: &PgPool, table: &str, key: &str) -> Option<(Option<String>, i64)> {
    sqlx::query_as(&format!(
        "SELECT locked_by, sequence::bigint FROM {table} WHERE key = $1"
    ))
    .bind(key)
    .fetch_optional(pool)
    .await
    .unwrap()
}

async fn delete_row(pool: &PgPool, table: &str, key: &str) {
    let deleted = sqlx::query(&format!("DELETE FROM {table} WHERE key = $1"))
        .bind(key)
        .execute(pool)
        .await
        .unwrap();
    assert_eq!(deleted.rows_affected(), 1);
}

/// Runs one of Ruby Locker's statements for its lock id; gives the number
/// of rows it changed.
async fn ruby(pool: &PgPool, sql: &str, key: &str) -> u64 {
    sqlx::query(sql)
        .bind(key)
        .bind(RUBY_ID)
        .execute(pool)
        .await
        .unwrap()
        .rows_affected()
}

/// The row deleted between acquisitions (as Ruby Locker's `prune` does):
/// the next token is still greater than every one before, and at least the
/// database clock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h4_a_deleted_row_does_not_restart_the_sequence() {
    let backend = Arc::new(TestBackend::new(&database_url()).await.unwrap());
    let (pool, table) = (backend.pool().clone(), backend.qualified_table().to_owned());
    let locker = Locker::new(Arc::clone(&backend));
    let key = key("deleted");
    let mut last = 0;
    for round in 0..3 {
        for _ in 0..2 {
            let next = token(&locker, &key).await;
            assert!(next > last, "round {round}: token {next} after {last}");
            assert_eq!(
                row(&pool, &table, &key).await,
                Some((None, i64::try_from(next).unwrap())),
                "released, and the row keeps the token"
            );
            last = next;
        }
        delete_row(&pool, &table, &key).await;
        let clock = db_micros(&pool).await;
        let next = token(&locker, &key).await;
        assert!(next > last, "after the deletion: token {next} after {last}");
        assert!(
            next >= clock,
            "token {next} below the database clock {clock}"
        );
        last = next;
    }
}

/// A row whose `sequence` is ahead of the clock (as after the clock stepped
/// back) counts on by one: the token is the greater of the two terms.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h4_a_sequence_ahead_of_the_clock_counts_on_by_one() {
    let backend = Arc::new(TestBackend::new(&database_url()).await.unwrap());
    let locker = Locker::new(Arc::clone(&backend));
    let key = key("ahead");
    token(&locker, &key).await;
    let ahead = db_micros(backend.pool()).await + 86_400 * 1_000_000;
    sqlx::query(&format!(
        "UPDATE {} SET sequence = $2 WHERE key = $1",
        backend.qualified_table()
    ))
    .bind(&key)
    .bind(i64::try_from(ahead).unwrap())
    .execute(backend.pool())
    .await
    .unwrap();
    assert_eq!(token(&locker, &key).await, ahead + 1);
    assert_eq!(token(&locker, &key).await, ahead + 2);
}

/// Ruby Locker's statements (its get, `sequence = sequence + 1`; its
/// release; a prune deleting the free row) interleaved with withlock's
/// acquisitions on one key: every holder's token is greater than the one
/// before, whichever side took the row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h4_ruby_locker_and_withlock_tokens_strictly_increase_together() {
    let backend = Arc::new(TestBackend::new(&database_url()).await.unwrap());
    let (pool, table) = (backend.pool().clone(), backend.qualified_table().to_owned());
    let locker = Locker::new(Arc::clone(&backend));
    let key = key("ruby");
    let ruby_get = format!(
        "UPDATE {table} SET locked_by = $2, \
         locked_at = clock_timestamp() at time zone 'UTC', \
         locked_until = clock_timestamp() at time zone 'UTC' + interval '30 seconds', \
         sequence = sequence + 1 \
         WHERE key = $1 AND (locked_by IS NULL OR locked_by = $2 \
         OR locked_until < clock_timestamp() at time zone 'UTC') \
         RETURNING sequence"
    );
    let ruby_release =
        format!("UPDATE {table} SET locked_by = NULL WHERE key = $1 AND locked_by = $2");
    let ruby_prune = format!("DELETE FROM {table} WHERE key = $1 AND locked_by IS NULL");

    let mut seen: Vec<(&str, u64)> = Vec::new();
    for _ in 0..3 {
        seen.push(("withlock", token(&locker, &key).await));
        let got: i64 = sqlx::query_scalar(&ruby_get)
            .bind(&key)
            .bind(RUBY_ID)
            .fetch_one(&pool)
            .await
            .expect("Locker gets the free row");
        seen.push(("ruby", u64::try_from(got).unwrap()));
        assert_eq!(ruby(&pool, &ruby_release, &key).await, 1);
        seen.push(("withlock", token(&locker, &key).await));
        assert_eq!(
            ruby(&pool, &ruby_prune, &key).await,
            1,
            "the free row is pruned"
        );
    }
    seen.push(("withlock", token(&locker, &key).await));
    assert!(
        seen.windows(2).all(|pair| pair[0].1 < pair[1].1),
        "tokens in acquisition order must strictly increase: {seen:?}"
    );
}

/// The Ruby gem's own test schema: `sequence integer`. The first
/// acquisition is refused with a clear error naming the table and the fix,
/// before anything is taken: no row is created, a free row stays free and
/// keeps its sequence. `migrate` leaves the table alone; once the column is
/// widened, the same backend works (a refusal is not remembered). The table
/// name needs quoting, so the check is seen to find it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h4_an_integer_sequence_column_is_refused_before_anything_is_taken() {
    let schema = TestSchema::create(&database_url()).await.unwrap();
    let pool = PgPoolOptions::new()
        .max_connections(4)
        .acquire_timeout(Duration::from_secs(5))
        .connect(&database_url())
        .await
        .unwrap();
    let name = r#"Ruby's "locks""#;
    let config = schema.config(PostgresConfig::default().table(name));
    let backend = PostgresBackend::with_config(pool.clone(), config).unwrap();
    let table = backend.qualified_table().to_owned();
    sqlx::raw_sql(&format!(
        "CREATE TABLE {table} (\
           id serial PRIMARY KEY, \
           key varchar(255) NOT NULL UNIQUE, \
           locked_by varchar(255), \
           locked_at timestamp, \
           locked_until timestamp, \
           sequence integer NOT NULL DEFAULT 0)"
    ))
    .execute(&pool)
    .await
    .unwrap();
    backend
        .migrate()
        .await
        .expect("migrate leaves an existing table alone");
    let column_type = || async {
        sqlx::query_scalar::<_, String>(
            "SELECT data_type FROM information_schema.columns \
             WHERE table_schema = $1 AND table_name = $2 AND column_name = 'sequence'",
        )
        .bind(schema.name())
        .bind(name)
        .fetch_one(&pool)
        .await
        .unwrap()
    };
    assert_eq!(column_type().await, "integer");
    // A row Ruby Locker made and released.
    let (fresh, ruby_row) = (key("fresh"), key("ruby-row"));
    sqlx::query(&format!(
        "INSERT INTO {table} (key, locked_by, locked_until, sequence) VALUES ($1, NULL, NULL, 7)"
    ))
    .bind(&ruby_row)
    .execute(&pool)
    .await
    .unwrap();

    let owner = OwnerToken::new("a");
    let ttl = Duration::from_secs(30);
    for k in [&fresh, &ruby_row] {
        let error = backend
            .try_acquire(k, &owner, ttl)
            .await
            .expect_err("an integer sequence is refused");
        assert_eq!(error.kind(), BackendErrorKind::Setup, "{error:?}");
        match error.inner().downcast_ref::<SetupError>() {
            Some(SetupError::NarrowSequence { table: t, found }) => {
                assert_eq!(t, &table);
                assert_eq!(found, "integer");
            }
            other => panic!("expected NarrowSequence, got {other:?}"),
        }
        let message = error.inner().to_string();
        for part in [
            table.as_str(),
            "\"sequence\"",
            "integer",
            "ALTER TABLE",
            "ALTER COLUMN sequence TYPE bigint",
        ] {
            assert!(message.contains(part), "{part:?} not in {message:?}");
        }
    }
    assert_eq!(row(&pool, &table, &fresh).await, None, "no row was created");
    assert_eq!(
        row(&pool, &table, &ruby_row).await,
        Some((None, 7)),
        "the free row stays free and keeps its sequence"
    );
    let got = tokio::time::timeout(
        SOON,
        Locker::new(backend.clone()).with_lock_config(
            &fresh,
            // [A8] The default ten retries: a setup error ends the call at
            // the first attempt all the same.
            &LockConfig::default(),
            |_| async { panic!("the callback must not run") },
        ),
    )
    .await
    .unwrap();
    match got {
        Err(LockError::NotAcquired {
            source: Some(e),
            attempts,
            ..
        }) => {
            assert_eq!(e.kind(), BackendErrorKind::Setup);
            assert_eq!(attempts, 1, "a8: a setup error is not retried");
        }
        other => panic!("expected NotAcquired with the refusal, got {other:?}"),
    }
    assert_eq!(row(&pool, &table, &fresh).await, None);

    // Widened: the same backend takes both keys now.
    sqlx::raw_sql(&format!(
        "ALTER TABLE {table} ALTER COLUMN sequence TYPE bigint"
    ))
    .execute(&pool)
    .await
    .unwrap();
    let clock = db_micros(&pool).await;
    for k in [&fresh, &ruby_row] {
        let AcquireOutcome::Acquired { fencing_token } =
            backend.try_acquire(k, &owner, ttl).await.unwrap()
        else {
            panic!("{k} is free");
        };
        assert!(
            fencing_token >= clock,
            "token {fencing_token} below {clock}"
        );
        assert_eq!(
            backend
                .release(&Lease::new(k.as_str(), owner.clone(), fencing_token))
                .await
                .unwrap(),
            ReleaseOutcome::Released
        );
    }
    drop(backend);
    pool.close().await;
    schema.drop_now().await.unwrap();
}

/// A pool that cannot connect (nothing listens on the port): every step
/// fails with kind `Unavailable`, the statement was never sent, and the
/// source is sqlx's pool error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h4_a_pool_that_cannot_connect_is_unavailable() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let pool = PgPoolOptions::new()
        .acquire_timeout(Duration::from_millis(300))
        .connect_lazy(&format!("postgres://postgres@127.0.0.1:{port}/test"))
        .unwrap();
    let backend = PostgresBackend::with_config(pool, PostgresConfig::default()).unwrap();
    let owner = OwnerToken::new("a");
    let ttl = Duration::from_secs(30);
    let lease = Lease::new("k", owner.clone(), 1);
    let errors = [
        (
            "acquisition",
            backend.try_acquire("k", &owner, ttl).await.err(),
        ),
        ("extension", backend.extend(&lease, ttl).await.err()),
        ("release", backend.release(&lease).await.err()),
    ];
    for (step, error) in errors {
        let error = error.unwrap_or_else(|| panic!("{step} succeeded"));
        assert_eq!(
            error.kind(),
            BackendErrorKind::Unavailable,
            "{step}: {error:?}"
        );
        assert!(!error.may_have_reached_store());
        assert!(
            error.inner().downcast_ref::<sqlx::Error>().is_some(),
            "{step}: the sqlx error is the source: {error:?}"
        );
    }
}

/// The contrast: an acquisition sent and then cut off by the statement
/// timeout (the row is locked by an open transaction) may still be applied
/// by the server, so it stays `Timeout`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h4_a_statement_sent_and_timed_out_stays_a_timeout() {
    let config = PostgresConfig::default().step_timeout(Duration::from_millis(500));
    let backend = TestBackend::with_config(&database_url(), config)
        .await
        .unwrap();
    let key = key("blocked");
    let owner = OwnerToken::new("a");
    let ttl = Duration::from_secs(30);
    let AcquireOutcome::Acquired { fencing_token } =
        backend.try_acquire(&key, &owner, ttl).await.unwrap()
    else {
        panic!("the key is free");
    };
    backend
        .release(&Lease::new(key.as_str(), owner.clone(), fencing_token))
        .await
        .unwrap();
    let mut blocker = backend.pool().begin().await.unwrap();
    sqlx::query(&format!(
        "SELECT 1 FROM {} WHERE key = $1 FOR UPDATE",
        backend.qualified_table()
    ))
    .bind(&key)
    .execute(&mut *blocker)
    .await
    .unwrap();
    let error = tokio::time::timeout(SOON, backend.try_acquire(&key, &owner, ttl))
        .await
        .unwrap()
        .expect_err("the row is locked");
    blocker.rollback().await.unwrap();
    assert_eq!(error.kind(), BackendErrorKind::Timeout, "{error:?}");
    assert!(error.may_have_reached_store());
}

//! Bad and awkward input: keys with quotes, semicolons and unicode, a
//! 1024-byte key, a table name that needs quoting, an unreachable URL, a
//! config that does not validate, and no password in `Debug`.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use lock_core::{InvalidInput, LockConfig, LockError, Locker};
use lock_postgres::testing::TestBackend;
use lock_postgres::{PostgresBackend, PostgresConfig, SetupError};
use sqlx::postgres::PgPoolOptions;
use withlock_test_servers::postgres::database_url;

const SOON: Duration = Duration::from_secs(10);

async fn holder(backend: &TestBackend, key: &str) -> Option<(Option<String>, i64)> {
    sqlx::query_as(&format!(
        "SELECT locked_by, sequence FROM {} WHERE key = $1",
        backend.qualified_table()
    ))
    .bind(key)
    .fetch_optional(backend.pool())
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn awkward_keys_are_stored_verbatim() {
    let backend = Arc::new(TestBackend::new(&database_url()).await.unwrap());
    let locker = Locker::new(Arc::clone(&backend));
    let ns = format!("bad:{:016x}:", rand::random::<u64>());
    let long = format!("{ns}{}", "k".repeat(1024 - ns.len()));
    assert_eq!(long.len(), 1024);
    let keys = [
        format!("{ns}it's \"quoted\""),
        format!("{ns}'; DROP TABLE locks; --"),
        format!("{ns}a;b;c $1 $$ \\ %_*{{}}"),
        format!("{ns}ключ 鍵 🔒 é"),
        format!("{ns} spaces and\ttabs\nnewline"),
        long,
    ];
    for key in &keys {
        let k = key.clone();
        let inside = Arc::clone(&backend);
        let seen = tokio::time::timeout(
            SOON,
            locker.with_lock(key, |ctx| async move {
                let row = holder(&inside, &k).await.expect("the row exists");
                (ctx.fencing_token(), row)
            }),
        )
        .await
        .unwrap()
        .unwrap();
        let (token, (locked_by, sequence)) = seen;
        assert!(locked_by.is_some(), "held while the callback ran: {key:?}");
        assert_eq!(sequence, i64::try_from(token).unwrap());
        let (locked_by, _) = holder(&backend, key).await.unwrap();
        assert_eq!(locked_by, None, "released: {key:?}");
    }
    let too_long = "x".repeat(1025);
    let refused = locker.with_lock(&too_long, |_| async {}).await;
    assert!(matches!(
        refused,
        Err(LockError::InvalidInput(InvalidInput::KeyTooLong {
            len: 1025,
            max: 1024
        }))
    ));
    assert!(
        holder(&backend, &too_long).await.is_none(),
        "nothing touched"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_name_that_needs_quoting_works_end_to_end() {
    let name = r#"My "Locks"; drop"#;
    let config = PostgresConfig::default().table(name);
    let backend = Arc::new(
        TestBackend::with_config(&database_url(), config)
            .await
            .unwrap(),
    );
    assert!(backend
        .qualified_table()
        .ends_with(r#"."My ""Locks""; drop""#));
    backend
        .migrate()
        .await
        .expect("the migration is idempotent");
    let exists: bool = sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM pg_tables WHERE schemaname = $1 AND tablename = $2)",
    )
    .bind(backend.schema().name())
    .bind(name)
    .fetch_one(backend.pool())
    .await
    .unwrap();
    assert!(exists, "the table has exactly the configured name");
    let locker = Locker::new(Arc::clone(&backend));
    let first = locker
        .with_lock("k", |ctx| async move { ctx.fencing_token() })
        .await
        .unwrap();
    let second = locker
        .with_lock("k", |ctx| async move { ctx.fencing_token() })
        .await
        .unwrap();
    assert!(second > first, "token {second} after {first}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_url_is_a_clear_error_and_nothing_is_held() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let url = format!("postgres://postgres:s3cret@127.0.0.1:{port}/test");
    let config = PostgresConfig::default().step_timeout(Duration::from_millis(800));
    let err = tokio::time::timeout(SOON, PostgresBackend::connect_with(&url, config.clone()))
        .await
        .expect("from_url gives up in time")
        .expect_err("nothing listens there");
    assert!(matches!(err, SetupError::Connect(_)), "{err:?}");
    assert_eq!(err.to_string(), "could not connect to PostgreSQL");
    assert!(!format!("{err:?}").contains("s3cret"));

    // A lazy pool: the steps fail, the callback never runs.
    let pool = PgPoolOptions::new()
        .acquire_timeout(Duration::from_millis(500))
        .connect_lazy(&url)
        .unwrap();
    let backend = PostgresBackend::with_config(pool, config).unwrap();
    let debug = format!("{backend:?}");
    assert!(!debug.contains("s3cret"), "no password in Debug: {debug}");
    assert!(debug.contains(&port.to_string()));
    let ran = Arc::new(AtomicBool::new(false));
    let flag = Arc::clone(&ran);
    let got = tokio::time::timeout(
        SOON,
        Locker::new(backend).with_lock_config(
            "k",
            &LockConfig::default().retry_attempts(0),
            |_| async move { flag.store(true, Ordering::SeqCst) },
        ),
    )
    .await
    .unwrap();
    match got {
        Err(LockError::NotAcquired {
            source: Some(e), ..
        }) => {
            assert!(e.inner().downcast_ref::<sqlx::Error>().is_some(), "{e:?}");
            assert!(!format!("{e:?} {e}").contains("s3cret"));
        }
        other => panic!("expected NotAcquired with a source, got {other:?}"),
    }
    assert!(!ran.load(Ordering::SeqCst));
}

#[tokio::test]
async fn a_bad_config_is_refused_before_anything_runs() {
    let pool = PgPoolOptions::new().connect_lazy(&database_url()).unwrap();
    for (config, field) in [
        (PostgresConfig::default().table(""), "table"),
        (PostgresConfig::default().schema("s".repeat(64)), "schema"),
        (PostgresConfig::default().channel(""), "channel"),
        (
            PostgresConfig::default().step_timeout(Duration::ZERO),
            "step_timeout",
        ),
    ] {
        match PostgresBackend::with_config(pool.clone(), config) {
            Err(SetupError::InvalidConfig { field: f, .. }) => assert_eq!(f, field),
            other => panic!("expected InvalidConfig for {field}, got {other:?}"),
        }
    }
}

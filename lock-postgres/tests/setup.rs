//! Setting the backend up: `from_url` is lazy and `connect` checks the
//! database, as on every backend.

use lock_core::{BackendErrorKind, LockBackend, Locker, OwnerToken};
use lock_postgres::testing::TestSchema;
use lock_postgres::{PostgresBackend, SetupError};
use withlock_test_servers::postgres::database_url;

fn closed_port_url() -> String {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    format!("postgres://postgres@127.0.0.1:{port}/test")
}

#[tokio::test]
async fn from_url_connects_nothing_and_connect_checks_the_database() {
    let url = closed_port_url();
    let lazy = PostgresBackend::from_url(&url).expect("from_url is lazy");
    let step = lazy
        .try_acquire(
            "k",
            &OwnerToken::new("a"),
            std::time::Duration::from_secs(1),
        )
        .await
        .expect_err("nothing listens there");
    assert_eq!(step.kind(), BackendErrorKind::Unavailable);
    assert!(matches!(
        PostgresBackend::connect(&url).await,
        Err(SetupError::Connect(_))
    ));
    assert!(matches!(
        PostgresBackend::from_url("not a url"),
        Err(SetupError::InvalidUrl(_))
    ));

    let url = database_url();
    let schema = TestSchema::create(&url).await.unwrap();
    let backend = PostgresBackend::from_url_with(&url, schema.config(Default::default())).unwrap();
    backend.migrate().await.unwrap();
    Locker::new(backend)
        .with_lock("lazy-then-used", |_| async {})
        .await
        .unwrap();
    schema.drop_now().await.unwrap();
}

#[test]
fn the_config_loads_from_a_file_with_human_durations() {
    let config: lock_postgres::PostgresConfig =
        serde_json::from_str(r#"{"schema": "jobs", "table": "job_locks", "step_timeout": "1s"}"#)
            .unwrap();
    assert_eq!(
        config,
        lock_postgres::PostgresConfig::default()
            .schema("jobs")
            .table("job_locks")
            .step_timeout(std::time::Duration::from_secs(1))
    );
}

/// SPEC A8: a permanent setup error (a missing lock table, a role the
/// server does not know, a missing database) ends the call at its first
/// attempt with that error as its source, with the default ten retries.
#[tokio::test]
async fn a8_setup_errors_are_not_retried() {
    use lock_core::{LockConfig, LockError};
    let url = database_url();
    let schema = TestSchema::create(&url).await.unwrap();
    let base = url
        .rsplit_once('@')
        .map_or("127.0.0.1:5432/test", |(_, rest)| rest);
    let host = base.split_once('/').map_or(base, |(host, _)| host);
    let cases = [
        ("a missing table", url.clone()),
        (
            "an unknown role",
            format!("postgres://withlock_no_such_role@{host}/test"),
        ),
        (
            "a missing database",
            format!("postgres://postgres@{host}/withlock_no_such_db"),
        ),
    ];
    for (what, case_url) in cases {
        // No `migrate`: the schema has no lock table.
        let backend =
            PostgresBackend::from_url_with(&case_url, schema.config(Default::default())).unwrap();
        let got = tokio::time::timeout(
            std::time::Duration::from_secs(15),
            Locker::new(backend).with_lock_config("a8", &LockConfig::default(), |_| async {
                panic!("the callback must not run")
            }),
        )
        .await
        .unwrap_or_else(|_| panic!("{what}: retried instead of said at once"));
        match got {
            Err(LockError::NotAcquired {
                attempts,
                source: Some(e),
                ..
            }) => {
                assert_eq!(e.kind(), BackendErrorKind::Setup, "{what}: {e:?}");
                assert_eq!(attempts, 1, "{what}: a setup error is not retried");
            }
            other => panic!("{what}: expected NotAcquired with the refusal, got {other:?}"),
        }
    }
    schema.drop_now().await.unwrap();
}

//! DDL runs only through `withlock migrate` \[D3\]: `run` on a missing
//! table exits 78 naming `withlock migrate` and creates nothing, and a
//! role with only DML rights on the table (and USAGE on its id sequence)
//! runs jobs.

mod common;

use common::{code, finish, stderr, stdout, withlock, Role, Scratch, Store};
use lock_postgres::testing::TestSchema;
use withlock_test_servers::postgres::database_url;

async fn table_exists(schema: &str) -> bool {
    let pool = lock_postgres::sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect(&database_url())
        .await
        .unwrap();
    let found: Option<String> =
        lock_postgres::sqlx::query_scalar("SELECT to_regclass(format('%I.locks', $1::text))::text")
            .bind(schema)
            .fetch_one(&pool)
            .await
            .unwrap();
    pool.close().await;
    found.is_some()
}

#[tokio::test]
async fn d3_run_runs_no_ddl_and_names_migrate() {
    let schema = TestSchema::create(&database_url()).await.unwrap();
    let args = ["--url", &database_url(), "--schema", schema.name()].map(str::to_owned);
    let scratch = Scratch::new();
    let ran = scratch.path("ran").display().to_string();

    let output = finish(
        withlock(["run"])
            .args(&args)
            .args(["--key", "k", "--", "touch", &ran]),
    )
    .await;
    let message = stderr(&output);
    assert_eq!(code(&output), 78, "{message}");
    assert!(message.contains("withlock migrate"), "{message}");
    assert!(!scratch.path("ran").exists(), "the command ran");
    assert!(!table_exists(schema.name()).await, "run created the table");

    for _ in 0..2 {
        let output = finish(withlock(["migrate"]).args(&args)).await;
        assert_eq!(code(&output), 0, "{}", stderr(&output));
        assert!(stdout(&output).contains("ready"), "{}", stdout(&output));
        assert!(table_exists(schema.name()).await);
    }
    let output = finish(
        withlock(["run"])
            .args(&args)
            .args(["--key", "k", "--", "touch", &ran]),
    )
    .await;
    assert_eq!(code(&output), 0, "{}", stderr(&output));
    assert!(scratch.path("ran").exists());
}

#[tokio::test]
async fn d3_a_role_with_dml_rights_only_runs_jobs() {
    let store = Store::postgres().await;
    let schema = store.args()[3].clone();
    let role = Role::create("LOGIN").await;
    common::sql(&format!(
        "GRANT USAGE ON SCHEMA \"{schema}\" TO \"{r}\"; \
         GRANT SELECT, INSERT, UPDATE, DELETE ON \"{schema}\".locks TO \"{r}\"; \
         GRANT USAGE ON SEQUENCE \"{schema}\".locks_id_seq TO \"{r}\"",
        r = role.name
    ))
    .await;
    let mut args = store.args();
    args[1] = role.url();
    let key = store.key("least privilege");
    let scratch = Scratch::new();
    let mut tokens = Vec::new();
    for _ in 0..2 {
        let script = format!("echo $WITHLOCK_FENCING_TOKEN > {}", scratch.sh("token"));
        let output = finish(
            withlock(["run"])
                .args(&args)
                .args(["--key", &key, "--", "sh", "-c", &script]),
        )
        .await;
        assert_eq!(code(&output), 0, "{}", stderr(&output));
        let token: u64 = common::appears(&scratch.path("token"))
            .await
            .trim()
            .parse()
            .unwrap();
        tokens.push(token);
        std::fs::remove_file(scratch.path("token")).unwrap();
    }
    assert!(tokens[1] > tokens[0], "{tokens:?}");
    assert_eq!(store.stored(&key).await.owner, None, "released");
    // The admin reads work with the same rights.
    let output = finish(withlock(["status"]).args(&args).arg(&key)).await;
    assert_eq!(code(&output), 1, "{}", stderr(&output));
    // The migration needs more: refused, 77.
    let output = finish(withlock(["migrate"]).args(&args)).await;
    assert_eq!(code(&output), 77, "{}", stderr(&output));
    assert!(
        stderr(&output).contains("permission denied"),
        "{}",
        stderr(&output)
    );
}

#[tokio::test]
async fn migrate_on_redis_has_nothing_to_do() {
    let store = Store::redis().await;
    let output = finish(&mut store.cmd("migrate")).await;
    assert_eq!(code(&output), 0, "{}", stderr(&output));
    assert!(
        stdout(&output).contains("nothing to do"),
        "{}",
        stdout(&output)
    );
}

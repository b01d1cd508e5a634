//! Test support for your own tests on PostgreSQL: a lock table in a
//! schema of its own on a shared server, dropped afterwards.
//!
//! The crate's own tests use it; so can yours.
//!
//! - [`TestSchema`] makes a schema named `withlock_test_<unix secs>_<random>`
//!   and drops it when dropped. Schemas of this prefix older than an hour
//!   (left by a killed test run) are dropped when the first schema of a
//!   process is made.
//! - [`TestBackend`] is a [`PostgresBackend`] on a fresh pool, with a
//!   [`TestSchema`] of its own and a random `application_name`, so that a
//!   test can find (and [`terminate_connections`]) exactly its own
//!   connections.
//! - With the `testcontainers` feature, `docker()` starts PostgreSQL in
//!   Docker.
//!
//! Everything waits with a bound: no helper here can hang a test. (The
//! PostgreSQL servers the workspace's own tests stop and restart are in its
//! unpublished `withlock-test-servers` crate.)

use std::fmt;
use std::ops::Deref;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use sqlx::ConnectOptions;

use crate::{quote_identifier, PostgresBackend, PostgresConfig, SetupError};

/// The prefix of every schema [`TestSchema`] makes.
pub const SCHEMA_PREFIX: &str = "withlock_test_";

/// How old a leftover test schema must be before a new run drops it.
pub const STALE_AFTER: Duration = Duration::from_secs(3600);

/// The bound on each helper's wait for the database.
const WAIT: Duration = Duration::from_secs(10);

/// What a test helper can fail with.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TestError {
    /// The database refused or failed.
    #[error("test database step failed")]
    Database(#[from] sqlx::Error),
    /// The backend could not be made or migrated.
    #[error("test backend setup failed")]
    Backend(#[from] SetupError),
    /// A helper did not finish within its bound.
    #[error("test helper timed out: {0}")]
    Timeout(&'static str),
}

/// A one-connection pool of its own for a helper's statements (a pool
/// rather than a bare connection keeps the helpers' futures `Send` in
/// generic code).
async fn admin_pool(url: &str) -> Result<PgPool, TestError> {
    let options: PgConnectOptions = url.parse()?;
    bounded(
        "connect",
        PgPoolOptions::new()
            .max_connections(1)
            .acquire_timeout(WAIT)
            .connect_with(options.application_name("withlock-test-admin")),
    )
    .await
}

async fn bounded<T>(
    what: &'static str,
    fut: impl std::future::Future<Output = Result<T, sqlx::Error>>,
) -> Result<T, TestError> {
    match tokio::time::timeout(WAIT, fut).await {
        Ok(result) => Ok(result?),
        Err(_) => Err(TestError::Timeout(what)),
    }
}

/// A schema of its own for one test, holding the lock table.
///
/// Dropping it drops the schema with everything in it, from a helper
/// thread with a runtime and a connection of its own (so it works while
/// the test's runtime shuts down); [`drop_now`](Self::drop_now) does it
/// asynchronously. A schema that could not be dropped is dropped by a later
/// run once it is older than [`STALE_AFTER`].
pub struct TestSchema {
    url: String,
    name: String,
    dropped: bool,
}

impl TestSchema {
    /// Makes a new schema on the server at `url`.
    ///
    /// # Errors
    ///
    /// [`TestError`] when the server cannot be reached in time.
    pub async fn create(url: &str) -> Result<Self, TestError> {
        let conn = admin_pool(url).await?;
        static CLEANED: AtomicBool = AtomicBool::new(false);
        if !CLEANED.swap(true, Ordering::SeqCst) {
            drop_stale_schemas(&conn).await?;
        }
        let secs = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let name = format!("{SCHEMA_PREFIX}{secs}_{:016x}", rand::random::<u64>());
        let create = format!("CREATE SCHEMA {}", quote_identifier(&name));
        bounded("create schema", sqlx::raw_sql(&create).execute(&conn)).await?;
        conn.close().await;
        Ok(Self {
            url: url.to_owned(),
            name,
            dropped: false,
        })
    }

    /// The schema's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// `config` with the schema set to this one and the channel to the
    /// schema's name, so that tests do not hear each other's releases.
    pub fn config(&self, config: PostgresConfig) -> PostgresConfig {
        config.schema(self.name.clone()).channel(self.name.clone())
    }

    /// Drops the schema now.
    ///
    /// # Errors
    ///
    /// [`TestError`] when the server cannot be reached in time; the schema
    /// is then left for a later run to drop.
    pub async fn drop_now(mut self) -> Result<(), TestError> {
        self.dropped = true;
        drop_schema(&self.url, &self.name).await
    }
}

impl fmt::Debug for TestSchema {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TestSchema")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

impl Drop for TestSchema {
    fn drop(&mut self) {
        if self.dropped {
            return;
        }
        let (url, name) = (self.url.clone(), self.name.clone());
        // A thread with a runtime of its own: the test's runtime may be
        // shutting down, and blocking one of its workers on it would hang.
        let helper = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            runtime
                .block_on(drop_schema(&url, &name))
                .map_err(std::io::Error::other)
        });
        // Not waited for on the background thread that every locker of
        // the process shares (the last lock's clean-up may drop the last
        // reference there): blocking it on a database that does not
        // answer would stall the other tests' locks meanwhile. What the
        // process does not finish, a later run drops as stale.
        if std::thread::current().name() == Some(lock_core::background::THREAD_NAME) {
            return;
        }
        if let Ok(Err(error)) = helper.join() {
            tracing::warn!(%error, schema = %self.name, "test schema left for a later run to drop");
        }
    }
}

async fn drop_schema(url: &str, name: &str) -> Result<(), TestError> {
    let conn = admin_pool(url).await?;
    // Waits for statements of connections just closed, within a bound.
    let sql = format!(
        "SET lock_timeout = '5s'; DROP SCHEMA IF EXISTS {} CASCADE",
        quote_identifier(name)
    );
    bounded("drop schema", sqlx::raw_sql(&sql).execute(&conn)).await?;
    conn.close().await;
    Ok(())
}

/// Drops the schemas of [`SCHEMA_PREFIX`] whose creation time, in their
/// name, is older than [`STALE_AFTER`].
async fn drop_stale_schemas(conn: &PgPool) -> Result<(), TestError> {
    let names: Vec<String> = bounded(
        "list schemas",
        sqlx::query_scalar("SELECT nspname::text FROM pg_namespace WHERE starts_with(nspname, $1)")
            .bind(SCHEMA_PREFIX)
            .fetch_all(conn),
    )
    .await?;
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    for name in names {
        let created = name
            .strip_prefix(SCHEMA_PREFIX)
            .and_then(|rest| rest.split('_').next())
            .and_then(|secs| secs.parse::<u64>().ok());
        if created.is_some_and(|c| now.saturating_sub(c) > STALE_AFTER.as_secs()) {
            let sql = format!("DROP SCHEMA IF EXISTS {} CASCADE", quote_identifier(&name));
            // Best effort: another run may be dropping it too.
            let _ = bounded("drop stale schema", sqlx::raw_sql(&sql).execute(conn)).await;
        }
    }
    Ok(())
}

/// A [`PostgresBackend`] on a pool of its own, with its lock table in a
/// [`TestSchema`] of its own that is dropped with it.
///
/// It is a [`LockBackend`](lock_core::LockBackend) itself (forwarding every step), so a
/// conformance factory can return it: the schema lives exactly as long as
/// the last locker that uses it.
pub struct TestBackend {
    // Field order matters: the backend (its pool and listener) goes first,
    // then the schema.
    backend: PostgresBackend,
    application_name: String,
    schema: TestSchema,
}

impl TestBackend {
    /// A backend with the default config on the server at `url`.
    ///
    /// # Errors
    ///
    /// [`TestError`] when the server cannot be reached or the migration
    /// fails.
    pub async fn new(url: &str) -> Result<Self, TestError> {
        Self::with_config(url, PostgresConfig::default()).await
    }

    /// A backend with `config` (its schema and channel replaced by the test
    /// schema's) on the server at `url`. The pool holds up to 8
    /// connections, gives up acquiring one after 1.5 s, and names its
    /// connections with a random [`application_name`](Self::application_name).
    ///
    /// # Errors
    ///
    /// [`TestError`] when the server cannot be reached or the migration
    /// fails.
    pub async fn with_config(url: &str, config: PostgresConfig) -> Result<Self, TestError> {
        let schema = TestSchema::create(url).await?;
        let application_name = format!("withlock-test-{:016x}", rand::random::<u64>());
        let options: PgConnectOptions = url.parse()?;
        let options = options
            .application_name(&application_name)
            .log_statements(tracing::log::LevelFilter::Trace);
        let pool = PgPoolOptions::new()
            .max_connections(8)
            .acquire_timeout(Duration::from_millis(1500))
            .connect_lazy_with(options);
        let backend = PostgresBackend::with_config(pool, schema.config(config))?;
        match tokio::time::timeout(WAIT, backend.migrate()).await {
            Ok(result) => result?,
            Err(_) => return Err(TestError::Timeout("migrate")),
        }
        Ok(Self {
            backend,
            application_name,
            schema,
        })
    }

    /// The backend (cloning it keeps the pool, not the schema).
    pub fn backend(&self) -> &PostgresBackend {
        &self.backend
    }

    /// The `application_name` of every connection of this backend,
    /// including its listening connection.
    pub fn application_name(&self) -> &str {
        &self.application_name
    }

    /// The test schema.
    pub fn schema(&self) -> &TestSchema {
        &self.schema
    }
}

impl Deref for TestBackend {
    type Target = PostgresBackend;

    fn deref(&self) -> &PostgresBackend {
        &self.backend
    }
}

impl fmt::Debug for TestBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TestBackend")
            .field("backend", &self.backend)
            .field("schema", &self.schema)
            .finish()
    }
}

lock_core::forward_lock_backend!(TestBackend => backend);
lock_core::forward_lock_admin!(TestBackend => backend);

/// Terminates the connections whose `application_name` is `name`, with
/// `pg_terminate_backend`, from a connection of its own to `url`. Returns
/// how many were terminated. Only ever touches connections of that name.
///
/// # Errors
///
/// [`TestError`] when the server cannot be reached in time.
pub async fn terminate_connections(
    url: &str,
    name: &str,
    only_listening: bool,
) -> Result<u64, TestError> {
    let conn = admin_pool(url).await?;
    let filter = if only_listening {
        "AND query LIKE 'LISTEN %'"
    } else {
        ""
    };
    let sql = format!(
        "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid))::bigint \
         FROM pg_stat_activity WHERE application_name = $1 AND pid <> pg_backend_pid() {filter}"
    );
    let n: i64 = bounded(
        "terminate",
        sqlx::query_scalar(&sql).bind(name).fetch_one(&conn),
    )
    .await?;
    conn.close().await;
    Ok(u64::try_from(n).unwrap_or(0))
}

/// PostgreSQL in Docker, for machines with a Docker engine and no local
/// installation: returns the running container (stopped when dropped) and
/// the URL of its `postgres` database.
///
/// # Errors
///
/// The error of testcontainers when Docker is not available.
#[cfg(feature = "testcontainers")]
pub async fn docker() -> Result<
    (
        testcontainers::ContainerAsync<testcontainers_modules::postgres::Postgres>,
        String,
    ),
    testcontainers::TestcontainersError,
> {
    use testcontainers::runners::AsyncRunner;

    let container = testcontainers_modules::postgres::Postgres::default()
        .with_host_auth()
        .start()
        .await?;
    let host = container.get_host().await?;
    let port = container.get_host_port_ipv4(5432).await?;
    Ok((
        container,
        format!("postgres://postgres@{host}:{port}/postgres"),
    ))
}

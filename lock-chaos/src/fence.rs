//! The fenced store: a table of its own on a PostgreSQL server that is not
//! under test, one row per key, that takes a write only with a fencing
//! token at least as high as any it has seen (equal only from the same
//! writer, so that one section may write twice).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use lock_postgres::quote_identifier;
use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};

use crate::event::WriteResult;

/// The prefix of every fence table.
pub const TABLE_PREFIX: &str = "chaos_fence_";

/// Fence tables older than this (left by a killed run) are dropped by the
/// next run.
pub const STALE_AFTER: Duration = Duration::from_secs(3600);

/// The bound on each statement, connecting included.
pub const STATEMENT_TIMEOUT: Duration = Duration::from_secs(3);

/// What the fence store can fail with.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FenceError {
    /// The database refused or failed.
    #[error("fence store statement failed")]
    Database(#[from] sqlx::Error),
    /// A statement did not finish within [`STATEMENT_TIMEOUT`].
    #[error("fence store step timed out: {0}")]
    Timeout(&'static str),
    /// The URL names a host that is not on this machine.
    #[error("the fence store must be on a loopback address, not {0:?}")]
    NotLoopback(String),
}

/// Whether `host` (as a URL gives it) is this machine: a loopback address,
/// `localhost`, or a Unix socket directory.
pub fn is_loopback(host: &str) -> bool {
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    bare == "localhost"
        || bare.starts_with('/')
        || bare
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

async fn bounded<T>(
    what: &'static str,
    fut: impl std::future::Future<Output = Result<T, sqlx::Error>>,
) -> Result<T, FenceError> {
    match tokio::time::timeout(STATEMENT_TIMEOUT, fut).await {
        Ok(result) => Ok(result?),
        Err(_) => Err(FenceError::Timeout(what)),
    }
}

fn pool(url: &str, connections: u32) -> Result<PgPool, FenceError> {
    let options: PgConnectOptions = url.parse()?;
    if !is_loopback(options.get_host()) {
        return Err(FenceError::NotLoopback(options.get_host().to_owned()));
    }
    Ok(PgPoolOptions::new()
        .max_connections(connections)
        .acquire_timeout(STATEMENT_TIMEOUT)
        .connect_lazy_with(options.application_name("withlock-chaos-fence")))
}

/// A connection to the fence table.
#[derive(Clone, Debug)]
pub struct FenceStore {
    pool: PgPool,
    table: String,
    update: String,
}

impl FenceStore {
    /// Creates a fence table with one row per key (token 0) on the server
    /// at `url`, after dropping stale fence tables of killed runs.
    ///
    /// # Errors
    ///
    /// [`FenceError`] when the server cannot be reached in time or is not
    /// on this machine.
    pub async fn create(url: &str, keys: &[String]) -> Result<Self, FenceError> {
        let pool = pool(url, 2)?;
        drop_stale_tables(&pool).await?;
        let secs = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let table = format!("{TABLE_PREFIX}{secs}_{:08x}", rand::random::<u32>());
        let quoted = quote_identifier(&table);
        let create = format!(
            "CREATE TABLE {quoted} (key text PRIMARY KEY, token bigint NOT NULL, \
             writer text, writes bigint NOT NULL DEFAULT 0)"
        );
        bounded("create", sqlx::raw_sql(&create).execute(&pool)).await?;
        let insert = format!("INSERT INTO {quoted} (key, token) SELECT unnest($1::text[]), 0");
        bounded("insert", sqlx::query(&insert).bind(keys).execute(&pool)).await?;
        Ok(Self::with_pool(pool, table))
    }

    /// Connects to the fence table `table` made by [`create`](Self::create),
    /// with a pool of up to `connections`. Nothing connects yet.
    ///
    /// # Errors
    ///
    /// [`FenceError`] when `url` does not parse or is not on this machine.
    pub fn connect(url: &str, table: &str, connections: u32) -> Result<Self, FenceError> {
        Ok(Self::with_pool(pool(url, connections)?, table.to_owned()))
    }

    fn with_pool(pool: PgPool, table: String) -> Self {
        let update = format!(
            "UPDATE {} SET token = $1, writer = $2, writes = writes + 1 \
             WHERE key = $3 AND (token < $1 OR (token = $1 AND writer = $2))",
            quote_identifier(&table)
        );
        Self {
            pool,
            table,
            update,
        }
    }

    /// The table's name.
    pub fn table(&self) -> &str {
        &self.table
    }

    /// Writes `token` for `key` as `writer`: accepted when no higher token
    /// (and no equal one from another writer) was written before.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future may or may not leave the write applied.
    pub async fn write(&self, key: &str, token: u64, writer: &str) -> WriteResult {
        let token = i64::try_from(token).unwrap_or(i64::MAX);
        let update = sqlx::query(&self.update)
            .bind(token)
            .bind(writer)
            .bind(key)
            .execute(&self.pool);
        match bounded("write", update).await {
            Ok(done) if done.rows_affected() == 1 => WriteResult::Accepted,
            Ok(_) => WriteResult::Refused,
            Err(error) => {
                tracing::debug!(%error, key, "fenced write failed");
                WriteResult::Failed
            }
        }
    }

    /// Drops the table.
    ///
    /// # Errors
    ///
    /// [`FenceError`] when the server cannot be reached in time; a later
    /// run drops it once it is stale.
    pub async fn drop_table(&self) -> Result<(), FenceError> {
        let sql = format!("DROP TABLE IF EXISTS {}", quote_identifier(&self.table));
        bounded("drop", sqlx::raw_sql(&sql).execute(&self.pool)).await?;
        Ok(())
    }
}

async fn drop_stale_tables(pool: &PgPool) -> Result<(), FenceError> {
    let names: Vec<String> = bounded(
        "list",
        sqlx::query_scalar(
            "SELECT tablename::text FROM pg_tables \
             WHERE schemaname = current_schema() AND starts_with(tablename, $1)",
        )
        .bind(TABLE_PREFIX)
        .fetch_all(pool),
    )
    .await?;
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    for name in names {
        let created = name
            .strip_prefix(TABLE_PREFIX)
            .and_then(|rest| rest.split('_').next())
            .and_then(|secs| secs.parse::<u64>().ok());
        if created.is_some_and(|c| now.saturating_sub(c) > STALE_AFTER.as_secs()) {
            let sql = format!("DROP TABLE IF EXISTS {}", quote_identifier(&name));
            // Best effort: another run may be dropping it too.
            let _ = bounded("drop stale", sqlx::raw_sql(&sql).execute(pool)).await;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_this_machine_is_accepted() {
        for host in [
            "127.0.0.1",
            "127.3.4.5",
            "localhost",
            "::1",
            "[::1]",
            "/run/postgresql",
        ] {
            assert!(is_loopback(host), "{host}");
        }
        for host in ["10.0.0.1", "192.168.1.2", "example.com", "0.0.0.0"] {
            assert!(!is_loopback(host), "{host}");
        }
        assert!(matches!(
            FenceStore::connect("postgres://u@10.1.2.3/db", "t", 1),
            Err(FenceError::NotLoopback(_))
        ));
    }
}

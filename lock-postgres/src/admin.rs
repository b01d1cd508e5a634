//! Operator functions: which locks are held now, one key's state, and a
//! forced release. For tools such as the `withlock` command; the lock steps
//! themselves never use them. Like the steps, each is one autocommit
//! statement timed by the database clock.

use std::future::Future;
use std::time::Duration;

use lock_core::{BackendError, OwnerToken};
use sqlx::postgres::PgRow;
use sqlx::Row;

use crate::backend::PostgresBackend;
use crate::error::{step_error, step_timeout};

/// The database's current time, as the lock steps read it.
const NOW: &str = "WITH now AS (SELECT clock_timestamp() AT TIME ZONE 'UTC' AS t)";

/// The remaining time of row `l` in whole microseconds, when it is held.
const TTL_US: &str = "CASE WHEN l.locked_by IS NOT NULL AND l.locked_until >= now.t \
     THEN (extract(epoch FROM (l.locked_until - now.t)) * 1000000)::bigint END";

/// What the table says about one key, read in one statement.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct LockInfo {
    /// The key (the row's `key`).
    pub key: String,
    /// The holder's owner token (`locked_by`), normally
    /// `<node id>/<32 hex>`; `None` when the key is free or its holder's
    /// time has run out.
    pub owner: Option<OwnerToken>,
    /// How long the lock lives without an extension (`locked_until` minus
    /// the database's now); `None` when the key is free.
    pub ttl: Option<Duration>,
    /// The last fencing token drawn for the key (`sequence`); `None` when
    /// the key has no row.
    pub fencing_token: Option<u64>,
}

impl LockInfo {
    /// Whether the key is held now.
    pub fn is_held(&self) -> bool {
        self.owner.is_some()
    }

    /// The node id part of the holder's owner token.
    pub fn node_id(&self) -> Option<&str> {
        self.owner.as_ref().map(OwnerToken::node_id)
    }
}

impl PostgresBackend {
    /// The locks held now (`locked_by` set, `locked_until` not past) whose
    /// key starts with `prefix`, ordered by key.
    ///
    /// # Errors
    ///
    /// The failed statement (a missing table too: run
    /// [`migrate`](Self::migrate) first), bounded by the statement timeout.
    ///
    /// # Cancel safety
    ///
    /// Read only: dropping the future changes nothing.
    pub async fn list_locks(&self, prefix: &str) -> Result<Vec<LockInfo>, BackendError> {
        let sql = format!(
            "{NOW} SELECT l.key, l.locked_by, {TTL_US} AS ttl_us, l.sequence \
             FROM {table} AS l CROSS JOIN now \
             WHERE l.locked_by IS NOT NULL AND l.locked_until >= now.t \
               AND left(l.key, char_length($1)) = $1 \
             ORDER BY l.key",
            table = self.qualified_table()
        );
        let rows = self
            .admin_step(
                "list",
                sqlx::query(&sql).bind(prefix).fetch_all(self.pool()),
            )
            .await?;
        rows.iter().map(info).collect()
    }

    /// The state of `key`: its holder and remaining ttl if it is held, and
    /// its last fencing token.
    ///
    /// # Errors
    ///
    /// The failed statement, bounded by the statement timeout.
    ///
    /// # Cancel safety
    ///
    /// Read only: dropping the future changes nothing.
    pub async fn inspect(&self, key: &str) -> Result<LockInfo, BackendError> {
        let sql = format!(
            "{NOW} SELECT $1::text AS key, \
               CASE WHEN l.locked_until >= now.t THEN l.locked_by END AS locked_by, \
               {TTL_US} AS ttl_us, l.sequence \
             FROM now LEFT JOIN {table} AS l ON l.key = $1",
            table = self.qualified_table()
        );
        let row = self
            .admin_step(
                "inspect",
                sqlx::query(&sql).bind(key).fetch_one(self.pool()),
            )
            .await?;
        info(&row)
    }

    /// Frees `key` whoever holds it (`locked_by = NULL`, keeping the row and
    /// its `sequence`, as a release does) and sends the release
    /// notification. Gives the holder it freed, or `None` when the key was
    /// free (a holder whose time had run out is cleared too, but was not
    /// holding it).
    ///
    /// The holder is not told: its next extension finds the row no longer
    /// its own and its call ends with a lost lock. Meant for a holder that
    /// is known to be dead, whose lock would otherwise last until its ttl.
    ///
    /// # Errors
    ///
    /// The failed statement, bounded by the statement timeout; the key may
    /// or may not have been freed then.
    ///
    /// # Cancel safety
    ///
    /// A dropped call may or may not have freed the key, never half.
    pub async fn force_release(&self, key: &str) -> Result<Option<LockInfo>, BackendError> {
        let notify = self.config().release_notifications;
        let announce = if notify { ", pg_notify($2, l.key)" } else { "" };
        // `old` locks the row and keeps its values; the update runs in the
        // same statement, on the same snapshot.
        let sql = format!(
            "{NOW}, \
             old AS (SELECT key, locked_by, locked_until, sequence FROM {table} \
                     WHERE key = $1 AND locked_by IS NOT NULL FOR UPDATE), \
             cleared AS (UPDATE {table} AS t SET locked_by = NULL FROM old \
                         WHERE t.key = old.key RETURNING t.key) \
             SELECT l.key, CASE WHEN l.locked_until >= now.t THEN l.locked_by END AS locked_by, \
               {TTL_US} AS ttl_us, l.sequence{announce} \
             FROM old AS l JOIN cleared AS c ON c.key = l.key CROSS JOIN now",
            table = self.qualified_table()
        );
        let mut query = sqlx::query(&sql).bind(key);
        if notify {
            query = query.bind(&self.config().channel);
        }
        let row = self
            .admin_step("force release", query.fetch_optional(self.pool()))
            .await?;
        let freed = row.as_ref().map(info).transpose()?;
        Ok(freed.filter(LockInfo::is_held))
    }

    /// Runs one statement within the statement timeout.
    async fn admin_step<T>(
        &self,
        name: &'static str,
        fut: impl Future<Output = Result<T, sqlx::Error>>,
    ) -> Result<T, BackendError> {
        let after = self.config().step_timeout;
        match tokio::time::timeout(after, fut).await {
            Ok(result) => result.map_err(step_error),
            Err(_) => Err(step_timeout(name, after)),
        }
    }
}

/// A [`LockInfo`] from a row of `(key, locked_by, ttl_us, sequence)`, where
/// `locked_by` is already `NULL` for an expired holder.
fn info(row: &PgRow) -> Result<LockInfo, BackendError> {
    let key: String = row.try_get(0).map_err(step_error)?;
    let locked_by: Option<String> = row.try_get(1).map_err(step_error)?;
    let ttl_us: Option<i64> = row.try_get(2).map_err(step_error)?;
    let sequence: Option<i64> = row.try_get(3).map_err(step_error)?;
    let ttl = ttl_us.map(|us| Duration::from_micros(u64::try_from(us).unwrap_or(0)));
    Ok(LockInfo {
        key,
        owner: locked_by.map(OwnerToken::from_value),
        ttl,
        fencing_token: sequence.and_then(|s| u64::try_from(s).ok()),
    })
}

//! The operator's functions ([`LockAdmin`]) on the lock table. Like the
//! steps, each is one autocommit statement timed by the database clock.

use std::future::Future;
use std::time::Duration;

use lock_core::{
    async_trait, AdminError, BackendError, BackendErrorKind, LockAdmin, LockInfo, OwnerToken,
};
use sqlx::postgres::PgRow;
use sqlx::Row;

use crate::backend::PostgresBackend;
use crate::error::{step_error, step_timeout};
use crate::sql::KEPT_PREFIX;

/// The database's current time, as the lock steps read it.
const NOW: &str = "WITH now AS (SELECT clock_timestamp() AT TIME ZONE 'UTC' AS t)";

/// Whether row `l` is held now, as the acquisition sees it: a holder
/// whose time has not run out (a row without `locked_until` never runs
/// out).
const HELD: &str =
    "(l.locked_by IS NOT NULL AND (l.locked_until IS NULL OR l.locked_until >= now.t))";

/// The columns every admin statement gives for row `l` and the record of
/// its minimum hold `m` (see [`kept_join`]), in the order [`info`] reads
/// them: key, holder, remaining time and time held in whole microseconds,
/// sequence, the last holder of a row whose holder's time ran out, and the
/// time left of a minimum hold \[H7\] (the row's remaining time, when the
/// record names its holder).
fn columns(key: &str) -> String {
    format!(
        "{key} AS key, \
         CASE WHEN {HELD} THEN l.locked_by END AS owner, \
         CASE WHEN {HELD} THEN (extract(epoch FROM (l.locked_until - now.t)) * 1000000)::bigint END \
           AS ttl_us, \
         l.sequence, \
         CASE WHEN {HELD} THEN (extract(epoch FROM (now.t - l.locked_at)) * 1000000)::bigint END \
           AS held_for_us, \
         CASE WHEN NOT {HELD} THEN l.locked_by END AS last_owner, \
         CASE WHEN {HELD} AND m.key IS NOT NULL \
           THEN (extract(epoch FROM (l.locked_until - now.t)) * 1000000)::bigint END AS kept_us"
    )
}

/// `LEFT JOIN` of `m`, the record of row `l`'s minimum hold \[H7\]: the row
/// [`KEPT_PREFIX`]`<key>` that the hold step took for `l`'s holder, while it
/// is held (written by [`PostgresBackend`]'s hold step, see its README).
fn kept_join(table: &str) -> String {
    format!(
        "LEFT JOIN {table} AS m ON m.key = '{KEPT_PREFIX}' || l.key \
           AND m.locked_by = l.locked_by AND m.locked_until >= now.t"
    )
}

/// Whether row `l` is the record of a minimum hold of the row it names,
/// held by that row's holder: not a lock of its own, so not listed.
fn is_record(table: &str) -> String {
    format!(
        "(left(l.key, char_length('{KEPT_PREFIX}')) = '{KEPT_PREFIX}' \
          AND EXISTS (SELECT 1 FROM {table} AS k \
                      WHERE k.key = substr(l.key, char_length('{KEPT_PREFIX}') + 1) \
                        AND k.locked_by = l.locked_by))"
    )
}

/// A holder in withlock's owner-token format, `<node id>/<32 hex>`: the
/// SQL form of [`OwnerToken::is_well_formed`] (tests/admin.rs checks that
/// both agree).
pub(crate) const WITHLOCK_HOLDER: &str = "^.+/[0-9A-Fa-f]{32}$";

/// A holder as Ruby's Locker gem writes it, `host:<name> pid:<n>
/// guid:<32 hex>` (or without the host when it cannot be read).
pub(crate) const RUBY_LOCKER_HOLDER: &str = "^(host:.* )?pid:[0-9]+ guid:[0-9a-f]{32}$";

/// Lists, inspects and force-releases the rows of the lock table.
///
/// - `list_locks`: the rows held now (`locked_by` set, `locked_until` not
///   past) whose key starts with the prefix, in byte order of the keys
///   (`COLLATE "C"`, whatever the database's collation).
/// - `inspect`: one key, with [`LockInfo::held_for`] from `locked_at`,
///   and [`LockInfo::last_owner`] when the holder's time ran out (a
///   released row has no holder left to show).
/// - `force_release`: sets `locked_by = NULL` (keeping the row and its
///   `sequence`, as a release does) and sends the release notification
///   as a release does, in one statement that locks the row. It frees
///   only a lock of the kind withlock takes \[D2\]: a held row with an
///   expiry (`locked_until`) whose holder is a withlock owner token, or a
///   Ruby Locker identifier (`host:… pid:… guid:<32 hex>`). The table is
///   the format both share: withlock waits for Locker's rows and takes
///   them over at their expiry exactly as its own, so an operator frees
///   either. A holder of any other form (a row written by hand or by
///   another program), or a held row without `locked_until` (which no
///   acquisition would ever take over), is refused with
///   [`AdminError::NotALock`] and left as it was. A row whose holder's
///   time ran out is free: nothing changes.
///
/// A missing table fails the statement: run
/// [`migrate`](PostgresBackend::migrate) first.
#[async_trait]
impl LockAdmin for PostgresBackend {
    async fn list_locks(&self, prefix: &str) -> Result<Vec<LockInfo>, BackendError> {
        let table = self.qualified_table();
        let sql = format!(
            "{NOW} SELECT {columns} \
             FROM {table} AS l CROSS JOIN now {kept} \
             WHERE {HELD} AND left(l.key, char_length($1)) = $1 AND NOT {record} \
             ORDER BY l.key COLLATE \"C\"",
            columns = columns("l.key"),
            kept = kept_join(table),
            record = is_record(table),
        );
        let rows = self
            .admin_step(
                "list",
                sqlx::query(&sql).bind(prefix).fetch_all(self.pool()),
            )
            .await?;
        rows.iter().map(info).collect()
    }

    async fn inspect(&self, key: &str) -> Result<LockInfo, BackendError> {
        let table = self.qualified_table();
        let sql = format!(
            "{NOW} SELECT {columns} \
             FROM now LEFT JOIN {table} AS l ON l.key = $1 {kept}",
            columns = columns("$1::text"),
            kept = kept_join(table),
        );
        let row = self
            .admin_step(
                "inspect",
                sqlx::query(&sql).bind(key).fetch_one(self.pool()),
            )
            .await?;
        info(&row)
    }

    async fn force_release(&self, key: &str) -> Result<Option<LockInfo>, AdminError> {
        let notify = self.config().release_notifications;
        // pg_notify runs once per row `cleared` returns, and only then:
        // the scalar subquery reads the data-modifying CTE's rows.
        let announce = if notify {
            "(SELECT count(*) FROM (SELECT pg_notify($2, c.key) FROM cleared AS c) AS n)"
        } else {
            "0::bigint"
        };
        // `old` locks the row; `verdict` judges it and `cleared` frees it
        // in the same statement, on the same snapshot, so nothing can
        // change the row in between. The outer select shows the row as it
        // was before.
        let table = self.qualified_table();
        let sql = format!(
            "{NOW}, \
             old AS (SELECT key, locked_by, locked_at, locked_until, sequence FROM {table} \
                     WHERE key = $1 FOR UPDATE), \
             verdict AS (SELECT l.*, CASE \
                 WHEN NOT {HELD} THEN 'free' \
                 WHEN l.locked_until IS NULL THEN 'no-expiry' \
                 WHEN l.locked_by ~ '{WITHLOCK_HOLDER}' OR l.locked_by ~ '{RUBY_LOCKER_HOLDER}' \
                   THEN 'freed' \
                 ELSE 'format' END AS verdict \
               FROM old AS l CROSS JOIN now), \
             cleared AS (UPDATE {table} AS t SET locked_by = NULL FROM verdict AS v \
                         WHERE t.key = v.key AND v.verdict = 'freed' RETURNING t.key), \
             unkept AS (UPDATE {table} AS t SET locked_by = NULL FROM verdict AS v \
                        WHERE t.key = '{KEPT_PREFIX}' || v.key AND t.locked_by = v.locked_by \
                          AND v.verdict = 'freed') \
             SELECT {columns}, l.verdict, {announce} AS announced \
             FROM verdict AS l CROSS JOIN now {kept}",
            columns = columns("l.key"),
            kept = kept_join(table),
        );
        let mut query = sqlx::query(&sql).bind(key);
        if notify {
            query = query.bind(&self.config().channel);
        }
        let Some(row) = self
            .admin_step("force release", query.fetch_optional(self.pool()))
            .await?
        else {
            return Ok(None);
        };
        let read = info(&row)?;
        let verdict: String = row.try_get("verdict").map_err(step_error)?;
        let found = match verdict.as_str() {
            "freed" => return Ok(Some(read)),
            "free" => return Ok(None),
            "no-expiry" => "a held row without locked_until (no expiry)",
            "format" => "a holder in neither withlock's owner-token format nor Ruby Locker's",
            other => {
                return Err(AdminError::Backend(BackendError::message(
                    BackendErrorKind::Protocol,
                    format!("the force release statement answered {other:?}"),
                )))
            }
        };
        Err(AdminError::NotALock {
            key: read.key,
            found: found.to_owned(),
        })
    }
}

impl PostgresBackend {
    /// Runs one statement within the statement timeout.
    async fn admin_step<T>(
        &self,
        name: &'static str,
        fut: impl Future<Output = Result<T, sqlx::Error>>,
    ) -> Result<T, BackendError> {
        let after = self.config().step_timeout;
        self.in_background(async {
            match tokio::time::timeout(after, fut).await {
                Ok(result) => result.map_err(step_error),
                Err(_) => Err(step_timeout(name, after)),
            }
        })
        .await
    }
}

/// A [`LockInfo`] from the [`columns`] of a row.
fn info(row: &PgRow) -> Result<LockInfo, BackendError> {
    let key: String = row.try_get(0).map_err(step_error)?;
    let owner: Option<String> = row.try_get(1).map_err(step_error)?;
    let ttl_us: Option<i64> = row.try_get(2).map_err(step_error)?;
    let sequence: Option<i64> = row.try_get(3).map_err(step_error)?;
    let held_for_us: Option<i64> = row.try_get(4).map_err(step_error)?;
    let last_owner: Option<String> = row.try_get(5).map_err(step_error)?;
    let kept_us: Option<i64> = row.try_get(6).map_err(step_error)?;
    // Negative only for a clock that stepped back since: counted as zero.
    let micros = |us: i64| Duration::from_micros(u64::try_from(us).unwrap_or(0));
    let info = match owner {
        Some(owner) => LockInfo::held(key, OwnerToken::from_value(owner), ttl_us.map(micros))
            .with_held_for(held_for_us.map(micros))
            .with_minimum_hold_left(kept_us.map(micros)),
        None => LockInfo::free(key).with_last_owner(last_owner.map(OwnerToken::from_value)),
    };
    Ok(info.with_fencing_token(sequence.and_then(|s| u64::try_from(s).ok())))
}

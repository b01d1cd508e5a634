//! Errors of setting the backend up. Errors of the lock steps are
//! [`lock_core::BackendError`]s made by [`step_error`].

use std::time::Duration;

use lock_core::{BackendError, BackendErrorKind};

/// What can go wrong while making a [`PostgresBackend`](crate::PostgresBackend),
/// running its migration, or with its table. Never shows a connection URL
/// or password.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SetupError {
    /// A field of [`PostgresConfig`](crate::PostgresConfig) is not acceptable.
    #[error("invalid lock-postgres config: {field} {reason}")]
    InvalidConfig {
        /// The field.
        field: &'static str,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// The URL does not parse (from [`from_url`](crate::PostgresBackend::from_url)).
    #[error("invalid PostgreSQL URL")]
    InvalidUrl(#[source] sqlx::Error),
    /// The database could not be reached (from [`connect`](crate::PostgresBackend::connect)).
    #[error("could not connect to PostgreSQL")]
    Connect(#[source] sqlx::Error),
    /// The migration failed; its transaction was rolled back.
    #[error("the lock table migration {migration} failed")]
    Migrate {
        /// The migration file that failed.
        migration: &'static str,
        /// The database's error.
        #[source]
        source: sqlx::Error,
    },
    /// The lock table's `sequence` column is narrower than `bigint` (Ruby
    /// Locker's own test schema has `integer`), so it cannot hold fencing
    /// tokens, which are database clock values in microseconds. Found by a
    /// check before the first acquisition, which takes nothing; it is the
    /// source of that acquisition's [`BackendError`] (kind `Protocol`).
    #[error(
        "the column \"sequence\" of the lock table {table} is {found}, too narrow for \
         fencing tokens (microsecond clock values); nothing was locked. Widen it with: \
         ALTER TABLE {table} ALTER COLUMN sequence TYPE bigint"
    )]
    NarrowSequence {
        /// The quoted, schema-qualified table name.
        table: String,
        /// The column's type, as PostgreSQL names it (`integer`, …).
        found: String,
    },
}

/// Maps a sqlx error of a lock step to a [`BackendError`], keeping it as the
/// source. The pool's own errors (`PoolTimedOut`, `PoolClosed`) get kind
/// `Unavailable`: without a connection no statement was sent. The server's
/// timeouts (`statement_timeout` / `lock_timeout`, SQLSTATE 57014 / 55P03)
/// get kind `Timeout`; anything else, `Request`.
pub(crate) fn step_error(error: sqlx::Error) -> BackendError {
    let kind = match &error {
        _ if is_setup_error(&error) => BackendErrorKind::Setup,
        sqlx::Error::PoolTimedOut | sqlx::Error::PoolClosed => BackendErrorKind::Unavailable,
        sqlx::Error::Database(db) if matches!(db.code().as_deref(), Some("57014" | "55P03")) => {
            BackendErrorKind::Timeout
        }
        _ => BackendErrorKind::Request,
    };
    BackendError::new(kind, error)
}

/// Maps the error of taking a connection from the pool (its timeout, a
/// closed pool, a refused or failed connect) to kind `Unavailable`: the
/// step's statement was never sent, so it changed nothing.
pub(crate) fn checkout_error(error: sqlx::Error) -> BackendError {
    if is_setup_error(&error) {
        return BackendError::setup(error);
    }
    BackendError::unavailable(error)
}

/// An error that trying again cannot mend \[A8\], by its SQLSTATE: a
/// refused login (28000, 28P01), a missing database, schema, table, column
/// or function (3D000, 3F000, 42P01, 42703, 42883), permission denied
/// (42501), a column of the wrong type (42804), and a fencing token that
/// does not fit the `sequence` column (22003: an `integer` column).
fn is_setup_error(error: &sqlx::Error) -> bool {
    matches!(
        error,
        sqlx::Error::Database(db) if matches!(
            db.code().as_deref(),
            Some("28000" | "28P01" | "3D000" | "3F000" | "42P01" | "42703" | "42883" | "42501" | "42804" | "22003")
        )
    )
}

/// The SQLSTATE of the database error behind a step's error, if one is.
pub(crate) fn sqlstate(error: &BackendError) -> Option<String> {
    match error.inner().downcast_ref::<sqlx::Error>()? {
        sqlx::Error::Database(db) => db.code().map(|code| code.into_owned()),
        _ => None,
    }
}

/// A step that did not answer within the configured statement timeout.
pub(crate) fn step_timeout(step: &'static str, after: Duration) -> BackendError {
    BackendError::timeout(step, after)
}

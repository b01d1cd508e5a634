//! Errors of setting the backend up. Errors of the lock steps are
//! [`lock_core::BackendError`]s made by [`step_error`].

use std::time::Duration;

use lock_core::{BackendError, BackendErrorKind};

/// What can go wrong while making a [`PostgresBackend`](crate::PostgresBackend)
/// or running its migration. Never shows a connection URL or password.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PostgresError {
    /// A field of [`PostgresConfig`](crate::PostgresConfig) is not acceptable.
    #[error("invalid lock-postgres config: {field} {reason}")]
    InvalidConfig {
        /// The field.
        field: &'static str,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// The database could not be reached (from [`from_url`](crate::PostgresBackend::from_url)).
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
}

/// Maps a sqlx error of a lock step to a [`BackendError`], keeping it as the
/// source. Timeouts (the pool's, or the server's `statement_timeout` /
/// `lock_timeout`, SQLSTATE 57014 / 55P03) get kind `Timeout`.
pub(crate) fn step_error(error: sqlx::Error) -> BackendError {
    let timeout = match &error {
        sqlx::Error::PoolTimedOut => true,
        sqlx::Error::Database(db) => matches!(db.code().as_deref(), Some("57014" | "55P03")),
        _ => false,
    };
    let kind = if timeout {
        BackendErrorKind::Timeout
    } else {
        BackendErrorKind::Request
    };
    BackendError::new(kind, error)
}

/// A step that did not answer within the configured statement timeout.
pub(crate) fn step_timeout(step: &'static str, after: Duration) -> BackendError {
    BackendError::timeout(step, after)
}

//! The backend's configuration and the safe quoting of the names it puts
//! into SQL.

use std::time::Duration;

use crate::error::SetupError;

/// The longest identifier PostgreSQL keeps (`NAMEDATALEN - 1`); longer
/// names would be truncated silently, so they are refused.
pub const MAX_IDENTIFIER_LEN: usize = 63;

/// Where the locks live and how the backend talks to PostgreSQL.
///
/// Plain data with a [`Default`]; [`PostgresBackend::with_config`](crate::PostgresBackend::with_config)
/// validates it.
///
/// ```
/// use std::time::Duration;
/// use lock_postgres::PostgresConfig;
///
/// let config = PostgresConfig::default()
///     .schema("jobs")
///     .table("job_locks")
///     .step_timeout(Duration::from_secs(1));
/// assert_eq!(config.qualified_table().unwrap(), r#""jobs"."job_locks""#);
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
#[cfg_attr(
    feature = "serde",
    derive(serde::Serialize, serde::Deserialize),
    serde(default, deny_unknown_fields)
)]
pub struct PostgresConfig {
    /// The schema of the lock table. It must exist; [`migrate`](crate::PostgresBackend::migrate)
    /// creates the table, not the schema.
    ///
    /// Default: `public`.
    pub schema: String,
    /// The lock table, one row per key.
    ///
    /// Default: `locks` (Ruby Locker's table name).
    pub table: String,
    /// The `NOTIFY` channel a release is announced on. Backends sharing a
    /// database and a channel wake each other's waiters on equal keys, which
    /// is only a hint (they try once more); give each table its own channel
    /// to avoid it.
    ///
    /// Default: `withlock_release`.
    pub channel: String,
    /// The longest a single step (one statement, including getting a pooled
    /// connection) may take before it fails with
    /// [`BackendErrorKind::Timeout`](lock_core::BackendErrorKind::Timeout).
    ///
    /// Default: 2 s.
    #[cfg_attr(feature = "serde", serde(with = "humantime_serde"))]
    pub step_timeout: Duration,
    /// Whether releases send `NOTIFY` and the backend listens for them, so
    /// that waiters wake at once instead of after a retry delay.
    ///
    /// Default: `true`.
    pub release_notifications: bool,
}

impl Default for PostgresConfig {
    fn default() -> Self {
        Self {
            schema: "public".into(),
            table: "locks".into(),
            channel: "withlock_release".into(),
            step_timeout: Duration::from_secs(2),
            release_notifications: true,
        }
    }
}

impl PostgresConfig {
    /// Sets [`schema`](Self::schema). Defaults to `public`.
    #[must_use]
    pub fn schema(mut self, schema: impl Into<String>) -> Self {
        self.schema = schema.into();
        self
    }

    /// Sets [`table`](Self::table). Defaults to `locks`.
    #[must_use]
    pub fn table(mut self, table: impl Into<String>) -> Self {
        self.table = table.into();
        self
    }

    /// Sets [`channel`](Self::channel). Defaults to `withlock_release`.
    #[must_use]
    pub fn channel(mut self, channel: impl Into<String>) -> Self {
        self.channel = channel.into();
        self
    }

    /// Sets [`step_timeout`](Self::step_timeout). Defaults to 2 s.
    #[must_use]
    pub fn step_timeout(mut self, timeout: Duration) -> Self {
        self.step_timeout = timeout;
        self
    }

    /// Sets [`release_notifications`](Self::release_notifications). Defaults to `true`.
    #[must_use]
    pub fn release_notifications(mut self, on: bool) -> Self {
        self.release_notifications = on;
        self
    }

    /// Checks every field, as [`PostgresBackend::new`](crate::PostgresBackend::new) does.
    ///
    /// # Errors
    ///
    /// [`SetupError::InvalidConfig`] naming the first bad field.
    pub fn validate(&self) -> Result<(), SetupError> {
        check_identifier("schema", &self.schema)?;
        check_identifier("table", &self.table)?;
        check_identifier("channel", &self.channel)?;
        if self.step_timeout.is_zero() {
            return Err(SetupError::InvalidConfig {
                field: "step_timeout",
                reason: "must be above zero",
            });
        }
        Ok(())
    }

    /// The schema-qualified table name, each part quoted as an identifier,
    /// as it appears in the backend's SQL.
    ///
    /// # Errors
    ///
    /// [`SetupError::InvalidConfig`] for an empty or too long name.
    pub fn qualified_table(&self) -> Result<String, SetupError> {
        check_identifier("schema", &self.schema)?;
        check_identifier("table", &self.table)?;
        Ok(format!(
            "{}.{}",
            quote_identifier(&self.schema),
            quote_identifier(&self.table)
        ))
    }
}

/// Refuses names PostgreSQL would reject or silently truncate.
fn check_identifier(field: &'static str, name: &str) -> Result<(), SetupError> {
    let reason = if name.is_empty() {
        "must not be empty"
    } else if name.len() > MAX_IDENTIFIER_LEN {
        "must be at most 63 bytes"
    } else if name.contains('\0') {
        "must not contain NUL"
    } else {
        return Ok(());
    };
    Err(SetupError::InvalidConfig { field, reason })
}

/// Quotes `name` as a PostgreSQL identifier: wrapped in double quotes, each
/// double quote inside doubled. The name is then taken literally, case and
/// all, whatever characters it holds.
///
/// ```
/// assert_eq!(lock_postgres::quote_identifier(r#"My "Locks"; drop"#), r#""My ""Locks""; drop""#);
/// ```
pub fn quote_identifier(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_quoted_and_validated() {
        let config = PostgresConfig::default().table(r#"My "Locks"; drop"#);
        assert_eq!(
            config.qualified_table().unwrap(),
            r#""public"."My ""Locks""; drop""#
        );
        assert!(PostgresConfig::default().table("").validate().is_err());
        assert!(PostgresConfig::default()
            .schema("x".repeat(64))
            .validate()
            .is_err());
        assert!(PostgresConfig::default()
            .channel("a\0b")
            .validate()
            .is_err());
        assert!(PostgresConfig::default()
            .step_timeout(Duration::ZERO)
            .validate()
            .is_err());
        PostgresConfig::default()
            .table("x".repeat(63))
            .validate()
            .unwrap();
    }
}

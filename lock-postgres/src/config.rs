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

/// The names of the fair queue's objects beside a lock table \[F1\]
/// (see [`PostgresConfig::waiters_table`]), each quoted and
/// schema-qualified, and the channel of its grants.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct QueueNames {
    /// The waiters table.
    pub(crate) waiters: String,
    /// The runs table: when each key's current run of grants began, and
    /// until when a key is left free after a long one \[F5\].
    pub(crate) streaks: String,
    /// The function of one queued attempt.
    pub(crate) queue_step: String,
    /// The function of a release that grants the key to the queue's head.
    pub(crate) release: String,
    /// The function of a waiter leaving the queue.
    pub(crate) leave: String,
    /// The functions of the earlier version (`_v1`: queued attempt,
    /// release, leave), which the migration still makes, for nodes of
    /// that version during a rolling upgrade; the backend calls none.
    pub(crate) earlier: [String; 3],
    /// The `NOTIFY` channel of grants (not quoted: a channel name).
    pub(crate) grant_channel: String,
}

/// The suffix of the waiters table's name.
const WAITERS_SUFFIX: &str = "_waiters";
/// The suffix of the runs table's name.
const STREAKS_SUFFIX: &str = "_streaks";
/// The suffix of the grant channel's name.
const GRANT_SUFFIX: &str = "_grant";
/// The suffixes of the queue's functions. The `_v2` is their version: a
/// crate that changes a function's body gives it a new name, so nodes of
/// both versions can share the table during a rolling upgrade. `_v2`
/// (`migrations/0003`) added the gap of \[F5\] to `_v1`'s
/// (`migrations/0002`).
const QUEUE_STEP_SUFFIX: &str = "_queue_v2";
const RELEASE_SUFFIX: &str = "_release_v2";
const LEAVE_SUFFIX: &str = "_leave_v2";
/// The earlier version's: queued attempt, release, leave.
const EARLIER_SUFFIXES: [&str; 3] = ["_queue_v1", "_release_v1", "_leave_v1"];

/// `name` followed by `suffix`, as one identifier of at most
/// [`MAX_IDENTIFIER_LEN`] bytes: when the two are longer, `name` is cut
/// (at a character boundary) and an 8-digit hash of the whole of it goes
/// before the suffix, so that two long names that share a beginning still
/// give two names.
pub(crate) fn derived_name(name: &str, suffix: &str) -> String {
    if name.len() + suffix.len() <= MAX_IDENTIFIER_LEN {
        return format!("{name}{suffix}");
    }
    let hash = name.bytes().fold(0x811c_9dc5_u32, |h, b| {
        (h ^ u32::from(b)).wrapping_mul(0x0100_0193)
    });
    // `_` and 8 hex digits.
    let mut cut = MAX_IDENTIFIER_LEN - suffix.len() - 9;
    while !name.is_char_boundary(cut) {
        cut -= 1;
    }
    format!("{}_{hash:08x}{suffix}", &name[..cut])
}

impl PostgresConfig {
    /// The name of the fair queue's waiters table \[F1\], in the lock
    /// table's schema: the table's name followed by `_waiters` (a name
    /// longer than 55 bytes is cut and followed by a hash of the whole
    /// name, so that the result fits in 63 bytes). [`migrate`] creates it
    /// beside the lock table, with the runs table `<table>_streaks` and
    /// the queue's three functions (`<table>_queue_v2`,
    /// `<table>_release_v2`, `<table>_leave_v2`, and the earlier
    /// version's `_v1`), named by the same rule.
    ///
    /// ```
    /// use lock_postgres::PostgresConfig;
    ///
    /// assert_eq!(PostgresConfig::default().waiters_table(), "locks_waiters");
    /// assert_eq!(
    ///     PostgresConfig::default().schema("jobs").qualified_waiters_table().unwrap(),
    ///     r#""jobs"."locks_waiters""#
    /// );
    /// ```
    ///
    /// [`migrate`]: crate::PostgresBackend::migrate
    pub fn waiters_table(&self) -> String {
        derived_name(&self.table, WAITERS_SUFFIX)
    }

    /// The name of the fair queue's runs table \[F5\], beside the
    /// waiters table: the table's name followed by `_streaks` (by the rule
    /// of [`waiters_table`](Self::waiters_table) when that is too long).
    /// One row per key whose queue granted it lately: when its current
    /// run of grants began, and until when the key is left free for
    /// clients outside the queue after a long one.
    ///
    /// ```
    /// use lock_postgres::PostgresConfig;
    ///
    /// assert_eq!(PostgresConfig::default().streaks_table(), "locks_streaks");
    /// ```
    pub fn streaks_table(&self) -> String {
        derived_name(&self.table, STREAKS_SUFFIX)
    }

    /// [`waiters_table`](Self::waiters_table), schema-qualified and quoted
    /// as the statements use it.
    ///
    /// # Errors
    ///
    /// [`SetupError::InvalidConfig`] for an empty or too long name.
    pub fn qualified_waiters_table(&self) -> Result<String, SetupError> {
        Ok(self.queue_names()?.waiters)
    }

    /// The `NOTIFY` channel of the fair queue's grants: the
    /// [`channel`](Self::channel) followed by `_grant` (by the rule of
    /// [`waiters_table`](Self::waiters_table) when that is too long). A
    /// grant cannot share the release channel: a payload that names a
    /// grant could be a key as well, since keys may hold any character.
    pub fn grant_channel(&self) -> String {
        derived_name(&self.channel, GRANT_SUFFIX)
    }

    /// Every name of the fair queue's objects, quoted and qualified.
    pub(crate) fn queue_names(&self) -> Result<QueueNames, SetupError> {
        check_identifier("schema", &self.schema)?;
        check_identifier("table", &self.table)?;
        let schema = quote_identifier(&self.schema);
        let qualified = |suffix: &str| {
            format!(
                "{schema}.{}",
                quote_identifier(&derived_name(&self.table, suffix))
            )
        };
        Ok(QueueNames {
            waiters: qualified(WAITERS_SUFFIX),
            streaks: qualified(STREAKS_SUFFIX),
            queue_step: qualified(QUEUE_STEP_SUFFIX),
            release: qualified(RELEASE_SUFFIX),
            leave: qualified(LEAVE_SUFFIX),
            earlier: EARLIER_SUFFIXES.map(qualified),
            grant_channel: self.grant_channel(),
        })
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

    #[test]
    fn the_queue_names_fit_in_an_identifier_and_stay_apart() {
        let short = PostgresConfig::default().table("job_locks");
        assert_eq!(short.waiters_table(), "job_locks_waiters");
        assert_eq!(short.grant_channel(), "withlock_release_grant");
        let names = short.queue_names().unwrap();
        assert_eq!(names.streaks, r#""public"."job_locks_streaks""#);
        assert_eq!(names.queue_step, r#""public"."job_locks_queue_v2""#);
        assert_eq!(names.release, r#""public"."job_locks_release_v2""#);
        assert_eq!(names.leave, r#""public"."job_locks_leave_v2""#);
        assert_eq!(
            names.earlier,
            [
                r#""public"."job_locks_queue_v1""#,
                r#""public"."job_locks_release_v1""#,
                r#""public"."job_locks_leave_v1""#
            ]
        );
        // Exactly 63 bytes still fits with the suffix cut in.
        let fits = "t".repeat(MAX_IDENTIFIER_LEN - WAITERS_SUFFIX.len());
        assert_eq!(
            derived_name(&fits, WAITERS_SUFFIX),
            format!("{fits}_waiters")
        );
        // Longer: cut, hashed, and at most 63 bytes, even with multibyte
        // characters at the cut; two names with one beginning differ.
        let long_a = format!("{}a", "é".repeat(31));
        let long_b = format!("{}b", "é".repeat(31));
        for suffix in [WAITERS_SUFFIX, GRANT_SUFFIX, RELEASE_SUFFIX, STREAKS_SUFFIX] {
            let (a, b) = (derived_name(&long_a, suffix), derived_name(&long_b, suffix));
            assert!(a.len() <= MAX_IDENTIFIER_LEN && b.len() <= MAX_IDENTIFIER_LEN);
            assert!(a.ends_with(suffix) && a.starts_with("éé"));
            assert_ne!(a, b);
        }
    }
}

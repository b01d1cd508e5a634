//! `PostgresBackend`: withlock's lock backend on PostgreSQL, one row per
//! key in a table with Ruby Locker's columns, timed by the database clock.
//!
//! # Setup
//!
//! ```no_run
//! use lock_core::Locker;
//! use lock_postgres::{sqlx::postgres::PgPoolOptions, PostgresBackend, PostgresConfig};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! // Your pool (or `PostgresBackend::connect(url)`).
//! let pool = PgPoolOptions::new().connect("postgres://app@db/app").await?;
//! let backend = PostgresBackend::with_config(pool, PostgresConfig::default())?;
//! backend.migrate().await?; // creates "public"."locks" if missing
//!
//! let locker = Locker::new(backend);
//! locker
//!     .with_lock("nightly-import", |ctx| async move {
//!         println!("fencing token {}", ctx.fencing_token());
//!     })
//!     .await?;
//! # Ok(()) }
//! ```
//!
//! # The table
//!
//! [`PostgresBackend::migrate`] runs the files of `migrations/` (with
//! `{{table}}` replaced by the quoted, schema-qualified name), each as one
//! transaction guarded by a transaction-scoped advisory lock, so two nodes
//! may migrate at once. It is idempotent (`CREATE TABLE IF NOT EXISTS`).
//! The schema must exist.
//!
//! | column | type | meaning |
//! |---|---|---|
//! | `id` | `bigserial` primary key | for ActiveRecord; unused here |
//! | `key` | `text`, unique | the lock key, verbatim |
//! | `locked_by` | `text` null | the owner token (`<node id>/<32 hex>`), `NULL` when free |
//! | `locked_at` | `timestamp` (UTC) | when the current holder took it |
//! | `locked_until` | `timestamp` (UTC) | when it expires unless extended |
//! | `sequence` | `bigint` | the fencing token: `max(sequence + 1, database clock in µs)` at every acquisition, so a deleted row never restarts it; a narrower column is refused before anything is taken |
//!
//! Every step is one autocommit statement:
//! - acquire: `INSERT … ON CONFLICT (key) DO UPDATE … WHERE locked_by IS NULL
//!   OR locked_until < now RETURNING sequence`: creates the row or takes it
//!   over only if it is free or expired, and bumps `sequence`;
//! - extend (one lease or up to [`MAX_EXTEND_BATCH`] in one statement over
//!   `unnest` arrays): sets `locked_until` only where `locked_by` is the lease's
//!   owner and not expired, and tells an expired or missing row (`Expired`)
//!   from another owner's (`Taken`) in the same statement;
//! - release: sets `locked_by = NULL` where it is the lease's owner, keeping
//!   the row, `locked_until` and `sequence` (as Locker does), and sends
//!   `pg_notify(channel, key)` in the same statement. A release after the
//!   lease's expiry (still ours, but `locked_until` past) clears the row too
//!   but answers `NotHeld`: the lease had ended.
//!
//! Expired rows are never cleaned up or announced: the next acquisition
//! takes them over. Waiters of an expired key wake on their retry timer.
//!
//! # Time source
//!
//! All times are the database's: `clock_timestamp() AT TIME ZONE 'UTC'`,
//! read once per statement, stored as `timestamp without time zone` exactly
//! as Ruby Locker writes them, so both can share one table. The client sends
//! only the key, the owner token and the ttl in microseconds; a client with
//! a wrong clock changes nothing ([`PostgresBackend::statements`] shows the
//! SQL).
//!
//! # Pooling proxies
//!
//! The lock is a row, not a session: no advisory lock, no `SET`, no
//! transaction spans two statements. So it works through a
//! transaction-pooling proxy such as PgBouncer, and a dropped future never
//! leaves a lock stuck on a pooled connection (a row left by a dropped
//! acquisition expires with its ttl, and the driver releases it by owner
//! token). sqlx prepares statements, so behind PgBouncer in transaction mode
//! use PgBouncer 1.21+ with `max_prepared_statements` set. The release
//! listener needs a real session (`LISTEN`): point the pool at the server
//! directly, or turn notifications off and rely on the retry timer.
//!
//! # Compared with `pg_advisory_lock`
//!
//! | | this backend | `pg_advisory_lock` |
//! |---|---|---|
//! | bound to | a row with an expiry | a database session |
//! | connection lost | held until `locked_until`, then free | released at once, silently |
//! | transaction pooling | works | breaks (the lock stays on a pooled server connection) |
//! | fencing token | `sequence`, strictly increasing per key | none |
//! | visibility | `SELECT * FROM locks`: who, since when, until when | `pg_locks` with hashed keys |
//! | keys | any text up to 1024 bytes | two `int4` or one `int8` |
//!
//! # Release notifications
//!
//! With [`PostgresConfig::release_notifications`] on, one `LISTEN` connection per
//! backend (its own one-connection pool with the user's connect options, so
//! it takes nothing from the user's pool) dispatches released keys to
//! waiters. It opens at the first wait, reconnects after it drops and then
//! wakes every waiter, and stops when the backend is dropped.
//!
//! # Config
//!
//! | field | default | meaning |
//! |---|---|---|
//! | [`schema`](PostgresConfig::schema) | `public` | schema of the table (must exist) |
//! | [`table`](PostgresConfig::table) | `locks` | table name (quoted; ≤ 63 bytes) |
//! | [`channel`](PostgresConfig::channel) | `withlock_release` | `NOTIFY` channel |
//! | [`step_timeout`](PostgresConfig::step_timeout) | 2 s | bound on each step, pool wait included |
//! | [`release_notifications`](PostgresConfig::release_notifications) | `true` | `NOTIFY` on release and one listener |
//!
//! Keys up to [`lock_core::MAX_KEY_LEN`] (1024) bytes; a step that fails
//! gives a [`lock_core::BackendError`] whose source is the sqlx error
//! (kind `Unavailable` when no pool connection could be had, so nothing was
//! sent; `Timeout` for the server's or the step's timeout).
//!
//! # Testing
//!
//! The `testing` module, behind the `testing` feature (for tests, never
//! needed in a service), makes a schema per test, drops it afterwards, and
//! starts PostgreSQL servers of a test's own (or in Docker, with the
//! `testcontainers` feature, which turns `testing` on).

mod admin;
mod backend;
mod config;
mod error;
mod listener;
mod sql;
#[cfg(feature = "testing")]
pub mod testing;

pub use admin::LockInfo;
pub use backend::{PostgresBackend, MAX_EXTEND_BATCH};
pub use config::{quote_identifier, PostgresConfig, MAX_IDENTIFIER_LEN};
pub use error::SetupError;

/// Re-exported so that users build their pool with the same sqlx version.
pub use sqlx;

// `lock_core` itself and everything a user needs from it (one list for
// every backend crate), so that this one dependency is enough.
lock_core::reexport_core!();

//! `PostgresBackend`: the lock steps as single statements on the user's pool.

use std::fmt;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use lock_core::background::Making;
use lock_core::{
    async_trait, batch_results, AcquireOutcome, BackendError, BackendErrorKind, Background,
    Capabilities, ExtendOutcome, ExtendRequest, Hold, Lease, LockBackend, OwnerToken, QueueTerms,
    ReleaseHub, ReleaseOutcome, ReleaseWatch, MAX_KEY_LEN,
};
use sqlx::pool::PoolConnection;
use sqlx::postgres::{PgPool, PgPoolOptions};
use sqlx::{Postgres, Row};
use tokio::sync::OnceCell;

use crate::config::{PostgresConfig, QueueNames};
use crate::error::{checkout_error, sqlstate, step_error, step_timeout, SetupError};
use crate::listener::Listener;
use crate::sql::{
    render_migration, Statements, EXPIRED, EXTENDED, MIGRATIONS, SEQUENCE_TYPE, TAKEN,
};

/// How many leases one [`LockBackend::extend_many`] call carries: one
/// statement with three arrays of this length.
pub const MAX_EXTEND_BATCH: usize = 1000;

/// A lock backend on PostgreSQL: one row per key in a Ruby-Locker-style
/// table, every step one autocommit statement timed by the database clock.
///
/// Cheap to clone; clones share the pool and the listening connection. The
/// listening task stops when the last clone is dropped.
///
/// The listening connection, and every connection the backend's steps
/// make, live on the process's background runtime ([`Background`]), not
/// on the caller's: a backend made on one runtime keeps working on
/// another after the first was dropped or while it idles \[T1\] (see
/// the crate's "Runtimes").
#[derive(Clone)]
pub struct PostgresBackend {
    inner: Arc<Inner>,
}

struct Inner {
    pool: PgPool,
    config: PostgresConfig,
    table: String,
    /// The fair queue's objects beside the table, and its grant channel.
    queue: QueueNames,
    sql: Statements,
    /// Set once a release found the queue's table, function or rights
    /// missing \[F6\]: releases then go without the queue (they free the
    /// key and announce it, as before the queue), until
    /// [`PostgresBackend::migrate`] succeeds on this backend.
    queue_release_refused: AtomicBool,
    hub: ReleaseHub,
    listener: Option<Listener>,
    /// Where the listener runs and the steps make their connections.
    background: Background,
    /// Set once the table's `sequence` column was found to be `bigint`;
    /// see [`PostgresBackend::check_sequence_column`].
    sequence_checked: OnceCell<()>,
}

/// Why the `sequence` column check did not pass.
enum Unchecked {
    /// No such table or column (yet): the statement itself will say so in
    /// the database's words, and the next acquisition checks again.
    Missing,
    /// The check failed or refused the table.
    Failed(BackendError),
}

impl PostgresBackend {
    /// A backend on the user's `pool`, with the default [`PostgresConfig`]
    /// (table `"public"."locks"`). Connects nothing: run
    /// [`migrate`](Self::migrate) once to create the table. The listening
    /// connection opens at the first wait.
    pub fn new(pool: PgPool) -> Self {
        match Self::with_config(pool, PostgresConfig::default()) {
            Ok(backend) => backend,
            Err(_) => unreachable!("the default config is valid"),
        }
    }

    /// A backend on the user's `pool`, with the table and channel `config`
    /// names. Connects nothing.
    ///
    /// # Errors
    ///
    /// [`SetupError::InvalidConfig`] when `config` does not validate.
    pub fn with_config(pool: PgPool, config: PostgresConfig) -> Result<Self, SetupError> {
        Self::with_background(pool, config, Background::default())
    }

    /// [`with_config`](Self::with_config) on the background runtime whose
    /// hold made `pool`.
    fn with_background(
        pool: PgPool,
        config: PostgresConfig,
        background: Background,
    ) -> Result<Self, SetupError> {
        config.validate()?;
        let table = config.qualified_table()?;
        let queue = config.queue_names()?;
        let sql = Statements::new(&table, &queue, config.release_notifications);
        let hub = ReleaseHub::new();
        let listener = config.release_notifications.then(|| {
            Listener::new(
                &pool,
                &config.channel,
                &queue.grant_channel,
                hub.clone(),
                config.step_timeout,
                background.clone(),
            )
        });
        Ok(Self {
            inner: Arc::new(Inner {
                pool,
                config,
                table,
                queue,
                sql,
                queue_release_refused: AtomicBool::new(false),
                hub,
                listener,
                background,
                sequence_checked: OnceCell::new(),
            }),
        })
    }

    /// A backend with a pool of its own, from a URL such as
    /// `postgres://app@db/app`, with the default config. Connects nothing:
    /// an unreachable database or a wrong password shows at the first step,
    /// as a [`BackendError`] with the sqlx error as source. See
    /// [`connect`](Self::connect) to check the URL at once.
    ///
    /// # Errors
    ///
    /// [`SetupError::InvalidUrl`] when `url` does not parse.
    pub fn from_url(url: &str) -> Result<Self, SetupError> {
        Self::from_url_with(url, PostgresConfig::default())
    }

    /// [`from_url`](Self::from_url) with `config`. The pool has sqlx's
    /// defaults (10 connections) except its acquire timeout, three quarters
    /// of [`PostgresConfig::step_timeout`], so that a database that cannot
    /// be reached fails a step with sqlx's own error.
    ///
    /// # Errors
    ///
    /// [`SetupError::InvalidUrl`] or [`SetupError::InvalidConfig`]; the
    /// error never shows the URL.
    pub fn from_url_with(url: &str, config: PostgresConfig) -> Result<Self, SetupError> {
        config.validate()?;
        let background = Background::default();
        // sqlx spawns the pool's maintenance task on the current runtime.
        let pool = {
            let _inside = background.handle().enter();
            Self::pool_options(&config)
                .connect_lazy(url)
                .map_err(SetupError::InvalidUrl)?
        };
        Self::with_background(pool, config, background)
    }

    /// Like [`from_url`](Self::from_url), and opens one connection at once
    /// to check that the database answers.
    ///
    /// # Errors
    ///
    /// [`SetupError::Connect`] when the database cannot be reached.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future drops the pool being connected; nothing is left.
    pub async fn connect(url: &str) -> Result<Self, SetupError> {
        Self::connect_with(url, PostgresConfig::default()).await
    }

    /// [`connect`](Self::connect) with `config`.
    ///
    /// # Errors
    ///
    /// [`SetupError::InvalidConfig`] or [`SetupError::Connect`]; the
    /// error never shows the URL.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future drops the pool being connected; nothing is left.
    pub async fn connect_with(url: &str, config: PostgresConfig) -> Result<Self, SetupError> {
        config.validate()?;
        let background = Background::default();
        let pool = background
            .making(Self::pool_options(&config).connect(url))
            .await
            .map_err(SetupError::Connect)?;
        Self::with_background(pool, config, background)
    }

    fn pool_options(config: &PostgresConfig) -> PgPoolOptions {
        PgPoolOptions::new().acquire_timeout(config.step_timeout * 3 / 4)
    }

    /// The pool the steps run on.
    pub fn pool(&self) -> &PgPool {
        &self.inner.pool
    }

    /// The config the backend was made with.
    pub fn config(&self) -> &PostgresConfig {
        &self.inner.config
    }

    /// The quoted, schema-qualified table name, as the statements use it.
    pub fn qualified_table(&self) -> &str {
        &self.inner.table
    }

    /// The size of each per-key structure the backend keeps in memory, by
    /// name, for tests \[T2\]. There is one: `watched_keys`, the release
    /// hub's entries, one per key that a waiter (or a holder, for its own
    /// key) watches; an entry goes with the key's last watch, so the bound
    /// at rest is 0. The backend keeps nothing else per key: the
    /// listener serves every key on one channel, and the pool's prepared
    /// statements are the backend's fixed SQL texts, with the key bound.
    /// (The table keeps one row per key ever locked, as Ruby Locker does.)
    #[doc(hidden)]
    pub fn state_counts(&self) -> Vec<(&'static str, usize)> {
        vec![("watched_keys", self.inner.hub.watched_keys())]
    }

    /// The SQL text of the four steps (acquire, extend, the minimum hold,
    /// release), for review: they read the time from the database only and
    /// bind only the key, the owner token, a duration in microseconds and
    /// the channels. (The fair queue's steps call the functions that
    /// `migrations/0003_leave_gaps.sql` creates.)
    pub fn statements(&self) -> [&str; 4] {
        self.inner.sql.all()
    }

    /// Creates the lock table, and the fair queue's waiters table and
    /// functions beside it (see [`PostgresConfig::waiters_table`]), where
    /// they do not exist, running each file of `migrations/` as one
    /// transaction. A transaction-scoped advisory lock on the table name
    /// keeps two nodes from migrating at once. The schema must exist.
    /// Idempotent: run it at every start if you like.
    ///
    /// An existing table is left as it is. One whose `sequence` column is
    /// narrower than `bigint` is refused at the first acquisition, with
    /// [`SetupError::NarrowSequence`], before anything is locked. A
    /// backend that found the queue missing \[F6\] uses it again once
    /// this succeeds.
    ///
    /// # Errors
    ///
    /// [`SetupError::Migrate`] naming the file; nothing is changed then.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future rolls the transaction back.
    pub async fn migrate(&self) -> Result<(), SetupError> {
        for (name, text) in MIGRATIONS {
            // One simple-query message of several statements runs as one
            // implicit transaction: the server rolls it all back if any
            // statement fails, and the advisory lock lasts until it ends.
            // (An explicit BEGIN would leave an aborted transaction on the
            // pooled connection after an error.)
            let script = format!(
                "SELECT pg_advisory_xact_lock({}); {}",
                migration_lock_key(&self.inner.table),
                render_migration(text, &self.inner.table, &self.inner.queue)
            );
            self.in_background(sqlx::raw_sql(&script).execute(&self.inner.pool))
                .await
                .map_err(|source| SetupError::Migrate {
                    migration: name,
                    source,
                })?;
        }
        self.inner
            .queue_release_refused
            .store(false, Ordering::Relaxed);
        Ok(())
    }

    /// Runs one step within the statement timeout: takes a connection from
    /// the pool, then runs `statement` on it. Taking the connection first
    /// tells a failed checkout (kind `Unavailable`: nothing was sent) from
    /// a failed statement, which may have been applied.
    async fn step<T, F, Fut>(&self, name: &'static str, statement: F) -> Result<T, BackendError>
    where
        F: FnOnce(PoolConnection<Postgres>) -> Fut,
        Fut: Future<Output = Result<T, sqlx::Error>>,
    {
        let after = self.inner.config.step_timeout;
        let work = async {
            let conn = self.inner.pool.acquire().await.map_err(checkout_error)?;
            statement(conn).await.map_err(step_error)
        };
        // The timer too is the background runtime's: a step dropped
        // midway is finished there by the driver, maybe after the
        // caller's runtime (and its timers) ended.
        self.in_background(async {
            match tokio::time::timeout(after, work).await {
                Ok(result) => result,
                Err(_) => Err(step_timeout(name, after)),
            }
        })
        .await
    }

    /// `work` polled inside the background runtime \[T1\]: a connection
    /// the pool makes meanwhile registers its socket there, the task sqlx
    /// spawns to return a connection to the pool runs there, and a timer
    /// made meanwhile is that runtime's, so none depends on the caller's
    /// runtime. The caller's task still runs the statement: no task hop.
    pub(crate) fn in_background<F: Future>(&self, work: F) -> Making<F> {
        self.inner.background.making(work)
    }

    /// Refuses a table whose `sequence` column cannot hold the fencing
    /// tokens (microsecond clock values need `bigint`), before anything is
    /// locked: an `integer` column would take the row and then fail to
    /// store or return the token. Checked once per backend; a refusal or a
    /// failure is not remembered, so the next acquisition checks again (an
    /// `ALTER TABLE` takes effect without a restart).
    async fn check_sequence_column(&self) -> Result<(), BackendError> {
        let checked = self
            .inner
            .sequence_checked
            .get_or_try_init(|| async {
                let config = &self.inner.config;
                let found: Option<String> = self
                    .step("try_acquire", |mut conn| async move {
                        sqlx::query_scalar(SEQUENCE_TYPE)
                            .bind(&config.schema)
                            .bind(&config.table)
                            .fetch_optional(&mut *conn)
                            .await
                    })
                    .await
                    .map_err(Unchecked::Failed)?;
                match found {
                    Some(found) if found == "bigint" => Ok(()),
                    Some(found) => Err(Unchecked::Failed(BackendError::new(
                        BackendErrorKind::Setup,
                        SetupError::NarrowSequence {
                            table: self.inner.table.clone(),
                            found,
                        },
                    ))),
                    None => Err(Unchecked::Missing),
                }
            })
            .await;
        match checked {
            Ok(()) | Err(Unchecked::Missing) => Ok(()),
            Err(Unchecked::Failed(error)) => Err(error),
        }
    }
}

/// The advisory lock key that serialises migrations of one table: a
/// 64-bit FNV-1a hash of its qualified name, the same on every node.
fn migration_lock_key(table: &str) -> i64 {
    let hash = format!("withlock migrate {table}")
        .bytes()
        .fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
        });
    i64::from_ne_bytes(hash.to_ne_bytes())
}

/// The ttl as the statements take it, in whole microseconds (the
/// precision of a PostgreSQL timestamp).
fn micros(ttl: Duration) -> i64 {
    i64::try_from(ttl.as_micros()).unwrap_or(i64::MAX)
}

fn protocol(message: impl Into<String>) -> BackendError {
    BackendError::message(BackendErrorKind::Protocol, message)
}

/// The answer of an acquisition statement (the lock step's or the queue's):
/// a fencing token when taken, else busy, with the holder's time left when
/// the statement gave it \[A9\].
fn acquire_outcome(
    row: Option<(Option<i64>, Option<i64>)>,
) -> Result<AcquireOutcome, BackendError> {
    match row {
        Some((Some(sequence), _)) => u64::try_from(sequence)
            .map(|fencing_token| AcquireOutcome::Acquired { fencing_token })
            .map_err(|_| protocol(format!("negative sequence {sequence} for the key"))),
        Some((None, expires_us)) => Ok(AcquireOutcome::busy(micros_left(expires_us))),
        None => Ok(AcquireOutcome::BUSY),
    }
}

/// A time left in µs, as the statements give it.
fn micros_left(us: Option<i64>) -> Option<Duration> {
    us.and_then(|us| u64::try_from(us).ok())
        .map(Duration::from_micros)
}

/// Whether the queue's release failed for want of the queue's tables,
/// functions or rights \[F6\]: undefined table (42P01: the waiters or the
/// runs table), undefined function (42883: a table migrated only to 0002
/// has no `_v2` functions), insufficient privilege (42501). The statement
/// failed whole, so nothing was released.
fn queue_missing(error: &BackendError) -> bool {
    sqlstate(error).is_some_and(|code| matches!(code.as_str(), "42P01" | "42883" | "42501"))
}

impl PostgresBackend {
    /// One release statement, `sql`; `queue`: the queue's, which binds the
    /// grant channel too.
    async fn release_with(
        &self,
        sql: &str,
        lease: &Lease,
        queue: bool,
    ) -> Result<ReleaseOutcome, BackendError> {
        let mut query = sqlx::query(sql)
            .bind(lease.key())
            .bind(lease.owner().as_str());
        if self.inner.config.release_notifications {
            query = query.bind(&self.inner.config.channel);
        }
        if queue {
            query = query.bind(&self.inner.queue.grant_channel);
        }
        let row = self
            .step("release", |mut conn| async move {
                query.fetch_optional(&mut *conn).await
            })
            .await?;
        // A row whose locked_by was still ours but whose time had run out
        // is cleared too, yet counts as not held: the lease had ended.
        let held = match row {
            None => false,
            Some(row) => row
                .try_get::<Option<bool>, _>(0)
                .map_err(step_error)?
                .unwrap_or(false),
        };
        Ok(if held {
            ReleaseOutcome::Released
        } else {
            ReleaseOutcome::NotHeld
        })
    }

    /// The extensions of [`LockBackend::extend_many`] in one statement.
    async fn extend_statement(
        &self,
        requests: &[ExtendRequest],
    ) -> Result<Vec<ExtendOutcome>, BackendError> {
        self.extension_statement("extend", &self.inner.sql.extend, requests)
            .await
    }

    /// The statement of `extend` or `hold` (`sql`), whose third parameter
    /// is each request's `ttl` in µs.
    async fn extension_statement(
        &self,
        step: &'static str,
        sql: &str,
        requests: &[ExtendRequest],
    ) -> Result<Vec<ExtendOutcome>, BackendError> {
        let keys: Vec<&str> = requests.iter().map(|r| r.lease.key()).collect();
        let owners: Vec<&str> = requests.iter().map(|r| r.lease.owner().as_str()).collect();
        let ttls: Vec<i64> = requests.iter().map(|r| micros(r.ttl)).collect();
        let rows = self
            .step(step, |mut conn| async move {
                sqlx::query_as::<_, (i64, i32)>(sql)
                    .bind(&keys)
                    .bind(&owners)
                    .bind(&ttls)
                    .fetch_all(&mut *conn)
                    .await
            })
            .await?;
        if rows.len() != requests.len() {
            return Err(protocol(format!(
                "{} outcomes for {} extensions",
                rows.len(),
                requests.len()
            )));
        }
        // Rows come ordered by request position (1-based).
        rows.into_iter()
            .enumerate()
            .map(|(i, (ord, outcome))| {
                if usize::try_from(ord).ok() != Some(i + 1) {
                    return Err(protocol(format!("extension outcome {ord} out of order")));
                }
                match outcome {
                    EXTENDED => Ok(ExtendOutcome::Extended),
                    EXPIRED => Ok(ExtendOutcome::Expired),
                    TAKEN => Ok(ExtendOutcome::Taken),
                    other => Err(protocol(format!("unknown extension outcome {other}"))),
                }
            })
            .collect()
    }
}

impl fmt::Debug for PostgresBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never the password: only the parts of the connect options that
        // say where the locks are.
        let options = self.inner.pool.connect_options();
        f.debug_struct("PostgresBackend")
            .field("host", &options.get_host())
            .field("port", &options.get_port())
            .field("database", &options.get_database())
            .field("username", &options.get_username())
            .field("table", &self.inner.table)
            .field("channel", &self.inner.config.channel)
            .field(
                "release_notifications",
                &self.inner.config.release_notifications,
            )
            .field("step_timeout", &self.inner.config.step_timeout)
            .finish()
    }
}

/// # Cancel safety
///
/// A dropped step may or may not have been applied by the server, never
/// half: each is one autocommit statement. No step leaves session state on
/// the connection, so a dropped future never strands a lock on a pooled
/// connection.
#[async_trait]
impl LockBackend for PostgresBackend {
    fn capabilities(&self) -> Capabilities {
        Capabilities::default()
            .with_name("postgres")
            .with_release_notifications(self.inner.config.release_notifications)
            .with_max_key_len(MAX_KEY_LEN)
            .with_max_extend_batch(MAX_EXTEND_BATCH)
            // The grants reach their waiters by NOTIFY: the driver queues
            // only when both are on.
            .with_fair_queue(self.inner.config.release_notifications)
    }

    /// One statement: creates the row or takes it over if free or expired,
    /// with `sequence = max(sequence + 1, database clock in µs)` as the
    /// fencing token, so tokens keep increasing when the row was deleted.
    /// Busy, it says how long the holder has left (`locked_until - now`,
    /// by the database clock) \[A9\], read in the same statement.
    /// The first call of a backend checks first that `sequence` is
    /// `bigint` ([`SetupError::NarrowSequence`], nothing taken). Fails
    /// with kind [`Unavailable`](BackendErrorKind::Unavailable) when no
    /// pooled connection could be had: nothing was sent.
    async fn try_acquire(
        &self,
        key: &str,
        owner: &OwnerToken,
        ttl: Duration,
    ) -> Result<AcquireOutcome, BackendError> {
        self.check_sequence_column().await?;
        let row = self
            .step("try_acquire", |mut conn| async move {
                sqlx::query_as::<_, (Option<i64>, Option<i64>)>(&self.inner.sql.acquire)
                    .bind(key)
                    .bind(owner.as_str())
                    .bind(micros(ttl))
                    .fetch_optional(&mut *conn)
                    .await
            })
            .await?;
        acquire_outcome(row)
    }

    async fn extend(&self, lease: &Lease, ttl: Duration) -> Result<ExtendOutcome, BackendError> {
        let request = ExtendRequest {
            lease: lease.clone(),
            ttl,
        };
        let outcomes = self
            .extend_statement(std::slice::from_ref(&request))
            .await?;
        outcomes
            .into_iter()
            .next()
            .ok_or_else(|| protocol("no outcome for the extension"))
    }

    async fn extend_many(
        &self,
        requests: &[ExtendRequest],
    ) -> Vec<Result<ExtendOutcome, BackendError>> {
        if requests.is_empty() {
            return Vec::new();
        }
        batch_results(requests.len(), self.extend_statement(requests).await)
    }

    /// One database.
    fn failure_domain(&self, _key: &str) -> u64 {
        0
    }

    /// With notifications on, one statement that releases as before when
    /// the key has no live place in its queue, and grants the key to the
    /// queue's head otherwise \[F1\], unless the key's grants in a row
    /// have lasted 10 s: it is then left free for 600 ms \[F5\] (see the
    /// crate's "The fair queue"). A store without the queue's table,
    /// function or rights (an upgrade without `migrate`, a role without
    /// rights on the waiters table) fails that statement whole: the
    /// release then goes without the queue, now and from then on (until
    /// `migrate` succeeds), as before the queue \[F6\].
    async fn release(&self, lease: &Lease) -> Result<ReleaseOutcome, BackendError> {
        let inner = &self.inner;
        if inner.config.release_notifications
            && !inner.queue_release_refused.load(Ordering::Relaxed)
        {
            match self.release_with(&inner.sql.release, lease, true).await {
                Err(error) if queue_missing(&error) => {
                    if !inner.queue_release_refused.swap(true, Ordering::Relaxed) {
                        tracing::warn!(
                            table = %inner.table,
                            waiters = %inner.queue.waiters,
                            error = %lock_core::ErrorChain(&error),
                            "the store refused the fair queue's release; releases of this backend \
                             grant nothing from now on (run the backend's migrate, or give the lock \
                             user SELECT, INSERT, UPDATE and DELETE on the waiters and streaks \
                             tables; see the lock-postgres README)"
                        );
                    }
                }
                answer => return answer,
            }
        }
        self.release_with(&inner.sql.release_plain, lease, false)
            .await
    }

    /// Sets `locked_until` to `locked_at` plus the minimum hold: the row's
    /// own record of the acquisition \[H7\]; and, in the same statement,
    /// takes the hold's record, the row [`KEPT_PREFIX`](crate::KEPT_PREFIX)`<key>`,
    /// for the holder until then, for the admin. A table that refuses the
    /// record's row (a `key` column too short for it, a constraint of its
    /// own) fails the whole statement, which then goes again without it.
    async fn hold(&self, lease: &Lease, hold: Hold) -> Result<ExtendOutcome, BackendError> {
        let request = ExtendRequest {
            lease: lease.clone(),
            ttl: hold.since_acquired,
        };
        let requests = std::slice::from_ref(&request);
        let outcomes = match self
            .extension_statement("hold", &self.inner.sql.hold, requests)
            .await
        {
            Err(error) if refused_row(&error) => {
                tracing::debug!(key = %lease.key(), error = %lock_core::ErrorChain(&error), "the table refuses the minimum hold's record; holding without it");
                self.extension_statement("hold", &self.inner.sql.hold_unrecorded, requests)
                    .await?
            }
            outcomes => outcomes?,
        };
        outcomes
            .into_iter()
            .next()
            .ok_or_else(|| protocol("no outcome for the minimum hold"))
    }

    async fn watch_release(&self, key: &str) -> Result<ReleaseWatch, BackendError> {
        let Some(listener) = &self.inner.listener else {
            return Ok(ReleaseWatch::never());
        };
        // The watch first, then LISTEN: a release between the two is caught
        // by the watch, since the listener wakes every watch when it
        // (re)connects.
        let watch = self.inner.hub.watch(key);
        listener.ensure_listening().await?;
        Ok(watch)
    }

    /// One call of the queue's function `<table>_queue_v2` (see the
    /// migrations `0002_create_waiters.sql` and `0003_leave_gaps.sql`):
    /// one autocommit statement, one round trip. It locks the key's row
    /// (made, free, if missing) so that the queue's steps on one key run
    /// one after the other, then takes up a grant, takes the free row when
    /// no live place is ahead and the key is not in a gap left for
    /// clients outside the queue \[F5\] (with the fencing token rule of
    /// `try_acquire`), or keeps the waiter's place (its ticket kept, its
    /// life renewed for the ticket ttl) and answers busy, with the
    /// holder's time left, or the gap's, to the queue's head only and the
    /// last fencing token drawn for the key (the row's `sequence`: a
    /// grant announced with a greater one came after).
    /// A store without the queue's table, function or rights fails with
    /// kind [`Setup`](BackendErrorKind::Setup), in the database's words
    /// \[F6\]; the driver then waits unqueued.
    async fn try_acquire_queued(
        &self,
        key: &str,
        owner: &OwnerToken,
        ttl: Duration,
        terms: QueueTerms,
    ) -> Result<AcquireOutcome, BackendError> {
        self.check_sequence_column().await?;
        let row = self
            .step("try_acquire_queued", |mut conn| async move {
                sqlx::query_as::<_, (Option<i64>, Option<i64>, Option<i64>)>(
                    &self.inner.sql.queue_step,
                )
                .bind(key)
                .bind(owner.as_str())
                .bind(micros(ttl))
                .bind(micros(terms.ticket_ttl))
                .bind(micros(terms.claim))
                .fetch_optional(&mut *conn)
                .await
            })
            .await?;
        match row {
            Some((None, expires_us, Some(last))) => Ok(AcquireOutcome::Busy {
                expires_in: micros_left(expires_us),
                last_token: u64::try_from(last).ok(),
            }),
            row => acquire_outcome(row.map(|(token, expires_us, _)| (token, expires_us))),
        }
    }

    /// One call of the queue's function `<table>_leave_v2`: removes the
    /// place; a grant to `owner` not taken up is handed on as a release
    /// would; a free key whose queue still has a live place is announced.
    async fn leave_queue(&self, key: &str, owner: &OwnerToken) -> Result<(), BackendError> {
        let inner = &self.inner;
        self.step("leave_queue", |mut conn| async move {
            sqlx::query(&inner.sql.leave)
                .bind(key)
                .bind(owner.as_str())
                .bind(&inner.config.channel)
                .bind(&inner.queue.grant_channel)
                .execute(&mut *conn)
                .await
        })
        .await?;
        Ok(())
    }
}

/// Whether `error` is the table's refusal of a row's data (SQLSTATE class
/// 22, a data exception such as a value too long for its column, or 23, an
/// integrity constraint): the statement failed whole, nothing was applied.
fn refused_row(error: &BackendError) -> bool {
    sqlstate(error).is_some_and(|code| code.starts_with("22") || code.starts_with("23"))
}

//! What several test files share.

// Each test file uses its own part of this module.
#![allow(dead_code)]

use std::collections::HashMap;
use std::time::Duration;

use lock_core::{AcquireOutcome, BackendError, OwnerToken, ReleaseOutcome};
use lock_postgres::testing::TestBackend;
use sqlx::postgres::PgPoolOptions;
use sqlx::PgPool;
use tokio::sync::watch;
use tokio::time::Instant;

/// A test backend that tells how many attempts on each key were answered
/// busy. A waiter's second busy answer comes after its release watch is
/// in place (the driver watches after the first, then tries again at
/// once), so from then on only a notification wakes it before its retry
/// delay.
#[derive(Debug)]
pub(crate) struct Observed {
    pub(crate) inner: TestBackend,
    busy: watch::Sender<HashMap<String, usize>>,
}

impl Observed {
    pub(crate) fn new(inner: TestBackend) -> Self {
        Self {
            inner,
            busy: watch::Sender::new(HashMap::new()),
        }
    }

    /// Returns once a waiter on `key` waits on its release watch, and
    /// forgets the key's count.
    pub(crate) async fn waiting(&self, key: &str, within: Duration) {
        let mut rx = self.busy.subscribe();
        let waited = tokio::time::timeout(
            within,
            rx.wait_for(|busy| busy.get(key).is_some_and(|&n| n >= 2)),
        );
        waited
            .await
            .unwrap_or_else(|_| panic!("the waiter on {key} never waited on its watch"))
            .unwrap();
        drop(rx);
        self.busy.send_modify(|busy| {
            busy.remove(key);
        });
    }
}

lock_core::forward_lock_backend!(Observed => inner {
    async fn try_acquire(
        &self,
        key: &str,
        owner: &OwnerToken,
        ttl: Duration,
    ) -> Result<AcquireOutcome, BackendError> {
        let answer = self.inner.try_acquire(key, owner, ttl).await;
        if matches!(answer, Ok(AcquireOutcome::Busy { .. })) {
            self.busy.send_modify(|busy| *busy.entry(key.to_owned()).or_default() += 1);
        }
        answer
    }

    fn try_acquire_now(
        &self,
        _key: &str,
        _owner: &OwnerToken,
        _ttl: Duration,
        _now: Instant,
    ) -> Option<Result<AcquireOutcome, BackendError>> {
        None
    }

    fn release_now(
        &self,
        _lease: &lock_core::Lease,
        _now: Instant,
    ) -> Option<Result<ReleaseOutcome, BackendError>> {
        None
    }
});

/// A login role made for one test, dropped with everything it owns when
/// the value is.
pub(crate) struct Role {
    pub(crate) name: String,
}

impl Role {
    /// A new role, then `grants` run as the admin with `{role}` standing
    /// for its quoted name.
    pub(crate) async fn with_grants(grants: &str) -> Self {
        let name = format!("withlock_test_role_{:016x}", rand::random::<u64>());
        let quoted = format!("\"{name}\"");
        admin(&format!(
            "CREATE ROLE {quoted} LOGIN; {}",
            grants.replace("{role}", &quoted)
        ))
        .await;
        Self { name }
    }

    /// The test server's URL with this role as the user.
    pub(crate) fn url(&self) -> String {
        let url = withlock_test_servers::postgres::database_url();
        let (scheme, rest) = url.split_once("://").unwrap();
        let host = rest.rsplit_once('@').map_or(rest, |(_, host)| host);
        format!("{scheme}://{}@{host}", self.name)
    }
}

impl Drop for Role {
    fn drop(&mut self) {
        let name = self.name.clone();
        // A runtime of its own: the test's may be shutting down.
        let _ = std::thread::spawn(move || {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap()
                .block_on(admin(&format!(
                    "DROP OWNED BY \"{name}\"; DROP ROLE IF EXISTS \"{name}\""
                )));
        })
        .join();
    }
}

/// Runs `sql` as the test server's admin user.
pub(crate) async fn admin(sql: &str) {
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect(&withlock_test_servers::postgres::database_url())
        .await
        .unwrap();
    sqlx::raw_sql(sql).execute(&pool).await.unwrap();
    pool.close().await;
}

/// Ruby's Locker gem on `table` (the gem's `locks`): its own statements,
/// as issue 4 quotes them (UTC timestamps from `clock_timestamp()`, 30 s
/// locks), on a one-connection pool of its own.
pub(crate) struct Ruby {
    pub(crate) pool: PgPool,
    pub(crate) get: String,
    pub(crate) renew: String,
    pub(crate) release: String,
    sequence: String,
}

impl Ruby {
    pub(crate) async fn new(table: &str) -> Self {
        let pool = PgPoolOptions::new()
            .max_connections(1)
            .acquire_timeout(Duration::from_secs(5))
            .connect(&withlock_test_servers::postgres::database_url())
            .await
            .unwrap();
        Self {
            pool,
            get: format!(
                "UPDATE {table} SET locked_by = $2, \
                 locked_at = clock_timestamp() at time zone 'UTC', \
                 locked_until = clock_timestamp() at time zone 'UTC' + interval '30 seconds', \
                 sequence = sequence + 1 \
                 WHERE key = $1 AND (locked_by IS NULL OR locked_by = $2 \
                 OR locked_until < clock_timestamp() at time zone 'UTC')"
            ),
            renew: format!(
                "UPDATE {table} SET locked_until = clock_timestamp() at time zone 'UTC' + interval '30 seconds' \
                 WHERE key = $1 AND locked_by = $2"
            ),
            release: format!("UPDATE {table} SET locked_by = NULL WHERE key = $1 AND locked_by = $2"),
            sequence: format!("SELECT sequence FROM {table} WHERE key = $1"),
        }
    }

    pub(crate) async fn run(&self, sql: &str, key: &str, id: &str) -> bool {
        let done = sqlx::query(sql)
            .bind(key)
            .bind(id)
            .execute(&self.pool)
            .await
            .unwrap();
        done.rows_affected() == 1
    }

    pub(crate) async fn sequence(&self, key: &str) -> i64 {
        sqlx::query_scalar(&self.sequence)
            .bind(key)
            .fetch_one(&self.pool)
            .await
            .unwrap()
    }
}

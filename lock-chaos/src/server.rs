//! The lock servers a run starts (a `redis-server`, a PostgreSQL, three
//! etcd members or a 6-node Redis Cluster of its own, on free loopback
//! ports), the faults injected into them, and the leak check.

use std::io;
use std::sync::Arc;
use std::time::Duration;

use lock_postgres::testing::{terminate_connections, TestError};
use lock_postgres::{PostgresBackend, PostgresConfig, SetupError};
use lock_redis::redis;
use nix::sys::signal::Signal;
use sqlx::postgres::{PgPool, PgPoolOptions};
use withlock_test_servers::postgres::TestServer;
use withlock_test_servers::redis::RedisServer;

use crate::args::Backend;
use crate::event::FaultKind;

pub mod etcd;
pub mod redis_cluster;

pub use etcd::EtcdServer;
pub use redis_cluster::ClusterServer;

/// The `application_name` of every worker connection to the PostgreSQL
/// lock server, so that faults cut exactly those.
pub const WORKER_APPLICATION_NAME: &str = "withlock-chaos-worker";

/// The bound on each admin step.
const WAIT: Duration = Duration::from_secs(10);

/// What starting a server or injecting a fault can fail with.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ServerError {
    /// A process or signal step failed.
    #[error("server process step failed")]
    Io(#[from] io::Error),
    /// A Redis admin command failed.
    #[error("Redis admin command failed")]
    Redis(#[from] redis::RedisError),
    /// A PostgreSQL test helper (terminating connections) failed.
    #[error("PostgreSQL test helper failed")]
    PgServer(#[from] TestError),
    /// The PostgreSQL lock table could not be made.
    #[error("PostgreSQL lock backend setup failed")]
    PgBackend(#[from] SetupError),
    /// A PostgreSQL admin statement failed.
    #[error("PostgreSQL admin statement failed")]
    Database(#[from] sqlx::Error),
    /// A step did not finish in time.
    #[error("server step timed out: {0}")]
    Timeout(&'static str),
    /// The etcd backend of the leak check could not connect.
    #[error("etcd backend setup failed")]
    Etcd(#[from] lock_etcd::SetupError),
    /// The Redis Cluster backend of the leak check could not be made.
    #[error("Redis Cluster backend setup failed")]
    RedisSetup(#[from] lock_redis::SetupError),
    /// A lock could not be inspected.
    #[error("lock inspection failed")]
    Inspect(#[from] lock_core::BackendError),
}

/// What a server fault did: to whom, what it reported, and which keys'
/// store it touched.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Injected {
    /// The kind to log, when it is not the one injected (a short stop of a
    /// Redis Cluster master that was failed over all the same).
    pub kind: Option<FaultKind>,
    /// `server`, `m<i>` (an etcd member), `127.0.0.1:<port>` (a Redis
    /// Cluster node).
    pub target: String,
    /// What the injection reported (connections closed, pids stopped…).
    pub detail: String,
    /// The keys whose store it touched; `None`: every key.
    pub keys: Option<Vec<String>>,
}

impl Injected {
    fn server(detail: String) -> Self {
        Self {
            kind: None,
            target: "server".to_owned(),
            detail,
            keys: None,
        }
    }
}

/// Sends `signal` to process `pid`.
///
/// # Errors
///
/// When the process does not exist or may not be signalled.
pub fn signal(pid: u32, signal: Signal) -> io::Result<()> {
    let pid = i32::try_from(pid).map_err(io::Error::other)?;
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), signal).map_err(io::Error::from)
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, ServerError> + Send + 'static,
) -> Result<T, ServerError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| ServerError::Io(io::Error::other(e)))?
}

async fn bounded<T>(
    what: &'static str,
    fut: impl std::future::Future<Output = Result<T, ServerError>>,
) -> Result<T, ServerError> {
    tokio::time::timeout(WAIT, fut)
        .await
        .map_err(|_| ServerError::Timeout(what))?
}

/// The lock server of a run. Dropping it resumes whatever a fault left
/// stopped and stops the server.
#[derive(Debug)]
pub enum LockServer {
    /// A `redis-server` child.
    Redis(Arc<RedisServer>),
    /// A PostgreSQL server of its own.
    Postgres(PgServer),
    /// Three etcd members.
    Etcd(EtcdServer),
    /// Three Redis Cluster masters with a replica each.
    RedisCluster(ClusterServer),
}

impl LockServer {
    /// Starts the server for `backend` and makes it ready for the workers
    /// (for PostgreSQL: the lock table).
    ///
    /// # Errors
    ///
    /// [`ServerError`] when the server cannot be started.
    pub async fn start(backend: Backend) -> Result<Self, ServerError> {
        match backend {
            Backend::Redis => {
                let server = blocking(|| Ok(RedisServer::start()?)).await?;
                Ok(Self::Redis(Arc::new(server)))
            }
            Backend::Postgres => Ok(Self::Postgres(PgServer::start().await?)),
            Backend::Etcd => Ok(Self::Etcd(EtcdServer::start().await?)),
            Backend::RedisCluster => Ok(Self::RedisCluster(ClusterServer::start().await?)),
        }
    }

    /// `n` keys named `<prefix><i>`; on Redis Cluster spread evenly over
    /// the masters.
    ///
    /// # Errors
    ///
    /// [`ServerError`] when the cluster cannot be asked who serves a key.
    pub async fn keys(&self, prefix: &str, n: u32) -> Result<Vec<String>, ServerError> {
        match self {
            Self::RedisCluster(cluster) => cluster.keys(prefix, n).await,
            _ => Ok((0..n).map(|i| format!("{prefix}{i}")).collect()),
        }
    }

    /// The URL the workers use.
    pub fn worker_url(&self) -> String {
        match self {
            Self::Redis(server) => server.url(),
            Self::Postgres(pg) => format!(
                "{}?application_name={WORKER_APPLICATION_NAME}",
                pg.server.url()
            ),
            Self::Etcd(etcd) => etcd.url(),
            Self::RedisCluster(cluster) => cluster.url(),
        }
    }

    /// The URL of a client of the run's own (the queue reader): on
    /// PostgreSQL with `application_name` set to `name`, so that the
    /// faults that cut the workers' connections leave it alone; elsewhere
    /// the workers' URL.
    pub fn admin_url(&self, name: &str) -> String {
        match self {
            Self::Postgres(pg) => format!("{}?application_name={name}", pg.server.url()),
            _ => self.worker_url(),
        }
    }

    /// Injects a server fault and heals it: a stop lasts `stop_for` (on
    /// Redis Cluster: until a replica is promoted, or for a short stop a
    /// fifth of it, at most 1 s). Returns what it did;
    /// `keys` are the run's, of which a Redis Cluster fault touches those
    /// its master served.
    ///
    /// # Errors
    ///
    /// [`ServerError`] when the fault could not be injected or healed; a
    /// stopped server is resumed whatever happens.
    pub async fn inject(
        &self,
        kind: FaultKind,
        stop_for: Duration,
        keys: &[String],
    ) -> Result<Injected, ServerError> {
        match self {
            Self::Etcd(etcd) => etcd.inject(kind, stop_for).await,
            Self::RedisCluster(cluster) => cluster.inject(kind, stop_for, keys).await,
            _ => self
                .inject_single(kind, stop_for)
                .await
                .map(Injected::server),
        }
    }

    async fn inject_single(
        &self,
        kind: FaultKind,
        stop_for: Duration,
    ) -> Result<String, ServerError> {
        match (self, kind) {
            (Self::Redis(server), FaultKind::ServerStop) => {
                let s = Arc::clone(server);
                blocking(move || Ok(s.pause()?)).await?;
                tokio::time::sleep(stop_for).await;
                let s = Arc::clone(server);
                blocking(move || Ok(s.resume()?)).await?;
                Ok(format!(
                    "redis-server stopped for {} ms",
                    stop_for.as_millis()
                ))
            }
            (Self::Redis(server), FaultKind::ServerKill) => {
                let s = Arc::clone(server);
                blocking(move || Ok(s.restart()?)).await?;
                Ok("redis-server killed (SIGKILL) and restarted empty".to_owned())
            }
            (Self::Redis(server), FaultKind::ClientKillNormal | FaultKind::ClientKillPubsub) => {
                let kind_name = if kind == FaultKind::ClientKillNormal {
                    "normal"
                } else {
                    "pubsub"
                };
                let s = Arc::clone(server);
                let n = blocking(move || Ok(s.kill_clients(kind_name)?)).await?;
                Ok(format!("CLIENT KILL TYPE {kind_name}: {n} closed"))
            }
            (Self::Postgres(pg), _) => pg.inject(kind, stop_for).await,
            (_, _) => Err(ServerError::Io(io::Error::other(format!(
                "{} is not a fault of this server",
                kind.name()
            )))),
        }
    }
}

/// A key the store says is held.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HeldKey {
    /// The key.
    pub key: String,
    /// The owner token holding it, `<node id>/<32 hex>`.
    pub owner: String,
    /// How long it stays held without an extension, in ms.
    pub expires_in_ms: i64,
}

impl HeldKey {
    /// Whether the locker with node id `node` holds it.
    pub fn is_held_by(&self, node: &str) -> bool {
        self.owner
            .strip_prefix(node)
            .is_some_and(|rest| rest.starts_with('/'))
    }
}

impl std::fmt::Display for HeldKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "key {:?} held by {:?}, expiring in {} ms",
            self.key, self.owner, self.expires_in_ms
        )
    }
}

/// The keys of `keys` that the lock store at `url` says are held, read
/// from the store itself (for PostgreSQL, the default lock table).
///
/// # Errors
///
/// [`ServerError`] when the store cannot be read in time.
pub async fn held_keys(
    backend: Backend,
    url: &str,
    keys: &[String],
) -> Result<Vec<HeldKey>, ServerError> {
    match backend {
        Backend::Redis => bounded("leak check", redis_held(url, keys)).await,
        Backend::Postgres => bounded("leak check", pg_held(url, keys)).await,
        Backend::Etcd => {
            bounded("leak check", async {
                inspected(&etcd::connect(url).await?, keys).await
            })
            .await
        }
        Backend::RedisCluster => {
            bounded("leak check", async {
                inspected(&redis_cluster::backend(url)?, keys).await
            })
            .await
        }
    }
}

/// The held keys of `keys`, as the backend's [`LockAdmin::inspect`] sees
/// them.
async fn inspected(
    admin: &dyn lock_core::LockAdmin,
    keys: &[String],
) -> Result<Vec<HeldKey>, ServerError> {
    let mut held = Vec::new();
    for key in keys {
        let info = admin.inspect(key).await?;
        if let Some(owner) = info.owner {
            held.push(HeldKey {
                key: key.clone(),
                owner: owner.as_str().to_owned(),
                expires_in_ms: info
                    .ttl
                    .map_or(-1, |t| i64::try_from(t.as_millis()).unwrap_or(i64::MAX)),
            });
        }
    }
    Ok(held)
}

async fn redis_held(url: &str, keys: &[String]) -> Result<Vec<HeldKey>, ServerError> {
    let client = redis::Client::open(url)?;
    let mut conn = client.get_multiplexed_async_connection().await?;
    let mut held = Vec::new();
    for key in keys {
        let (owner, pttl): (Option<String>, i64) = redis::pipe()
            .cmd("GET")
            .arg(key)
            .cmd("PTTL")
            .arg(key)
            .query_async(&mut conn)
            .await?;
        // -2: no such key.
        if pttl != -2 {
            held.push(HeldKey {
                key: key.clone(),
                owner: owner.unwrap_or_default(),
                expires_in_ms: pttl,
            });
        }
    }
    Ok(held)
}

async fn pg_held(url: &str, keys: &[String]) -> Result<Vec<HeldKey>, ServerError> {
    let table = PostgresConfig::default().qualified_table()?;
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(WAIT)
        .connect(url)
        .await?;
    // The backend's own notion of held: an owner, and time left.
    let sql = format!(
        "SELECT key, locked_by, (EXTRACT(EPOCH FROM locked_until - \
         (clock_timestamp() AT TIME ZONE 'UTC')) * 1000)::bigint \
         FROM {table} WHERE key = ANY($1) AND locked_by IS NOT NULL \
         AND locked_until >= clock_timestamp() AT TIME ZONE 'UTC'"
    );
    let rows: Vec<(String, String, i64)> = sqlx::query_as(&sql).bind(keys).fetch_all(&pool).await?;
    pool.close().await;
    Ok(rows
        .into_iter()
        .map(|(key, owner, expires_in_ms)| HeldKey {
            key,
            owner,
            expires_in_ms,
        })
        .collect())
}

/// A PostgreSQL server of its own with the lock table. Its watchdog kills
/// it (and resumes what a fault stopped) if this process dies without
/// dropping it.
pub struct PgServer {
    server: Arc<TestServer>,
    table: String,
}

impl std::fmt::Debug for PgServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgServer")
            .field("server", &self.server)
            .field("table", &self.table)
            .finish()
    }
}

impl PgServer {
    async fn start() -> Result<Self, ServerError> {
        let server = Arc::new(blocking(|| Ok(TestServer::start()?)).await?);
        let backend = bounded("migrate", async {
            let backend = PostgresBackend::connect(&server.url()).await?;
            backend.migrate().await?;
            Ok(backend)
        })
        .await?;
        let table = backend.qualified_table().to_owned();
        backend.pool().close().await;
        Ok(Self { server, table })
    }

    async fn admin(&self) -> Result<PgPool, ServerError> {
        Ok(PgPoolOptions::new()
            .max_connections(1)
            .acquire_timeout(WAIT)
            .connect(&self.server.url())
            .await?)
    }

    async fn inject(&self, kind: FaultKind, stop_for: Duration) -> Result<String, ServerError> {
        let url = self.server.url();
        match kind {
            FaultKind::ServerStop => {
                let s = Arc::clone(&self.server);
                let backends = blocking(move || Ok(s.pause()?)).await?;
                tokio::time::sleep(stop_for).await;
                let s = Arc::clone(&self.server);
                blocking(move || Ok(s.resume()?)).await?;
                Ok(format!(
                    "postmaster and {backends} backends stopped for {} ms",
                    stop_for.as_millis()
                ))
            }
            FaultKind::PgTerminate | FaultKind::PgTerminateListen => {
                let only_listening = kind == FaultKind::PgTerminateListen;
                let n = bounded("terminate", async {
                    Ok(
                        terminate_connections(&url, WORKER_APPLICATION_NAME, only_listening)
                            .await?,
                    )
                })
                .await?;
                Ok(format!("pg_terminate_backend: {n} connections"))
            }
            FaultKind::PgRestart => {
                let s = Arc::clone(&self.server);
                blocking(move || {
                    s.stop()?;
                    Ok(s.start_again()?)
                })
                .await?;
                Ok("pg_ctl stop -m immediate, then start".to_owned())
            }
            FaultKind::PgDeleteRows => {
                let pool = self.admin().await?;
                let sql = format!("DELETE FROM {}", self.table);
                let done = sqlx::query(&sql).execute(&pool).await?;
                pool.close().await;
                Ok(format!("deleted {} lock rows", done.rows_affected()))
            }
            other => Err(ServerError::Io(io::Error::other(format!(
                "{} is not a PostgreSQL fault",
                other.name()
            )))),
        }
    }
}

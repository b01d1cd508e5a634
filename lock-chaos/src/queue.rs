//! The coordinator's reads of the fair queue \[F1\]: every
//! [`SAMPLE_EVERY`], the live places of each key, head first, read with
//! the store's own client the way the backend orders them, logged as
//! [`QueueSnapshot`]s in `queue.jsonl` for the order check
//! ([`analysis`](crate::analysis)):
//!
//! - Redis: the key's queue sorted set by score and its waiters hash
//!   (`alive_until:claim`), with `TIME`, in one `MULTI`; a place whose
//!   `alive_until` has passed is dead (the scripts skip it) and left out.
//! - PostgreSQL: `<table>_waiters` by `ticket`, `alive_until` not passed
//!   by `clock_timestamp()`.
//! - etcd: the name's contender keys by create revision, their values the
//!   owner tokens; the lowest is the holder's once it holds.
//!
//! Redis Cluster is not read. A read that fails or times out (the store is
//! stopped, killed, electing) is skipped; the next one reconnects.

use std::collections::HashMap;
use std::path::Path;
use std::time::Duration;

use lock_etcd::etcd_client;
use lock_redis::redis;
use rand::seq::SliceRandom;
use sqlx::postgres::{PgPool, PgPoolOptions};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::args::Backend;
use crate::event::{now_us, Event, LogWriter, QueueSnapshot};
use crate::server::LockServer;

/// How often the queue is read.
pub const SAMPLE_EVERY: Duration = Duration::from_millis(20);

/// The bound on one read, connecting included.
const READ_TIMEOUT: Duration = Duration::from_millis(500);

/// What setting up or making a read can fail with.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum QueueReadError {
    /// A Redis command failed.
    #[error("Redis read of the queue failed")]
    Redis(#[from] redis::RedisError),
    /// The Redis backend (which names the queue's keys) could not be made.
    #[error("Redis backend setup failed")]
    RedisSetup(#[from] lock_redis::SetupError),
    /// A PostgreSQL statement failed.
    #[error("PostgreSQL read of the queue failed")]
    Database(#[from] sqlx::Error),
    /// The PostgreSQL config did not give the waiters table's name.
    #[error("PostgreSQL config refused")]
    PostgresSetup(#[from] lock_postgres::SetupError),
    /// An etcd request failed.
    #[error("etcd read of the queue failed")]
    Etcd(#[from] etcd_client::Error),
    /// The etcd URL did not parse.
    #[error("etcd config refused")]
    EtcdSetup(#[from] lock_etcd::SetupError),
    /// A read answered something that is not a queue.
    #[error("unexpected answer: {0}")]
    Unexpected(&'static str),
    /// A read did not finish in time.
    #[error("queue read timed out")]
    Timeout,
}

/// Reads the live places of the run's keys from the store.
pub enum QueueReader {
    /// A single Redis server.
    Redis {
        /// The server's client.
        client: redis::Client,
        /// The connection, made again after a failure.
        conn: Option<redis::aio::MultiplexedConnection>,
        /// Each key with its queue and waiters keys.
        keys: Vec<(String, String, String)>,
    },
    /// A PostgreSQL server.
    Postgres {
        /// One connection, not one of those the faults cut.
        pool: PgPool,
        /// The read.
        sql: String,
        /// The keys.
        keys: Vec<String>,
    },
    /// A Redis Cluster: each key's queue read on the node that serves its
    /// slot, found by trying the nodes in turn (a node that does not serve
    /// it, or a replica, answers `MOVED`; a stopped one times out).
    RedisCluster {
        /// A client of each node.
        clients: Vec<redis::Client>,
        /// Their connections, made again after a failure.
        conns: Vec<Option<redis::aio::MultiplexedConnection>>,
        /// Each key with its queue and waiters keys, and the node that
        /// served its slot last.
        keys: Vec<((String, String, String), usize)>,
    },
    /// An etcd cluster, one client per member, tried in turn.
    Etcd {
        /// The members' endpoints.
        endpoints: Vec<String>,
        /// A client of each, made when first needed and again after a
        /// failure.
        clients: Vec<Option<etcd_client::Client>>,
        /// The member asked next.
        next: usize,
        /// The keys.
        keys: Vec<String>,
    },
}

impl std::fmt::Debug for QueueReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let name = match self {
            Self::Redis { .. } => "redis",
            Self::RedisCluster { .. } => "redis-cluster",
            Self::Postgres { .. } => "postgres",
            Self::Etcd { .. } => "etcd",
        };
        f.debug_struct("QueueReader")
            .field("backend", &name)
            .finish_non_exhaustive()
    }
}

/// The `application_name` of the reader's PostgreSQL connection: not the
/// workers', so that `pg_terminate` leaves it alone.
pub const QUEUE_APPLICATION_NAME: &str = "withlock-chaos-queue";

impl QueueReader {
    /// A reader of the queues of `keys` on `server`.
    ///
    /// # Errors
    ///
    /// [`QueueReadError`] when the store's address or names do not parse.
    pub fn new(
        backend: Backend,
        server: &LockServer,
        keys: &[String],
    ) -> Result<Option<Self>, QueueReadError> {
        let url = server.worker_url();
        Ok(Some(match backend {
            Backend::Redis => {
                // The backend's own names for the queue's keys.
                let lock = lock_redis::RedisBackend::from_url(&url)?;
                let keys = keys
                    .iter()
                    .map(|k| {
                        let (queue, waiters) = lock.queue_keys(k);
                        (k.clone(), queue, waiters)
                    })
                    .collect();
                Self::Redis {
                    client: redis::Client::open(url)?,
                    conn: None,
                    keys,
                }
            }
            Backend::Postgres => {
                let waiters = lock_postgres::PostgresConfig::default().qualified_waiters_table()?;
                let url = server.admin_url(QUEUE_APPLICATION_NAME);
                let pool = PgPoolOptions::new()
                    .max_connections(1)
                    .acquire_timeout(READ_TIMEOUT)
                    .test_before_acquire(false)
                    .connect_lazy(&url)?;
                Self::Postgres {
                    pool,
                    // As the queue's functions read it: live places by
                    // ticket, on the database's clock.
                    sql: format!(
                        "SELECT key, owner FROM {waiters} WHERE key = ANY($1) \
                         AND alive_until >= clock_timestamp() AT TIME ZONE 'UTC' \
                         ORDER BY key, ticket"
                    ),
                    keys: keys.to_vec(),
                }
            }
            Backend::Etcd => {
                let endpoints = crate::server::etcd::config(&url)?.endpoints;
                Self::Etcd {
                    clients: endpoints.iter().map(|_| None).collect(),
                    endpoints,
                    next: 0,
                    keys: keys.to_vec(),
                }
            }
            Backend::RedisCluster => {
                // The backend's own names: the lock key, and the queue's
                // keys in its slot.
                let lock = crate::server::redis_cluster::backend(&url)?;
                let keys = keys
                    .iter()
                    .map(|k| {
                        let lock_key = lock.lock_key(k);
                        let queue = lock_redis::slot::queue_key(&lock_key);
                        let waiters = lock_redis::slot::waiters_key(&lock_key);
                        ((k.clone(), queue, waiters), 0)
                    })
                    .collect();
                let clients = url
                    .split(',')
                    .map(redis::Client::open)
                    .collect::<Result<Vec<_>, _>>()?;
                Self::RedisCluster {
                    conns: clients.iter().map(|_| None).collect(),
                    clients,
                    keys,
                }
            }
        }))
    }

    /// The live places of each key, head first.
    ///
    /// # Errors
    ///
    /// [`QueueReadError`] when the store does not answer in time; the
    /// next read connects again.
    pub async fn read(&mut self) -> Result<Vec<(String, Vec<String>)>, QueueReadError> {
        let read = async {
            match self {
                Self::Redis { client, conn, keys } => redis_read(client, conn, keys).await,
                Self::RedisCluster {
                    clients,
                    conns,
                    keys,
                } => cluster_read(clients, conns, keys).await,
                Self::Postgres { pool, sql, keys } => pg_read(pool, sql, keys).await,
                Self::Etcd {
                    endpoints,
                    clients,
                    next,
                    keys,
                } => etcd_read(endpoints, clients, next, keys).await,
            }
        };
        let answer = tokio::time::timeout(READ_TIMEOUT, read)
            .await
            .unwrap_or(Err(QueueReadError::Timeout));
        if answer.is_err() {
            match self {
                Self::Redis { conn, .. } => *conn = None,
                Self::Etcd {
                    clients,
                    next,
                    endpoints,
                    ..
                } => {
                    // This member may be stopped or gone: the next.
                    clients[*next] = None;
                    *next = (*next + 1) % endpoints.len().max(1);
                }
                Self::Postgres { .. } | Self::RedisCluster { .. } => {}
            }
        }
        answer
    }
}

async fn redis_read(
    client: &redis::Client,
    conn: &mut Option<redis::aio::MultiplexedConnection>,
    keys: &[(String, String, String)],
) -> Result<Vec<(String, Vec<String>)>, QueueReadError> {
    let conn = match conn {
        Some(conn) => conn,
        None => conn.insert(client.get_multiplexed_async_connection().await?),
    };
    let mut pipe = redis::pipe();
    pipe.atomic();
    for (_, queue, waiters) in keys {
        pipe.cmd("ZRANGE").arg(queue).arg(0).arg(-1);
        pipe.cmd("HGETALL").arg(waiters);
    }
    pipe.cmd("TIME");
    let values: Vec<redis::Value> = pipe.query_async(conn).await?;
    let (secs, micros): (u64, u64) =
        redis::from_redis_value(values.last().ok_or(QueueReadError::Unexpected("no TIME"))?)?;
    let now_ms = secs * 1000 + micros / 1000;
    let mut out = Vec::with_capacity(keys.len());
    for (i, (key, _, _)) in keys.iter().enumerate() {
        let (Some(order), Some(places)) = (values.get(2 * i), values.get(2 * i + 1)) else {
            return Err(QueueReadError::Unexpected("fewer answers than reads"));
        };
        let order: Vec<String> = redis::from_redis_value(order)?;
        let places: HashMap<String, String> = redis::from_redis_value(places)?;
        let live = order
            .into_iter()
            .filter(|owner| {
                places
                    .get(owner)
                    .and_then(|place| place.split_once(':'))
                    .and_then(|(alive, _)| alive.parse::<u64>().ok())
                    .is_some_and(|alive| alive > now_ms)
            })
            .collect();
        out.push((key.clone(), live));
    }
    Ok(out)
}

/// Each key's queue on the node that serves its slot: the node that
/// served it last first, then the others in turn, each within a fraction
/// of the read's time (a stopped master must not use it all up).
async fn cluster_read(
    clients: &[redis::Client],
    conns: &mut [Option<redis::aio::MultiplexedConnection>],
    keys: &mut [((String, String, String), usize)],
) -> Result<Vec<(String, Vec<String>)>, QueueReadError> {
    let n = clients.len().max(1);
    let mut out = Vec::with_capacity(keys.len());
    for (key, served_by) in keys.iter_mut() {
        let mut last = QueueReadError::Unexpected("no node serves the key's slot");
        let mut found = None;
        for step in 0..n {
            let i = (*served_by + step) % n;
            let one = std::slice::from_ref(&*key);
            let read = redis_read(&clients[i], &mut conns[i], one);
            match tokio::time::timeout(READ_TIMEOUT / 8, read).await {
                Ok(Ok(mut places)) => {
                    *served_by = i;
                    found = places.pop();
                    break;
                }
                Ok(Err(error)) => {
                    // A redirection or a refused transaction keeps its
                    // connection; a broken one is made again.
                    if matches!(&error, QueueReadError::Redis(e)
                        if e.is_io_error() || e.is_connection_dropped() || e.is_timeout())
                    {
                        conns[i] = None;
                    }
                    last = error;
                }
                Err(_) => {
                    conns[i] = None;
                    last = QueueReadError::Timeout;
                }
            }
        }
        out.push(found.ok_or(last)?);
    }
    Ok(out)
}

async fn pg_read(
    pool: &PgPool,
    sql: &str,
    keys: &[String],
) -> Result<Vec<(String, Vec<String>)>, QueueReadError> {
    let rows: Vec<(String, String)> = sqlx::query_as(sql).bind(keys).fetch_all(pool).await?;
    let mut by_key: HashMap<String, Vec<String>> = HashMap::new();
    for (key, owner) in rows {
        by_key.entry(key).or_default().push(owner);
    }
    Ok(keys
        .iter()
        .map(|k| (k.clone(), by_key.remove(k).unwrap_or_default()))
        .collect())
}

async fn etcd_read(
    endpoints: &[String],
    clients: &mut [Option<etcd_client::Client>],
    next: &mut usize,
    keys: &[String],
) -> Result<Vec<(String, Vec<String>)>, QueueReadError> {
    let i = *next;
    let client = match &mut clients[i] {
        Some(client) => client,
        slot => {
            let options = etcd_client::ConnectOptions::new()
                .with_connect_timeout(READ_TIMEOUT)
                .with_timeout(READ_TIMEOUT);
            slot.insert(etcd_client::Client::connect([&endpoints[i]], Some(options)).await?)
        }
    };
    let mut out = Vec::with_capacity(keys.len());
    for name in keys {
        // The contender range of etcd's own lock layout, oldest first.
        let options = etcd_client::GetOptions::new()
            .with_range(format!("{name}/g"))
            .with_sort(
                etcd_client::SortTarget::Create,
                etcd_client::SortOrder::Ascend,
            );
        let answer = client.get(format!("{name}/0"), Some(options)).await?;
        let mut line: Vec<(i64, String)> = answer
            .kvs()
            .iter()
            .filter(|kv| is_contender(name, kv.key()))
            .filter_map(|kv| Some((kv.create_revision(), kv.value_str().ok()?.to_owned())))
            .collect();
        line.sort_by_key(|(revision, _)| *revision);
        out.push((name.clone(), line.into_iter().map(|(_, o)| o).collect()));
    }
    Ok(out)
}

/// Whether `key` is a contender key of `name` in etcd's lock layout:
/// `name/` and a lease id in lower-case hex.
fn is_contender(name: &str, key: &[u8]) -> bool {
    key.strip_prefix(name.as_bytes())
        .and_then(|rest| rest.strip_prefix(b"/"))
        .is_some_and(|hex| {
            (1..=16).contains(&hex.len())
                && hex.iter().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
        })
}

/// The reads of a run, logged while it lasts.
#[derive(Debug)]
pub struct Sampler {
    stop: watch::Sender<bool>,
    task: JoinHandle<std::io::Result<ReadCounts>>,
}

/// How the reads went.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReadCounts {
    /// Reads answered.
    pub answered: u64,
    /// Reads that failed or timed out.
    pub failed: u64,
}

impl Sampler {
    /// Reads `reader` every [`SAMPLE_EVERY`] and logs each key's order of
    /// two places or more to `queue.jsonl` in `dir`, one line per run of
    /// reads that found the same order. With `shuffle`, each read's order
    /// is shuffled first: a queue out of order on purpose, which the order
    /// check must report.
    ///
    /// # Errors
    ///
    /// When the log cannot be created.
    pub fn start(reader: QueueReader, dir: &Path, shuffle: bool) -> std::io::Result<Self> {
        let log = LogWriter::create(&dir.join("queue.jsonl"))?;
        let (stop, stopped) = watch::channel(false);
        let task = tokio::spawn(sample(reader, log, shuffle, stopped));
        Ok(Self { stop, task })
    }

    /// Stops reading and writes what was still open.
    ///
    /// # Errors
    ///
    /// When the log could not be written.
    pub async fn stop(self) -> std::io::Result<ReadCounts> {
        self.stop.send_replace(true);
        self.task.await.map_err(std::io::Error::other)?
    }
}

async fn sample(
    mut reader: QueueReader,
    log: LogWriter,
    shuffle: bool,
    mut stopped: watch::Receiver<bool>,
) -> std::io::Result<ReadCounts> {
    let mut open: HashMap<String, QueueSnapshot> = HashMap::new();
    let mut counts = ReadCounts::default();
    let mut every = tokio::time::interval(SAMPLE_EVERY);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = every.tick() => {}
            _ = stopped.wait_for(|s| *s) => break,
        }
        let t = now_us();
        let Ok(read) = reader.read().await else {
            counts.failed += 1;
            continue;
        };
        counts.answered += 1;
        for (key, mut owners) in read {
            if shuffle {
                owners.shuffle(&mut rand::rng());
            }
            match open.get_mut(&key) {
                Some(run) if run.owners == owners => {
                    run.t_last = t;
                    run.reads += 1;
                    continue;
                }
                _ => {}
            }
            if let Some(run) = open.remove(&key) {
                log.write(&Event::Queue(run))?;
            }
            // One place orders nothing.
            if owners.len() >= 2 {
                open.insert(
                    key.clone(),
                    QueueSnapshot {
                        key,
                        t_first: t,
                        t_last: t,
                        reads: 1,
                        owners,
                    },
                );
            }
        }
    }
    for run in open.into_values() {
        log.write(&Event::Queue(run))?;
    }
    Ok(counts)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn contender_keys_are_the_names_hex_keys_only() {
        assert!(is_contender("k", b"k/694d7a3c1f2e"));
        for other in [
            &b"k/"[..],
            b"k/ABC",
            b"kx/ab",
            b"k/a/b",
            b"k/ffffffffffffffffff",
        ] {
            assert!(!is_contender("k", other), "{other:?}");
        }
    }
}

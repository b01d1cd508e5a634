//! The Redis Cluster line of the Redis benchmarks (P7): on a local Redis
//! Cluster (3 masters, 3 replicas, started here from the installed
//! `redis-server`), the uncontended `with_lock` cycle and 64 tasks on
//! distinct keys spread over the masters, `RedisClusterBackend` against,
//! in the same run:
//!
//! - the raw commands (`SET NX PX`, then a compare-and-delete script) sent
//!   by hand on the `redis` crate's cluster connection (P7's baseline), and
//!   on one multiplexed connection per master, each key routed to its
//!   master beforehand (the least a client can do);
//! - the backend's own two scripts (`lua/acquire.lua`,
//!   `lua/release_sharded.lua`: fencing token, companion key, `SPUBLISH`)
//!   with the same keys, arguments and shard channel, sent by hand by
//!   `EVALSHA` on the cluster connection and on the per-master
//!   connections: the server's work of a cycle with no driver, so that the
//!   ratio to it is what the driver and the backend cost beyond it.
//!
//! Each kind's i-th key hashes to the i-th lock key's slot (its hash tag
//! is the lock key), so every kind spreads over the masters alike. The
//! 64-task lines also show, per cycle, the commands the masters ran (those
//! inside scripts too, from `INFO commandstats`), the `EVALSHA`s among
//! them, the reads the masters made from client sockets (`INFO stats`
//! `total_reads_processed`: at most one per round trip), the CPU of the
//! masters and of the replicas (`INFO cpu`) and of this process. Run it in
//! release mode:
//!
//! ```text
//! cargo run --release -p lock-redis --example bench_redis_cluster
//! ```
//!
//! To count the client's instructions, `--cycles N KIND [TASKS]` runs N
//! cycles of one kind (`raw`, `raw-direct`, `hand`, `hand-direct`,
//! `with_lock`) on each of TASKS tasks (default 1) after a warm-up, on a
//! current-thread runtime, and prints the masters' counts per cycle; under
//! `valgrind --tool=callgrind` the difference between two values of N is
//! the cost of N cycles whatever the machine's load.

use std::error::Error;
use std::sync::Arc;
use std::time::{Duration, Instant};

use lock_core::{Locker, LockerOptions};
use lock_redis::slot::{fence_key, key_slot};
use lock_redis::testing::{ACQUIRE_SCRIPT, RELEASE_SHARDED_SCRIPT};
use lock_redis::{RedisClusterBackend, RedisConfig};
use redis::{Script, Value};
use withlock_test_servers::redis::RedisCluster;

#[path = "../../bench-support/bench_support.rs"]
mod bench_support;
use bench_support::{cpu_time, median};

type BoxError = Box<dyn Error + Send + Sync>;

const RAW_RELEASE: &str = "if redis.call('GET', KEYS[1]) == ARGV[1] then \
                           return redis.call('DEL', KEYS[1]) end return 0";

/// The lock ttl of every kind, in milliseconds (the driver's default).
const TTL_MS: u64 = 30_000;

type NodeConn = redis::aio::MultiplexedConnection;
type ClusterConn = redis::cluster_async::ClusterConnection;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Raw,
    RawDirect,
    Hand,
    HandDirect,
    WithLock,
    Unbatched,
}

const KINDS: [Kind; 6] = [
    Kind::Raw,
    Kind::RawDirect,
    Kind::Hand,
    Kind::HandDirect,
    Kind::WithLock,
    Kind::Unbatched,
];

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Self::Raw => "raw",
            Self::RawDirect => "raw-direct",
            Self::Hand => "hand",
            Self::HandDirect => "hand-direct",
            Self::WithLock => "with_lock",
            Self::Unbatched => "unbatched",
        }
    }

    fn label(self) -> &'static str {
        match self {
            Self::Raw => "raw SET NX PX + release, cluster connection",
            Self::RawDirect => "raw, per-master connections",
            Self::Hand => "backend's scripts by hand, cluster connection",
            Self::HandDirect => "backend's scripts by hand, per-master connections",
            Self::WithLock => "with_lock (RedisClusterBackend)",
            Self::Unbatched => "with_lock, batch_steps off",
        }
    }

    fn parse(name: &str) -> Option<Self> {
        KINDS.into_iter().find(|k| k.name() == name)
    }
}

/// What the cycles of every kind run against, shared by every task.
struct Clients {
    cluster: RedisCluster,
    backend: RedisClusterBackend,
    locker: Locker,
    unbatched: Locker,
    raw: ClusterConn,
    /// One multiplexed connection per master, by port.
    masters: std::collections::HashMap<u16, NodeConn>,
    /// A connection to every node, for `INFO`, and whether it is a master.
    stats: Vec<(bool, NodeConn)>,
    release: Script,
    acquire_fenced: Script,
    release_fenced: Script,
}

/// One task's keys and connection for one kind, made before the timing.
struct Target {
    kind: Kind,
    /// The `with_lock` key, or the Redis key of the other kinds.
    key: String,
    fence: String,
    channel: String,
    value: String,
    direct: Option<NodeConn>,
}

impl Clients {
    async fn start() -> Result<Option<Arc<Self>>, BoxError> {
        let cluster = match tokio::task::spawn_blocking(RedisCluster::start).await? {
            Ok(cluster) => cluster,
            Err(e) => {
                println!("Cluster: skipped, no local Redis Cluster could be started: {e}");
                return Ok(None);
            }
        };
        let urls = cluster.urls();
        let prefix = format!("withlock-bench:{:08x}:", rand::random::<u32>());
        let backend =
            RedisClusterBackend::from_urls_with(&urls, RedisConfig::default().prefix(&prefix))?;
        let locker =
            Locker::with_options(backend.clone(), LockerOptions::default().node_id("cluster"))?;
        let unbatched = Locker::with_options(
            RedisClusterBackend::from_urls_with(
                &urls,
                RedisConfig::default().prefix(&prefix).batch_steps(false),
            )?,
            LockerOptions::default().node_id("unbatched"),
        )?;
        let raw = redis::cluster::ClusterClientBuilder::new(urls.clone())
            .retries(0)
            .build()?
            .get_async_connection()
            .await?;
        let mut masters = std::collections::HashMap::new();
        let master_ports = cluster.master_ports()?;
        for &port in &master_ports {
            let url = cluster.node(port).ok_or("no master")?.url();
            masters.insert(port, connect(&url).await?);
        }
        let mut stats = Vec::new();
        for node in cluster.nodes() {
            stats.push((
                master_ports.contains(&node.port()),
                connect(&node.url()).await?,
            ));
        }
        Ok(Some(Arc::new(Self {
            cluster,
            backend,
            locker,
            unbatched,
            raw,
            masters,
            stats,
            release: Script::new(RAW_RELEASE),
            acquire_fenced: Script::new(ACQUIRE_SCRIPT),
            release_fenced: Script::new(RELEASE_SHARDED_SCRIPT),
        })))
    }

    /// The keys of `kind` for the lock named `name`: the lock key's slot
    /// for every kind (the lock key is the others' hash tag), and the
    /// shard channel the backend would use.
    fn target(&self, kind: Kind, name: &str, value: &str) -> Result<Target, BoxError> {
        let lock_key = self.backend.lock_key(name);
        let key = match kind {
            Kind::WithLock => name.to_owned(),
            Kind::Unbatched => format!("{{{lock_key}}}:unbatched"),
            Kind::Raw | Kind::RawDirect => format!("{{{lock_key}}}:raw"),
            Kind::Hand | Kind::HandDirect => format!("{{{lock_key}}}:hand"),
        };
        let direct = match kind {
            Kind::RawDirect | Kind::HandDirect => {
                let port = self.cluster.master_port_of_slot(key_slot(&key))?;
                Some(self.masters.get(&port).ok_or("no master")?.clone())
            }
            _ => None,
        };
        Ok(Target {
            kind,
            fence: fence_key(&key),
            channel: self.backend.channel(name),
            key,
            value: value.to_owned(),
            direct,
        })
    }

    async fn cycle(&self, t: &Target) -> Result<(), BoxError> {
        match (t.kind, &t.direct) {
            (Kind::WithLock, _) => self.locker.with_lock(&t.key, |_| async {}).await?,
            (Kind::Unbatched, _) => self.unbatched.with_lock(&t.key, |_| async {}).await?,
            (Kind::Raw, _) => self.raw_cycle(&mut self.raw.clone(), t).await?,
            (Kind::Hand, _) => self.hand_cycle(&mut self.raw.clone(), t).await?,
            (Kind::RawDirect, Some(conn)) => self.raw_cycle(&mut conn.clone(), t).await?,
            (Kind::HandDirect, Some(conn)) => self.hand_cycle(&mut conn.clone(), t).await?,
            _ => return Err("no per-master connection".into()),
        }
        Ok(())
    }

    /// `SET NX PX`, then the compare-and-delete script.
    async fn raw_cycle(
        &self,
        conn: &mut (impl redis::aio::ConnectionLike + Send),
        t: &Target,
    ) -> Result<(), BoxError> {
        let ok: Option<String> = redis::cmd("SET")
            .arg(&t.key)
            .arg(&t.value)
            .arg("NX")
            .arg("PX")
            .arg(TTL_MS)
            .query_async(conn)
            .await?;
        assert!(ok.is_some(), "raw baseline: key busy");
        let _: i64 = self
            .release
            .key(&t.key)
            .arg(&t.value)
            .invoke_async(conn)
            .await?;
        Ok(())
    }

    /// The backend's acquisition and release scripts, with its arguments.
    async fn hand_cycle(
        &self,
        conn: &mut (impl redis::aio::ConnectionLike + Send),
        t: &Target,
    ) -> Result<(), BoxError> {
        let config = self.backend.config();
        let idle = config.fence_idle.as_millis() as u64;
        let token: Value = self
            .acquire_fenced
            .key(&t.key)
            .key(&t.fence)
            .arg(&t.value)
            .arg(TTL_MS)
            .arg(TTL_MS + idle)
            .invoke_async(conn)
            .await?;
        assert!(token != Value::Int(0), "by hand: key busy");
        let released: i64 = self
            .release_fenced
            .key(&t.key)
            .arg(&t.value)
            .arg(&t.channel)
            .invoke_async(conn)
            .await?;
        assert_eq!(released, 1, "by hand: not released");
        Ok(())
    }

    /// The counters of every node, summed over masters and replicas.
    async fn counters(&self) -> Result<Counters, BoxError> {
        let mut total = Counters::default();
        for (is_master, conn) in &self.stats {
            let info: String = redis::cmd("INFO")
                .arg("cpu")
                .arg("stats")
                .arg("commandstats")
                .query_async(&mut conn.clone())
                .await?;
            let field = |name: &str| -> f64 {
                info.lines()
                    .filter_map(|l| l.strip_prefix(name)?.trim().parse::<f64>().ok())
                    .sum()
            };
            let cpu = field("used_cpu_user:") + field("used_cpu_sys:");
            if *is_master {
                total.master_cpu += cpu;
                total.reads += field("total_reads_processed:");
                for line in info.lines().filter(|l| l.starts_with("cmdstat_")) {
                    let calls: f64 = line
                        .split_once(":calls=")
                        .and_then(|(_, rest)| rest.split(',').next()?.parse().ok())
                        .unwrap_or(0.0);
                    total.commands += calls;
                    if line.starts_with("cmdstat_evalsha:") {
                        total.evalsha += calls;
                    }
                }
            } else {
                total.replica_cpu += cpu;
            }
        }
        total.client_cpu = cpu_time().unwrap_or_default().as_secs_f64();
        Ok(total)
    }
}

async fn connect(url: &str) -> Result<NodeConn, BoxError> {
    Ok(redis::Client::open(url)?
        .get_multiplexed_async_connection()
        .await?)
}

/// Server and client counters; a difference of two, per cycle.
#[derive(Clone, Copy, Debug, Default)]
struct Counters {
    commands: f64,
    evalsha: f64,
    reads: f64,
    master_cpu: f64,
    replica_cpu: f64,
    client_cpu: f64,
}

impl Counters {
    fn per_cycle(self, before: Self, cycles: f64) -> Self {
        Self {
            commands: (self.commands - before.commands) / cycles,
            evalsha: (self.evalsha - before.evalsha) / cycles,
            reads: (self.reads - before.reads) / cycles,
            master_cpu: (self.master_cpu - before.master_cpu) / cycles,
            replica_cpu: (self.replica_cpu - before.replica_cpu) / cycles,
            client_cpu: (self.client_cpu - before.client_cpu) / cycles,
        }
    }
}

/// `cycles` cycles of `kind` on each of `tasks` tasks at once, on distinct
/// keys: cycles per second, and the counters per cycle.
async fn run_tasks(
    clients: &Arc<Clients>,
    kind: Kind,
    tasks: usize,
    cycles: u32,
) -> Result<(f64, Counters), BoxError> {
    let targets = (0..tasks)
        .map(|i| clients.target(kind, &format!("p2:{i}"), &format!("p2/{i:032x}")))
        .collect::<Result<Vec<_>, _>>()?;
    let before = clients.counters().await?;
    let t = Instant::now();
    let mut running = Vec::new();
    for target in targets {
        let clients = Arc::clone(clients);
        running.push(tokio::spawn(async move {
            for _ in 0..cycles {
                clients.cycle(&target).await?;
            }
            Ok::<_, BoxError>(())
        }));
    }
    for task in running {
        task.await??;
    }
    let took = t.elapsed();
    let total = f64::from(cycles) * tasks as f64;
    let after = clients.counters().await?;
    Ok((total / took.as_secs_f64(), after.per_cycle(before, total)))
}

async fn p7(clients: &Arc<Clients>) -> Result<(), BoxError> {
    const ROUNDS: usize = 7;
    const N: u32 = 1000;
    let targets = KINDS
        .iter()
        .map(|&k| clients.target(k, "p1", "cl/00000000000000000000000000000000"))
        .collect::<Result<Vec<_>, _>>()?;
    for t in &targets {
        for _ in 0..200 {
            clients.cycle(t).await?;
        }
    }
    // Per kind, each round's time per cycle; the order rotates by round.
    let mut times: Vec<Vec<Duration>> = vec![Vec::new(); KINDS.len()];
    for round in 0..ROUNDS {
        for j in 0..KINDS.len() {
            let i = (round + j) % KINDS.len();
            let t = Instant::now();
            for _ in 0..N {
                clients.cycle(&targets[i]).await?;
            }
            times[i].push(t.elapsed() / N);
        }
    }
    let medians: Vec<Duration> = times.into_iter().map(median).collect();
    let ours = medians[4].as_secs_f64();
    println!(
        "P7 uncontended cycle, {ROUNDS} rounds of {N} cycles per kind, order rotating; medians (target with_lock <= 1.15x raw on the cluster connection):"
    );
    for (kind, took) in KINDS.iter().zip(&medians) {
        println!(
            "  {:<52} {:>10.1?}   with_lock / this {:.3}x",
            kind.label(),
            took,
            ours / took.as_secs_f64()
        );
    }

    const TASKS: usize = 64;
    const CYCLES: u32 = 150;
    let masters: std::collections::HashSet<u16> = (0..TASKS)
        .filter_map(|i| {
            let key = clients.backend.lock_key(&format!("p2:{i}"));
            clients.cluster.master_port_of_slot(key_slot(&key)).ok()
        })
        .collect();
    for &kind in &KINDS {
        run_tasks(clients, kind, TASKS, CYCLES / 3).await?;
    }
    const RUNS: usize = 3;
    let mut rates: Vec<Vec<f64>> = vec![Vec::new(); KINDS.len()];
    let mut counts: Vec<Vec<Counters>> = vec![Vec::new(); KINDS.len()];
    for run in 0..RUNS {
        for j in 0..KINDS.len() {
            let i = (run + j) % KINDS.len();
            let (rate, per_cycle) = run_tasks(clients, KINDS[i], TASKS, CYCLES).await?;
            rates[i].push(rate);
            counts[i].push(per_cycle);
        }
    }
    let rates: Vec<f64> = rates.into_iter().map(median).collect();
    let ours = rates[4];
    println!(
        "P7 {TASKS} tasks, distinct keys on {} masters, {RUNS} runs, order rotating; medians (target with_lock >= 0.80x raw on the cluster connection); per cycle: master commands (EVALSHA), master socket reads, CPU µs of masters / replicas / this process:",
        masters.len()
    );
    for ((kind, rate), counts) in KINDS.iter().zip(&rates).zip(&counts) {
        let c = counts[counts.len() / 2];
        println!(
            "  {:<52} {:>7.0} cycles/s   with_lock / this {:.3}x   cmds {:.2} ({:.2})  reads {:.2}  cpu {:.1} / {:.1} / {:.1}",
            kind.label(),
            rate,
            ours / rate,
            c.commands,
            c.evalsha,
            c.reads,
            c.master_cpu * 1e6,
            c.replica_cpu * 1e6,
            c.client_cpu * 1e6,
        );
    }
    Ok(())
}

/// Runs `n` cycles of `kind` on each of `tasks` tasks after a warm-up, for
/// an instruction count; prints the masters' counts per cycle.
async fn count_cycles(n: u32, kind: Kind, tasks: usize) -> Result<(), BoxError> {
    let Some(clients) = Clients::start().await? else {
        return Ok(());
    };
    run_tasks(&clients, kind, tasks, 100).await?;
    let (rate, c) = run_tasks(&clients, kind, tasks, n).await?;
    println!(
        "{} x{tasks}: {rate:.0} cycles/s; per cycle: master commands {:.2} (EVALSHA {:.2}), master reads {:.2}",
        kind.name(),
        c.commands,
        c.evalsha,
        c.reads
    );
    shut_down(clients).await
}

async fn shut_down(clients: Arc<Clients>) -> Result<(), BoxError> {
    let clients = Arc::into_inner(clients).ok_or("clients still shared")?;
    let Clients {
        cluster,
        locker,
        unbatched,
        ..
    } = clients;
    drop((locker, unbatched));
    tokio::task::spawn_blocking(move || drop(cluster)).await?;
    Ok(())
}

fn main() -> Result<(), BoxError> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if let [flag, n, kind, rest @ ..] = args.as_slice() {
        if flag == "--cycles" {
            let kind =
                Kind::parse(kind).ok_or("KIND: raw, raw-direct, hand, hand-direct or with_lock")?;
            let tasks = rest.first().map_or(Ok(1), |t| t.parse())?;
            return tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?
                .block_on(count_cycles(n.parse()?, kind, tasks));
        }
    }
    if !args.is_empty() {
        return Err("usage: bench_redis_cluster [--cycles N KIND [TASKS]]".into());
    }
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?
        .block_on(async {
            let started = Instant::now();
            if let Some(clients) = Clients::start().await? {
                p7(&clients).await?;
                shut_down(clients).await?;
            }
            println!("total {:.1?}", started.elapsed());
            Ok(())
        })
}

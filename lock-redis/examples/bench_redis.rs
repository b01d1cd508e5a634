//! P1–P4 on Redis, each against hand-written baselines in the same run.
//!
//! - P1: one uncontended `with_lock` cycle, in 35 short rounds (200 cycles
//!   of each kind, in an order that rotates from round to round; the
//!   ratios printed are the medians of the rounds' own ratios, so that the
//!   machine's drift over seconds cancels out), against
//!   - the raw floor: the two commands by hand (`SET key v NX PX 30000`,
//!     then a compare-and-delete script by `EVALSHA`) on a multiplexed
//!     connection taken from the same pool, as the backend takes its own;
//!   - the raw floor with fencing: the backend's own two scripts
//!     (`lua/fencing.lua` + `lua/acquire.lua`, `lua/release.lua`: fencing token and release
//!     notification) sent by hand by `EVALSHA` on that connection;
//!   - rslock 0.10 (`LockManager::lock` + `unlock`, one server): no fencing,
//!     no extension, no notifications.
//!
//!   Target ≤ 1.10x the raw floor and ≤ 1.00x rslock.
//! - P2: 64 tasks on 64 distinct keys, cycles/s of the same four, interleaved.
//!   Target ≥ 0.85x the raw floor and ≥ 1.00x rslock. Each line also shows
//!   the server's CPU per cycle (`INFO cpu` before and after; on a shared
//!   server other clients' work counts too).
//! - P3: handoff latency, from the holder's callback returning to the next
//!   waiter's callback running, `retry_delay` 200 ms, with release
//!   notifications and without (polling).
//! - P4: 10,000 locks held by one node with a 3 s ttl for 4 s: extension
//!   calls per tick, leases per call, and process CPU while holding vs idle.
//!
//! Against `REDIS_URL` (default `redis://127.0.0.1:6379`, or a child
//! `redis-server` when none answers), in a random key namespace deleted at
//! the end. Run it in release mode; name parts to run only those:
//!
//! ```text
//! cargo run --release -p lock-redis --example bench_redis [p1] [p2] [p3] [p4]
//! ```
//!
//! To count the client's instructions per cycle, `--cycles N KIND` runs N
//! cycles of one kind (`raw`, `fenced`, `rslock`, `with_lock`) after 500 of
//! warm-up, on a current-thread runtime; under
//! `valgrind --tool=callgrind` the difference between two values of N,
//! divided by their difference, is the cost of one cycle whatever the
//! machine's load:
//!
//! ```text
//! valgrind --tool=callgrind --callgrind-out-file=/tmp/cg.%p \
//!     target/release/examples/bench_redis --cycles 5000 with_lock
//! ```

use std::error::Error;
use std::future::Future;
use std::time::{Duration, Instant};

use bench_support::{cpu_time, median, percentile, rotating_rounds, round_ratios};
use lock_conformance::{CountingBackend, Step};
use lock_core::{LockConfig, Locker, LockerOptions};
use lock_redis::testing::Namespace;
use lock_redis::{RedisBackend, RedisConfig};
use redis::Script;
use withlock_test_servers::redis::server_url;

#[path = "../../bench-support/bench_support.rs"]
mod bench_support;

const RAW_RELEASE: &str = "if redis.call('GET', KEYS[1]) == ARGV[1] then \
                           return redis.call('DEL', KEYS[1]) end return 0";

fn node(backend: impl lock_core::LockBackend, name: &str) -> Locker {
    Locker::with_options(backend, LockerOptions::default().node_id(name)).expect("node id")
}

/// A multiplexed connection taken from the pool, as the backend does, so
/// that neither side pays deadpool's `PING` per checkout.
async fn raw_connection(pool: &deadpool_redis::Pool) -> Result<Conn, BoxError> {
    Ok(deadpool_redis::Connection::take(pool.get().await?))
}

type Conn = redis::aio::MultiplexedConnection;
type BoxError = Box<dyn Error + Send + Sync>;

/// The four kinds of cycle, in the order every round runs them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Raw,
    Fenced,
    Rslock,
    WithLock,
}

impl Kind {
    const ALL: [Self; 4] = [Self::Raw, Self::Fenced, Self::Rslock, Self::WithLock];

    fn name(self) -> &'static str {
        match self {
            Self::Raw => "raw SET NX PX + compare-and-delete",
            Self::Fenced => "raw, backend's scripts (fencing)",
            Self::Rslock => "rslock 0.10 lock + unlock",
            Self::WithLock => "with_lock",
        }
    }

    fn parse(name: &str) -> Option<Self> {
        match name {
            "raw" => Some(Self::Raw),
            "fenced" => Some(Self::Fenced),
            "rslock" => Some(Self::Rslock),
            "with_lock" => Some(Self::WithLock),
            _ => None,
        }
    }
}

/// What the cycles of every kind run against, shared by every task.
#[derive(Clone)]
struct Clients {
    conn: Conn,
    release: Script,
    acquire_fenced: Script,
    release_fenced: Script,
    channel: String,
    rslock: rslock::LockManager,
    locker: Locker,
}

impl Clients {
    async fn new(url: &str, backend: &RedisBackend, name: &str) -> Result<Self, BoxError> {
        Ok(Self {
            conn: raw_connection(backend.pool()).await?,
            release: Script::new(RAW_RELEASE),
            acquire_fenced: Script::new(lock_redis::testing::ACQUIRE_SCRIPT),
            release_fenced: Script::new(lock_redis::testing::RELEASE_SCRIPT),
            channel: backend.channel().to_owned(),
            rslock: rslock::LockManager::new(vec![url.to_owned()]),
            locker: node(backend.clone(), name),
        })
    }

    /// One uncontended cycle of `kind` on `key`; `value` is the raw kinds'
    /// owner token.
    async fn cycle(&self, kind: Kind, key: &str, value: &str) -> Result<(), BoxError> {
        let mut conn = self.conn.clone();
        match kind {
            Kind::Raw => {
                let ok: Option<String> = redis::cmd("SET")
                    .arg(key)
                    .arg(value)
                    .arg("NX")
                    .arg("PX")
                    .arg(30_000)
                    .query_async(&mut conn)
                    .await?;
                assert!(ok.is_some(), "raw baseline: key busy");
                let _: i64 = self
                    .release
                    .key(key)
                    .arg(value)
                    .invoke_async(&mut conn)
                    .await?;
            }
            Kind::Fenced => {
                let fence = lock_redis::slot::fence_key(key);
                let token: i64 = self
                    .acquire_fenced
                    .key(key)
                    .key(&fence)
                    .arg(value)
                    .arg(30_000)
                    .arg(30_000 + 7 * 24 * 3600 * 1000_u64)
                    .invoke_async(&mut conn)
                    .await?;
                assert!(token > 0, "fenced baseline: key busy");
                let _: i64 = self
                    .release_fenced
                    .key(key)
                    .arg(value)
                    .arg(&self.channel)
                    .invoke_async(&mut conn)
                    .await?;
            }
            Kind::Rslock => {
                let lock = self
                    .rslock
                    .lock(key.as_bytes(), Duration::from_secs(30))
                    .await?;
                self.rslock.unlock(&lock).await;
            }
            Kind::WithLock => self.locker.with_lock(key, |_| async {}).await?,
        }
        Ok(())
    }
}

/// The server's CPU time so far (`used_cpu_user + used_cpu_sys`).
async fn server_cpu(conn: &Conn) -> Result<Duration, BoxError> {
    let info: String = redis::cmd("INFO")
        .arg("cpu")
        .query_async(&mut conn.clone())
        .await?;
    let seconds: f64 = info
        .lines()
        .filter_map(|l| {
            l.strip_prefix("used_cpu_user:")
                .or_else(|| l.strip_prefix("used_cpu_sys:"))
        })
        .filter_map(|v| v.trim().parse::<f64>().ok())
        .sum();
    Ok(Duration::from_secs_f64(seconds))
}

/// Times `work`, and the server's and this process's CPU it took.
async fn timed<F: Future<Output = Result<(), BoxError>>>(
    conn: &Conn,
    work: F,
) -> Result<(Duration, Duration, Duration), BoxError> {
    let cpu = server_cpu(conn).await?;
    let client = cpu_time().unwrap_or_default();
    let t = Instant::now();
    work.await?;
    let took = t.elapsed();
    let client = cpu_time().unwrap_or_default().saturating_sub(client);
    Ok((took, server_cpu(conn).await?.saturating_sub(cpu), client))
}

async fn cpu_percent_over(window: Duration) -> f64 {
    let (c0, t0) = (cpu_time().unwrap_or_default(), Instant::now());
    tokio::time::sleep(window).await;
    let (c1, t1) = (cpu_time().unwrap_or_default(), Instant::now());
    (c1 - c0).as_secs_f64() / (t1 - t0).as_secs_f64() * 100.0
}

async fn p1(clients: &Clients, ns: &Namespace) -> Result<(), BoxError> {
    // Short rounds, each kind once per round in an order that rotates from
    // round to round: the machine's speed drifts over seconds, and a ratio
    // taken within one round (a second or less) sees the same drift on
    // both sides. The ratios printed are the medians of the rounds' own.
    const N: u32 = 200;
    const ROUNDS: usize = 35;
    let key = ns.key("p1");
    let value = "p1/00000000000000000000000000000000";
    for _ in 0..100 {
        for kind in Kind::ALL {
            clients.cycle(kind, &key, value).await?;
        }
    }
    let key = &key;
    // Per kind: the time and server CPU of each round.
    let samples = rotating_rounds(Kind::ALL.len(), ROUNDS, |i| async move {
        let kind = Kind::ALL[i];
        let (took, cpu, _) = timed(&clients.conn, async {
            for _ in 0..N {
                clients.cycle(kind, key, value).await?;
            }
            Ok(())
        })
        .await?;
        Ok::<_, BoxError>((took / N, cpu / N))
    })
    .await?;
    let (times, cpus): (Vec<Vec<Duration>>, Vec<Vec<Duration>>) = samples
        .into_iter()
        .map(|rounds| rounds.into_iter().unzip())
        .unzip();
    let index = |kind: Kind| Kind::ALL.iter().position(|k| *k == kind).unwrap_or(0);
    let (raw, rslock) = (index(Kind::Raw), index(Kind::Rslock));
    // The median over the rounds of one kind's time over another's.
    let ratio = |i: usize, base: usize| median(round_ratios(&times[i], &times[base]));
    println!(
        "P1 uncontended cycle, {ROUNDS} rounds of {N} cycles per kind, order rotating; \
         medians of the time and of the rounds' ratios \
         (target with_lock <= 1.10x raw, <= 1.00x rslock):"
    );
    for (i, kind) in Kind::ALL.into_iter().enumerate() {
        println!(
            "  {:<38} {:>10.1?}  {:.3}x raw  {:.3}x rslock  server CPU {:>6.1?}/cycle",
            kind.name(),
            median(times[i].clone()),
            ratio(i, raw),
            ratio(i, rslock),
            median(cpus[i].clone()),
        );
    }
    Ok(())
}

async fn p2(clients: &Clients, ns: &Namespace) -> Result<(), BoxError> {
    const TASKS: usize = 64;
    const CYCLES: u32 = 150;
    const ROUNDS: usize = 5;
    let run = |kind: Kind| async move {
        let mut tasks = Vec::new();
        for i in 0..TASKS {
            let (clients, key) = (clients.clone(), ns.key(&format!("p2:{i}")));
            tasks.push(tokio::spawn(async move {
                let value = format!("p2/{i:032x}");
                for _ in 0..CYCLES {
                    clients.cycle(kind, &key, &value).await?;
                }
                Ok::<_, BoxError>(())
            }));
        }
        for t in tasks {
            t.await??;
        }
        Ok(())
    };
    for kind in Kind::ALL {
        run(kind).await?;
    }
    let cycles = f64::from(CYCLES) * TASKS as f64;
    let mut samples = vec![(Vec::new(), Vec::new(), Vec::new()); Kind::ALL.len()];
    for _ in 0..ROUNDS {
        for (i, kind) in Kind::ALL.into_iter().enumerate() {
            let (took, cpu, client) = timed(&clients.conn, run(kind)).await?;
            samples[i].0.push(cycles / took.as_secs_f64());
            samples[i].1.push(cpu.as_secs_f64() / cycles);
            samples[i].2.push(client.as_secs_f64() / cycles);
        }
    }
    let lines: Vec<(Kind, f64, f64, f64)> = Kind::ALL
        .into_iter()
        .zip(samples)
        .map(|(kind, (rate, cpu, client))| (kind, median(rate), median(cpu), median(client)))
        .collect();
    let of = |kind: Kind| lines.iter().find(|l| l.0 == kind).map_or(f64::NAN, |l| l.1);
    let (raw, fenced, rslock) = (of(Kind::Raw), of(Kind::Fenced), of(Kind::Rslock));
    println!(
        "P2 {TASKS} tasks on distinct keys, median of {ROUNDS} interleaved rounds \
         (target with_lock >= 0.85x raw, >= 1.00x rslock):"
    );
    for (kind, rate, cpu, client) in &lines {
        println!(
            "  {:<38} {:>7.0} cycles/s  {:.3}x raw  {:.3}x fenced  {:.3}x rslock  \
             server CPU {:>5.1}µs/cycle ({:.0}% of a core), client {:>5.1}µs/cycle",
            kind.name(),
            rate,
            rate / raw,
            rate / fenced,
            rate / rslock,
            cpu * 1e6,
            cpu * rate * 100.0,
            client * 1e6,
        );
    }
    Ok(())
}

/// Handoff latencies between two nodes, each with a backend of its own.
async fn handoffs(
    url: &str,
    ns: &Namespace,
    notifications: bool,
    rounds: usize,
) -> Result<Vec<Duration>, BoxError> {
    let config = RedisConfig::default().release_notifications(notifications);
    let holder = node(RedisBackend::from_url_with(url, config.clone())?, "holder");
    let waiter = node(RedisBackend::from_url_with(url, config)?, "waiter");
    let key = ns.key(if notifications {
        "p3:notify"
    } else {
        "p3:poll"
    });
    let cfg = LockConfig::default()
        .wait_forever()
        .retry_delay(Duration::from_millis(200));
    let mut latencies = Vec::with_capacity(rounds);
    for _ in 0..rounds {
        let (go, wait_go) = tokio::sync::oneshot::channel::<()>();
        let (released_tx, released_rx) = tokio::sync::oneshot::channel::<Instant>();
        let (held_tx, held_rx) = tokio::sync::oneshot::channel::<()>();
        let (h, k) = (holder.clone(), key.clone());
        let holding = tokio::spawn(async move {
            h.with_lock(&k, move |_| async move {
                let _ = held_tx.send(());
                let _ = wait_go.await;
                let _ = released_tx.send(Instant::now());
            })
            .await
        });
        held_rx.await?;
        let (w, k, c) = (waiter.clone(), key.clone(), cfg);
        let waiting = tokio::spawn(async move {
            w.with_lock_config(&k, &c, |_| async { Instant::now() })
                .await
        });
        // Let the waiter find the key busy and start waiting; a random
        // offset so that polling is measured at a random phase.
        tokio::time::sleep(Duration::from_millis(30 + rand::random::<u64>() % 200)).await;
        let _ = go.send(());
        let released_at = released_rx.await?;
        holding.await??;
        let ran_at = waiting.await??;
        latencies.push(ran_at.saturating_duration_since(released_at));
    }
    latencies.sort();
    Ok(latencies)
}

async fn p3(url: &str, ns: &Namespace) -> Result<(), BoxError> {
    for (notifications, rounds) in [(true, 100), (false, 30)] {
        let l = handoffs(url, ns, notifications, rounds).await?;
        println!(
            "P3 handoff, retry_delay 200 ms, notifications {}: p50 {:?}, p99 {:?}, max {:?} ({} handoffs){}",
            if notifications { "on " } else { "off" },
            percentile(&l, 0.50),
            percentile(&l, 0.99),
            l[l.len() - 1],
            l.len(),
            if notifications { " (target p50 <= 1 ms, p99 <= 5 ms)" } else { "" },
        );
    }
    Ok(())
}

async fn p4(url: &str, ns: &Namespace) -> Result<(), BoxError> {
    const LOCKS: usize = 10_000;
    let ttl = Duration::from_secs(3);
    let backend = RedisBackend::from_url_with(url, RedisConfig::default())?;
    let counting = CountingBackend::new(backend);
    let locker = node(counting.clone(), "p4");
    let idle = cpu_percent_over(Duration::from_secs(2)).await;
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let (count_tx, mut count_rx) = tokio::sync::mpsc::unbounded_channel::<()>();
    let cfg = LockConfig::default().ttl(ttl);
    let mut calls = Vec::with_capacity(LOCKS);
    for i in 0..LOCKS {
        let (locker, key, cfg, mut stopped, count_tx) = (
            locker.clone(),
            ns.key(&format!("p4:{i}")),
            cfg,
            stopped.clone(),
            count_tx.clone(),
        );
        calls.push(tokio::spawn(async move {
            locker
                .with_lock_config(&key, &cfg, move |_| async move {
                    let _ = count_tx.send(());
                    let _ = stopped.wait_for(|s| *s).await;
                })
                .await
        }));
    }
    for _ in 0..LOCKS {
        count_rx.recv().await.ok_or("callbacks ended early")?;
    }
    let (e0, l0) = (counting.calls(Step::Extend), counting.extended_leases());
    let hold = Duration::from_secs(4);
    let busy = cpu_percent_over(hold).await;
    let (e1, l1) = (counting.calls(Step::Extend), counting.extended_leases());
    let _ = stop.send(true);
    let mut lost = 0;
    for c in calls {
        if c.await?.is_err() {
            lost += 1;
        }
    }
    let ticks = hold.as_secs_f64() / (ttl.as_secs_f64() / 3.0);
    let (calls_n, leases) = (e1 - e0, l1 - l0);
    println!(
        "P4 {LOCKS} locks, ttl {ttl:?}, held {hold:?} (~{ticks:.0} ticks of ttl/3): {calls_n} extension calls \
         ({:.1} per tick), {leases} leases extended ({:.0} per call, {:.2} per lock per tick); \
         process CPU {busy:.1}% of one core while holding vs {idle:.1}% idle; {lost} lost",
        calls_n as f64 / ticks,
        leases as f64 / calls_n.max(1) as f64,
        leases as f64 / LOCKS as f64 / ticks,
    );
    Ok(())
}

fn main() -> Result<(), BoxError> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if let [flag, n, kind] = args.as_slice() {
        if flag == "--cycles" {
            let kind = Kind::parse(kind).ok_or("KIND: raw, fenced, rslock or with_lock")?;
            return tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?
                .block_on(count_cycles(n.parse()?, kind));
        }
    }
    let parts: Vec<&str> = args.iter().map(String::as_str).collect();
    if let Some(bad) = parts.iter().find(|p| !["p1", "p2", "p3", "p4"].contains(p)) {
        return Err(format!(
            "unknown argument {bad:?}; usage: bench_redis [p1] [p2] [p3] [p4] | --cycles N KIND"
        )
        .into());
    }
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?
        .block_on(run(&parts))
}

/// Runs `n` cycles of `kind` after a warm-up, printing nothing, for an
/// instruction count.
async fn count_cycles(n: u32, kind: Kind) -> Result<(), BoxError> {
    let url = server_url().await;
    let ns = Namespace::new(&url);
    let backend = RedisBackend::from_url_with(&url, RedisConfig::default())?;
    let clients = Clients::new(&url, &backend, "cg").await?;
    let key = ns.key("cg");
    let value = "cg/00000000000000000000000000000000";
    for _ in 0..500 {
        clients.cycle(kind, &key, value).await?;
    }
    for _ in 0..n {
        clients.cycle(kind, &key, value).await?;
    }
    Ok(())
}

async fn run(parts: &[&str]) -> Result<(), BoxError> {
    let wanted = |part: &str| parts.is_empty() || parts.contains(&part);
    let url = server_url().await;
    let ns = Namespace::new(&url);
    let backend = RedisBackend::from_url_with(&url, RedisConfig::default())?;
    println!("lock-redis benchmark against {backend:?}");
    let started = Instant::now();
    if wanted("p1") {
        p1(&Clients::new(&url, &backend, "p1").await?, &ns).await?;
    }
    if wanted("p2") {
        p2(&Clients::new(&url, &backend, "p2").await?, &ns).await?;
    }
    if wanted("p3") {
        p3(&url, &ns).await?;
    }
    if wanted("p4") {
        p4(&url, &ns).await?;
    }
    println!("total {:.1?}", started.elapsed());
    let deleted = tokio::task::spawn_blocking(move || ns.cleanup()).await??;
    println!("cleaned up {deleted} keys");
    Ok(())
}

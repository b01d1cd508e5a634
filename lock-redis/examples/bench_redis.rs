//! P1–P4 on Redis, each against a hand-written baseline in the same run.
//!
//! - P1: one uncontended `with_lock` cycle vs the two raw commands by hand
//!   (`SET key v NX PX 30000`, then a compare-and-delete script by
//!   `EVALSHA`) on a multiplexed connection taken from the same pool, as the
//!   backend takes its own. Target ≤ 1.15x.
//! - P2: 64 tasks on 64 distinct keys, cycles/s vs the same raw commands.
//!   Target ≥ 0.85x.
//! - P3: handoff latency, from the holder's callback returning to the next
//!   waiter's callback running, `retry_delay` 200 ms, with release
//!   notifications and without (polling).
//! - P4: 10,000 locks held by one node with a 3 s ttl for 4 s: extension
//!   calls per tick, leases per call, and process CPU while holding vs idle.
//!
//! Against `REDIS_URL` (default `redis://127.0.0.1:6379`, or a child
//! `redis-server` when none answers), in a random key namespace deleted at
//! the end. Run it in release mode:
//!
//! ```text
//! cargo run --release -p lock-redis --example bench_redis
//! ```

use std::error::Error;
use std::time::{Duration, Instant};

use lock_conformance::{CountingBackend, Step};
use lock_core::{LockConfig, Locker, LockerOptions};
use lock_redis::testing::{server_url, Namespace};
use lock_redis::{RedisBackend, RedisConfig};
use redis::Script;

const RAW_RELEASE: &str = "if redis.call('GET', KEYS[1]) == ARGV[1] then \
                           return redis.call('DEL', KEYS[1]) end return 0";

fn node(backend: impl lock_core::LockBackend, name: &str) -> Locker {
    Locker::with_options(backend, LockerOptions::default().node_id(name)).expect("node id")
}

/// A multiplexed connection taken from the pool, as the backend does, so
/// that neither side pays deadpool's `PING` per checkout.
async fn raw_connection(pool: &deadpool_redis::Pool) -> Result<Conn, Box<dyn Error>> {
    Ok(deadpool_redis::Connection::take(pool.get().await?))
}

type Conn = redis::aio::MultiplexedConnection;

async fn raw_cycle(
    conn: &Conn,
    release: &Script,
    key: &str,
    value: &str,
) -> Result<(), Box<dyn Error>> {
    let mut conn = conn.clone();
    let ok: Option<String> = redis::cmd("SET")
        .arg(key)
        .arg(value)
        .arg("NX")
        .arg("PX")
        .arg(30_000)
        .query_async(&mut conn)
        .await?;
    assert!(ok.is_some(), "raw baseline: key busy");
    let _: i64 = release.key(key).arg(value).invoke_async(&mut conn).await?;
    Ok(())
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i]
}

/// User + system CPU time of this process, from /proc (Linux).
fn cpu_time() -> Option<Duration> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    let after_name = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<&str> = after_name.split(' ').collect();
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    // Clock ticks are 100 Hz on every Linux this runs on.
    Some(Duration::from_millis((utime + stime) * 10))
}

async fn cpu_percent_over(window: Duration) -> f64 {
    let (c0, t0) = (cpu_time().unwrap_or_default(), Instant::now());
    tokio::time::sleep(window).await;
    let (c1, t1) = (cpu_time().unwrap_or_default(), Instant::now());
    (c1 - c0).as_secs_f64() / (t1 - t0).as_secs_f64() * 100.0
}

async fn p1(
    backend: &RedisBackend,
    ns: &Namespace,
    release: &Script,
) -> Result<(), Box<dyn Error>> {
    let locker = node(backend.clone(), "p1");
    let pool = &raw_connection(backend.pool()).await?;
    let key = ns.key("p1");
    let value = "p1/00000000000000000000000000000000";
    const N: u32 = 2000;
    for _ in 0..200 {
        raw_cycle(pool, release, &key, value).await?;
        locker.with_lock(&key, |_| async {}).await?;
    }
    let (mut raw, mut ours) = (Vec::new(), Vec::new());
    for _ in 0..5 {
        let t = Instant::now();
        for _ in 0..N {
            raw_cycle(pool, release, &key, value).await?;
        }
        raw.push(t.elapsed() / N);
        let t = Instant::now();
        for _ in 0..N {
            locker.with_lock(&key, |_| async {}).await?;
        }
        ours.push(t.elapsed() / N);
    }
    raw.sort();
    ours.sort();
    let (raw, ours) = (raw[2], ours[2]);
    println!(
        "P1 uncontended cycle: with_lock {ours:?}, raw SET NX PX + release script {raw:?}: \
         ratio {:.3}x (target <= 1.15x)",
        ours.as_secs_f64() / raw.as_secs_f64()
    );
    Ok(())
}

async fn p2(
    backend: &RedisBackend,
    ns: &Namespace,
    release: &Script,
) -> Result<(), Box<dyn Error>> {
    const TASKS: usize = 64;
    const CYCLES: u32 = 150;
    let locker = node(backend.clone(), "p2");
    let conn = raw_connection(backend.pool()).await?;
    let run_raw = || async {
        let t = Instant::now();
        let mut tasks = Vec::new();
        for i in 0..TASKS {
            let (pool, release, key) = (conn.clone(), release.clone(), ns.key(&format!("p2:{i}")));
            tasks.push(tokio::spawn(async move {
                let value = format!("p2/{i:032x}");
                for _ in 0..CYCLES {
                    raw_cycle(&pool, &release, &key, &value)
                        .await
                        .expect("raw cycle");
                }
            }));
        }
        for t in tasks {
            t.await.expect("raw task");
        }
        f64::from(CYCLES) * TASKS as f64 / t.elapsed().as_secs_f64()
    };
    let run_ours = || async {
        let t = Instant::now();
        let mut tasks = Vec::new();
        for i in 0..TASKS {
            let (locker, key) = (locker.clone(), ns.key(&format!("p2:{i}")));
            tasks.push(tokio::spawn(async move {
                for _ in 0..CYCLES {
                    locker
                        .with_lock(&key, |_| async {})
                        .await
                        .expect("with_lock");
                }
            }));
        }
        for t in tasks {
            t.await.expect("with_lock task");
        }
        f64::from(CYCLES) * TASKS as f64 / t.elapsed().as_secs_f64()
    };
    run_raw().await;
    run_ours().await;
    let (mut raw, mut ours) = (Vec::new(), Vec::new());
    for _ in 0..3 {
        raw.push(run_raw().await);
        ours.push(run_ours().await);
    }
    raw.sort_by(f64::total_cmp);
    ours.sort_by(f64::total_cmp);
    let (raw, ours) = (raw[1], ours[1]);
    println!(
        "P2 64 tasks, distinct keys: with_lock {ours:.0} cycles/s, raw {raw:.0} cycles/s: \
         ratio {:.3}x (target >= 0.85x)",
        ours / raw
    );
    Ok(())
}

/// Handoff latencies between two nodes, each with a backend of its own.
async fn handoffs(
    url: &str,
    ns: &Namespace,
    notifications: bool,
    rounds: usize,
) -> Result<Vec<Duration>, Box<dyn Error>> {
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

async fn p3(url: &str, ns: &Namespace) -> Result<(), Box<dyn Error>> {
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

async fn p4(url: &str, ns: &Namespace) -> Result<(), Box<dyn Error>> {
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

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<(), Box<dyn Error>> {
    let url = server_url().await;
    let ns = Namespace::new(&url);
    let backend = RedisBackend::from_url_with(&url, RedisConfig::default())?;
    let release = Script::new(RAW_RELEASE);
    println!("lock-redis benchmark against {backend:?}");
    let started = Instant::now();
    p1(&backend, &ns, &release).await?;
    p2(&backend, &ns, &release).await?;
    p3(&url, &ns).await?;
    p4(&url, &ns).await?;
    println!("total {:.1?}", started.elapsed());
    let deleted = tokio::task::spawn_blocking(move || ns.cleanup()).await??;
    println!("cleaned up {deleted} keys");
    Ok(())
}

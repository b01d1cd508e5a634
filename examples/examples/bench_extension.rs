//! P4: what holding 10,000 locks at once costs one node.
//!
//! One [`Locker`] on a memory backend holds 10,000 locks at once (10,000
//! `with_lock_config` calls on distinct keys, ttl 3 s, each callback waiting
//! to be told to finish). A counting wrapper in front of the backend counts
//! the extension calls and the leases they carry. Over 5 periods of ttl / 3
//! the program measures:
//!
//! - backend extension calls per period, and per lock (SPEC: at most 1
//!   round trip per lock per ttl / 3, batched);
//! - leases extended per lease per ttl / 3 (at most 1: no lease is extended
//!   more often than it needs);
//! - the process's CPU time (`utime + stime` of `/proc/self/stat`) as a
//!   share of one core, minus that of a hand-made baseline: the same 10,000
//!   tasks parked on the same channel for the same time, with no locks
//!   (SPEC: the driver takes at most 5% of a core).
//!
//! Linux only (it reads `/proc/self/stat`). Run it in release mode:
//!
//! ```text
//! cargo run --release -p withlock-examples --example bench_extension
//! ```

use std::error::Error;
use std::time::{Duration, Instant};

use lock_conformance::{CountingBackend, Step};
use lock_memory::lock_core::LockBackend;
use lock_memory::MemoryBackend;
use lock_memory::{LockConfig, Locker};
use tokio::sync::watch;
use tokio::task::JoinSet;

const LOCKS: usize = 10_000;
const TTL: Duration = Duration::from_secs(3);
/// The extension period the driver aims at.
const PERIOD: Duration = Duration::from_secs(1); // TTL / 3
/// How many periods each measurement lasts.
const PERIODS: u32 = 5;
/// SPEC P4: the driver's share of one core.
const CPU_TARGET_PERCENT: f64 = 5.0;

type Result<T = (), E = Box<dyn Error>> = std::result::Result<T, E>;

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result {
    let clock_ticks = clock_ticks_per_second();
    let window = PERIOD * PERIODS;

    // Baseline: the same tasks, parked the same way, holding nothing.
    let (finish, finish_rx) = watch::channel(false);
    let mut parked = JoinSet::new();
    for _ in 0..LOCKS {
        let mut finish_rx = finish_rx.clone();
        parked.spawn(async move {
            let _ = finish_rx.wait_for(|done| *done).await;
        });
    }
    tokio::time::sleep(Duration::from_millis(200)).await; // let them all park
    let idle = measure_cpu(window, clock_ticks).await?;
    finish.send_replace(true);
    while let Some(task) = parked.join_next().await {
        task?;
    }

    // The same tasks, each holding a lock.
    let backend = CountingBackend::new(MemoryBackend::new());
    let locker = Locker::new(backend.clone());
    let config = LockConfig::default().ttl(TTL);
    let (finish, finish_rx) = watch::channel(false);
    let mut holders = JoinSet::new();
    for i in 0..LOCKS {
        let (locker, mut finish_rx) = (locker.clone(), finish_rx.clone());
        holders.spawn(async move {
            let key = format!("bench:p4:{i}");
            locker
                .with_lock_config(&key, &config, move |_| async move {
                    let _ = finish_rx.wait_for(|done| *done).await;
                })
                .await
        });
    }
    wait_until("every lock is held", || locker.held() == LOCKS).await?;

    // Start half a period after an extension round, so the window holds
    // exactly `PERIODS` rounds if the driver extends every ttl / 3.
    let before = backend.extended_leases();
    wait_until("the first extension round", || {
        backend.extended_leases() > before
    })
    .await?;
    tokio::time::sleep(PERIOD / 2).await;
    let (calls_0, leases_0) = (backend.calls(Step::Extend), backend.extended_leases());
    let holding = measure_cpu(window, clock_ticks).await?;
    let calls = backend.calls(Step::Extend) - calls_0;
    let leases = backend.extended_leases() - leases_0;

    finish.send_replace(true);
    while let Some(holder) = holders.join_next().await {
        holder??;
    }
    if backend.inner().held_keys() != 0 {
        return Err("locks were left held".into());
    }

    let periods = f64::from(PERIODS);
    let calls_per_period = calls as f64 / periods;
    let calls_per_lock = calls_per_period / LOCKS as f64;
    let extensions_per_lease = leases as f64 / LOCKS as f64 / periods;
    let driver_cpu = holding.percent_of_core - idle.percent_of_core;
    let verdict = |pass: bool| if pass { "PASS" } else { "MISS" };

    println!(
        "P4, memory backend: {LOCKS} locks held at once by one locker, ttl {TTL:?}, \
         measured over {PERIODS} periods of ttl/3 ({window:?}), 2 worker threads"
    );
    println!();
    println!(
        "{:<52} {:>12}   {:<16} result",
        "measure", "value", "target"
    );
    let row = |name: &str, value: String, target: &str, result: &str| {
        println!("{name:<52} {value:>12}   {target:<16} {result}");
    };
    row(
        "backend extension calls per period (ttl/3)",
        format!("{calls_per_period:.2}"),
        "batched",
        &format!("max batch {}", backend.capabilities().max_extend_batch),
    );
    row(
        "backend round trips per lock per ttl/3",
        format!("{calls_per_lock:.5}"),
        "<= 1",
        verdict(calls_per_lock <= 1.0),
    );
    row(
        "leases extended per lease per ttl/3",
        format!("{extensions_per_lease:.3}"),
        "<= 1",
        verdict(extensions_per_lease <= 1.0),
    );
    row(
        "CPU, baseline: 10,000 parked tasks, no locks",
        format!("{:.2}%", idle.percent_of_core),
        "",
        &format!("{} ticks", idle.ticks),
    );
    row(
        "CPU, holding 10,000 locks",
        format!("{:.2}%", holding.percent_of_core),
        "",
        &format!("{} ticks", holding.ticks),
    );
    row(
        "CPU of the driver (holding - baseline), of one core",
        format!("{driver_cpu:.2}%"),
        "<= 5%",
        verdict(driver_cpu <= CPU_TARGET_PERCENT),
    );
    println!(
        "(CPU from /proc/self/stat at {clock_ticks} ticks/s: one tick is {:.2}% of the window)",
        100.0 / (window.as_secs_f64() * clock_ticks as f64)
    );
    Ok(())
}

/// CPU used by the whole process over a window.
struct CpuUse {
    ticks: u64,
    percent_of_core: f64,
}

/// Sleeps for `window` and says how much CPU the process used meanwhile.
async fn measure_cpu(window: Duration, clock_ticks: u64) -> Result<CpuUse> {
    let before = process_cpu_ticks()?;
    let started = Instant::now();
    tokio::time::sleep(window).await;
    let ticks = process_cpu_ticks()? - before;
    let seconds = ticks as f64 / clock_ticks as f64;
    Ok(CpuUse {
        ticks,
        percent_of_core: 100.0 * seconds / started.elapsed().as_secs_f64(),
    })
}

/// `utime + stime` of every thread of this process, in clock ticks.
fn process_cpu_ticks() -> Result<u64> {
    let stat = std::fs::read_to_string("/proc/self/stat")?;
    // The command name, in parentheses, may hold spaces: count fields after it.
    let after_name = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
    let fields: Vec<&str> = after_name.split_whitespace().collect();
    // Fields 14 and 15 of the line; the first field after the name is field 3.
    let field = |n: usize| -> Result<u64> {
        let value = fields.get(n - 3).ok_or("/proc/self/stat is too short")?;
        Ok(value.parse()?)
    };
    Ok(field(14)? + field(15)?)
}

/// `getconf CLK_TCK`, or the usual 100.
fn clock_ticks_per_second() -> u64 {
    std::process::Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|out| String::from_utf8(out.stdout).ok())
        .and_then(|text| text.trim().parse().ok())
        .unwrap_or(100)
}

/// Polls `done` every 5 ms, for up to 10 s.
async fn wait_until(what: &str, mut done: impl FnMut() -> bool) -> Result {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !done() {
        if Instant::now() > deadline {
            return Err(format!("timed out waiting for {what}").into());
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    Ok(())
}

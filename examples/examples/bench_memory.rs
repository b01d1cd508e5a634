//! P6: the cost of one uncontended `with_lock` cycle on the memory backend.
//!
//! Measures, in one run and on one multi-thread tokio runtime with 2 worker
//! threads, the time per cycle of:
//!
//! - `tokio::sync::Mutex` lock and unlock: the SPEC's baseline;
//! - a per-key map lookup (`std::sync::Mutex<HashMap<String, Arc<tokio
//!   Mutex>>>`) then lock and unlock: a fairer baseline, since a lock
//!   service must find the key's lock first;
//! - `locker.with_lock(key, |_| async {})` on a `MemoryBackend`, the same
//!   key every time;
//! - `locker.with_lock_cancel_on_loss(key, &LockConfig::default(), ..)`.
//!
//! Each is warmed up, then run 5 times interleaved; the table shows the
//! median ns per cycle and the ratio against both baselines, with the SPEC
//! target P6 (≤ 12x a `tokio::sync::Mutex` cycle). Run it in release mode:
//!
//! ```text
//! cargo run --release -p withlock-examples --example bench_memory
//! ```
//!
//! To count the instructions of one kind of cycle, `--cycles N KIND` runs
//! N cycles of one kind (`mutex`, `keyed`, `with_lock`, `cancel_on_loss`)
//! after a warm-up of 1,000, on a current-thread runtime, and prints
//! nothing else; under `valgrind --tool=callgrind` the difference between
//! two values of N, divided by their difference, is the cost of one cycle
//! whatever the machine's load:
//!
//! ```text
//! valgrind --tool=callgrind --callgrind-out-file=/tmp/cg.%p \
//!     target/release/examples/bench_memory --cycles 10000 with_lock
//! ```

use std::collections::HashMap;
use std::error::Error;
use std::hint::black_box;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use lock_memory::MemoryBackend;
use lock_memory::{LockConfig, LockError, Locker};

const KEY: &str = "bench:p6";
const WARMUP: u32 = 20_000;
const ITERATIONS: u32 = 200_000;
const RUNS: usize = 5;
/// SPEC P6: a memory cycle costs at most this many `tokio::sync::Mutex` cycles.
const TARGET_RATIO: f64 = 12.0;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Bench {
    TokioMutex,
    KeyedMutex,
    WithLock,
    WithLockCancelOnLoss,
}

impl Bench {
    const ALL: [Self; 4] = [
        Self::TokioMutex,
        Self::KeyedMutex,
        Self::WithLock,
        Self::WithLockCancelOnLoss,
    ];

    fn name(self) -> &'static str {
        match self {
            Self::TokioMutex => "tokio::sync::Mutex lock/unlock",
            Self::KeyedMutex => "per-key map + tokio Mutex",
            Self::WithLock => "with_lock (MemoryBackend)",
            Self::WithLockCancelOnLoss => "with_lock_cancel_on_loss (default)",
        }
    }
}

/// What the cycles run against, built once.
struct Fixture {
    mutex: tokio::sync::Mutex<()>,
    keyed: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    locker: Locker,
    config: LockConfig,
}

impl Fixture {
    /// Runs `iterations` cycles of `bench` and says how long they took.
    async fn measure(&self, bench: Bench, iterations: u32) -> Result<Duration, LockError> {
        let started = Instant::now();
        match bench {
            Bench::TokioMutex => {
                for _ in 0..iterations {
                    drop(black_box(self.mutex.lock().await));
                }
            }
            Bench::KeyedMutex => {
                for _ in 0..iterations {
                    let lock = self.keyed_lock(black_box(KEY));
                    drop(black_box(lock.lock().await));
                }
            }
            Bench::WithLock => {
                for _ in 0..iterations {
                    self.locker.with_lock(black_box(KEY), |_| async {}).await?;
                }
            }
            Bench::WithLockCancelOnLoss => {
                for _ in 0..iterations {
                    self.locker
                        .with_lock_cancel_on_loss(black_box(KEY), &self.config, |_| async {})
                        .await?;
                }
            }
        }
        Ok(started.elapsed())
    }

    fn keyed_lock(&self, key: &str) -> Arc<tokio::sync::Mutex<()>> {
        let mut map = self.keyed.lock().unwrap_or_else(PoisonError::into_inner);
        match map.get(key) {
            Some(lock) => Arc::clone(lock),
            None => Arc::clone(map.entry(key.to_owned()).or_default()),
        }
    }
}

fn main() -> Result<(), Box<dyn Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if let [flag, n, kind] = args.as_slice() {
        if flag == "--cycles" {
            return count_cycles(n.parse()?, kind);
        }
    }
    if !args.is_empty() {
        return Err("usage: bench_memory [--cycles N mutex|keyed|with_lock|cancel_on_loss]".into());
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    // Measure on a worker thread, where application code runs, not on the
    // thread that blocks on `main`.
    let medians = runtime.block_on(async { tokio::spawn(run()).await })??;
    print_table(&medians);
    Ok(())
}

/// Runs `n` cycles of one kind after a warm-up, for an instruction count.
fn count_cycles(n: u32, kind: &str) -> Result<(), Box<dyn Error>> {
    let bench = match kind {
        "mutex" => Bench::TokioMutex,
        "keyed" => Bench::KeyedMutex,
        "with_lock" => Bench::WithLock,
        "cancel_on_loss" => Bench::WithLockCancelOnLoss,
        other => return Err(format!("unknown kind {other:?}").into()),
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let fixture = fixture();
        fixture.measure(bench, 1_000).await?;
        fixture.measure(bench, n).await?;
        Ok(())
    })
}

fn fixture() -> Fixture {
    Fixture {
        mutex: tokio::sync::Mutex::new(()),
        keyed: Mutex::default(),
        locker: Locker::new(MemoryBackend::new()),
        config: LockConfig::default(),
    }
}

async fn run() -> Result<Vec<(Bench, f64)>, LockError> {
    let fixture = fixture();
    for bench in Bench::ALL {
        fixture.measure(bench, WARMUP).await?;
    }
    let mut samples: Vec<Vec<f64>> = vec![Vec::with_capacity(RUNS); Bench::ALL.len()];
    for _ in 0..RUNS {
        for (i, bench) in Bench::ALL.into_iter().enumerate() {
            let took = fixture.measure(bench, ITERATIONS).await?;
            samples[i].push(took.as_nanos() as f64 / f64::from(ITERATIONS));
        }
    }
    Ok(Bench::ALL
        .into_iter()
        .zip(samples)
        .map(|(bench, mut ns)| {
            ns.sort_by(f64::total_cmp);
            (bench, ns[ns.len() / 2])
        })
        .collect())
}

fn print_table(medians: &[(Bench, f64)]) {
    let baseline = |which: Bench| {
        medians
            .iter()
            .find(|(bench, _)| *bench == which)
            .map_or(f64::NAN, |(_, ns)| *ns)
    };
    let (mutex, keyed) = (baseline(Bench::TokioMutex), baseline(Bench::KeyedMutex));
    println!(
        "P6, memory backend: uncontended cycles on one key, 2 worker threads, \
         median of {RUNS} interleaved runs of {ITERATIONS} cycles"
    );
    println!();
    println!(
        "{:<36} {:>10} {:>14} {:>14}   SPEC P6 <= {TARGET_RATIO}x",
        "name", "ns/cycle", "vs tokio Mutex", "vs per-key map"
    );
    for &(bench, ns) in medians {
        let verdict = match bench {
            Bench::WithLock | Bench::WithLockCancelOnLoss if ns / mutex <= TARGET_RATIO => "PASS",
            Bench::WithLock | Bench::WithLockCancelOnLoss => "MISS",
            Bench::TokioMutex | Bench::KeyedMutex => "(baseline)",
        };
        println!(
            "{:<36} {:>10.1} {:>13.2}x {:>13.2}x   {verdict}",
            bench.name(),
            ns,
            ns / mutex,
            ns / keyed
        );
    }
}

//! Benchmarks of the PostgreSQL backend, printed in one run (about 30 s):
//!
//! - P5: an uncontended `with_lock` cycle against the same two statements
//!   (acquire + release, the backend's own SQL) sent by hand on the same
//!   pool, as a ratio (target ≤ 1.2x);
//! - handoff: from a holder's release to the next waiter's callback
//!   running, with `retry_delay` 200 ms, with release notifications and
//!   without (p50 / p99).
//!
//! ```text
//! DATABASE_URL=postgres://postgres@127.0.0.1:5432/test \
//!     cargo run --release -p lock-postgres --example bench_postgres
//! ```
//!
//! The tables live in schemas of their own, dropped at the end.

use std::sync::Arc;
use std::time::Duration;

use bench_support::{percentile, Spread};
use lock_core::{LockConfig, Locker, LockerOptions, OwnerToken};
use lock_postgres::testing::TestBackend;
use lock_postgres::PostgresConfig;
use tokio::time::Instant;
use withlock_test_servers::postgres::database_url;

#[path = "../../bench-support/bench_support.rs"]
mod bench_support;

const ROUNDS: usize = 12;
const CYCLES_PER_ROUND: usize = 150;
const HANDOFFS: usize = 60;

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = database_url();
    let backend = Arc::new(TestBackend::new(&url).await?);
    p5(&backend).await?;
    let quiet = Arc::new(
        TestBackend::with_config(&url, PostgresConfig::default().release_notifications(false))
            .await?,
    );
    let with = handoff(&backend).await?;
    let without = handoff(&quiet).await?;
    println!(
        "handoff (release -> next waiter's callback), retry_delay 200 ms, {HANDOFFS} samples each:"
    );
    println!(
        "  with notifications:    p50 {:>9.3?}  p99 {:>9.3?}",
        with.0, with.1
    );
    println!(
        "  without notifications: p50 {:>9.3?}  p99 {:>9.3?}",
        without.0, without.1
    );
    Ok(())
}

/// P5: rounds of `with_lock` cycles and of raw statement pairs, interleaved
/// so that both see the same load.
async fn p5(backend: &Arc<TestBackend>) -> Result<(), Box<dyn std::error::Error>> {
    let locker = Locker::new(Arc::clone(backend));
    let [acquire, _, _, release] = backend.statements();
    let (acquire, release) = (acquire.to_owned(), release.to_owned());
    let channel = backend.config().channel.clone();
    let grant_channel = backend.config().grant_channel();
    let pool = backend.pool().clone();
    let key = format!("bench:{:016x}", rand::random::<u64>());
    let ttl_us = 30_000_000_i64;
    // Warm up both paths (connections, prepared statements).
    for _ in 0..50 {
        locker.with_lock(&key, |_| async {}).await?;
    }
    let (mut locked, mut raw) = (Duration::ZERO, Duration::ZERO);
    let mut round_ratios = Vec::with_capacity(ROUNDS);
    for _ in 0..ROUNDS {
        let started = Instant::now();
        for _ in 0..CYCLES_PER_ROUND {
            locker.with_lock(&key, |_| async {}).await?;
        }
        let locked_round = started.elapsed();
        locked += locked_round;

        let started = Instant::now();
        for _ in 0..CYCLES_PER_ROUND {
            let owner = OwnerToken::new("raw");
            let token: Option<i64> = sqlx::query_scalar(&acquire)
                .bind(&key)
                .bind(owner.as_str())
                .bind(ttl_us)
                .fetch_optional(&pool)
                .await?;
            assert!(token.is_some(), "the raw cycle takes the free key");
            let released = sqlx::query(&release)
                .bind(&key)
                .bind(owner.as_str())
                .bind(&channel)
                .bind(&grant_channel)
                .fetch_optional(&pool)
                .await?;
            assert!(released.is_some());
        }
        let raw_round = started.elapsed();
        raw += raw_round;
        round_ratios.push(locked_round.as_secs_f64() / raw_round.as_secs_f64());
    }
    let spread = Spread::of(&round_ratios);
    let n = u32::try_from(ROUNDS * CYCLES_PER_ROUND)?;
    let (per_locked, per_raw) = (locked / n, raw / n);
    println!("P5 uncontended cycle, {n} cycles each, interleaved rounds:");
    println!("  with_lock:            {per_locked:>9.3?} per cycle");
    println!("  raw acquire+release:  {per_raw:>9.3?} per cycle");
    println!(
        "  ratio:                {:.3}x (target <= 1.2x)",
        locked.as_secs_f64() / raw.as_secs_f64()
    );
    // A commit waits for the disk, whose stalls hit one round or the
    // other: the median of the rounds' own ratios shrugs them off.
    println!(
        "  rounds' ratios:       median {:.3}x, from {:.3}x to {:.3}x",
        spread.median, spread.low, spread.high
    );
    Ok(())
}

/// Handoff latency percentiles (p50, p99) on `backend`.
async fn handoff(
    backend: &Arc<TestBackend>,
) -> Result<(Duration, Duration), Box<dyn std::error::Error>> {
    let holder = Locker::with_options(
        Arc::clone(backend),
        LockerOptions::default().node_id("holder"),
    )?;
    let waiter = Locker::with_options(
        Arc::clone(backend),
        LockerOptions::default().node_id("waiter"),
    )?;
    let cfg = LockConfig::default()
        .wait_forever()
        .retry_delay(Duration::from_millis(200));
    let key = format!("handoff:{:016x}", rand::random::<u64>());
    let mut samples = Vec::with_capacity(HANDOFFS);
    for _ in 0..HANDOFFS {
        let mut held = holder.handle(&key, Duration::from_secs(30))?;
        assert!(held.acquire().await?);
        let (w, k, c) = (waiter.clone(), key.clone(), cfg);
        let waiting = tokio::spawn(async move {
            w.with_lock_config(&k, &c, |_| async { Instant::now() })
                .await
        });
        // Let the waiter find the key busy and wait, at a random phase of
        // its retry timer.
        let pause = 30 + rand::random::<u64>() % 200;
        tokio::time::sleep(Duration::from_millis(pause)).await;
        let released_at = Instant::now();
        assert!(held.release().await?);
        let ran_at = tokio::time::timeout(Duration::from_secs(5), waiting).await???;
        samples.push(ran_at - released_at);
    }
    samples.sort();
    Ok((percentile(&samples, 0.50), percentile(&samples, 0.99)))
}

//! \[T2\] The process's memory before and after 100,000 distinct keys: locked
//! once each, one after the other, then twice all held at once (each with
//! a waiter on a second locker) and released, with the per-key counts of
//! the locker and the backend after each. A benchmark line, not a test:
//!
//! ```sh
//! cargo run --release -p lock-memory --example t2_memory
//! ```
//!
//! The resident set size is read from `/proc/self/statm` (Linux); the
//! allocator may keep freed pages, so the counts say what the structures
//! keep and the RSS what the process kept; the second round shows
//! whether the first one's memory is used again.

use std::sync::Arc;
use std::time::Instant;

use lock_memory::{LockConfig, Locker, MemoryBackend};
use tokio::sync::Semaphore;

const KEYS: usize = 100_000;

/// The resident set size in MiB, or `None` off Linux.
fn rss_mib() -> Option<f64> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: f64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    // The page size of every Linux this runs on in CI; `getconf PAGESIZE`.
    Some(pages * 4096.0 / (1024.0 * 1024.0))
}

fn line(what: &str, locker: &Locker, backend: &MemoryBackend) {
    let rss = rss_mib().map_or_else(|| "n/a".to_owned(), |m| format!("{m:.1} MiB"));
    let mut counts = locker.state_counts();
    counts.extend(backend.state_counts());
    let counts: Vec<String> = counts
        .iter()
        .filter(|(_, n)| *n > 0)
        .map(|(name, n)| format!("{name}={n}"))
        .collect();
    println!("{what:<46} rss {rss:>10}  {}", counts.join(" "));
}

/// Holds `KEYS` keys at once on `a`, each with a waiter on `b`, then
/// releases them all and lets the waiters through.
async fn crowd(round: usize, a: &Locker, b: &Locker, backend: &MemoryBackend) {
    let started = Instant::now();
    let release = Arc::new(Semaphore::new(0));
    let held = Arc::new(Semaphore::new(0));
    let mut calls = Vec::with_capacity(KEYS);
    for i in 0..KEYS {
        let (a, release, held) = (a.clone(), Arc::clone(&release), Arc::clone(&held));
        calls.push(tokio::spawn(async move {
            a.with_lock(&format!("t2:at-once:{i}"), |_| async move {
                held.add_permits(1);
                let _ = release.acquire().await;
            })
            .await
        }));
    }
    let _ = held.acquire_many(KEYS as u32).await;
    let waits = LockConfig::default().wait_forever();
    let mut waiters = Vec::with_capacity(KEYS);
    for i in 0..KEYS {
        let b = b.clone();
        waiters.push(tokio::spawn(async move {
            b.with_lock_config(&format!("t2:at-once:{i}"), &waits, |_| async {})
                .await
        }));
    }
    // Every waiter watches its key.
    while backend
        .state_counts()
        .iter()
        .any(|&(name, n)| name == "hub: watched keys" && n < KEYS)
    {
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    line(
        &format!("round {round}: 100,000 held, 100,000 waiting"),
        a,
        backend,
    );
    release.add_permits(KEYS);
    for call in calls {
        call.await.expect("no panic").expect("held throughout");
    }
    for waiter in waiters {
        waiter
            .await
            .expect("no panic")
            .expect("the waiter got the key");
    }
    line(
        &format!("round {round}: all released ({:.1?})", started.elapsed()),
        a,
        backend,
    );
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let backend = MemoryBackend::new();
    let (a, b) = (Locker::new(backend.clone()), Locker::new(backend.clone()));
    line("before", &a, &backend);

    let started = Instant::now();
    for i in 0..KEYS {
        a.with_lock(&format!("t2:once:{i}"), |_| async {})
            .await
            .expect("the key is free");
    }
    line(
        &format!("100,000 keys locked once each ({:.1?})", started.elapsed()),
        &a,
        &backend,
    );

    crowd(1, &a, &b, &backend).await;
    crowd(2, &a, &b, &backend).await;
    line("  (the waiters' locker)", &b, &backend);
}

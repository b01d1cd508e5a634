//! Run a task on one node at a time.
//!
//! The first usage example of Kuzzle's `withLock`, in Rust: four nodes (four
//! [`Locker`]s on one in-memory backend) are all told to rebuild the same
//! report at the same moment. Each rebuild runs under `with_lock`, so the
//! rebuilds happen one after the other, never two at once. The report store
//! also checks the fencing token of every write, as a store should when a
//! lock may be lost, and accepts each one because each holder's token is
//! greater than the last.
//!
//! ```text
//! cargo run -p withlock-examples --example run_once
//! ```

use std::error::Error;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use lock_memory::MemoryBackend;
use lock_memory::{LockError, Locker, LockerOptions};
use tokio::task::JoinSet;

/// How long one rebuild takes.
const REBUILD_TIME: Duration = Duration::from_millis(100);

#[tokio::main]
async fn main() -> Result<(), Box<dyn Error>> {
    let backend = MemoryBackend::new();
    let store = ReportStore::default();
    let started = Instant::now();

    let mut nodes = JoinSet::new();
    for n in 1..=4 {
        let node = Locker::with_options(
            backend.clone(),
            LockerOptions::default().node_id(format!("node-{n}")),
        )?;
        let store = store.clone();
        nodes.spawn(async move {
            let report = rebuild_report(&node, &store).await;
            (node.node_id().to_owned(), report)
        });
    }

    let mut reports = Vec::new();
    while let Some(joined) = nodes.join_next().await {
        let (node, report) = joined?;
        // The outer `?`: the lock; the inner one: the rebuild itself.
        let report = report??;
        println!(
            "{node} rebuilt the report: version {}, fencing token {}, finished at +{:.0?}",
            report.version,
            report.fencing_token,
            report.finished_at.duration_since(started)
        );
        reports.push(report);
    }

    let most = store.most_rebuilding.load(Ordering::SeqCst);
    println!(
        "At most {most} rebuild ran at any moment; every write carried a fresh fencing token."
    );
    if reports.len() != 4 || most != 1 {
        return Err(format!(
            "expected 4 rebuilds one at a time, saw {} with up to {most} at once",
            reports.len()
        )
        .into());
    }
    reports.sort_by_key(|r| r.version);
    let in_order = reports.windows(2).all(|pair| {
        pair[0].fencing_token < pair[1].fencing_token
            && pair[1].finished_at >= pair[0].finished_at + REBUILD_TIME
    });
    if !in_order {
        return Err("rebuilds overlapped or went out of token order".into());
    }
    if backend.held_keys() != 0 {
        return Err("a lock was left held".into());
    }
    println!("run_once: each node rebuilt the report, one at a time");
    Ok(())
}

/// Rebuilds the report while holding `report:rebuild`: only one node runs
/// this at any given time. With the default config a node waits up to about
/// 2 s (11 attempts) for the others to finish.
async fn rebuild_report(
    node: &Locker,
    store: &ReportStore,
) -> Result<Result<Report, StaleToken>, LockError> {
    let store = store.clone();
    node.with_lock("report:rebuild", move |lock| async move {
        store.rebuild(lock.fencing_token()).await
    })
    .await
}

/// One rebuilt report.
#[derive(Debug)]
struct Report {
    version: u64,
    fencing_token: u64,
    finished_at: Instant,
}

/// Where reports are written. It counts how many rebuilds run at once and
/// refuses a write whose fencing token is not above every one seen before.
#[derive(Clone, Default)]
struct ReportStore {
    rebuilding: Arc<AtomicUsize>,
    most_rebuilding: Arc<AtomicUsize>,
    versions: Arc<AtomicU64>,
    last_token: Arc<Mutex<u64>>,
}

impl ReportStore {
    async fn rebuild(&self, fencing_token: u64) -> Result<Report, StaleToken> {
        let now = self.rebuilding.fetch_add(1, Ordering::SeqCst) + 1;
        self.most_rebuilding.fetch_max(now, Ordering::SeqCst);
        tokio::time::sleep(REBUILD_TIME).await;
        let written = self.write(fencing_token);
        self.rebuilding.fetch_sub(1, Ordering::SeqCst);
        written
    }

    /// Writes the report if `fencing_token` is fresh.
    fn write(&self, fencing_token: u64) -> Result<Report, StaleToken> {
        let mut last = self
            .last_token
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if fencing_token <= *last {
            return Err(StaleToken {
                token: fencing_token,
                last: *last,
            });
        }
        *last = fencing_token;
        Ok(Report {
            version: self.versions.fetch_add(1, Ordering::SeqCst) + 1,
            fencing_token,
            finished_at: Instant::now(),
        })
    }
}

/// A write refused because a later lock holder already wrote.
#[derive(Debug)]
struct StaleToken {
    token: u64,
    last: u64,
}

impl std::fmt::Display for StaleToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "write with fencing token {} refused: token {} already wrote",
            self.token, self.last
        )
    }
}

impl Error for StaleToken {}

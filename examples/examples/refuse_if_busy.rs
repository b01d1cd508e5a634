//! Refuse a task that is already running somewhere in the cluster.
//!
//! The second usage example of Kuzzle's `withLock`, in Rust. With
//! `retry_attempts(0)` a single attempt is made. The JavaScript version
//! needs a `started` flag to tell "the lock was busy" from "the task threw";
//! here the two are apart in the types:
//!
//! - `Err(LockError::NotAcquired { .. })`: the callback did not run, the task
//!   is already ongoing elsewhere;
//! - `Ok(Err(e))`: the callback ran and the task itself failed with `e`.
//!
//! Two nodes (two [`Locker`]s on one in-memory backend) try the same task.
//!
//! ```text
//! cargo run -p withlock-examples --example refuse_if_busy
//! ```

use std::error::Error;
use std::fmt;
use std::time::{Duration, Instant};

use lock_memory::MemoryBackend;
use lock_memory::{LockConfig, LockError, Locker, LockerOptions};

#[tokio::main]
async fn main() -> Result<(), Box<dyn Error>> {
    let backend = MemoryBackend::new();
    let node_a = Locker::with_options(backend.clone(), LockerOptions::default().node_id("node-a"))?;
    let node_b = Locker::with_options(backend.clone(), LockerOptions::default().node_id("node-b"))?;

    println!("node-a starts importing 3 rows (it takes 300 ms).");
    let a = node_a.clone();
    let long_import = tokio::spawn(async move { do_not_repeat_process(&a, vec![1, 2, 3]).await });
    while backend.holder("uniqueTask").is_none() {
        tokio::time::sleep(Duration::from_millis(1)).await; // until node-a holds the lock
    }

    let asked = Instant::now();
    let busy = do_not_repeat_process(&node_b, vec![4, 5]).await;
    println!(
        "node-b asks for the same task meanwhile: {busy:?}, answered in {:.1?}.",
        asked.elapsed()
    );
    if !matches!(busy, Err(ProcessError::AlreadyOngoing)) {
        return Err(format!("expected AlreadyOngoing, got {busy:?}").into());
    }

    let imported = long_import.await??;
    println!("node-a finished: imported {imported} rows.");

    let failed = do_not_repeat_process(&node_b, vec![6, 0, 7]).await;
    println!("node-b runs the task on a bad batch: {failed:?}.");
    if !matches!(failed, Err(ProcessError::Task(_))) {
        return Err(format!("expected the task's own error, got {failed:?}").into());
    }

    let retried = do_not_repeat_process(&node_b, vec![6, 7]).await?;
    println!("node-b runs it again on a fixed batch: imported {retried} rows; the failed run had released the lock.");

    if backend.held_keys() != 0 {
        return Err("a lock was left held".into());
    }
    println!("refuse_if_busy: \"busy\" and \"the task failed\" were told apart without a flag");
    Ok(())
}

/// Runs the import unless it is already running on some node.
async fn do_not_repeat_process(node: &Locker, rows: Vec<u32>) -> Result<usize, ProcessError> {
    let once = LockConfig::default().retry_attempts(0);
    match node
        .with_lock_config("uniqueTask", &once, move |_| import(rows))
        .await
    {
        Ok(Ok(imported)) => Ok(imported),
        // The callback ran; the task itself failed.
        Ok(Err(task_error)) => Err(ProcessError::Task(task_error)),
        // The callback did not run: the single attempt found the key busy.
        Err(LockError::NotAcquired { source: None, .. }) => Err(ProcessError::AlreadyOngoing),
        // The attempt failed on a backend error, or the lock was lost.
        Err(lock_error) => Err(ProcessError::Lock(lock_error)),
    }
}

/// The task: imports rows, failing on a row numbered 0.
async fn import(rows: Vec<u32>) -> Result<usize, ImportError> {
    for &row in &rows {
        if row == 0 {
            return Err(ImportError { row });
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok(rows.len())
}

/// Why [`do_not_repeat_process`] did not import.
#[derive(Debug)]
enum ProcessError {
    /// The task is already running somewhere in the cluster: Kuzzle's
    /// `TooManyRequestsError`.
    AlreadyOngoing,
    /// The task ran and failed.
    Task(ImportError),
    /// The lock failed: backend errors, or lost while the task ran.
    Lock(LockError),
}

impl fmt::Display for ProcessError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::AlreadyOngoing => f.write_str("that task is already ongoing"),
            Self::Task(_) => f.write_str("the import failed"),
            Self::Lock(_) => f.write_str("the import's lock failed"),
        }
    }
}

impl Error for ProcessError {
    fn source(&self) -> Option<&(dyn Error + 'static)> {
        match self {
            Self::AlreadyOngoing => None,
            Self::Task(e) => Some(e),
            Self::Lock(e) => Some(e),
        }
    }
}

/// The task's own error.
#[derive(Debug)]
struct ImportError {
    row: u32,
}

impl fmt::Display for ImportError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "row {} is invalid", self.row)
    }
}

impl Error for ImportError {}

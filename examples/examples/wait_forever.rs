//! Wait as long as it takes, for a task that outlives the ttl.
//!
//! The third usage example of Kuzzle's `withLock`, in Rust. node-a runs a
//! one-second import under a lock whose ttl is only 300 ms: the driver
//! extends the lock about every 100 ms, so it stays held for the whole
//! second. node-b asks for the same lock with
//! [`LockConfig::wait_forever`] and waits as long as it takes, then runs its
//! own import as soon as node-a releases the key.
//!
//! ```text
//! cargo run -p withlock-examples --example wait_forever
//! ```

use std::error::Error;
use std::time::{Duration, Instant};

use lock_memory::MemoryBackend;
use lock_memory::{LockConfig, Locker, LockerOptions};
use tokio::sync::oneshot;

const KEY: &str = "nightly:import";
const TTL: Duration = Duration::from_millis(300);
const TASK_TIME: Duration = Duration::from_secs(1);

#[tokio::main]
async fn main() -> Result<(), Box<dyn Error>> {
    let backend = MemoryBackend::new();
    let node_a = Locker::with_options(backend.clone(), LockerOptions::default().node_id("node-a"))?;
    let node_b = Locker::with_options(backend.clone(), LockerOptions::default().node_id("node-b"))?;
    let config = LockConfig::default().ttl(TTL).wait_forever();
    let started = Instant::now();

    let (held_tx, held_rx) = oneshot::channel();
    let watcher = backend.clone();
    let a = tokio::spawn(async move {
        node_a
            .with_lock_config(KEY, &config, move |_| async move {
                let _ = held_tx.send(());
                // The lock is extended for as long as this runs. Look at the
                // key's remaining ttl now and then: it never runs out.
                let mut shortest = TTL;
                let task = Instant::now();
                while task.elapsed() < TASK_TIME {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    let left = watcher.remaining_ttl(KEY).unwrap_or_default();
                    shortest = shortest.min(left);
                }
                println!(
                    "node-a: import done after {:.0?}; the key's remaining ttl never fell below {shortest:.0?}.",
                    task.elapsed()
                );
                (Instant::now(), shortest)
            })
            .await
    });
    held_rx.await?;
    println!("node-a: holds {KEY:?} with a {TTL:?} ttl and runs a {TASK_TIME:?} import.");

    println!("node-b: asks for {KEY:?} too, and waits as long as it takes.");
    let b_started = Instant::now();
    let b_ran_at = node_b
        .with_lock_config(KEY, &config, |_| async { Instant::now() })
        .await?;
    let waited = b_started.elapsed();
    let (a_done_at, shortest) = a.await??;
    let handoff = b_ran_at.saturating_duration_since(a_done_at);
    println!("node-b: ran after waiting {waited:.0?}, {handoff:.1?} after node-a's import ended.");

    if shortest.is_zero() {
        return Err("node-a's key expired while its import ran".into());
    }
    if waited < TASK_TIME - Duration::from_millis(100) || b_ran_at < a_done_at {
        return Err("node-b ran before node-a's import ended".into());
    }
    if handoff > Duration::from_millis(100) {
        return Err(format!("node-b took {handoff:?} to get the freed lock").into());
    }
    if started.elapsed() > Duration::from_secs(3) || backend.held_keys() != 0 {
        return Err("the run took too long or left a lock held".into());
    }
    println!(
        "wait_forever: the lock outlived its ttl, and the waiter got it as soon as it was freed"
    );
    Ok(())
}

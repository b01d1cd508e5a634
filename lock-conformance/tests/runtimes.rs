//! \[T1\] on the memory backend: a locker made with its first lock on a
//! runtime that is then dropped, left idle or blocked keeps its locks and
//! wakes its waiters on another runtime.

use std::time::Duration;

use lock_conformance::runtimes::{t1_locker_outlives_runtime, RuntimeState};
use lock_memory::MemoryBackend;

const TTL: Duration = Duration::from_millis(400);

#[test]
fn t1_memory_runtime_dropped() {
    t1_locker_outlives_runtime(RuntimeState::Dropped, TTL, || async {
        MemoryBackend::new()
    });
}

#[test]
fn t1_memory_runtime_idle() {
    t1_locker_outlives_runtime(RuntimeState::Idle, TTL, || async { MemoryBackend::new() });
}

#[test]
fn t1_memory_runtime_blocked() {
    t1_locker_outlives_runtime(RuntimeState::Blocked, TTL, || async {
        MemoryBackend::new()
    });
}

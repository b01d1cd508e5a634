//! The suite on the memory backend alone and inside each wrapper.

use std::time::Duration;

use lock_conformance::{CountingBackend, FaultInjector};
use lock_memory::MemoryBackend;

mod memory {
    use super::*;

    lock_conformance::conformance_tests!(|| async { MemoryBackend::new() });
}

/// Every step takes a millisecond, so the driver's slow paths (steps that
/// need more than one poll) run too.
mod memory_in_fault_injector {
    use super::*;

    lock_conformance::conformance_tests!(|| async {
        FaultInjector::new(MemoryBackend::new()).with_delay_on_every_step(Duration::from_millis(1))
    });
}

mod memory_in_counting_backend {
    use super::*;

    lock_conformance::conformance_tests!(|| async { CountingBackend::new(MemoryBackend::new()) });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_case_is_listed_once() {
    let mut names: Vec<_> = lock_conformance::CASES.iter().map(|c| c.name).collect();
    let n = names.len();
    names.sort_unstable();
    names.dedup();
    assert_eq!(names.len(), n, "a case is listed twice");
    for id in [
        "o1", "o2", "o3", "o4", "o5", "a1", "a2", "a3", "a4", "a5", "a6", "a9", "h1", "h2", "h3",
        "h4", "h5", "l1", "l2", "l3", "r1", "r2", "r3", "r4", "c1", "c2", "c3", "m1", "m2", "s1",
        "s2", "s3", "f1", "f2", "f3", "f5", "f6",
    ] {
        assert!(
            names.iter().any(|n| n.starts_with(&format!("{id}_"))),
            "no case for behaviour {id}"
        );
    }
}

/// `run_all` runs the same list from inside one async test.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_all_runs_every_case_on_the_memory_backend() {
    lock_conformance::run_all(|| async { MemoryBackend::new() }).await;
}

//! \[T1\] on etcd: a backend made, with its first locks, on a runtime that
//! is then dropped, left idle or blocked keeps its locks alive (the
//! keep-alive task and the connections live on the background runtime)
//! and wakes its waiters (the watch task) on another runtime.

mod common;

use std::time::Duration;

use common::EtcdClusterExt;
use lock_conformance::runtimes::{t1_locker_outlives_runtime, RuntimeState};
use withlock_test_servers::etcd::shared_server;

/// Twice etcd's lease floor in the tests (1 s), for a loaded machine.
const TTL: Duration = Duration::from_secs(2);

#[test]
fn t1_etcd_runtime_dropped() {
    t1_locker_outlives_runtime(RuntimeState::Dropped, TTL, || async {
        shared_server().await.backend().await
    });
}

#[test]
fn t1_etcd_runtime_idle() {
    t1_locker_outlives_runtime(RuntimeState::Idle, TTL, || async {
        shared_server().await.backend().await
    });
}

#[test]
fn t1_etcd_runtime_blocked() {
    t1_locker_outlives_runtime(RuntimeState::Blocked, TTL, || async {
        shared_server().await.backend().await
    });
}

//! A backend shared by two runtimes: its connections (the steps' and the
//! release subscription's) are opened on runtime A, and runtime B then
//! uses the same backend while A's only thread is blocked, and after A is
//! dropped. Every step from B must answer, first time, and a release from
//! B must reach B's watch over the subscription, on the single node, behind
//! Sentinel and on a Cluster (each with servers of its own, or namespaced
//! keys on the shared one).
//!
//! Before the backend drove its connections on a runtime of its own, each
//! connection's driver ran on the runtime that opened it: while A was
//! blocked B's steps waited for the step timeout, and once A was dropped
//! they failed with a dropped connection; the subscription never delivered
//! again in either case.

use std::future::Future;
use std::sync::mpsc;
use std::time::Duration;

use lock_core::{AcquireOutcome, Lease, LockBackend, OwnerToken};
use lock_redis::testing::{ScratchBackend, ScratchClusterBackend};
use lock_redis::{RedisBackend, RedisClusterBackend, RedisConfig, RedisSentinelBackend};
use withlock_test_servers::redis::{redis_url, shared_cluster, SentinelGroup, MASTER_NAME};

/// Long enough that a step from B never times out on a loaded machine
/// when the backend is right; on the old code a step on a connection of
/// the blocked runtime A waited for it and failed.
const STEP_TIMEOUT: Duration = Duration::from_secs(10);
const TTL: Duration = Duration::from_secs(60);

fn config() -> RedisConfig {
    RedisConfig::default().step_timeout(STEP_TIMEOUT)
}

/// One lock cycle per key from the caller's runtime, each step answering
/// first time: acquire, extend, a watch on the key, release, and the
/// release's notification reaching the watch. `who` names the runtime in
/// failures.
async fn cycle_each<B: LockBackend>(backend: &B, keys: &[String], who: &str) {
    for key in keys {
        let owner = OwnerToken::new(who);
        let acquired = backend
            .try_acquire(key, &owner, TTL)
            .await
            .unwrap_or_else(|e| panic!("{who}: acquiring {key}: {e}"));
        let AcquireOutcome::Acquired { fencing_token } = acquired else {
            panic!("{who}: {key} is busy");
        };
        let lease = Lease::new(key.as_str(), owner, fencing_token);
        backend
            .extend(&lease, TTL)
            .await
            .unwrap_or_else(|e| panic!("{who}: extending {key}: {e}"));
        let mut watch = backend
            .watch_release(key)
            .await
            .unwrap_or_else(|e| panic!("{who}: watching {key}: {e}"));
        backend
            .release(&lease)
            .await
            .unwrap_or_else(|e| panic!("{who}: releasing {key}: {e}"));
        // The notification comes over the subscription connection, or
        // never: no poll stands in for it here.
        tokio::time::timeout(STEP_TIMEOUT, watch.released())
            .await
            .unwrap_or_else(|_| panic!("{who}: the release of {key} never reached its watch"));
    }
}

/// Runtime A: a current-thread runtime on a thread of its own. It runs
/// `open` (which opens the backend's connections there), and then its
/// only thread blocks, inside a task, until this is dropped.
struct BlockedRuntime {
    unblock: Option<mpsc::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl BlockedRuntime {
    /// Returns once `open` has finished and A's thread is blocked.
    fn after(open: impl Future<Output = ()> + Send + 'static) -> Self {
        let (opened, has_opened) = mpsc::channel();
        let (unblock, blocked) = mpsc::channel::<()>();
        let thread = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            runtime.block_on(async move {
                open.await;
                opened.send(()).unwrap();
                // Blocks the runtime's only thread: nothing else on A runs.
                let _ = blocked.recv();
            });
        });
        has_opened
            .recv()
            .expect("runtime A opened the backend's connections");
        Self {
            unblock: Some(unblock),
            thread: Some(thread),
        }
    }
}

impl Drop for BlockedRuntime {
    fn drop(&mut self) {
        drop(self.unblock.take());
        if let Some(thread) = self.thread.take() {
            let joined = thread.join();
            if !std::thread::panicking() {
                joined.expect("runtime A's thread");
            }
        }
    }
}

/// Runs `open` on runtime A (a current-thread runtime on a thread of its
/// own) and drops A.
fn on_dropped_runtime(open: impl Future<Output = ()> + Send + 'static) {
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(open);
        drop(runtime);
    })
    .join()
    .expect("runtime A opened the backend's connections");
}

/// Runtime B: the test's own current-thread runtime.
fn on_runtime_b(work: impl Future<Output = ()>) {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(work);
}

/// Opens `backend`'s connections on runtime A, blocks A's only thread,
/// and cycles `keys` from runtime B.
fn while_a_is_blocked<B: LockBackend + Clone>(backend: &B, keys: &[String]) {
    let on_a = (backend.clone(), keys.to_vec());
    let blocked = BlockedRuntime::after(async move { cycle_each(&on_a.0, &on_a.1, "A").await });
    on_runtime_b(cycle_each(backend, keys, "B"));
    drop(blocked);
}

/// Opens `backend`'s connections on runtime A, drops A, and cycles `keys`
/// from runtime B.
fn after_a_is_dropped<B: LockBackend + Clone>(backend: &B, keys: &[String]) {
    let on_a = (backend.clone(), keys.to_vec());
    on_dropped_runtime(async move { cycle_each(&on_a.0, &on_a.1, "A").await });
    on_runtime_b(cycle_each(backend, keys, "B"));
}

/// A single-node backend on the shared server, in a namespace of its own
/// (deleted when it is dropped), and a key in it.
fn single_node() -> (ScratchBackend, Vec<String>) {
    let backend = ScratchBackend::new(&redis_url(), config());
    let key = backend.namespace().key("shared");
    (backend, vec![key])
}

/// A Cluster backend on the test binary's cluster, in a namespace of its
/// own, and a key on every master.
fn cluster() -> (ScratchClusterBackend, Vec<String>) {
    let cluster = shared_cluster();
    let backend = ScratchClusterBackend::new(&cluster.urls(), config());
    let masters = cluster.master_ports().expect("the cluster's masters");
    let mut keys: Vec<String> = Vec::new();
    let mut covered = Vec::new();
    for i in 0.. {
        let key = backend.namespace().key(&format!("shared-{i}"));
        let master = cluster
            .master_of_key(&key)
            .expect("a master serves every key")
            .port();
        if !covered.contains(&master) {
            covered.push(master);
            keys.push(key);
        }
        if covered.len() == masters.len() {
            break;
        }
    }
    (backend, keys)
}

#[test]
fn single_node_steps_and_notifications_go_on_while_the_opening_runtime_is_blocked() {
    let (scratch, keys) = single_node();
    while_a_is_blocked(&RedisBackend::clone(&scratch), &keys);
}

#[test]
fn single_node_steps_and_notifications_go_on_after_the_opening_runtime_is_dropped() {
    let (scratch, keys) = single_node();
    after_a_is_dropped(&RedisBackend::clone(&scratch), &keys);
}

#[test]
fn cluster_steps_and_notifications_go_on_while_the_opening_runtime_is_blocked() {
    let (scratch, keys) = cluster();
    while_a_is_blocked(&RedisClusterBackend::clone(&scratch), &keys);
}

#[test]
fn cluster_steps_and_notifications_go_on_after_the_opening_runtime_is_dropped() {
    let (scratch, keys) = cluster();
    after_a_is_dropped(&RedisClusterBackend::clone(&scratch), &keys);
}

/// A Sentinel group of the test's own (a primary without replicas and
/// three Sentinels), and a backend on it: the backend's connection to the
/// primary, its subscription, and the connections to the Sentinels that
/// the `redis` crate keeps between look-ups are all opened on A.
fn sentinel(group: &SentinelGroup) -> RedisSentinelBackend {
    // The group is the test's own: its keys go with it.
    RedisSentinelBackend::from_urls_with(MASTER_NAME, group.sentinel_urls(), config())
        .expect("a Sentinel backend")
}

#[test]
fn sentinel_steps_and_notifications_go_on_while_the_opening_runtime_is_blocked() {
    let group = SentinelGroup::start(0).expect("a Sentinel group");
    while_a_is_blocked(&sentinel(&group), &["shared".to_owned()]);
}

#[test]
fn sentinel_steps_and_notifications_go_on_after_the_opening_runtime_is_dropped() {
    let group = SentinelGroup::start(0).expect("a Sentinel group");
    after_a_is_dropped(&sentinel(&group), &["shared".to_owned()]);
}

/// Runtime A only watches (which starts the release subscription there)
/// and blocks; B's steps open their own connections, and B's release must
/// still reach B's watch.
fn subscribed_on_a_then_blocked<B: LockBackend + Clone>(backend: &B, keys: &[String]) {
    let on_a = (backend.clone(), keys[0].clone());
    let blocked = BlockedRuntime::after(async move {
        on_a.0
            .watch_release(&on_a.1)
            .await
            .unwrap_or_else(|e| panic!("A: watching: {e}"));
    });
    on_runtime_b(cycle_each(backend, keys, "B"));
    drop(blocked);
}

#[test]
fn single_node_notifications_reach_b_while_the_runtime_that_subscribed_is_blocked() {
    let (scratch, keys) = single_node();
    subscribed_on_a_then_blocked(&RedisBackend::clone(&scratch), &keys);
}

#[test]
fn cluster_notifications_reach_b_while_the_runtime_that_subscribed_is_blocked() {
    let (scratch, keys) = cluster();
    subscribed_on_a_then_blocked(&RedisClusterBackend::clone(&scratch), &keys);
}

/// \[T1\] at the Locker level, on the lead's harness: a backend made, with
/// its lockers' first locks, on a runtime then dropped, left idle or
/// blocked keeps extending and waking waiters on another runtime. The
/// backends are made lazily here and connect on runtime A at their first
/// lock.
mod t1 {
    use super::*;
    use lock_conformance::runtimes::{t1_locker_outlives_runtime, RuntimeState};

    /// A Redis suite's ttl with room for a loaded machine.
    const T1_TTL: Duration = Duration::from_secs(2);

    fn on_single_node(state: RuntimeState) {
        let (scratch, _) = single_node();
        let backend = RedisBackend::clone(&scratch);
        t1_locker_outlives_runtime(state, T1_TTL, move || async move { backend });
    }

    fn on_sentinel(state: RuntimeState) {
        let group = SentinelGroup::start(0).expect("a Sentinel group");
        let backend = sentinel(&group);
        t1_locker_outlives_runtime(state, T1_TTL, move || async move { backend });
    }

    fn on_cluster(state: RuntimeState) {
        let (scratch, _) = cluster();
        let backend = RedisClusterBackend::clone(&scratch);
        t1_locker_outlives_runtime(state, T1_TTL, move || async move { backend });
    }

    #[test]
    fn t1_single_node_runtime_dropped() {
        on_single_node(RuntimeState::Dropped);
    }

    #[test]
    fn t1_single_node_runtime_idle() {
        on_single_node(RuntimeState::Idle);
    }

    #[test]
    fn t1_single_node_runtime_blocked() {
        on_single_node(RuntimeState::Blocked);
    }

    #[test]
    fn t1_sentinel_runtime_dropped() {
        on_sentinel(RuntimeState::Dropped);
    }

    #[test]
    fn t1_sentinel_runtime_idle() {
        on_sentinel(RuntimeState::Idle);
    }

    #[test]
    fn t1_sentinel_runtime_blocked() {
        on_sentinel(RuntimeState::Blocked);
    }

    #[test]
    fn t1_cluster_runtime_dropped() {
        on_cluster(RuntimeState::Dropped);
    }

    #[test]
    fn t1_cluster_runtime_idle() {
        on_cluster(RuntimeState::Idle);
    }

    #[test]
    fn t1_cluster_runtime_blocked() {
        on_cluster(RuntimeState::Blocked);
    }
}

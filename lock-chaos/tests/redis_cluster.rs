//! The fault checker on a Redis Cluster of 3 masters with a replica each
//! and a 2 s ttl: a master paused for 1 s, short of a failover, and every
//! node's connections cut, neither of which may cost a held lock; a worker
//! paused past the ttl; a master paused until its replica is promoted, and
//! a master killed, then restarted empty once its replica is promoted; no
//! lock on another master is ever reported lost. The heal time is 2 s, so
//! that every fault fits in `CHAOS_CLUSTER_SECONDS` (default 40; under a
//! minute with the setup; `CHAOS_SECONDS` does not apply).

mod common;

#[test]
fn redis_cluster_survives_every_fault() {
    common::run_and_check(
        "redis-cluster",
        common::seconds_from("CHAOS_CLUSTER_SECONDS", 40),
        6,
        &["--heal", "2s"],
    );
}

/// Every worker on one key (SPEC F1–F3 on a Cluster: the queue's keys in
/// the lock key's slot, grants on its shard channel), through the faults
/// that touch the queue: a master paused until its replica is promoted, a
/// master killed (either may lose the queue with the lock), and a worker
/// paused past its place's ticket ttl. The same checks as on one server,
/// the queue's order too (the coordinator reads the queue on the node
/// that serves its slot). `CHAOS_CLUSTER_HOT_KEY_SECONDS` sets how long
/// (default 45); the liveness bound is 8 s, as on one server's hot key.
#[test]
fn redis_cluster_survives_every_fault_on_one_hot_key() {
    common::run_and_check(
        "redis-cluster",
        common::seconds_from("CHAOS_CLUSTER_HOT_KEY_SECONDS", 45),
        1,
        &[
            "--heal",
            "2s",
            "--keys",
            "1",
            "--liveness-bound",
            "8s",
            "--faults",
            "worker_stop,master_stop,master_kill",
        ],
    );
}

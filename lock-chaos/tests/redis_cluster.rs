//! The fault checker on a Redis Cluster of 3 masters with a replica each
//! and a 2 s ttl: a master paused until its replica is promoted, and a
//! master killed, then restarted empty once its replica is promoted; no
//! lock on another master is ever reported lost. `CHAOS_CLUSTER_SECONDS`
//! sets how long (default 30: each fault once, in under a minute with the
//! setup; `CHAOS_SECONDS` does not apply).

mod common;

#[test]
fn redis_cluster_survives_every_fault() {
    common::run_and_check(
        "redis-cluster",
        common::seconds_from("CHAOS_CLUSTER_SECONDS", 30),
        6,
    );
}

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

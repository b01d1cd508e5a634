//! The fault checker on a 3-member etcd cluster: workers paused past the
//! ttl, the leader killed and restarted on its data, the leader paused
//! past the election timeout, a follower paused, a follower killed and
//! restarted.
//! `CHAOS_ETCD_SECONDS` sets how long (default 40: every fault once, in
//! under a minute with the setup; `CHAOS_SECONDS` does not apply).

mod common;

#[test]
fn etcd_survives_every_fault() {
    common::run_and_check(
        "etcd",
        common::seconds_from("CHAOS_ETCD_SECONDS", 40),
        4,
        &[],
    );
}

/// Every worker on one name, so that etcd's own line of contender keys,
/// the fair queue there (SPEC F1–F3), holds waiters from every process
/// through every fault. The liveness bound is 8 s: a stopped worker's key
/// stays at the head until its ticket lease runs out (3 s, plus up to
/// 0.5 s of the lessor's lag), then the next holder's run (up to two
/// ttls). The waiters must acquire in the order of their keys' create
/// revisions, as the coordinator read them. `CHAOS_HOT_KEY_SECONDS` sets
/// how long (default 40).
#[test]
fn etcd_survives_every_fault_on_one_hot_key() {
    common::run_and_check(
        "etcd",
        common::seconds_from("CHAOS_HOT_KEY_SECONDS", 40),
        1,
        &["--keys", "1", "--liveness-bound", "8s"],
    );
}

//! The fault checker on Redis: workers paused past the ttl, the server
//! paused, killed and restarted empty, normal and pub/sub clients cut.
//! `CHAOS_SECONDS` sets how long (default 40).

mod common;

#[test]
fn redis_survives_every_fault() {
    common::run_and_check("redis", common::seconds_from("CHAOS_SECONDS", 40), 4, &[]);
}

/// Every worker on one key, so that the fair queue (SPEC F1–F3) holds
/// waiters from every process through every fault: its grants, its
/// places of stopped workers and its leaves at shutdown meet the same
/// checks (exclusion modulo loss reports, token order, refused writes,
/// liveness, nothing left held). `CHAOS_HOT_KEY_SECONDS` sets how long
/// (default 40). The liveness bound is 8 s, not 5: on one key the first
/// lock after a heal may wait for a stopped worker's grant to run out
/// (its claim deadline, 2 s) or its place to lapse (its ticket ttl, 3 s),
/// then for the holder's own run (up to two ttls, 2 s).
#[test]
fn redis_survives_every_fault_on_one_hot_key() {
    common::run_and_check(
        "redis",
        common::seconds_from("CHAOS_HOT_KEY_SECONDS", 40),
        1,
        &["--keys", "1", "--liveness-bound", "8s"],
    );
}

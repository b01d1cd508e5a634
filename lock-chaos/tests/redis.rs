//! The fault checker on Redis: workers paused past the ttl, the server
//! paused, killed and restarted empty, normal and pub/sub clients cut.
//! `CHAOS_SECONDS` sets how long (default 40).

mod common;

use lock_chaos::analysis::Check;

#[test]
fn redis_survives_every_fault() {
    common::run_and_check("redis", common::seconds_from("CHAOS_SECONDS", 40), 4, &[]);
}

/// Every worker on one key, so that the fair queue (SPEC F1–F3) holds
/// waiters from every process through every fault: its grants, its
/// places of stopped workers and its leaves at shutdown meet the same
/// checks (exclusion modulo loss reports, token order, refused writes,
/// liveness, nothing left held), and the queue's order is checked against
/// the coordinator's reads of the store's queue on at least
/// `MIN_ORDER_PAIRS_CHECKED` pairs of waiters. `CHAOS_HOT_KEY_SECONDS` sets how long
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

/// The order check can fail: with every read of the fair queue shuffled
/// before it is logged (`--shuffle-queue`, the store and the workers
/// untouched), it must find waiters acquiring out of the order the reads
/// say, and nothing else may be wrong. 12 s on one key, one cheap fault.
#[test]
fn the_order_check_finds_a_shuffled_queue_out_of_order() {
    let run = common::run(
        "redis",
        12,
        &[
            "--keys",
            "1",
            "--liveness-bound",
            "8s",
            "--heal",
            "1s",
            "--faults",
            "client_kill_normal",
            "--shuffle-queue",
            "true",
        ],
    );
    let report = &run.report;
    let order = report
        .summary
        .queue_order
        .as_ref()
        .expect("the queue was read");
    assert!(
        order.out_of_order > 0 && report.count(Check::QueueOrder) > 0,
        "a shuffled queue passed the order check:\n{report}"
    );
    for check in Check::ALL {
        if check != Check::QueueOrder {
            assert_eq!(report.count(check), 0, "{check:?} in:\n{report}");
        }
    }
    assert_eq!(run.status.code(), Some(1), "violations exit 1");
    let _ = std::fs::remove_dir_all(&run.dir);
}

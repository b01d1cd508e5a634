//! The fault checker on PostgreSQL: workers and the server paused past the
//! ttl, connections terminated (all, or the listening ones), an immediate
//! restart, every lock row deleted. `CHAOS_SECONDS` sets how long
//! (default 40).

mod common;

#[test]
fn postgres_survives_every_fault() {
    common::run_and_check(
        "postgres",
        common::seconds_from("CHAOS_SECONDS", 40),
        4,
        &[],
    );
}

/// Every worker on one key, so that the fair queue (SPEC F1–F3) holds
/// waiters from every process through every fault (as the Redis test of
/// that name; the liveness bound is 8 s for the same reasons: a stopped
/// worker's grant runs out after its claim deadline, 2 s, or its place
/// after its ticket ttl, 3 s), and the waiters must acquire in the order
/// of the `<table>_waiters` rows' tickets, as the coordinator read them.
/// `CHAOS_HOT_KEY_SECONDS` sets how long (default 40).
#[test]
fn postgres_survives_every_fault_on_one_hot_key() {
    common::run_and_check(
        "postgres",
        common::seconds_from("CHAOS_HOT_KEY_SECONDS", 40),
        1,
        &["--keys", "1", "--liveness-bound", "8s"],
    );
}

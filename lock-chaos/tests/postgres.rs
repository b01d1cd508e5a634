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

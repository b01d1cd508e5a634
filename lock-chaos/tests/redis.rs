//! The fault checker on Redis: workers paused past the ttl, the server
//! paused, killed and restarted empty, normal and pub/sub clients cut.
//! `CHAOS_SECONDS` sets how long (default 40).

mod common;

#[test]
fn redis_survives_every_fault() {
    common::run_and_check("redis", common::seconds_from("CHAOS_SECONDS", 40), 4, &[]);
}

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

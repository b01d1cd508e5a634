//! The whole conformance suite against Redis at `REDIS_URL` (default
//! `redis://127.0.0.1:6379`; a `redis-server` child when nothing answers
//! there). Each case's backend lives in a random key namespace (its prefix),
//! deleted with the backend, fencing counters included.
//!
//! The cases' ttls are at least 1 s here, as in every Redis conformance
//! suite of this crate ([`lock_conformance::with_min_ttl`]): on a busy
//! machine the suite's 400 ms ttl left an extension too little time to
//! arrive (a loaded run of the same suite over TLS, `tls.rs`, lost
//! `h1_lock_is_extended_while_callback_runs` to "extension did not finish
//! within 11.6ms"). The backend's sub-second
//! ttls are covered by its own tests (`faults.rs`, `batch.rs`,
//! `fence_expiry.rs`).

use lock_redis::testing::ScratchBackend;
use lock_redis::RedisConfig;
use withlock_test_servers::redis::server_url;

/// The cases' smallest ttl (see the module's text).
const MIN_TTL: std::time::Duration = std::time::Duration::from_secs(1);

mod with_notifications {
    use super::*;

    lock_conformance::conformance_tests!(lock_conformance::with_min_ttl(MIN_TTL, || async {
        ScratchBackend::new(&server_url().await, RedisConfig::default())
    }));
}

/// The driver's fallback: waiters poll on their retry timer.
mod without_notifications {
    use super::*;

    lock_conformance::conformance_tests!(lock_conformance::with_min_ttl(MIN_TTL, || async {
        ScratchBackend::new(
            &server_url().await,
            RedisConfig::default().release_notifications(false),
        )
    }));
}

//! The whole conformance suite against Redis at `REDIS_URL` (default
//! `redis://127.0.0.1:6379`; a `redis-server` child when nothing answers
//! there). Each case's backend lives in a random key namespace (its prefix),
//! deleted with the backend, fencing counters included.

use lock_redis::testing::{server_url, ScratchBackend};
use lock_redis::RedisConfig;

mod with_notifications {
    use super::*;

    lock_conformance::conformance_tests!(|| async {
        ScratchBackend::new(&server_url().await, RedisConfig::default())
    });
}

/// The driver's fallback: waiters poll on their retry timer.
mod without_notifications {
    use super::*;

    lock_conformance::conformance_tests!(|| async {
        ScratchBackend::new(
            &server_url().await,
            RedisConfig::default().release_notifications(false),
        )
    });
}

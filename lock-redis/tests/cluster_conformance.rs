//! The whole conformance suite against a local Redis Cluster (3 masters, 3
//! replicas) started once for this test binary. Each case's backend lives
//! in a random key namespace, deleted on every master with the backend.
//!
//! Each case's backend opens its connections at its first step on each
//! master; the backend drives them on a runtime of its own, so a case that
//! stalls one node's runtime on purpose (`o6_stalled_holder_is_told_lost`)
//! stalls no other node's steps (tests/runtimes.rs).
//!
//! The cases' ttls are at least 1 s ([`lock_conformance::with_min_ttl`]),
//! as on a single node (see `conformance.rs`): 400 ms leaves a loaded
//! machine's extension too little time.

use lock_redis::testing::ScratchClusterBackend;
use lock_redis::RedisConfig;
use withlock_test_servers::redis::shared_cluster;

/// The cases' smallest ttl (see the module's text).
const MIN_TTL: std::time::Duration = std::time::Duration::from_secs(1);

fn backend(config: RedisConfig) -> ScratchClusterBackend {
    ScratchClusterBackend::new(&shared_cluster().urls(), config)
}

mod with_notifications {
    use super::*;

    lock_conformance::conformance_tests!(lock_conformance::with_min_ttl(MIN_TTL, || async {
        backend(RedisConfig::default())
    }));
}

/// The driver's fallback: waiters poll on their retry timer.
mod without_notifications {
    use super::*;

    lock_conformance::conformance_tests!(lock_conformance::with_min_ttl(MIN_TTL, || async {
        backend(RedisConfig::default().release_notifications(false))
    }));
}

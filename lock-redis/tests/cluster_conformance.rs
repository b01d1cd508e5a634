//! The whole conformance suite against a local Redis Cluster (3 masters, 3
//! replicas) started once for this test binary. Each case's backend lives
//! in a random key namespace, deleted on every master with the backend.

use lock_redis::testing::{shared_cluster, ScratchClusterBackend};
use lock_redis::RedisConfig;

mod with_notifications {
    use super::*;

    lock_conformance::conformance_tests!(|| async {
        ScratchClusterBackend::new(&shared_cluster().urls(), RedisConfig::default())
    });
}

/// The driver's fallback: waiters poll on their retry timer.
mod without_notifications {
    use super::*;

    lock_conformance::conformance_tests!(|| async {
        ScratchClusterBackend::new(
            &shared_cluster().urls(),
            RedisConfig::default().release_notifications(false),
        )
    });
}

//! The whole conformance suite against a local Redis Cluster (3 masters, 3
//! replicas) started once for this test binary. Each case's backend lives
//! in a random key namespace, deleted on every master with the backend.

//!
//! The backend opens its connection to a master at the first step there,
//! and a connection is driven by the runtime that opened it. Cases that
//! stall one node's runtime on purpose (`o6_stalled_holder_is_told_lost`)
//! would then stall every node sharing that connection until a step
//! timeout drops it, so each case's backend first lists its (empty)
//! namespace, which opens a connection to every master on the case's own
//! runtime, as a long-running service's backend has.
//!
//! The cases' ttls are at least 1 s ([`lock_conformance::with_min_ttl`]),
//! as on a single node (see `conformance.rs`): 400 ms leaves a loaded
//! machine's extension too little time.

use lock_core::LockAdmin;
use lock_redis::testing::{shared_cluster, ScratchClusterBackend};
use lock_redis::RedisConfig;

/// The cases' smallest ttl (see the module's text).
const MIN_TTL: std::time::Duration = std::time::Duration::from_secs(1);

async fn warm(config: RedisConfig) -> ScratchClusterBackend {
    let backend = ScratchClusterBackend::new(&shared_cluster().urls(), config);
    let listed = backend.list_locks("").await.expect("every master answers");
    assert!(listed.is_empty(), "a fresh namespace: {listed:?}");
    backend
}

mod with_notifications {
    use super::*;

    lock_conformance::conformance_tests!(lock_conformance::with_min_ttl(MIN_TTL, || warm(
        RedisConfig::default()
    )));
}

/// The driver's fallback: waiters poll on their retry timer.
mod without_notifications {
    use super::*;

    lock_conformance::conformance_tests!(lock_conformance::with_min_ttl(MIN_TTL, || warm(
        RedisConfig::default().release_notifications(false)
    )));
}

//! The runtime that drives every backend's connections, whichever runtime
//! the caller of a step runs on: lock-core's background runtime.
//!
//! The `redis` crate spawns a connection's driver task (the one that
//! writes the requests and reads the answers of a multiplexed or pub/sub
//! connection) on the runtime current where the connection is made, and
//! registers its socket with that runtime's reactor. A backend shared by
//! two runtimes would then depend on the one that made each connection:
//! while that runtime's threads are busy every step on the connection
//! waits, and once it is dropped the connection is dead. So a backend
//! makes its connections, and runs its background tasks (the release
//! subscription, the Cluster's slot map reads), on the process's
//! background runtime instead ([`lock_core::background`]).

pub(crate) use lock_core::Background as Driver;

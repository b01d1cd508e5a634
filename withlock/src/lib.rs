#![doc = include_str!("../README.md")]

// The driver's API (`Locker`, `LockConfig`, `LockError`, the admin API, the
// backend trait, …): the same list every backend crate re-exports.
lock_core::reexport_core!();

/// The in-memory backend's crate (`lock-memory`).
#[cfg(feature = "memory")]
#[doc(inline)]
pub use lock_memory::{self as memory, MemoryBackend};

/// The PostgreSQL backend's crate (`lock-postgres`), with its `sqlx`.
#[cfg(feature = "postgres")]
#[doc(inline)]
pub use lock_postgres::{self as postgres, PostgresBackend, PostgresConfig};

/// The Redis backends' crate (`lock-redis`), with its `redis` and
/// `deadpool_redis`.
#[cfg(feature = "redis")]
#[doc(inline)]
pub use lock_redis::{
    self as redis, RedisBackend, RedisClusterBackend, RedisConfig, RedisSentinelBackend,
};

/// The etcd backend's crate (`lock-etcd`), with its `etcd_client`.
#[cfg(feature = "etcd")]
#[doc(inline)]
pub use lock_etcd::{self as etcd, EtcdBackend, EtcdConfig};

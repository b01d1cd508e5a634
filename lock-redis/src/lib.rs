//! `RedisBackend`: the primary withlock backend, on Redis `SET NX PX`.
//!
//! # Setup
//!
//! ```no_run
//! use lock_core::Locker;
//! use lock_redis::RedisBackend;
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let backend = RedisBackend::from_url("redis://127.0.0.1:6379")?;
//! let locker = Locker::new(backend);
//! let token = locker
//!     .with_lock("nightly:import", |ctx| async move { ctx.fencing_token() })
//!     .await?;
//! println!("ran with fencing token {token}");
//! # Ok(()) }
//! ```
//!
//! ## Reusing your pool
//!
//! The steps run on a [`deadpool_redis::Pool`]; pass yours to share it
//! with the rest of the application. The backend takes one multiplexed
//! connection from the pool and shares it between all its steps (a pool
//! checkout costs a `PING` round trip each time); after a connection error
//! or a timeout it takes a fresh one from the pool. The `redis::Client` opens
//! the backend's one pub/sub connection and should point at the same
//! server. Both crates are re-exported, so versions match.
//!
//! ```no_run
//! use lock_redis::{deadpool_redis, redis, RedisBackend, RedisConfig};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let url = "redis://127.0.0.1:6379";
//! let pool = deadpool_redis::Config::from_url(url)
//!     .create_pool(Some(deadpool_redis::Runtime::Tokio1))?;
//! let client = redis::Client::open(url)?;
//! let backend = RedisBackend::with_config(pool, client, RedisConfig::default().prefix("locks:"))?;
//! # let _ = backend; Ok(()) }
//! ```
//!
//! Nothing connects while the backend is made: an unreachable server or a
//! wrong password shows at the first call, as `LockError::NotAcquired` whose
//! source is the Redis error. `Debug` of the backend never shows a password.
//!
//! # Configuration
//!
//! | [`RedisConfig`] field | default | what |
//! |---|---|---|
//! | `prefix` | `""` | put before every lock key and the channel name |
//! | `step_timeout` | 2 s | bound on each round trip, pool checkout included (error kind `Timeout`) |
//! | `release_notifications` | `true` | wake waiters over pub/sub; off: waiters poll on `retry_delay` |
//! | `max_extend_batch` | 500 | leases per `extend_many` pipeline (one round trip) |
//! | `health_check_interval` | 5 s | `PING` on the subscription connection, to notice a hung one |
//! | `max_reconnect_delay` | 2 s | cap of the subscription's reconnect backoff (from 50 ms, doubling) |
//! | `durability` | none | `WAIT` for this many replicas after each acquisition; fewer in time: released, attempt failed |
//!
//! # Wire format
//!
//! | what | Redis key or channel | value |
//! |---|---|---|
//! | the lock of `key` | `<prefix><key>` (exactly `key` by default) | `<node id>/<32 hex>`, with a `PX` expiry |
//! | its fencing counter | `{T}:withlock-fence:<prefix><key>` (see below) | an integer, no expiry |
//! | releases | channel `<prefix>withlock:released` | message: the released Redis key |
//!
//! Each step is one Lua script, in `lua/` in this crate, run by `EVALSHA`
//! and loaded again after `NOSCRIPT` (a restarted server, `SCRIPT FLUSH`):
//!
//! - acquire: `SET key token NX PX ttl`; if that took the key, the fencing
//!   token `max(counter + 1, TIME in µs)` is drawn and stored in the counter;
//! - extend: `PEXPIRE key ttl` only if `GET key` is the token (a missing key
//!   is *expired*, another value *taken*); never re-creates the key;
//! - release: `DEL key` only if `GET key` is the token, then `PUBLISH` of the
//!   key on the channel.
//!
//! This is the wire format of other Redis lock clients (a random value set
//! with `SET NX PX`, compare-and-delete to release): a process using one of
//! them on the same key is excluded, in both directions.
//!
//! ## The fencing counter
//!
//! One small integer key per lock key ever used, which never expires. Since
//! each token is at least the server's clock in microseconds, losing the
//! counter (an empty restart, a flush, eviction, a failover, a deletion)
//! never makes tokens go back, as long as the server's clock does not step
//! back by more than the counter's lead over it. Its name,
//! `{T}:withlock-fence:<redis key>`, puts it in the lock key's Redis Cluster
//! hash slot whatever braces the key has ([`slot::fence_key`]): `T` is the
//! key's hash tag if it has one, else the whole key if it has no `}`, else
//! the smallest non-negative integer (in decimal) with the key's slot.
//!
//! # Redis Cluster
//!
//! Every script touches the keys of one hash slot only (the lock key and its
//! counter), so the scripts are valid on a Redis Cluster and through proxies
//! that route by slot. [`RedisClusterBackend`] runs them on a real cluster
//! (Redis 7.0 or later) through the `redis` crate's async cluster
//! connection: each script on the master of its key's slot (following
//! `MOVED` / `ASK`, one attempt per step otherwise), `extend_many` as one
//! pipeline per master, and releases published with `SPUBLISH` on one shard
//! channel per slot, heard with `SSUBSCRIBE` (RESP3 push) and subscribed
//! again when a slot moves or a node fails. Same keys, values and counters
//! as [`RedisBackend`].
//!
//! ```no_run
//! use lock_redis::{Locker, RedisClusterBackend};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let backend = RedisClusterBackend::connect(["redis://10.0.0.1:7000"]).await?;
//! let token = Locker::new(backend)
//!     .with_lock("nightly:import", |ctx| async move { ctx.fencing_token() })
//!     .await?;
//! # let _ = token; Ok(()) }
//! ```
//!
//! [`RedisBackend`] itself talks to one endpoint; its releases use classic
//! `PUBLISH`, which a cluster broadcasts to every node.
//!
//! # Sentinel
//!
//! [`RedisSentinelBackend`] runs the steps of [`RedisBackend`] on the
//! primary that Sentinel names for a master name, and follows failovers: a
//! connection that breaks or answers `READONLY` (a demoted primary still
//! answers `PING`) is dropped and the Sentinels are asked again.
//!
//! # Failover
//!
//! Redis replication is asynchronous. If the primary fails and a replica
//! that missed the latest writes is promoted, a lock taken or extended just
//! before may be gone, and another node can take it while its first holder
//! still runs: Redis alone cannot rule this out. The defences are:
//!
//! - the opt-in [`Durability`] setting ([`RedisConfig::durability`]): after
//!   each acquisition, `WAIT` for that many replicas, and count the attempt
//!   as failed (releasing the lock) when fewer acknowledged in time;
//! - fencing tokens: pass `ctx.fencing_token()` to the store you protect
//!   and have it refuse writes with a token lower than one it has seen
//!   (tokens are drawn from the server clock, so they keep increasing
//!   across a failover to a replica that lost the counter);
//! - loss detection: the next extension (every `ttl / 3`) finds the key
//!   missing or someone else's and the call returns `LockError::Lost`, and
//!   `ctx.is_lost()` / `ctx.lost()` tell the callback.
//!
//! # Outages
//!
//! After the server restarts, the same `Locker` works again: pool
//! connections are recycled, scripts reloaded, the subscription reconnects
//! (with backoff) and wakes every waiter, since it may have missed releases.
//! During an outage, acquisitions fail with `NotAcquired` carrying the Redis
//! error, and held locks are lost with the Redis error as cause once their
//! validity runs out.
//!
//! # Features
//!
//! | feature | what |
//! |---|---|
//! | `testing` | the `testing` module: a `redis-server` of a test's own to kill, restart, pause and cut, a local Redis Cluster and a Sentinel group to fail over, and key namespaces that clean up after themselves; for tests, never needed in a service |
//! | `testcontainers` | `testing`, and it can start Redis in Docker when no `redis-server` can be started |

mod admin;
mod backend;
mod batch;
mod cluster;
mod cluster_check;
mod cluster_subscription;
mod config;
mod durability;
mod sentinel;
pub mod slot;
mod subscription;
#[cfg(feature = "testing")]
pub mod testing;

pub use admin::LockInfo;
pub use backend::{RedisBackend, CHANNEL};
pub use cluster::RedisClusterBackend;
pub use config::{RedisConfig, SetupError};
pub use deadpool_redis;
pub use durability::Durability;
pub use redis;
pub use sentinel::RedisSentinelBackend;

// `lock_core` itself and everything a user needs from it (one list for
// every backend crate), so that this one dependency is enough.
lock_core::reexport_core!();

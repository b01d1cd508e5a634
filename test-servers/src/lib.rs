//! The servers the withlock workspace's tests start, in one place, with
//! the parts they share written once (`process`): a free loopback port
//! each, a scratch directory each (`withlock-<kind>.<pid>.<random>`, the
//! leftovers of a killed run removed by the next), a watchdog that kills a
//! server when the test process dies without dropping it, and start, stop,
//! kill, pause (SIGSTOP) and resume (SIGCONT).
//!
//! | feature | module |
//! |---|---|
//! | `redis` | `redis`: `server_url`, `RedisServer`, `RedisCluster`, `SentinelGroup` |
//! | `tls` | TLS Redis servers (`RedisServer::start_tls`…) whose `client` speaks TLS |
//! | `postgres` | `postgres`: `database_url`, `TestServer` (`initdb` + `pg_ctl`) |
//! | `etcd` | `etcd`: `EtcdCluster`, `shared_server` |
//!
//! Not published: the backend crates take it as a path-only
//! dev-dependency, and it depends on none of them, so a test build holds
//! one copy of each. What a user's own tests need (key namespaces, test
//! schemas, servers in Docker) stays in the backend crates' `testing` and
//! `testcontainers` features; the helpers that need a backend type (a
//! backend in a namespace, an etcd config with short timeouts) are there
//! or in the tests, and take the URLs and endpoints these servers give.

#[cfg(feature = "etcd")]
pub mod etcd;
#[cfg(feature = "postgres")]
pub mod postgres;
// Each feature uses its part; with none, nothing is used.
#[cfg_attr(
    not(all(feature = "redis", feature = "postgres", feature = "etcd")),
    allow(dead_code)
)]
mod process;
#[cfg(feature = "redis")]
pub mod redis;

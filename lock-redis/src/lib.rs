#![doc = include_str!("../README.md")]

mod admin;
mod backend;
mod batch;
mod cluster;
mod cluster_admin;
mod cluster_batch;
mod cluster_check;
mod cluster_nodes;
mod cluster_subscription;
mod config;
mod durability;
mod plumbing;
mod same_server;
mod sentinel;
mod sentinel_watch;
mod single_node;
pub mod slot;
mod subscription;
#[cfg(feature = "testing")]
pub mod testing;
mod tls;

pub use backend::{RedisBackend, CHANNEL, GRANT_CHANNEL};
pub use cluster::RedisClusterBackend;
pub use cluster_subscription::SubscriptionStats;
pub use config::{RedisConfig, SetupError};
pub use deadpool_redis;
pub use durability::Durability;
pub use plumbing::errors::ServerReply;
pub use redis;
pub use sentinel::{RedisSentinelBackend, SentinelConfig};

// `lock_core` itself and everything a user needs from it (one list for
// every backend crate), so that this one dependency is enough.
lock_core::reexport_core!();

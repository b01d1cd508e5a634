#![doc = include_str!("../README.md")]

mod admin;
mod backend;
mod config;
mod endpoints;
mod error;
mod keepalive;
mod layout;
mod queue;
mod watch;

pub use backend::{EtcdBackend, MAX_EXTEND_BATCH};
pub use config::EtcdConfig;
pub use error::SetupError;

/// Re-exported so that users build TLS options and read errors with the
/// same etcd-client version.
pub use etcd_client;

// `lock_core` itself and everything a user needs from it (one list for
// every backend crate), so that this one dependency is enough.
lock_core::reexport_core!();

#![doc = include_str!("../README.md")]

mod admin;
mod backend;
mod config;
mod error;
mod listener;
mod sql;
#[cfg(feature = "testing")]
pub mod testing;

pub use backend::{PostgresBackend, MAX_EXTEND_BATCH};
pub use config::{quote_identifier, PostgresConfig, MAX_IDENTIFIER_LEN};
pub use error::SetupError;
pub use sql::KEPT_PREFIX;

/// Re-exported so that users build their pool with the same sqlx version.
pub use sqlx;

// `lock_core` itself and everything a user needs from it (one list for
// every backend crate), so that this one dependency is enough.
lock_core::reexport_core!();

//! The core of withlock: run a piece of code while holding a lock across
//! every node that shares a lock backend.
//!
//! - [`LockBackend`] is the small set of atomic steps a store implements
//!   (`lock-redis`, `lock-postgres`, `lock-memory`, or your own).
//! - [`Locker`] is one node. [`Locker::with_lock`] owns everything with a
//!   timer or a policy: retries, waiting with release notifications,
//!   background extension, fencing tokens, lost-lock racing, reentrancy and
//!   shutdown.
//! - [`LockHandle`] is the low-level acquire / renew / release handle, and
//!   [`Mutex`] the deprecated lock/unlock surface.
//!
//! ```
//! use std::time::Duration;
//! use lock_core::{LockConfig, LockError, Locker};
//! use lock_memory::MemoryBackend;
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), LockError> {
//! let locker = Locker::new(MemoryBackend::new());
//!
//! // Refuse a task already running somewhere: one attempt only.
//! let once = LockConfig::default().retry_attempts(0);
//! match locker.with_lock_config("unique-task", &once, |_| async { Ok::<_, std::io::Error>(()) }).await {
//!     Ok(Ok(())) => println!("done"),
//!     Ok(Err(task_error)) => println!("the task failed: {task_error}"),
//!     Err(busy) if busy.is_busy() => println!("that task is already ongoing"),
//!     Err(other) => return Err(other), // the backend failed, or bad input
//! }
//! # Ok(()) }
//! ```
//!
//! The contract each behaviour follows is in the workspace README; the
//! `lock-conformance` crate proves it for every backend.
//!
//! # Metrics
//!
//! With the `metrics` feature the driver records on the
//! [`metrics`](https://docs.rs/metrics) facade, to the recorder the
//! application installs (nothing is recorded without one):
//! `withlock_acquire_seconds`, `withlock_held_seconds`,
//! `withlock_extensions_total`, `withlock_lost_total`,
//! `withlock_release_notification_lag_seconds` and
//! `withlock_backend_errors_total`, each labelled with the backend's
//! [`Capabilities::name`]. The key is a label only with
//! [`LockerOptions::metrics_key_label`]. The workspace README lists each
//! metric's labels and meaning.

mod acquire;
mod admin;
mod backend;
mod config;
mod context;
mod error;
mod extender;
mod gate;
mod handle;
mod held;
mod locker;
mod metrics;
mod mutex;
mod notify;
mod reexport;
mod registry;
mod release;
mod shutdown;
mod task;

pub use admin::{AdminError, LockAdmin, LockInfo};
pub use backend::{
    AcquireOutcome, Capabilities, DynLockBackend, ExtendOutcome, ExtendRequest, Lease, LockBackend,
    OwnerToken, ReleaseOutcome, MAX_KEY_LEN,
};
pub use config::{LockConfig, LockerOptions, RetryAttempts, MAX_RETRY_DELAY, MAX_TTL, MIN_TTL};
pub use context::LockContext;
pub use error::{BackendError, BackendErrorKind, InvalidInput, LockError, LossCause};
pub use handle::LockHandle;
pub use locker::Locker;
#[allow(deprecated)]
pub use mutex::{Mutex, MutexConfig};
pub use notify::{ReleaseHub, ReleaseWatch};
#[doc(hidden)]
pub use reexport::__reexported;
pub use shutdown::ShutdownReport;

/// Re-exported so that backend crates implement the trait with the same
/// macro version.
pub use async_trait::async_trait;

/// What [`forward_lock_backend!`] names from its users' crates.
#[doc(hidden)]
pub mod __macro_support {
    pub use tokio::time::Instant;
}

#![doc = include_str!("../README.md")]

mod admin;
mod backend;
pub mod background;
mod config;
mod context;
mod error;
mod extender;
mod gate;
mod held;
mod hold;
mod locker;
mod metrics;
mod mutex;
mod notify;
mod redact;
mod reexport;
mod registry;
mod release;
mod task;

pub use admin::{AdminError, LockAdmin, LockInfo, LockList, Unreachable};
pub use backend::{
    batch_results, AcquireOutcome, Capabilities, DynLockBackend, ExtendOutcome, ExtendRequest,
    Hold, Lease, LockBackend, OwnerToken, QueueTerms, ReleaseOutcome, EXPIRY_MARGIN, MAX_KEY_LEN,
};
pub use background::Background;
pub use config::{LockConfig, LockerOptions, RetryAttempts, MAX_RETRY_DELAY, MAX_TTL, MIN_TTL};
pub use context::LockContext;
pub use error::{BackendError, BackendErrorKind, ErrorChain, InvalidInput, LockError, LossCause};
pub use locker::handle::LockHandle;
pub use locker::shutdown::ShutdownReport;
pub use locker::Locker;
#[allow(deprecated)]
pub use mutex::{Mutex, MutexConfig};
pub use notify::{Grant, ReleaseHub, ReleaseWatch};
#[doc(hidden)]
pub use reexport::__reexported;

/// Re-exported so that backend crates implement the trait with the same
/// macro version.
pub use async_trait::async_trait;

/// What [`forward_lock_backend!`] names from its users' crates.
#[doc(hidden)]
pub mod __macro_support {
    pub use tokio::time::Instant;
}

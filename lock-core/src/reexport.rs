//! The one list of `lock-core` items that every backend crate (and the
//! `withlock` facade) re-exports, so that a user depends on one crate only
//! and the list cannot drift between crates.

/// What [`reexport_core!`](crate::reexport_core) re-exports: everything a
/// user of a backend needs, the admin API, and the trait a backend author
/// implements. A glob of this module is what the macro expands to, so a
/// crate's own item of the same name (say, its own `LockInfo`) shadows the
/// core one instead of clashing with it.
#[doc(hidden)]
pub mod __reexported {
    pub use crate::{
        AdminError, BackendError, BackendErrorKind, DynLockBackend, InvalidInput, LockAdmin,
        LockBackend, LockConfig, LockContext, LockError, LockHandle, LockInfo, LockList, Locker,
        LockerOptions, LossCause, OwnerToken, RetryAttempts, ShutdownReport, Unreachable,
    };
    #[allow(deprecated)]
    pub use crate::{Mutex, MutexConfig};
}

/// Re-exports, in the crate that calls it, `lock-core` itself (as
/// `lock_core`) and everything a user of a backend needs from it:
/// [`Locker`](crate::Locker), [`LockConfig`](crate::LockConfig),
/// [`LockerOptions`](crate::LockerOptions),
/// [`RetryAttempts`](crate::RetryAttempts),
/// [`LockContext`](crate::LockContext), [`LockHandle`](crate::LockHandle),
/// [`LockError`](crate::LockError), [`LossCause`](crate::LossCause),
/// [`BackendError`](crate::BackendError),
/// [`BackendErrorKind`](crate::BackendErrorKind),
/// [`InvalidInput`](crate::InvalidInput),
/// [`ShutdownReport`](crate::ShutdownReport),
/// [`OwnerToken`](crate::OwnerToken) (which [`LockInfo`](crate::LockInfo)
/// carries), the admin API ([`LockAdmin`](crate::LockAdmin),
/// [`LockInfo`](crate::LockInfo), [`LockList`](crate::LockList),
/// [`Unreachable`](crate::Unreachable), [`AdminError`](crate::AdminError)), the
/// backend trait ([`LockBackend`](crate::LockBackend),
/// [`DynLockBackend`](crate::DynLockBackend)) and the deprecated
/// [`Mutex`](crate::Mutex) / [`MutexConfig`](crate::MutexConfig).
///
/// Every backend crate calls it once at its root, so that one dependency is
/// enough and the versions always match:
///
/// ```
/// // At the root of a backend crate; here a module stands for that crate.
/// mod my_backend {
///     lock_core::reexport_core!();
/// }
/// # fn main() {
/// let _: Option<my_backend::Locker> = None;
/// let _: Option<my_backend::OwnerToken> = None;
/// let _: Option<&dyn my_backend::lock_core::LockBackend> = None;
/// # }
/// ```
///
/// The items come in through a glob, so an item of the calling crate with
/// the same name wins over the core one.
#[macro_export]
macro_rules! reexport_core {
    () => {
        /// The core crate, for wrappers and backend authors.
        pub use $crate as lock_core;
        /// Everything a user of this backend needs from `lock-core`,
        /// re-exported so that this one dependency is enough and the
        /// versions always match.
        #[doc(inline)]
        pub use $crate::__reexported::*;
    };
}

//! The operator's view of a lock store: which locks are held, one key's
//! state, and a forced release \[D1, D2\]. Every backend implements
//! [`LockAdmin`], and the `withlock` command uses nothing else, so every
//! backend and deployment has the same operator commands.

use std::time::Duration;

use async_trait::async_trait;

use crate::backend::OwnerToken;
use crate::error::BackendError;

/// What a store says about one key, read in one step.
///
/// Built by backends with [`LockInfo::free`] or [`LockInfo::held`] and the
/// `with_*` setters.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct LockInfo {
    /// The key, as given to `with_lock` (without a backend's prefix).
    pub key: String,
    /// The holder's owner token, normally `<node id>/<32 hex>`; a key another
    /// client keeps in a form withlock does not write shows as its type in
    /// angle brackets (`<hash>`). `None` when the key is free.
    pub owner: Option<OwnerToken>,
    /// How long the lock lives without an extension; `None` when the key is
    /// free, or when its value was set without an expiry (not by withlock).
    pub ttl: Option<Duration>,
    /// The last fencing token drawn for the key; `None` when the store has
    /// no record of one.
    pub fencing_token: Option<u64>,
    /// How long the current holder has held the key, where the store
    /// records when it was taken (PostgreSQL's `locked_at`); `None`
    /// elsewhere and when free.
    pub held_for: Option<Duration>,
    /// When the key is free: its last holder, where the store still has it
    /// (PostgreSQL keeps the row); `None` elsewhere.
    pub last_owner: Option<OwnerToken>,
}

impl LockInfo {
    /// A free key.
    pub fn free(key: impl Into<String>) -> Self {
        Self {
            key: key.into(),
            owner: None,
            ttl: None,
            fencing_token: None,
            held_for: None,
            last_owner: None,
        }
    }

    /// A key held by `owner`, `ttl` left (`None`: no expiry).
    pub fn held(key: impl Into<String>, owner: OwnerToken, ttl: Option<Duration>) -> Self {
        Self {
            owner: Some(owner),
            ttl,
            ..Self::free(key)
        }
    }

    /// Sets [`LockInfo::fencing_token`].
    #[must_use]
    pub fn with_fencing_token(mut self, fencing_token: Option<u64>) -> Self {
        self.fencing_token = fencing_token;
        self
    }

    /// Sets [`LockInfo::held_for`].
    #[must_use]
    pub fn with_held_for(mut self, held_for: Option<Duration>) -> Self {
        self.held_for = held_for;
        self
    }

    /// Sets [`LockInfo::last_owner`].
    #[must_use]
    pub fn with_last_owner(mut self, last_owner: Option<OwnerToken>) -> Self {
        self.last_owner = last_owner;
        self
    }

    /// Whether the key is held now.
    pub fn is_held(&self) -> bool {
        self.owner.is_some()
    }

    /// The node id part of the holder's owner token.
    pub fn node_id(&self) -> Option<&str> {
        self.owner.as_ref().map(OwnerToken::node_id)
    }

    /// Whether the holder's value is in withlock's owner-token format
    /// (`<node id>/<32 hex>`), as every withlock node and every client of
    /// the same wire format writes it.
    pub fn is_withlock_lock(&self) -> bool {
        self.owner
            .as_ref()
            .is_some_and(|owner| OwnerToken::is_well_formed(owner.as_str()))
    }
}

/// Why a forced release refused or failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AdminError {
    /// The key holds something that is not a lock of withlock's format (a
    /// list, a hash, a string without an owner token, a value without an
    /// expiry): it was left untouched \[D2\].
    #[error("refused: key {key:?} is not a withlock lock ({found}); nothing was changed")]
    NotALock {
        /// The key asked for.
        key: String,
        /// What the key holds, in a few words.
        found: String,
    },
    /// The store failed.
    #[error(transparent)]
    Backend(#[from] BackendError),
}

/// The operator's functions of a lock store \[D1\]: list, inspect and force
/// release. For tools such as the `withlock` command; the lock steps never
/// use them.
///
/// # Contract
///
/// - `list_locks` and `inspect` only read. `list_locks` gives the locks
///   held now whose key starts with the prefix, ordered by key.
/// - `force_release` frees the key whoever holds it, but only when it is a
///   lock of withlock's format (a value in the owner-token format, with an
///   expiry, where the store keeps one); anything else is refused with
///   [`AdminError::NotALock`] and left untouched \[D2\]. It announces the
///   release on the backend's release notifications where it has them, so
///   that the holder learns of it at once \[L5\] and waiters get the key.
///   It returns what it freed, `None` when the key was free.
///
/// # Cancel safety
///
/// Reads are read only: dropping their futures changes nothing. A dropped
/// `force_release` may or may not have freed the key.
#[async_trait]
pub trait LockAdmin: Send + Sync {
    /// The locks held now whose key starts with `prefix`, ordered by key.
    async fn list_locks(&self, prefix: &str) -> Result<Vec<LockInfo>, BackendError>;

    /// The state of `key`.
    async fn inspect(&self, key: &str) -> Result<LockInfo, BackendError>;

    /// Frees `key` whoever holds it, if it is a withlock lock; gives what it
    /// freed, `None` when the key was free.
    async fn force_release(&self, key: &str) -> Result<Option<LockInfo>, AdminError>;
}

/// Implements [`LockAdmin`] for a type by forwarding every function to an
/// admin it holds, as [`forward_lock_backend!`](crate::forward_lock_backend)
/// does for the lock steps: for wrappers of a backend (a test namespace, a
/// deployment mode) whose store is the wrapped one's.
///
/// ```
/// use lock_memory::MemoryBackend;
///
/// #[derive(Debug)]
/// struct Scratch {
///     backend: MemoryBackend,
/// }
///
/// lock_core::forward_lock_backend!(Scratch => backend);
/// lock_core::forward_lock_admin!(Scratch => backend);
/// ```
#[macro_export]
macro_rules! forward_lock_admin {
    ($ty:ty => $field:ident) => {
        $crate::forward_lock_admin!(@impl [] $ty, this => &this.$field);
    };
    (@impl [$($generics:tt)*] $ty:ty, $this:ident => $inner:expr) => {
        #[$crate::async_trait]
        impl<$($generics)*> $crate::LockAdmin for $ty {
            async fn list_locks(
                &self,
                prefix: &str,
            ) -> ::std::result::Result<::std::vec::Vec<$crate::LockInfo>, $crate::BackendError> {
                let $this = self;
                $crate::LockAdmin::list_locks($inner, prefix).await
            }

            async fn inspect(
                &self,
                key: &str,
            ) -> ::std::result::Result<$crate::LockInfo, $crate::BackendError> {
                let $this = self;
                $crate::LockAdmin::inspect($inner, key).await
            }

            async fn force_release(
                &self,
                key: &str,
            ) -> ::std::result::Result<::std::option::Option<$crate::LockInfo>, $crate::AdminError>
            {
                let $this = self;
                $crate::LockAdmin::force_release($inner, key).await
            }
        }
    };
}

forward_lock_admin!(@impl [T: LockAdmin + ?Sized] std::sync::Arc<T>, this => &**this);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_an_owner_token_of_withlock_format_is_a_withlock_lock() {
        let ours = LockInfo::held("k", OwnerToken::new("node-a"), None);
        assert!(ours.is_withlock_lock());
        let read = LockInfo::held(
            "k",
            OwnerToken::from_value(ours.owner.clone().unwrap().as_str()),
            None,
        );
        assert!(read.is_withlock_lock());
        for other in [
            "<list>",
            "plain",
            "node/abc",
            "n/0123456789abcdef0123456789abcdeg",
            "/0123456789abcdef0123456789abcdef",
        ] {
            let info = LockInfo::held("k", OwnerToken::from_value(other), None);
            assert!(!info.is_withlock_lock(), "{other:?}");
        }
        assert!(!LockInfo::free("k").is_withlock_lock());
    }
}

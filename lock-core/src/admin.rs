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
    /// When the holder's run has ended and the key is kept to the end of
    /// its minimum hold \[H7\] ([`hold_at_least`](crate::LockConfig::hold_at_least)):
    /// how long until that end, when the key expires and anyone may take
    /// it. `None` while its holder runs (and extends it), when the key is
    /// free, and for a lock of another client. Every backend of the
    /// workspace records the hold where its hold step runs (each one's
    /// README says where); a backend that records nothing shows `None`,
    /// as for a running job.
    pub minimum_hold_left: Option<Duration>,
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
            minimum_hold_left: None,
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

    /// Sets [`LockInfo::minimum_hold_left`].
    #[must_use]
    pub fn with_minimum_hold_left(mut self, left: Option<Duration>) -> Self {
        self.minimum_hold_left = left;
        self
    }

    /// Whether the key is held now.
    pub fn is_held(&self) -> bool {
        self.owner.is_some()
    }

    /// Whether the key is held only by its minimum hold \[H7\]: its
    /// holder's run has ended, and the key is left to expire when the hold
    /// ends ([`LockInfo::minimum_hold_left`] from now).
    pub fn is_kept(&self) -> bool {
        self.is_held() && self.minimum_hold_left.is_some()
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

/// What a listing found: the locks held in every part of the store that
/// answered, and the parts that did not, for
/// [`LockAdmin::list_locks_partial`].
#[derive(Clone, Debug, Default)]
#[non_exhaustive]
pub struct LockList {
    /// The locks held now, ordered by key, of the parts that answered.
    pub locks: Vec<LockInfo>,
    /// The parts of the store whose locks are missing from
    /// [`LockList::locks`] because they did not answer; empty when the
    /// listing is whole.
    pub unreachable: Vec<Unreachable>,
}

impl LockList {
    /// A whole listing: every part of the store answered.
    pub fn whole(locks: Vec<LockInfo>) -> Self {
        Self {
            locks,
            unreachable: Vec::new(),
        }
    }

    /// A listing of the parts that answered, `unreachable` naming the others.
    pub fn partial(locks: Vec<LockInfo>, unreachable: Vec<Unreachable>) -> Self {
        Self { locks, unreachable }
    }

    /// Whether every part of the store answered.
    pub fn is_whole(&self) -> bool {
        self.unreachable.is_empty()
    }
}

/// A part of the store that did not answer a listing (a Redis Cluster
/// master), and why.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct Unreachable {
    /// The part, as the store names it (a Cluster master's `host:port`).
    pub node: String,
    /// What it answered, or the timeout it ran into.
    pub error: BackendError,
}

impl Unreachable {
    /// `node` did not answer, with `error`.
    pub fn new(node: impl Into<String>, error: BackendError) -> Self {
        Self {
            node: node.into(),
            error,
        }
    }
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
/// - `list_locks_partial` is `list_locks` for a store of several parts
///   that answer on their own (a Redis Cluster's masters): where some part
///   fails or does not answer within the backend's step timeout, it gives
///   the locks of the parts that answered and names the others
///   ([`LockList::unreachable`]), where `list_locks` fails as a whole. Its
///   default calls `list_locks` and gives a whole list, which is right for
///   a store that answers as one; a backend of several parts overrides it.
/// - A lock whose holder's run ended before its minimum hold \[H7\] is
///   held until that hold ends; `list_locks` and `inspect` show it held,
///   with [`LockInfo::minimum_hold_left`], where the store records the
///   hold.
///
/// # Cancel safety
///
/// Reads are read only: dropping their futures changes nothing. A dropped
/// `force_release` may or may not have freed the key.
#[async_trait]
pub trait LockAdmin: Send + Sync {
    /// The locks held now whose key starts with `prefix`, ordered by key.
    async fn list_locks(&self, prefix: &str) -> Result<Vec<LockInfo>, BackendError>;

    /// The locks held now whose key starts with `prefix`, ordered by key,
    /// from every part of the store that answers, naming those that do not.
    /// Fails as a whole only when nothing could be listed (the store's
    /// layout could not be read, or no part answered). Default: a whole
    /// [`list_locks`](Self::list_locks).
    async fn list_locks_partial(&self, prefix: &str) -> Result<LockList, BackendError> {
        self.list_locks(prefix).await.map(LockList::whole)
    }

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

            async fn list_locks_partial(
                &self,
                prefix: &str,
            ) -> ::std::result::Result<$crate::LockList, $crate::BackendError> {
                let $this = self;
                $crate::LockAdmin::list_locks_partial($inner, prefix).await
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

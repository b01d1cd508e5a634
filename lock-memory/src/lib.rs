//! `MemoryBackend`: a correct single-process lock backend for withlock.
//!
//! For one process, and for users' unit tests: its expiry follows tokio's
//! clock, so a test under `tokio::time::pause()` can jump past a ttl at once.
//!
//! ```
//! use std::time::Duration;
//! use lock_memory::{LockConfig, Locker};
//! use lock_memory::MemoryBackend;
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), lock_memory::LockError> {
//! let backend = MemoryBackend::new();
//! // Two lockers on one backend are two nodes.
//! let (a, b) = (Locker::new(backend.clone()), Locker::new(backend.clone()));
//! a.with_lock("nightly:import", |_| async {}).await?;
//! b.with_lock("nightly:import", |_| async {}).await?;
//! assert_eq!(backend.held_keys(), 0);
//! # Ok(()) }
//! ```

use std::collections::HashMap;
use std::sync::{Arc, MutexGuard, PoisonError};
use std::time::Duration;

use lock_core::{
    async_trait, AcquireOutcome, Capabilities, ExtendOutcome, ExtendRequest, Lease, LockBackend,
    OwnerToken, ReleaseHub, ReleaseOutcome, ReleaseWatch,
};
use tokio::time::Instant;

/// The core crate, for wrappers and backend authors.
pub use lock_core;
/// Everything a user of this backend needs from `lock-core`, re-exported so
/// that this one dependency is enough and the versions always match.
pub use lock_core::{
    BackendError, BackendErrorKind, InvalidInput, LockConfig, LockContext, LockError, LockHandle,
    Locker, LockerOptions, LossCause, RetryAttempts, ShutdownReport,
};
#[allow(deprecated)]
pub use lock_core::{Mutex, MutexConfig};

/// A lock backend in this process's memory, with release notifications.
///
/// Cheap to clone; clones share the same locks. Fencing tokens come from one
/// counter for all keys, so they strictly increase per key while released
/// keys take no memory.
#[derive(Clone, Default)]
pub struct MemoryBackend {
    inner: Arc<Inner>,
}

#[derive(Default)]
struct Inner {
    state: std::sync::Mutex<State>,
    hub: ReleaseHub,
}

#[derive(Default)]
struct State {
    held: HashMap<Box<str>, Holder>,
    fence: u64,
}

struct Holder {
    owner: OwnerToken,
    expires_at: Instant,
}

impl MemoryBackend {
    /// An empty backend.
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.inner
            .state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// How many keys are held now (expired ones do not count).
    pub fn held_keys(&self) -> usize {
        let now = Instant::now();
        self.lock()
            .held
            .values()
            .filter(|h| h.expires_at > now)
            .count()
    }

    /// The owner token holding `key` now, if any.
    pub fn holder(&self, key: &str) -> Option<OwnerToken> {
        let now = Instant::now();
        self.lock()
            .held
            .get(key)
            .filter(|h| h.expires_at > now)
            .map(|h| h.owner.clone())
    }

    /// How long `key` stays held without an extension, if it is held.
    pub fn remaining_ttl(&self, key: &str) -> Option<Duration> {
        let now = Instant::now();
        self.lock()
            .held
            .get(key)
            .filter(|h| h.expires_at > now)
            .map(|h| h.expires_at - now)
    }

    fn extend_one(state: &mut State, lease: &Lease, ttl: Duration, now: Instant) -> ExtendOutcome {
        match state.held.get_mut(lease.key()) {
            Some(h) if h.expires_at <= now => ExtendOutcome::Expired,
            Some(h) if h.owner == *lease.owner() => {
                h.expires_at = now + ttl;
                ExtendOutcome::Extended
            }
            Some(_) => ExtendOutcome::Taken,
            None => ExtendOutcome::Expired,
        }
    }
}

impl std::fmt::Debug for MemoryBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryBackend")
            .field("held_keys", &self.held_keys())
            .finish()
    }
}

#[async_trait]
impl LockBackend for MemoryBackend {
    fn capabilities(&self) -> Capabilities {
        Capabilities::default()
            .with_name("memory")
            .with_release_notifications(true)
            .with_max_extend_batch(10_000)
    }

    async fn try_acquire(
        &self,
        key: &str,
        owner: &OwnerToken,
        ttl: Duration,
    ) -> Result<AcquireOutcome, BackendError> {
        let now = Instant::now();
        let mut state = self.lock();
        if state.held.get(key).is_some_and(|h| h.expires_at > now) {
            return Ok(AcquireOutcome::Busy);
        }
        state.fence += 1;
        let fencing_token = state.fence;
        let holder = Holder {
            owner: owner.clone(),
            expires_at: now + ttl,
        };
        match state.held.get_mut(key) {
            Some(slot) => *slot = holder,
            None => {
                state.held.insert(key.into(), holder);
            }
        }
        Ok(AcquireOutcome::Acquired { fencing_token })
    }

    async fn extend(&self, lease: &Lease, ttl: Duration) -> Result<ExtendOutcome, BackendError> {
        Ok(Self::extend_one(
            &mut self.lock(),
            lease,
            ttl,
            Instant::now(),
        ))
    }

    async fn extend_many(
        &self,
        requests: &[ExtendRequest],
    ) -> Result<Vec<ExtendOutcome>, BackendError> {
        let now = Instant::now();
        let mut state = self.lock();
        Ok(requests
            .iter()
            .map(|r| Self::extend_one(&mut state, &r.lease, r.ttl, now))
            .collect())
    }

    async fn release(&self, lease: &Lease) -> Result<ReleaseOutcome, BackendError> {
        let now = Instant::now();
        let mut state = self.lock();
        let outcome = match state.held.get(lease.key()) {
            Some(h) if h.owner == *lease.owner() && h.expires_at > now => ReleaseOutcome::Released,
            _ => ReleaseOutcome::NotHeld,
        };
        if state
            .held
            .get(lease.key())
            .is_some_and(|h| h.expires_at <= now || outcome == ReleaseOutcome::Released)
        {
            state.held.remove(lease.key());
        }
        drop(state);
        if outcome == ReleaseOutcome::Released {
            self.inner.hub.notify(lease.key());
        }
        Ok(outcome)
    }

    async fn watch_release(&self, key: &str) -> Result<ReleaseWatch, BackendError> {
        Ok(self.inner.hub.watch(key))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn expiry_follows_tokios_paused_clock() {
        let backend = MemoryBackend::new();
        let a = OwnerToken::new("a");
        let b = OwnerToken::new("b");
        let ttl = Duration::from_secs(30);
        assert!(matches!(
            backend.try_acquire("k", &a, ttl).await.unwrap(),
            AcquireOutcome::Acquired { .. }
        ));
        assert_eq!(
            backend.try_acquire("k", &b, ttl).await.unwrap(),
            AcquireOutcome::Busy
        );
        tokio::time::advance(ttl).await;
        assert_eq!(backend.held_keys(), 0);
        assert!(matches!(
            backend.try_acquire("k", &b, ttl).await.unwrap(),
            AcquireOutcome::Acquired { .. }
        ));
    }
}

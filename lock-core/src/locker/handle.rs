//! The low-level lock handle: acquire, renew and release by hand, as Ruby
//! Locker's "advanced usage" \[M1\].

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use crate::backend::{AcquireOutcome, ExtendOutcome, Lease, OwnerToken, ReleaseOutcome};
use crate::config::{validate_key, validate_ttl};
use crate::error::{BackendError, LockError, LossCause};
use crate::held::{HeldLock, Holder};
use crate::locker::Locker;
use crate::metrics::Step;
use crate::registry::{self, Ending};
use crate::task::{finish_even_if_dropped, never};

/// A lock taken and kept by hand: no retries, no background extension.
///
/// The caller renews it before its ttl runs out and releases it when done;
/// dropping a handle that holds its lock releases it in the background. It
/// excludes, and is excluded by, `with_lock` on the same key \[M2\].
///
/// ```
/// # use std::time::Duration;
/// # use lock_core::Locker;
/// # use lock_memory::MemoryBackend;
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), lock_core::LockError> {
/// let locker = Locker::new(MemoryBackend::new());
/// let mut lock = locker.handle("some-unique-key", Duration::from_secs(30))?;
/// assert!(lock.acquire().await?);  // obtained
/// // do something that doesn't take too long here
/// assert!(lock.renew().await?);    // renewed
/// assert!(lock.release().await?);  // released
/// # Ok(()) }
/// ```
pub struct LockHandle {
    locker: Locker,
    key: Arc<str>,
    ttl: Duration,
    held: Option<(u64, Arc<HeldLock>)>,
}

impl Locker {
    /// A handle on `key` whose acquisitions and renewals last `ttl`.
    ///
    /// # Errors
    ///
    /// [`LockError::InvalidInput`] for a bad key or ttl; nothing is touched.
    pub fn handle(&self, key: &str, ttl: Duration) -> Result<LockHandle, LockError> {
        let caps = self.backend().capabilities();
        validate_key(key, caps.max_key_len)?;
        validate_ttl(ttl)?;
        Ok(LockHandle {
            locker: self.clone(),
            key: key.into(),
            ttl: caps.effective_ttl(ttl),
            held: None,
        })
    }
}

impl LockHandle {
    /// One attempt to take the lock. `Ok(true)`: this handle holds it (a
    /// handle that already held it renews it instead). `Ok(false)`: someone
    /// else holds it.
    ///
    /// # Errors
    ///
    /// [`LockError::Backend`] when the attempt failed.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future leaves nothing held: a lock taken by an attempt
    /// whose answer arrives after the drop is released.
    pub async fn acquire(&mut self) -> Result<bool, LockError> {
        if self.held.is_some() {
            return self.renew().await;
        }
        let inner = self.locker.inner();
        if self.locker.is_shut_down() {
            return never().await;
        }
        let owner = OwnerToken::new(&inner.node_id);
        let sent_at = tokio::time::Instant::now();
        // Counted in flight until the lease is held or owed a release [S1].
        let (answer, at_once, in_flight) =
            inner.attempt(&self.key, &owner, self.ttl, sent_at).await;
        match answer {
            Ok(AcquireOutcome::Acquired { fencing_token }) => {
                let lease = Lease::new(Arc::clone(&self.key), owner, fencing_token);
                match inner
                    .hold(lease, self.ttl, sent_at, at_once, Holder::Handle, in_flight)
                    .await
                {
                    Ok(held) => {
                        self.held = Some(held);
                        Ok(true)
                    }
                    Err(late) => Err(self.backend_error(late)),
                }
            }
            Ok(AcquireOutcome::Busy { .. }) => Ok(false),
            Err(source) => Err(self.backend_error(source)),
        }
    }

    /// Resets the lock's expiry to the ttl from now. `Ok(false)`: this handle
    /// does not hold the lock (any more); it then forgets it.
    ///
    /// A handle acquired by an attempt answered after its validity ran out
    /// gives [`LockError::Backend`] from `acquire` instead, and holds nothing.
    ///
    /// # Errors
    ///
    /// [`LockError::Backend`] when the step failed; the lock may still be held.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future may or may not have renewed the lock.
    pub async fn renew(&mut self) -> Result<bool, LockError> {
        let Some((id, held)) = &self.held else {
            return Ok(false);
        };
        let id = *id;
        let sent_at = tokio::time::Instant::now();
        let answer = self.locker.backend().extend(&held.lease, self.ttl).await;
        let meter = &self.locker.inner().registry.meter;
        meter.extension(held.lease.key_arc(), answer.as_ref().copied());
        match answer {
            Ok(ExtendOutcome::Extended) => {
                held.confirm(sent_at);
                Ok(true)
            }
            Ok(outcome @ (ExtendOutcome::Expired | ExtendOutcome::Taken)) => {
                let cause = if outcome == ExtendOutcome::Expired {
                    LossCause::Expired
                } else {
                    LossCause::Taken
                };
                self.locker.inner().registry.end(id, Ending::Lost(cause));
                self.held = None;
                Ok(false)
            }
            Err(source) => {
                meter.backend_error(held.lease.key_arc(), Step::Extend);
                Err(self.backend_error(source))
            }
        }
    }

    /// Releases the lock. `Ok(true)`: this handle held it and freed it;
    /// `Ok(false)`: it did not hold it (any more).
    ///
    /// # Errors
    ///
    /// [`LockError::Backend`] when the step failed; the key then expires
    /// with its ttl.
    ///
    /// # Cancel safety
    ///
    /// The release goes on to its end if the future is dropped.
    pub async fn release(&mut self) -> Result<bool, LockError> {
        let Some((id, held)) = self.held.take() else {
            return Ok(false);
        };
        let registry = &self.locker.inner().registry;
        let Some(owed) = registry.end(id, Ending::Released) else {
            return Ok(false); // released by shutdown
        };
        let sent_at = tokio::time::Instant::now();
        let answer = finish_even_if_dropped(registry, owed.send(), |_| {}).await;
        // As `with_lock` tells them apart [O6].
        registry::settle_release(&held, Some(&answer), sent_at);
        match answer {
            Ok(outcome) => Ok(outcome == ReleaseOutcome::Released),
            Err(source) => Err(self.backend_error(source)),
        }
    }

    /// Whether this handle believes it holds the lock: it acquired it and
    /// has not seen it lost or released. Only the backend knows for sure;
    /// [`renew`](Self::renew) asks it.
    pub fn is_held(&self) -> bool {
        self.held.is_some()
    }

    /// The fencing token of the current acquisition.
    pub fn fencing_token(&self) -> Option<u64> {
        self.held
            .as_ref()
            .map(|(_, held)| held.lease.fencing_token())
    }

    /// The key.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The ttl of every acquisition and renewal: the one asked for, as the
    /// store grants it ([`Capabilities::effective_ttl`]).
    ///
    /// [`Capabilities::effective_ttl`]: crate::Capabilities::effective_ttl
    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    fn backend_error(&self, source: BackendError) -> LockError {
        LockError::Backend {
            key: self.key.to_string(),
            source,
        }
    }
}

impl Drop for LockHandle {
    fn drop(&mut self) {
        if let Some((id, _)) = self.held.take() {
            self.locker.inner().registry.end(id, Ending::Dropped);
        }
    }
}

impl fmt::Debug for LockHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LockHandle")
            .field("key", &self.key)
            .field("ttl", &self.ttl)
            .field("fencing_token", &self.fencing_token())
            .finish()
    }
}

//! The deprecated `Mutex`, with the lock/unlock surface of Kuzzle's Mutex
//! that `with_lock` replaces \[M1, M2\].

#![allow(deprecated)]

use std::time::Duration;

use crate::config::MAX_RETRY_DELAY;
use crate::error::{InvalidInput, LockError};
use crate::locker::handle::LockHandle;
use crate::locker::Locker;

/// Settings of a [`Mutex`], with Kuzzle's Mutex defaults.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MutexConfig {
    /// Time between two attempts.
    ///
    /// Default: 200 ms.
    pub attempt_delay: Duration,
    /// How long [`Mutex::lock`] tries before it answers `false`.
    ///
    /// Default: `None`, wait forever.
    pub timeout: Option<Duration>,
    /// The lock's time to live. It is never extended.
    ///
    /// Default: 5 s.
    pub ttl: Duration,
}

impl Default for MutexConfig {
    fn default() -> Self {
        Self {
            attempt_delay: Duration::from_millis(200),
            timeout: None,
            ttl: Duration::from_secs(5),
        }
    }
}

/// The old lock/unlock surface: a lock with a fixed ttl and no extension.
///
/// It takes the same backend key as `with_lock`, so on the same key the two
/// exclude each other and neither can release the other's lock: call sites
/// can move to `with_lock` one at a time.
#[deprecated(
    since = "0.1.0",
    note = "use Locker::with_lock, which extends the lock while the work runs and reports its loss"
)]
#[derive(Debug)]
pub struct Mutex {
    handle: LockHandle,
    config: MutexConfig,
}

impl Mutex {
    /// A mutex on `key` of `locker`'s backend.
    ///
    /// # Errors
    ///
    /// [`LockError::InvalidInput`] for a bad key, ttl or delay.
    pub fn new(locker: &Locker, key: &str, config: MutexConfig) -> Result<Self, LockError> {
        if config.attempt_delay > MAX_RETRY_DELAY {
            return Err(InvalidInput::RetryDelayTooLong {
                delay: config.attempt_delay,
                max: MAX_RETRY_DELAY,
            }
            .into());
        }
        if config.attempt_delay.is_zero() && config.timeout.is_none() {
            return Err(InvalidInput::ZeroDelayUnlimited.into());
        }
        Ok(Self {
            handle: locker.handle(key, config.ttl)?,
            config,
        })
    }

    /// Tries to take the lock every `attempt_delay` until it is taken
    /// (`Ok(true)`) or `timeout` has passed (`Ok(false)`).
    ///
    /// # Errors
    ///
    /// [`LockError::Backend`] when an attempt failed.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future leaves nothing held.
    pub async fn lock(&mut self) -> Result<bool, LockError> {
        let deadline = self.config.timeout.map(|t| tokio::time::Instant::now() + t);
        loop {
            if self.handle.acquire().await? {
                return Ok(true);
            }
            let mut next = tokio::time::Instant::now() + self.config.attempt_delay;
            if let Some(deadline) = deadline {
                if tokio::time::Instant::now() >= deadline {
                    return Ok(false);
                }
                next = next.min(deadline);
            }
            tokio::time::sleep_until(next).await;
        }
    }

    /// Releases the lock if this mutex holds it.
    ///
    /// # Errors
    ///
    /// [`LockError::Backend`] when the release failed; the key expires with
    /// its ttl.
    ///
    /// # Cancel safety
    ///
    /// The release goes on to its end if the future is dropped.
    pub async fn unlock(&mut self) -> Result<(), LockError> {
        self.handle.release().await.map(drop)
    }

    /// Whether this mutex believes it holds the lock.
    pub fn is_locked(&self) -> bool {
        self.handle.is_held()
    }

    /// The fencing token of the current acquisition.
    pub fn fencing_token(&self) -> Option<u64> {
        self.handle.fencing_token()
    }
}

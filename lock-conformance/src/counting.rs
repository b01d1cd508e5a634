//! `CountingBackend`: a wrapper that counts the calls of each step, to prove
//! how many round trips the driver makes.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

use lock_core::{
    async_trait, AcquireOutcome, BackendError, Capabilities, ExtendOutcome, ExtendRequest, Hold,
    Lease, LockBackend, OwnerToken, QueueTerms, ReleaseOutcome, ReleaseWatch,
};

use crate::faults::Step;

#[derive(Default)]
struct Counts {
    calls: [AtomicU64; crate::faults::STEPS],
    /// Calls whose answer the wrapped backend has given.
    answers: [AtomicU64; crate::faults::STEPS],
    /// Woken at every answer.
    answered: Notify,
    extended_leases: AtomicU64,
    /// When each `try_acquire` was called, with its key and owner token.
    attempts: Mutex<Vec<(Instant, String, OwnerToken)>>,
}

/// Wraps a backend and counts every call. Cheap to clone; clones share
/// their counts.
#[derive(Clone)]
pub struct CountingBackend<B> {
    inner: B,
    counts: Arc<Counts>,
}

impl<B: LockBackend> CountingBackend<B> {
    /// Wraps `inner` with every count at zero.
    pub fn new(inner: B) -> Self {
        Self {
            inner,
            counts: Arc::default(),
        }
    }

    /// The wrapped backend.
    pub fn inner(&self) -> &B {
        &self.inner
    }

    /// Calls of `step` so far; `Extend` counts `extend` and `extend_many`
    /// calls alike (each is one round trip).
    pub fn calls(&self, step: Step) -> u64 {
        self.counts.calls[step.index()].load(Ordering::SeqCst)
    }

    /// Calls of `step` the wrapped backend has answered so far (counted
    /// once the answer is back, whatever it says).
    pub fn answers(&self, step: Step) -> u64 {
        self.counts.answers[step.index()].load(Ordering::SeqCst)
    }

    /// Waits until the wrapped backend has answered `n` calls of `step`:
    /// a handshake with the driver (its first attempt found the key busy,
    /// its first extension went through) instead of a sleep that hopes so.
    pub async fn until_answered(&self, step: Step, n: u64) {
        loop {
            let answered = self.counts.answered.notified();
            tokio::pin!(answered);
            // Registered before the count is read, so an answer between
            // the two wakes it.
            answered.as_mut().enable();
            if self.answers(step) >= n {
                return;
            }
            answered.await;
        }
    }

    /// Calls of every step so far.
    pub fn total_calls(&self) -> u64 {
        self.counts
            .calls
            .iter()
            .map(|c| c.load(Ordering::SeqCst))
            .sum()
    }

    /// When each `try_acquire` call was made, in order.
    pub fn attempt_times(&self) -> Vec<Instant> {
        self.attempts().iter().map(|(at, _, _)| *at).collect()
    }

    /// The owner token of the last `try_acquire` on `key`: after a
    /// successful call, the token that holds the key.
    pub fn last_owner(&self, key: &str) -> Option<OwnerToken> {
        self.attempts()
            .iter()
            .rev()
            .find(|(_, k, _)| k == key)
            .map(|(_, _, owner)| owner.clone())
    }

    fn attempts(&self) -> std::sync::MutexGuard<'_, Vec<(Instant, String, OwnerToken)>> {
        self.counts
            .attempts
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Leases extended so far, over all extension calls.
    pub fn extended_leases(&self) -> u64 {
        self.counts.extended_leases.load(Ordering::SeqCst)
    }

    fn count(&self, step: Step) {
        self.counts.calls[step.index()].fetch_add(1, Ordering::SeqCst);
    }

    /// Counts an answer of `step` and passes it on.
    fn answered<T>(&self, step: Step, answer: T) -> T {
        self.counts.answers[step.index()].fetch_add(1, Ordering::SeqCst);
        self.counts.answered.notify_waiters();
        answer
    }
}

impl<B: fmt::Debug> fmt::Debug for CountingBackend<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CountingBackend")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

// The admin of the wrapped store, uncounted: the counts are the lock
// steps'.
lock_core::forward_lock_admin!(@impl [B: lock_core::LockAdmin] CountingBackend<B>, this => &this.inner);

#[async_trait]
impl<B: LockBackend> LockBackend for CountingBackend<B> {
    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }

    async fn try_acquire(
        &self,
        key: &str,
        owner: &OwnerToken,
        ttl: Duration,
    ) -> Result<AcquireOutcome, BackendError> {
        self.count(Step::TryAcquire);
        self.attempts()
            .push((Instant::now(), key.to_owned(), owner.clone()));
        let answer = self.inner.try_acquire(key, owner, ttl).await;
        self.answered(Step::TryAcquire, answer)
    }

    /// Counted as an acquisition attempt, as `try_acquire` is.
    async fn try_acquire_queued(
        &self,
        key: &str,
        owner: &OwnerToken,
        ttl: Duration,
        terms: QueueTerms,
    ) -> Result<AcquireOutcome, BackendError> {
        self.count(Step::TryAcquire);
        self.attempts()
            .push((Instant::now(), key.to_owned(), owner.clone()));
        let answer = self.inner.try_acquire_queued(key, owner, ttl, terms).await;
        self.answered(Step::TryAcquire, answer)
    }

    async fn leave_queue(&self, key: &str, owner: &OwnerToken) -> Result<(), BackendError> {
        self.inner.leave_queue(key, owner).await
    }

    async fn extend(&self, lease: &Lease, ttl: Duration) -> Result<ExtendOutcome, BackendError> {
        self.count(Step::Extend);
        self.counts.extended_leases.fetch_add(1, Ordering::SeqCst);
        let answer = self.inner.extend(lease, ttl).await;
        self.answered(Step::Extend, answer)
    }

    async fn extend_many(
        &self,
        requests: &[ExtendRequest],
    ) -> Vec<Result<ExtendOutcome, BackendError>> {
        self.count(Step::Extend);
        self.counts
            .extended_leases
            .fetch_add(requests.len() as u64, Ordering::SeqCst);
        let answer = self.inner.extend_many(requests).await;
        self.answered(Step::Extend, answer)
    }

    fn failure_domain(&self, key: &str) -> u64 {
        self.inner.failure_domain(key)
    }

    async fn release(&self, lease: &Lease) -> Result<ReleaseOutcome, BackendError> {
        self.count(Step::Release);
        let answer = self.inner.release(lease).await;
        self.answered(Step::Release, answer)
    }

    async fn hold(&self, lease: &Lease, hold: Hold) -> Result<ExtendOutcome, BackendError> {
        self.count(Step::Hold);
        let answer = self.inner.hold(lease, hold).await;
        self.answered(Step::Hold, answer)
    }

    async fn watch_release(&self, key: &str) -> Result<ReleaseWatch, BackendError> {
        self.count(Step::WatchRelease);
        let answer = self.inner.watch_release(key).await;
        self.answered(Step::WatchRelease, answer)
    }
}

//! `CountingBackend`: a wrapper that counts the calls of each step, to prove
//! how many round trips the driver makes.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use lock_core::{
    async_trait, AcquireOutcome, BackendError, Capabilities, ExtendOutcome, ExtendRequest, Lease,
    LockBackend, OwnerToken, ReleaseOutcome, ReleaseWatch,
};

use crate::faults::Step;

#[derive(Default)]
struct Counts {
    calls: [AtomicU64; 4],
    extended_leases: AtomicU64,
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

    /// Calls of every step so far.
    pub fn total_calls(&self) -> u64 {
        self.counts
            .calls
            .iter()
            .map(|c| c.load(Ordering::SeqCst))
            .sum()
    }

    /// Leases extended so far, over all extension calls.
    pub fn extended_leases(&self) -> u64 {
        self.counts.extended_leases.load(Ordering::SeqCst)
    }

    fn count(&self, step: Step) {
        self.counts.calls[step.index()].fetch_add(1, Ordering::SeqCst);
    }
}

impl<B: fmt::Debug> fmt::Debug for CountingBackend<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CountingBackend")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

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
        self.inner.try_acquire(key, owner, ttl).await
    }

    async fn extend(&self, lease: &Lease, ttl: Duration) -> Result<ExtendOutcome, BackendError> {
        self.count(Step::Extend);
        self.counts.extended_leases.fetch_add(1, Ordering::SeqCst);
        self.inner.extend(lease, ttl).await
    }

    async fn extend_many(
        &self,
        requests: &[ExtendRequest],
    ) -> Result<Vec<ExtendOutcome>, BackendError> {
        self.count(Step::Extend);
        self.counts
            .extended_leases
            .fetch_add(requests.len() as u64, Ordering::SeqCst);
        self.inner.extend_many(requests).await
    }

    async fn release(&self, lease: &Lease) -> Result<ReleaseOutcome, BackendError> {
        self.count(Step::Release);
        self.inner.release(lease).await
    }

    async fn watch_release(&self, key: &str) -> Result<ReleaseWatch, BackendError> {
        self.count(Step::WatchRelease);
        self.inner.watch_release(key).await
    }
}

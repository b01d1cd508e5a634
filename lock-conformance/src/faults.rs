//! `FaultInjector`: a wrapper around any backend that fails, delays, hangs
//! or lies on demand, to prove how the driver copes.

use std::collections::HashSet;
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use lock_core::{
    async_trait, AcquireOutcome, BackendError, BackendErrorKind, Capabilities, ExtendOutcome,
    ExtendRequest, Hold, Lease, LockBackend, OwnerToken, QueueTerms, ReleaseHub, ReleaseOutcome,
    ReleaseWatch,
};

/// A step of the backend trait.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Step {
    /// `try_acquire`.
    TryAcquire,
    /// `extend` and `extend_many`.
    Extend,
    /// `release`.
    Release,
    /// `watch_release`.
    WatchRelease,
    /// `hold`, the minimum hold's step \[H7\].
    Hold,
}

pub(crate) const STEPS: usize = 5;

impl Step {
    pub(crate) fn index(self) -> usize {
        match self {
            Self::TryAcquire => 0,
            Self::Extend => 1,
            Self::Release => 2,
            Self::WatchRelease => 3,
            Self::Hold => 4,
        }
    }
}

/// The error a [`FaultInjector`] fails a step with.
#[derive(Debug, thiserror::Error)]
#[error("injected fault in {0:?}")]
pub struct InjectedFault(pub Step);

/// Whether `error` was made by a [`FaultInjector`].
pub fn is_injected(error: &BackendError) -> bool {
    error.inner().downcast_ref::<InjectedFault>().is_some()
}

#[derive(Default)]
struct Faults {
    fail_next: [AtomicU32; STEPS],
    lose_answers: [AtomicU32; STEPS],
    fail_always: [AtomicBool; STEPS],
    hang: [AtomicBool; STEPS],
    delay: Mutex<[Duration; STEPS]>,
    late_answers: Mutex<[(u32, Duration); STEPS]>,
    /// Calls whose answer was held back, counted once the store applied
    /// them, and a wake-up for [`FaultInjector::applied_late`].
    applied_late: [AtomicU32; STEPS],
    applied_late_changed: tokio::sync::Notify,
    skip_extensions: AtomicBool,
    stolen: Mutex<HashSet<String>>,
    failing_extensions: Mutex<HashSet<String>>,
    hung_extensions: Mutex<HashSet<String>>,
    hub: ReleaseHub,
}

/// Wraps a backend and injects faults on demand. With nothing injected it
/// forwards every call unchanged.
///
/// Cheap to clone; clones share their faults, so a test keeps one clone to
/// steer and hands the other to a `Locker`.
#[derive(Clone)]
pub struct FaultInjector<B> {
    inner: B,
    faults: Arc<Faults>,
}

impl<B: LockBackend> FaultInjector<B> {
    /// Wraps `inner` with no faults.
    pub fn new(inner: B) -> Self {
        Self {
            inner,
            faults: Arc::default(),
        }
    }

    /// The wrapped backend.
    pub fn inner(&self) -> &B {
        &self.inner
    }

    /// Fails the next `n` calls of `step` with [`InjectedFault`].
    pub fn fail_next(&self, step: Step, n: u32) {
        self.faults.fail_next[step.index()].store(n, Ordering::SeqCst);
    }

    /// Lets the next `n` calls of `step` reach the store, then fails them
    /// with [`InjectedFault`]: the answer is lost on the way back, as when a
    /// connection drops or a timeout fires after the request was sent.
    pub fn lose_answers(&self, step: Step, n: u32) {
        self.faults.lose_answers[step.index()].store(n, Ordering::SeqCst);
    }

    /// Fails every call of `step` until turned off.
    pub fn fail_always(&self, step: Step, on: bool) {
        self.faults.fail_always[step.index()].store(on, Ordering::SeqCst);
    }

    /// Makes every call of `step` hang, never answering, until turned off
    /// (calls already hanging stay hung).
    pub fn hang(&self, step: Step, on: bool) {
        self.faults.hang[step.index()].store(on, Ordering::SeqCst);
    }

    /// Delays every call of `step` by `delay` before it reaches the store.
    pub fn delay(&self, step: Step, delay: Duration) {
        self.faults
            .delay
            .lock()
            .unwrap_or_else(PoisonError::into_inner)[step.index()] = delay;
    }

    /// Holds back the answers of the next `n` calls of `step` by `delay`
    /// after the store applied them, as a store that was paused answers
    /// late: the step took effect, its answer arrives long after.
    pub fn delay_answers(&self, step: Step, n: u32, delay: Duration) {
        self.faults
            .late_answers
            .lock()
            .unwrap_or_else(PoisonError::into_inner)[step.index()] = (n, delay);
    }

    /// Resolves once `n` calls of `step` whose answers
    /// [`delay_answers`](Self::delay_answers) holds back have been applied
    /// by the store: their answers are on their way back now.
    pub async fn applied_late(&self, step: Step, n: u32) {
        loop {
            let changed = self.faults.applied_late_changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            if self.faults.applied_late[step.index()].load(Ordering::SeqCst) >= n {
                return;
            }
            changed.await;
        }
    }

    /// Delays every step by `delay`.
    #[must_use]
    pub fn with_delay_on_every_step(self, delay: Duration) -> Self {
        for step in [
            Step::TryAcquire,
            Step::Extend,
            Step::Release,
            Step::WatchRelease,
        ] {
            self.delay(step, delay);
        }
        self
    }

    /// Makes extensions answer `Extended` without reaching the store, as if
    /// the store lost them (a failover to a replica that never saw them):
    /// the key really expires while the holder believes it extended it.
    pub fn skip_extensions(&self, on: bool) {
        self.faults.skip_extensions.store(on, Ordering::SeqCst);
    }

    /// Makes `key` look held by another owner: its extensions answer
    /// `Taken` and its releases `NotHeld`, without reaching the store.
    pub fn look_stolen(&self, key: &str, on: bool) {
        set_member(&self.faults.stolen, key, on);
    }

    /// Fails the extensions of `key` with [`InjectedFault`] while the other
    /// leases of the same `extend_many` call go on to the store and get
    /// their own answers, as when one server of a cluster fails \[L4\].
    pub fn fail_extensions_of(&self, key: &str, on: bool) {
        set_member(&self.faults.failing_extensions, key, on);
    }

    /// Puts `key` on a server of its own that hangs: its leases get a
    /// [`failure_domain`](LockBackend::failure_domain) of their own, and an
    /// `extend_many` call carrying them never answers \[L4\] (calls already
    /// hanging stay hung when turned off).
    pub fn hang_extensions_of(&self, key: &str, on: bool) {
        set_member(&self.faults.hung_extensions, key, on);
    }

    /// Wakes the watches on `key` without any release: a spurious
    /// notification, which the driver must treat as a hint only.
    pub fn notify_without_release(&self, key: &str) {
        self.faults.hub.notify(key);
    }

    fn is_stolen(&self, key: &str) -> bool {
        is_member(&self.faults.stolen, key)
    }

    async fn enter(&self, step: Step) -> Result<(), BackendError> {
        let i = step.index();
        let delay = self
            .faults
            .delay
            .lock()
            .unwrap_or_else(PoisonError::into_inner)[i];
        if !delay.is_zero() {
            tokio::time::sleep(delay).await;
        }
        if self.faults.hang[i].load(Ordering::SeqCst) {
            std::future::pending::<()>().await;
        }
        let fail_once = self.faults.fail_next[i]
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok();
        if fail_once || self.faults.fail_always[i].load(Ordering::SeqCst) {
            return Err(BackendError::new(
                BackendErrorKind::Request,
                InjectedFault(step),
            ));
        }
        Ok(())
    }
}

impl<B> FaultInjector<B> {
    fn take_late_answer(&self, step: Step) -> Option<Duration> {
        let delay = {
            let mut late = self
                .faults
                .late_answers
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            let (n, delay) = &mut late[step.index()];
            if *n == 0 {
                return None;
            }
            *n -= 1;
            *delay
        };
        self.faults.applied_late[step.index()].fetch_add(1, Ordering::SeqCst);
        self.faults.applied_late_changed.notify_waiters();
        Some(delay)
    }

    fn lose_answer<T>(
        &self,
        step: Step,
        answer: Result<T, BackendError>,
    ) -> Result<T, BackendError> {
        let lost = self.faults.lose_answers[step.index()]
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok();
        if lost {
            return Err(BackendError::new(
                BackendErrorKind::Request,
                InjectedFault(step),
            ));
        }
        answer
    }
}

fn set_member(set: &Mutex<HashSet<String>>, key: &str, on: bool) {
    let mut set = set.lock().unwrap_or_else(PoisonError::into_inner);
    if on {
        set.insert(key.to_owned());
    } else {
        set.remove(key);
    }
}

fn is_member(set: &Mutex<HashSet<String>>, key: &str) -> bool {
    set.lock()
        .unwrap_or_else(PoisonError::into_inner)
        .contains(key)
}

impl<B: fmt::Debug> fmt::Debug for FaultInjector<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FaultInjector")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

// The admin of the wrapped store, unchanged: faults are the lock steps'.
lock_core::forward_lock_admin!(@impl [B: lock_core::LockAdmin] FaultInjector<B>, this => &this.inner);

#[async_trait]
impl<B: LockBackend> LockBackend for FaultInjector<B> {
    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }

    async fn try_acquire(
        &self,
        key: &str,
        owner: &OwnerToken,
        ttl: Duration,
    ) -> Result<AcquireOutcome, BackendError> {
        self.enter(Step::TryAcquire).await?;
        let answer = self.inner.try_acquire(key, owner, ttl).await;
        if let Some(late) = self.take_late_answer(Step::TryAcquire) {
            tokio::time::sleep(late).await;
        }
        self.lose_answer(Step::TryAcquire, answer)
    }

    /// A queued attempt is an acquisition attempt: the same faults.
    async fn try_acquire_queued(
        &self,
        key: &str,
        owner: &OwnerToken,
        ttl: Duration,
        terms: QueueTerms,
    ) -> Result<AcquireOutcome, BackendError> {
        self.enter(Step::TryAcquire).await?;
        let answer = self.inner.try_acquire_queued(key, owner, ttl, terms).await;
        if let Some(late) = self.take_late_answer(Step::TryAcquire) {
            tokio::time::sleep(late).await;
        }
        self.lose_answer(Step::TryAcquire, answer)
    }

    async fn leave_queue(&self, key: &str, owner: &OwnerToken) -> Result<(), BackendError> {
        self.inner.leave_queue(key, owner).await
    }

    async fn extend(&self, lease: &Lease, ttl: Duration) -> Result<ExtendOutcome, BackendError> {
        self.enter(Step::Extend).await?;
        if self.is_stolen(lease.key()) {
            return Ok(ExtendOutcome::Taken);
        }
        if self.faults.skip_extensions.load(Ordering::SeqCst) {
            return Ok(ExtendOutcome::Extended);
        }
        self.inner.extend(lease, ttl).await
    }

    async fn extend_many(
        &self,
        requests: &[ExtendRequest],
    ) -> Vec<Result<ExtendOutcome, BackendError>> {
        if let Err(error) = self.enter(Step::Extend).await {
            return vec![Err(error); requests.len()];
        }
        if self.faults.skip_extensions.load(Ordering::SeqCst) {
            return vec![Ok(ExtendOutcome::Extended); requests.len()];
        }
        if requests
            .iter()
            .any(|r| is_member(&self.faults.hung_extensions, r.lease.key()))
        {
            std::future::pending::<()>().await;
        }
        let failing = |r: &ExtendRequest| is_member(&self.faults.failing_extensions, r.lease.key());
        let sent: Vec<ExtendRequest> = requests.iter().filter(|r| !failing(r)).cloned().collect();
        let mut answers = self.inner.extend_many(&sent).await.into_iter();
        requests
            .iter()
            .map(|request| {
                if failing(request) {
                    return Err(BackendError::new(
                        BackendErrorKind::Request,
                        InjectedFault(Step::Extend),
                    ));
                }
                let answer = answers.next().unwrap_or_else(|| {
                    Err(BackendError::message(
                        BackendErrorKind::Protocol,
                        "the wrapped backend gave too few answers",
                    ))
                });
                if self.is_stolen(request.lease.key()) {
                    return Ok(ExtendOutcome::Taken);
                }
                answer
            })
            .collect()
    }

    fn failure_domain(&self, key: &str) -> u64 {
        if is_member(&self.faults.hung_extensions, key) {
            // The hung server's.
            u64::MAX
        } else {
            self.inner.failure_domain(key)
        }
    }

    async fn release(&self, lease: &Lease) -> Result<ReleaseOutcome, BackendError> {
        self.enter(Step::Release).await?;
        if self.is_stolen(lease.key()) {
            return Ok(ReleaseOutcome::NotHeld);
        }
        let answer = self.inner.release(lease).await;
        self.lose_answer(Step::Release, answer)
    }

    async fn hold(&self, lease: &Lease, hold: Hold) -> Result<ExtendOutcome, BackendError> {
        self.enter(Step::Hold).await?;
        if self.is_stolen(lease.key()) {
            return Ok(ExtendOutcome::Taken);
        }
        let answer = self.inner.hold(lease, hold).await;
        if let Some(late) = self.take_late_answer(Step::Hold) {
            tokio::time::sleep(late).await;
        }
        self.lose_answer(Step::Hold, answer)
    }

    async fn watch_release(&self, key: &str) -> Result<ReleaseWatch, BackendError> {
        self.enter(Step::WatchRelease).await?;
        let inner = self.inner.watch_release(key).await?;
        Ok(ReleaseWatch::either(inner, self.faults.hub.watch(key)))
    }
}

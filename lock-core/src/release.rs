//! Releases: the ones a locker owes for the locks it took, and the clean-up
//! of keys that a failed attempt may have taken.

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tokio::time::Instant;

use crate::backend::{DynLockBackend, Lease, OwnerToken, ReleaseOutcome};
use crate::error::BackendError;
use crate::metrics::{Meter, Step};
use crate::registry::Registry;

/// A release this locker owes: counted by the registry from the moment the
/// lock left it until the store answered, so that shutdown can wait for it.
/// Dropping it unanswered gives the release up (the key expires with its
/// ttl), unless it is to be sent again.
pub(crate) struct OwedRelease {
    registry: Arc<Registry>,
    lease: Lease,
    settled: bool,
    send_again_if_dropped: bool,
}

impl OwedRelease {
    pub(crate) fn new(registry: Arc<Registry>, lease: Lease) -> Self {
        Self {
            registry,
            lease,
            settled: false,
            send_again_if_dropped: false,
        }
    }

    /// Makes a drop before the answer send the release once more, in the
    /// background, for a caller that may be dropped while it waits. (Cheaper
    /// than keeping the call alive in a task of its own: it needs no
    /// allocation unless it is dropped.)
    pub(crate) fn sent_again_if_dropped(mut self) -> Self {
        self.send_again_if_dropped = true;
        self
    }

    /// Sends the release to a backend that answers at once
    /// ([`LockBackend::release_now`](crate::LockBackend::release_now)):
    /// then the answer, settled. Else the release, still owed, with the
    /// failed answer if there was one (to hand to
    /// [`send_until`](Self::send_until)).
    #[allow(clippy::type_complexity)]
    pub(crate) fn at_once(
        mut self,
        now: Instant,
    ) -> Result<Result<ReleaseOutcome, BackendError>, (Self, Option<BackendError>)> {
        match self.registry.backend.release_now(&self.lease, now) {
            Some(Ok(outcome)) => {
                tracing::debug!(key = %self.lease.key(), fencing_token = self.lease.fencing_token(), ?outcome, "released");
                self.settled = true;
                self.registry.release_settled(true);
                Ok(Ok(outcome))
            }
            answer => Err((self, answer.and_then(Result::err))),
        }
    }

    /// Settles the debt of a lock left to its minimum hold, whose step
    /// answered (`ok`) or failed, without a release.
    pub(crate) fn settled_by_hold(mut self, ok: bool) {
        self.settled = true;
        self.registry.release_settled(ok);
    }

    /// Sends the release and waits for the store's answer.
    pub(crate) async fn send(self) -> Result<ReleaseOutcome, BackendError> {
        let now = Instant::now();
        self.send_until(now, now, None).await
    }

    /// Sends the release, and sends it again with a short backoff after a
    /// failure until `deadline` (a release is idempotent, and the backend
    /// takes a fresh connection after an error), so that the answer says
    /// whether the key was still ours. Gives the last answer, except that
    /// "not held" after a failed try that may have been applied proves
    /// nothing (that try may have released it): then the failure is given.
    /// `now` is the clock read just before; `failed`, the error of a first
    /// try already made.
    pub(crate) async fn send_until(
        self,
        deadline: Instant,
        now: Instant,
        failed: Option<BackendError>,
    ) -> Result<ReleaseOutcome, BackendError> {
        match self.send_until_decided(deadline, now, failed, false).await {
            Ok(answer) => answer,
            Err((error, _)) => Err(error),
        }
    }

    /// As [`send_until`](Self::send_until) for a caller that needs to know
    /// only whether the key was found taken \[O6\]: after a failed try that
    /// may have reached the store, no later answer can say so (a "not held"
    /// then proves nothing), so the caller gets that error at once and the
    /// release goes on in the background until `deadline`, still owed.
    pub(crate) async fn send_until_taken_or_failed(
        self,
        deadline: Instant,
        now: Instant,
        failed: Option<BackendError>,
    ) -> Result<ReleaseOutcome, BackendError> {
        match self.send_until_decided(deadline, now, failed, true).await {
            Ok(answer) => answer,
            Err((error, rest)) => {
                let registry = Arc::clone(&rest.registry);
                let resend = async move {
                    let _ = rest.send_until(deadline, Instant::now(), None).await;
                };
                // Without a runtime the release is dropped, given up.
                registry.spawn(resend);
                Err(error)
            }
        }
    }

    /// The loop of both: `Err` with the release still owed when
    /// `stop_when_undecidable` and a try failed after it may have reached
    /// the store.
    async fn send_until_decided(
        mut self,
        deadline: Instant,
        mut now: Instant,
        failed: Option<BackendError>,
        stop_when_undecidable: bool,
    ) -> Result<Result<ReleaseOutcome, BackendError>, (BackendError, Self)> {
        let mut failed = failed.map(Err);
        let mut pause = RETRY_PAUSE;
        // The first failed try whose request may have reached the store.
        let mut maybe_applied: Option<BackendError> = None;
        let answer = loop {
            let backend = &self.registry.backend;
            let answer = match failed.take() {
                Some(answer) => answer,
                None => match backend.release_now(&self.lease, now) {
                    Some(answer) => answer,
                    None => backend.release(&self.lease).await,
                },
            };
            match &answer {
                Ok(ReleaseOutcome::NotHeld) => {
                    if let Some(error) = maybe_applied.take() {
                        break Err(error);
                    }
                }
                Ok(ReleaseOutcome::Released) => {}
                Err(error) => {
                    self.registry
                        .meter
                        .backend_error(self.lease.key_arc(), Step::Release);
                    if maybe_applied.is_none() && error.may_have_reached_store() {
                        maybe_applied = Some(error.clone());
                    }
                }
            }
            if answer.is_ok() || Instant::now() + pause >= deadline {
                break answer;
            }
            if let Err(error) = &answer {
                tracing::debug!(key = %self.lease.key(), error = %crate::ErrorChain(error), "release failed; sending it again");
            }
            if stop_when_undecidable {
                if let Some(error) = maybe_applied.clone() {
                    return Err((error, self));
                }
            }
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(MAX_RETRY_PAUSE);
            now = Instant::now();
        };
        match &answer {
            Ok(outcome) => {
                tracing::debug!(key = %self.lease.key(), fencing_token = self.lease.fencing_token(), ?outcome, "released");
            }
            Err(error) => {
                tracing::debug!(key = %self.lease.key(), error = %crate::ErrorChain(error), "release failed; the key expires with its ttl");
            }
        }
        self.settled = true;
        self.registry.release_settled(answer.is_ok());
        Ok(answer)
    }

    /// Sends the release without waiting: it is polled once in place (an
    /// in-memory backend finishes there), and if it needs more, it goes on in
    /// a task of its own.
    pub(crate) fn in_background(self) {
        let registry = Arc::clone(&self.registry);
        let mut release = Box::pin(async move {
            let _ = self.send().await;
        });
        if tokio::runtime::Handle::try_current().is_ok() {
            // Polled inside the background runtime's context, as
            // `finish_even_if_dropped` polls a step: a timer or connection
            // the first poll makes belongs to the runtime the task goes on
            // in, not to the caller's, which may end first \[T1\].
            let _inside = registry
                .background_handle()
                .map(tokio::runtime::Handle::enter);
            let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
            if release.as_mut().poll(&mut cx).is_ready() {
                return;
            }
        }
        // Outside a runtime the release runs on the one that took the lock;
        // with none left it is dropped, given up.
        registry.spawn(release);
    }
}

impl Drop for OwedRelease {
    fn drop(&mut self) {
        if self.settled {
            return;
        }
        if self.send_again_if_dropped {
            // Still owed: the new one settles the count.
            Self::new(Arc::clone(&self.registry), self.lease.clone()).in_background();
        } else {
            self.registry.release_settled(false);
        }
    }
}

type Pending = HashMap<Arc<str>, Vec<(OwnerToken, Instant)>>;

/// The keys that attempts which failed on an error may have taken: the
/// request may have been applied, or may still be (a hung store runs it
/// when it wakes up). One task per key releases them with their owner
/// tokens, with backoff, until each frees its key or its ttl has passed, so
/// a failing store costs one task per key, not one per attempt.
pub(crate) struct Cleanup {
    backend: Arc<DynLockBackend>,
    meter: Meter,
    pending: Mutex<Pending>,
}

/// The first pause before a failed release is sent again; it doubles up to
/// [`MAX_RETRY_PAUSE`].
pub(crate) const RETRY_PAUSE: Duration = Duration::from_millis(10);
pub(crate) const MAX_RETRY_PAUSE: Duration = Duration::from_millis(500);

/// The first pause between two clean-up rounds of a key; it doubles up to
/// [`MAX_PAUSE`].
const FIRST_PAUSE: Duration = Duration::from_millis(50);
const MAX_PAUSE: Duration = Duration::from_secs(5);

impl Cleanup {
    pub(crate) fn new(backend: Arc<DynLockBackend>, meter: Meter) -> Self {
        Self {
            backend,
            meter,
            pending: Mutex::default(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Pending> {
        self.pending.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Releases `key` for `owner` until `until`, in the key's one clean-up
    /// task (started if the key has none).
    pub(crate) fn add(
        self: &Arc<Self>,
        registry: &Registry,
        key: &Arc<str>,
        owner: OwnerToken,
        until: Instant,
    ) {
        let mut pending = self.lock();
        if let Some(tokens) = pending.get_mut(key) {
            tokens.push((owner, until));
            return;
        }
        pending.insert(Arc::clone(key), vec![(owner, until)]);
        drop(pending);
        let task = KeyCleanup {
            cleanup: Arc::clone(self),
            key: Arc::clone(key),
            done: false,
        };
        if !registry.spawn(task.run()) {
            self.lock().remove(key);
        }
    }

    /// One last release of every pending token, for shutdown, each given
    /// up at `deadline`; then nothing is pending any more. Returns how
    /// many failed or were given up.
    pub(crate) async fn final_pass(&self, deadline: Instant) -> usize {
        let pending = std::mem::take(&mut *self.lock());
        let releases = pending.into_iter().flat_map(|(key, tokens)| {
            tokens.into_iter().map(move |(owner, _)| {
                let lease = Lease::new(Arc::clone(&key), owner, 0);
                let backend = Arc::clone(&self.backend);
                async move {
                    let answer = tokio::time::timeout_at(deadline, backend.release(&lease)).await;
                    let ok = matches!(answer, Ok(Ok(_)));
                    if !ok {
                        self.meter.backend_error(lease.key_arc(), Step::Release);
                    }
                    ok
                }
            })
        });
        let answers = futures_util::future::join_all(releases).await;
        answers.into_iter().filter(|ok| !ok).count()
    }
}

/// The clean-up task of one key. Dropped before its end (its runtime shut
/// down), it takes the key out, so the next failed attempt starts a new task.
struct KeyCleanup {
    cleanup: Arc<Cleanup>,
    key: Arc<str>,
    done: bool,
}

impl KeyCleanup {
    async fn run(mut self) {
        self.clean().await;
        self.done = true;
    }

    async fn clean(&self) {
        let mut pause = FIRST_PAUSE;
        loop {
            let now = Instant::now();
            let tokens: Vec<(OwnerToken, Instant)> = {
                let mut pending = self.cleanup.lock();
                let Some(tokens) = pending.get_mut(&self.key) else {
                    return; // shutdown's final pass took them
                };
                tokens.retain(|(_, until)| *until > now);
                if tokens.is_empty() {
                    pending.remove(&self.key);
                    give_back_room(&mut pending);
                    return;
                }
                tokens.clone()
            };
            for (owner, until) in tokens {
                let lease = Lease::new(Arc::clone(&self.key), owner, 0);
                let remaining = until.saturating_duration_since(Instant::now());
                let release = tokio::time::timeout(remaining, self.cleanup.backend.release(&lease));
                match release.await {
                    Ok(Ok(ReleaseOutcome::Released)) => {
                        tracing::debug!(key = %self.key, "released a key taken by a failed attempt");
                        if let Some(tokens) = self.cleanup.lock().get_mut(&self.key) {
                            tokens.retain(|(o, _)| o != lease.owner());
                        }
                    }
                    Ok(Err(_)) => self.cleanup.meter.backend_error(&self.key, Step::Release),
                    Ok(Ok(ReleaseOutcome::NotHeld)) | Err(_) => {}
                }
            }
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(MAX_PAUSE);
        }
    }
}

impl Drop for KeyCleanup {
    fn drop(&mut self) {
        if !self.done {
            self.cleanup.lock().remove(&self.key);
        }
    }
}

impl Cleanup {
    /// The keys with tokens to clean up, and their map's room \[T2\]: a
    /// key stays at most one ttl after the failed attempt that put it
    /// there; the room is given back below a quarter full.
    pub(crate) fn counts(&self) -> [(&'static str, usize); 2] {
        let pending = self.lock();
        [
            ("cleanup: keys", pending.len()),
            ("cleanup: map capacity", pending.capacity()),
        ]
    }
}

/// Gives back the room of a crowd of keys once the map is less than a
/// quarter full, at most once per halving \[T2\].
fn give_back_room(pending: &mut Pending) {
    let len = pending.len();
    if pending.capacity() > 64 && len < pending.capacity() / 4 {
        pending.shrink_to(2 * len);
    }
}

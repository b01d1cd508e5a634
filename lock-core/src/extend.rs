//! The registry of the leases a locker holds, and the one extender task per
//! locker that keeps them alive \[H1, L1, L2, P4\].
//!
//! Leases are kept in one schedule ordered by when they are due. The
//! extender sleeps until the first is due, then sends every lease due within
//! a twelfth of its ttl in batches of [`Capabilities::max_extend_batch`], each
//! batch one backend call in a task of its own, so a stalled call cannot hold
//! up the others. Holding 10,000 locks costs one timer and, per ttl / 3,
//! `10_000 / max_extend_batch` backend calls.
//!
//! [`Capabilities::max_extend_batch`]: crate::Capabilities::max_extend_batch

use std::collections::{BTreeSet, HashMap};
use std::future::Future;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

use crate::backend::{DynLockBackend, ExtendOutcome, ExtendRequest, Lease};
use crate::context::LeaseState;
use crate::error::{BackendError, BackendErrorKind, LossCause};

/// The margin taken off a lease's validity for clock drift between this
/// process and the store: 1% of the ttl plus 2 ms.
pub(crate) fn drift(ttl: Duration) -> Duration {
    ttl / 100 + Duration::from_millis(2)
}

fn first_backoff(ttl: Duration) -> Duration {
    (ttl / 30).max(Duration::from_millis(10))
}

/// What kind of holder a lease has.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Holder {
    /// A `with_lock` callback: extended in the background, waited for by shutdown.
    Callback,
    /// A low-level handle or a `Mutex`: released by shutdown, never extended.
    Handle,
}

struct Entry {
    lease: Lease,
    ttl: Duration,
    holder: Holder,
    state: Option<Arc<LeaseState>>,
    due: Option<Instant>,
    valid_until: Instant,
    backoff: Duration,
    last_error: Option<BackendError>,
}

#[derive(Default)]
struct State {
    next_id: u64,
    entries: HashMap<u64, Entry>,
    schedule: BTreeSet<(Instant, u64)>,
    callbacks: usize,
    extender_running: bool,
    /// When the extender will look at the schedule next; `None` while it
    /// waits for a wake-up. A new lease due later needs no wake-up.
    extender_wakes_at: Option<Instant>,
    /// Shutdown began: no new leases.
    no_new: bool,
    /// Shutdown drained the registry: the extender stops.
    closed: bool,
}

impl State {
    /// Schedules an extension; returns whether the extender must be woken
    /// to see it in time.
    fn schedule(&mut self, id: u64, due: Instant) -> bool {
        let Some(e) = self.entries.get_mut(&id) else {
            return false;
        };
        e.due = Some(due);
        self.schedule.insert((due, id));
        if self.extender_wakes_at.is_none_or(|at| due < at) {
            self.extender_wakes_at = Some(due);
            return true;
        }
        false
    }

    fn remove(&mut self, id: u64) -> Option<Entry> {
        let e = self.entries.remove(&id)?;
        if let Some(due) = e.due {
            self.schedule.remove(&(due, id));
        }
        if e.holder == Holder::Callback {
            self.callbacks -= 1;
        }
        Some(e)
    }
}

/// A lease taken out of the registry by a loss or by shutdown.
pub(crate) struct Removed {
    pub(crate) lease: Lease,
    pub(crate) state: Option<Arc<LeaseState>>,
}

pub(crate) struct Registry {
    state: Mutex<State>,
    /// Wakes the extender when the schedule changed or the registry is gone.
    wake: Arc<Notify>,
    /// Wakes shutdown when no callback holds a lease any more.
    idle: Notify,
    backend: Arc<DynLockBackend>,
    max_batch: usize,
}

impl Registry {
    pub(crate) fn new(backend: Arc<DynLockBackend>) -> Self {
        let max_batch = backend.capabilities().max_extend_batch.max(1);
        Self {
            state: Mutex::default(),
            wake: Arc::new(Notify::new()),
            idle: Notify::new(),
            backend,
            max_batch,
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Records a lease taken at `acquired_at` (when its attempt was sent).
    /// Returns `None` once the registry is closed by shutdown: the caller
    /// must then release the lease itself.
    pub(crate) fn insert(
        self: &Arc<Self>,
        lease: Lease,
        ttl: Duration,
        acquired_at: Instant,
        holder: Holder,
        state: Option<Arc<LeaseState>>,
    ) -> Option<u64> {
        let mut s = self.lock();
        if s.no_new {
            return None;
        }
        let id = s.next_id;
        s.next_id += 1;
        s.entries.insert(
            id,
            Entry {
                lease,
                ttl,
                holder,
                state,
                due: None,
                valid_until: acquired_at + ttl - drift(ttl),
                backoff: first_backoff(ttl),
                last_error: None,
            },
        );
        if holder == Holder::Callback {
            s.callbacks += 1;
            let wake = s.schedule(id, acquired_at + ttl / 3);
            if !s.extender_running {
                s.extender_running = true;
                tokio::spawn(run_extender(Arc::downgrade(self), Arc::clone(&self.wake)));
            } else if wake {
                self.wake.notify_one();
            }
        }
        Some(id)
    }

    /// Takes a lease out. `None` if it was already taken out by a loss or
    /// by shutdown.
    pub(crate) fn remove(&self, id: u64) -> Option<Lease> {
        let mut s = self.lock();
        let e = s.remove(id)?;
        if s.callbacks == 0 {
            self.idle.notify_waiters();
        }
        Some(e.lease)
    }

    /// How many `with_lock` callbacks hold a lease.
    pub(crate) fn callbacks(&self) -> usize {
        self.lock().callbacks
    }

    /// How many leases are held, by callbacks and handles.
    pub(crate) fn len(&self) -> usize {
        self.lock().entries.len()
    }

    /// Resolves once no callback holds a lease.
    pub(crate) async fn idle(&self) {
        loop {
            let notified = self.idle.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.callbacks() == 0 {
                return;
            }
            notified.await;
        }
    }

    /// Refuses new leases from now on; held ones are still extended.
    pub(crate) fn close_to_new(&self) {
        self.lock().no_new = true;
    }

    /// Closes the registry to new leases and takes out every lease it holds.
    pub(crate) fn close_and_drain(&self) -> Vec<Removed> {
        let mut s = self.lock();
        s.no_new = true;
        s.closed = true;
        s.schedule.clear();
        s.callbacks = 0;
        let drained = s
            .entries
            .drain()
            .map(|(_, e)| Removed {
                lease: e.lease,
                state: e.state,
            })
            .collect();
        drop(s);
        self.idle.notify_waiters();
        self.wake.notify_one();
        drained
    }

    /// Takes the leases due now, as batches, and says when to wake next.
    fn take_due(&self, now: Instant) -> (Vec<Batch>, Vec<(Removed, Instant)>, Option<Instant>) {
        let mut s = self.lock();
        let mut batches = Vec::new();
        let mut lost = Vec::new();
        let mut current = Batch::default();
        while let Some(&(due, id)) = s.schedule.first() {
            let Some(e) = s.entries.get(&id) else {
                s.schedule.pop_first();
                continue;
            };
            if due > now + e.ttl / 12 {
                break;
            }
            if now >= e.valid_until {
                let error = e.last_error.clone().unwrap_or_else(|| {
                    BackendError::message(
                        BackendErrorKind::Timeout,
                        "the lock's validity ran out before an extension could be sent",
                    )
                });
                if let Some(e) = s.remove(id) {
                    lost.push((e, LossCause::Backend(error)));
                }
                continue;
            }
            let request = ExtendRequest {
                lease: e.lease.clone(),
                ttl: e.ttl,
            };
            let valid_until = e.valid_until;
            s.schedule.pop_first();
            if let Some(e) = s.entries.get_mut(&id) {
                e.due = None;
            }
            current.deadline = Some(current.deadline.map_or(valid_until, |d| d.min(valid_until)));
            current.ids.push(id);
            current.requests.push(request);
            if current.ids.len() == self.max_batch {
                batches.push(std::mem::take(&mut current));
            }
        }
        if !current.ids.is_empty() {
            batches.push(current);
        }
        let next = s.schedule.first().map(|(d, _)| *d);
        s.extender_wakes_at = next;
        if s.callbacks == 0 {
            self.idle.notify_waiters();
        }
        drop(s);
        let removed = lost
            .into_iter()
            .map(|(e, cause)| {
                let until = now + e.ttl;
                (self.lose(e, cause), until)
            })
            .collect();
        (batches, removed, next)
    }

    fn lose(&self, e: Entry, cause: LossCause) -> Removed {
        tracing::warn!(
            key = %e.lease.key(),
            fencing_token = e.lease.fencing_token(),
            cause = %cause,
            "lock lost"
        );
        if let Some(state) = &e.state {
            state.mark_lost(cause);
        }
        Removed {
            lease: e.lease,
            state: e.state,
        }
    }

    /// Applies the answer to one batch sent at `sent_at`. `timed_out`: the
    /// error is the driver's own deadline, not the store's answer.
    fn apply(
        &self,
        batch: &Batch,
        sent_at: Instant,
        answer: Result<Vec<ExtendOutcome>, BackendError>,
        timed_out: bool,
    ) {
        let now = Instant::now();
        let mut s = self.lock();
        let mut lost = Vec::new();
        let mut wake = false;
        for (i, &id) in batch.ids.iter().enumerate() {
            let Some(e) = s.entries.get_mut(&id) else {
                continue; // released while the batch was in flight
            };
            let outcome = answer.as_ref().map(|v| v[i]);
            match outcome {
                Ok(ExtendOutcome::Extended) => {
                    e.valid_until = sent_at + e.ttl - drift(e.ttl);
                    e.backoff = first_backoff(e.ttl);
                    e.last_error = None;
                    tracing::trace!(key = %e.lease.key(), fencing_token = e.lease.fencing_token(), "lock extended");
                    let due = sent_at + e.ttl / 3;
                    wake |= s.schedule(id, due);
                }
                Ok(ExtendOutcome::Expired) => lost.push((id, LossCause::Expired)),
                Ok(ExtendOutcome::Taken) => lost.push((id, LossCause::Taken)),
                Err(error) => {
                    tracing::debug!(key = %e.lease.key(), error = %error, "lock extension failed; retrying");
                    // A last try cut short by the validity deadline says less
                    // than the store's own error before it.
                    let error = match (&e.last_error, timed_out) {
                        (Some(earlier), true) => earlier.clone(),
                        _ => error.clone(),
                    };
                    e.last_error = Some(error.clone());
                    if now >= e.valid_until {
                        lost.push((id, LossCause::Backend(error)));
                    } else {
                        let due = (now + e.backoff).min(e.valid_until);
                        e.backoff = (e.backoff * 2).min(e.ttl / 6);
                        wake |= s.schedule(id, due);
                    }
                }
            }
        }
        let lost: Vec<_> = lost
            .into_iter()
            .filter_map(|(id, cause)| s.remove(id).map(|e| (e, cause)))
            .collect();
        if s.callbacks == 0 {
            self.idle.notify_waiters();
        }
        drop(s);
        for (e, cause) in lost {
            let backend_failed = matches!(cause, LossCause::Backend(_));
            let until = now + e.ttl;
            let removed = self.lose(e, cause);
            if backend_failed {
                // The key may still carry our token, and an extension still
                // on its way may lengthen it: free it while it may.
                spawn_uncertain_release(Arc::clone(&self.backend), removed.lease, until);
            }
        }
        if wake {
            self.wake.notify_one();
        }
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        self.wake.notify_one();
    }
}

#[derive(Default)]
struct Batch {
    ids: Vec<u64>,
    requests: Vec<ExtendRequest>,
    deadline: Option<Instant>,
}

/// Releases a lease best effort, without waiting: the release is polled
/// once in place (an in-memory backend finishes there), and if it needs
/// more, it goes on in a task of its own.
pub(crate) fn spawn_release(backend: Arc<DynLockBackend>, lease: Lease) {
    let mut release = Box::pin(async move {
        if let Err(error) = backend.release(&lease).await {
            tracing::debug!(key = %lease.key(), error = %error, "background release failed; the key expires with its ttl");
        }
    });
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    if release.as_mut().poll(&mut cx).is_pending() {
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(release);
        }
    }
}

/// Releases a lease whose acquisition failed on an error, in a task of its
/// own: the request may have been applied, or may still be, so releases go
/// on with backoff until one frees the key or `until` (the acquisition's
/// ttl) has passed, after which the key expires anyway. A release only ever
/// frees a key that still carries this owner token.
pub(crate) fn spawn_uncertain_release(backend: Arc<DynLockBackend>, lease: Lease, until: Instant) {
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        return;
    };
    runtime.spawn(async move {
        let mut pause = Duration::from_millis(50);
        loop {
            let remaining = until.saturating_duration_since(Instant::now());
            if remaining.is_zero() {
                return;
            }
            let release = tokio::time::timeout(remaining, backend.release(&lease)).await;
            if matches!(release, Ok(Ok(crate::backend::ReleaseOutcome::Released))) {
                tracing::debug!(key = %lease.key(), "released a key taken by a failed attempt");
                return;
            }
            tokio::time::sleep(pause.min(until.saturating_duration_since(Instant::now()))).await;
            pause = (pause * 2).min(Duration::from_secs(5));
        }
    });
}

async fn run_extender(registry: Weak<Registry>, wake: Arc<Notify>) {
    loop {
        let notified = wake.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        let next = {
            let Some(reg) = registry.upgrade() else {
                return;
            };
            if reg.lock().closed {
                return;
            }
            let (batches, lost, next) = reg.take_due(Instant::now());
            for (removed, until) in lost {
                spawn_uncertain_release(Arc::clone(&reg.backend), removed.lease, until);
            }
            for batch in batches {
                tokio::spawn(send_batch(Arc::clone(&reg), batch));
            }
            next
        };
        match next {
            Some(at) => {
                tokio::select! {
                    () = tokio::time::sleep_until(at) => {}
                    () = &mut notified => {}
                }
            }
            None => notified.await,
        }
    }
}

async fn send_batch(registry: Arc<Registry>, batch: Batch) {
    let sent_at = Instant::now();
    let deadline = batch.deadline.unwrap_or(sent_at);
    let call = registry.backend.extend_many(&batch.requests);
    let mut timed_out = false;
    let answer = match tokio::time::timeout_at(deadline, call).await {
        Ok(Ok(outcomes)) if outcomes.len() == batch.requests.len() => Ok(outcomes),
        Ok(Ok(outcomes)) => Err(BackendError::message(
            BackendErrorKind::Protocol,
            format!(
                "extend_many answered {} outcomes for {} leases",
                outcomes.len(),
                batch.requests.len()
            ),
        )),
        Ok(Err(error)) => Err(error),
        Err(_) => {
            timed_out = true;
            Err(BackendError::timeout(
                "extension",
                deadline.saturating_duration_since(sent_at),
            ))
        }
    };
    registry.apply(&batch, sent_at, answer, timed_out);
}

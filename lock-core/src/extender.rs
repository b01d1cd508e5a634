//! The one extender task per locker that keeps its callbacks' locks alive
//! \[H1, L1, L2, P4\].
//!
//! Locks are kept in one schedule ordered by when they are due, entered
//! there when the extender next looks (a lock released before that costs
//! no schedule entry and no wake-up). The extender sleeps until the first
//! is due, then sends every lock due within
//! a twelfth of its ttl in batches of [`Capabilities::max_extend_batch`], each
//! batch one backend call in a task of its own, so a stalled call cannot hold
//! up the others. Holding 10,000 locks costs one timer and, per ttl / 3,
//! `10_000 / max_extend_batch` backend calls.
//!
//! The task runs on the runtime of the call that started it. If that
//! runtime goes away, the task's end is noticed and the next lock taken
//! starts a new one.
//!
//! [`Capabilities::max_extend_batch`]: crate::Capabilities::max_extend_batch

use std::sync::{Arc, Weak};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

use crate::backend::{ExtendOutcome, ExtendRequest};
use crate::error::{BackendError, BackendErrorKind, LossCause};
use crate::held::HeldLock;
use crate::metrics::Step;
use crate::registry::Registry;

/// The first pause before an extension that failed is sent again.
pub(crate) fn first_backoff(ttl: Duration) -> Duration {
    (ttl / 30).max(Duration::from_millis(10))
}

/// Starts the extender of `registry` on the current runtime.
pub(crate) fn start(registry: &Arc<Registry>) {
    let running = Running(Arc::downgrade(registry));
    tokio::spawn(run(running, Arc::clone(&registry.wake)));
}

/// Marks the extender stopped when its task ends or is dropped with its
/// runtime.
struct Running(Weak<Registry>);

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(registry) = self.0.upgrade() {
            let mut s = registry.lock();
            s.extender_running = false;
            s.extender_wakes_at = None;
        }
    }
}

async fn run(running: Running, wake: Arc<Notify>) {
    loop {
        let notified = wake.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        let next = {
            let Some(registry) = running.0.upgrade() else {
                return;
            };
            if registry.lock().closed {
                return;
            }
            let (batches, next) = take_due(&registry, Instant::now());
            for batch in batches {
                tokio::spawn(send_batch(Arc::clone(&registry), batch));
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

#[derive(Default)]
struct Batch {
    ids: Vec<u64>,
    /// The records, counted as extending until the batch is answered.
    helds: Vec<Arc<HeldLock>>,
    requests: Vec<ExtendRequest>,
    /// The earliest validity in the batch: an answer after it says nothing.
    deadline: Option<Instant>,
}

impl Batch {
    fn push(&mut self, id: u64, held: Arc<HeldLock>, request: ExtendRequest, valid_until: Instant) {
        self.deadline = Some(self.deadline.map_or(valid_until, |d| d.min(valid_until)));
        self.ids.push(id);
        self.helds.push(held);
        self.requests.push(request);
    }
}

impl Drop for Batch {
    /// Answered, given up or dropped with its task: its locks are no longer
    /// extending.
    fn drop(&mut self) {
        for held in &self.helds {
            held.extension_answered();
        }
    }
}

/// Takes the locks due now, as batches of one failure domain each \[L4\],
/// declares lost those whose validity ran out before an extension could be
/// sent, and says when to wake next.
fn take_due(registry: &Registry, now: Instant) -> (Vec<Batch>, Option<Instant>) {
    let mut s = registry.lock();
    s.schedule_taken();
    let mut due_now = Vec::new();
    let mut lost = Vec::new();
    while let Some(&(due, id)) = s.schedule.first() {
        let Some(e) = s.entries.get(&id) else {
            s.schedule.pop_first();
            continue;
        };
        let ttl = e.held.ttl;
        if due > now + ttl / 12 {
            break;
        }
        let valid_until = e.held.valid_until();
        if now >= valid_until {
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
            lease: e.held.lease.clone(),
            ttl,
        };
        let held = Arc::clone(&e.held);
        held.extension_sent();
        s.schedule.pop_first();
        if let Some(e) = s.entries.get_mut(&id) {
            e.due = None;
            // Sent after any release announced so far.
            e.recheck = false;
        }
        due_now.push((id, held, request, valid_until));
    }
    // With nothing to extend right after locks were taken (most are
    // released before a first extension), look again in a quarter of a
    // ttl rather than wait to be woken: the locks taken meanwhile are due
    // later, so taking them wakes nobody. Only a look that saw no lock
    // taken since the last one lets the extender sleep until woken.
    let next = match s.schedule.first() {
        Some(&(due, _)) => Some(due),
        None if s.taken_since_look => Some(now + s.last_ttl / 4),
        None => None,
    };
    s.taken_since_look = false;
    s.extender_wakes_at = next;
    drop(s);
    if !lost.is_empty() {
        registry.notify_changed();
    }
    for (held, cause) in lost {
        lose(registry, &held, cause, now);
    }
    (batches(registry, due_now), next)
}

/// Groups the leases due into batches of at most the backend's batch size,
/// each of one failure domain, so that a hung server holds up only the
/// leases it holds \[L4\]. Asked outside the registry's lock: the
/// backend's answer may take its own locks.
#[allow(clippy::type_complexity)]
fn batches(
    registry: &Registry,
    due: Vec<(u64, Arc<HeldLock>, ExtendRequest, Instant)>,
) -> Vec<Batch> {
    let mut open: Vec<(u64, Batch)> = Vec::new();
    let mut full = Vec::new();
    for (id, held, request, valid_until) in due {
        let domain = registry.backend.failure_domain(request.lease.key());
        let i = match open.iter().position(|(d, _)| *d == domain) {
            Some(i) => i,
            None => {
                open.push((domain, Batch::default()));
                open.len() - 1
            }
        };
        let batch = &mut open[i].1;
        batch.push(id, held, request, valid_until);
        if batch.ids.len() == registry.max_batch {
            full.push(std::mem::take(batch));
        }
    }
    full.extend(
        open.into_iter()
            .map(|(_, batch)| batch)
            .filter(|b| !b.ids.is_empty()),
    );
    full
}

/// Tells the holder of a lock the extender took out that it was lost.
fn lose(registry: &Registry, held: &HeldLock, cause: LossCause, now: Instant) {
    tracing::warn!(
        key = %held.lease.key(),
        fencing_token = held.lease.fencing_token(),
        cause = %cause,
        "lock lost"
    );
    let backend_failed = matches!(cause, LossCause::Backend(_));
    held.mark_lost(cause);
    if backend_failed {
        // The key may still carry our token, and an extension still on its
        // way may lengthen it: free it while it may.
        registry.cleanup.add(
            registry,
            held.lease.key_arc(),
            held.lease.owner().clone(),
            now + held.ttl,
        );
    }
}

/// Applies the answer to one batch sent at `sent_at`. `timed_out`: the
/// error is the driver's own deadline, not the store's answer.
fn apply(
    registry: &Registry,
    batch: &Batch,
    sent_at: Instant,
    answers: Vec<Result<ExtendOutcome, BackendError>>,
    timed_out: bool,
) {
    let now = Instant::now();
    let mut s = registry.lock();
    let mut lost = Vec::new();
    let mut wake = false;
    for (&id, answer) in batch.ids.iter().zip(answers) {
        let Some(e) = s.entries.get_mut(&id) else {
            continue; // released while the batch was in flight
        };
        // Each lease's own answer \[L4\].
        let result = answer.as_ref().copied();
        let key = e.held.lease.key_arc();
        registry.meter.extension(key, result);
        if result.is_err() {
            registry.meter.backend_error(key, Step::Extend);
        }
        match result {
            Ok(ExtendOutcome::Extended) => {
                e.held.confirm(sent_at);
                e.backoff = Duration::ZERO;
                e.last_error = None;
                tracing::trace!(key = %e.held.lease.key(), fencing_token = e.held.lease.fencing_token(), "lock extended");
                // [L5] A release announced while it was on its way: the
                // answer may predate it.
                let due = if std::mem::take(&mut e.recheck) {
                    now
                } else {
                    e.held.extension_due()
                };
                wake |= s.schedule(id, due);
            }
            // [L1] A key found gone by an extension sent while the lock
            // was valid did not expire: it was deleted, freed or lost by
            // the store (a flush, a failover that missed the write).
            Ok(ExtendOutcome::Expired) if sent_at < e.held.valid_until() => {
                lost.push((id, LossCause::Taken));
            }
            Ok(ExtendOutcome::Expired) => lost.push((id, LossCause::Expired)),
            Ok(ExtendOutcome::Taken) => lost.push((id, LossCause::Taken)),
            Err(error) => {
                tracing::debug!(key = %e.held.lease.key(), error = %error, "lock extension failed; retrying");
                // A last try cut short by the validity deadline says less
                // than the store's own error before it.
                let error = match (&e.last_error, timed_out) {
                    (Some(earlier), true) => earlier.clone(),
                    _ => error.clone(),
                };
                e.last_error = Some(error.clone());
                let valid_until = e.held.valid_until();
                if now >= valid_until {
                    lost.push((id, LossCause::Backend(error)));
                } else {
                    let backoff = if e.backoff.is_zero() {
                        first_backoff(e.held.ttl)
                    } else {
                        e.backoff
                    };
                    let due = (now + backoff).min(valid_until);
                    e.backoff = (backoff * 2).min(e.held.ttl / 6);
                    wake |= s.schedule(id, due);
                }
            }
        }
    }
    let lost: Vec<_> = lost
        .into_iter()
        .filter_map(|(id, cause)| s.remove(id).map(|held| (held, cause)))
        .collect();
    drop(s);
    if !lost.is_empty() {
        registry.notify_changed();
    }
    for (held, cause) in lost {
        lose(registry, &held, cause, now);
    }
    if wake {
        registry.wake.notify_one();
    }
}

async fn send_batch(registry: Arc<Registry>, batch: Batch) {
    let sent_at = Instant::now();
    let deadline = batch.deadline.unwrap_or(sent_at);
    let call = registry.backend.extend_many(&batch.requests);
    let mut timed_out = false;
    let len = batch.requests.len();
    let answers = match tokio::time::timeout_at(deadline, call).await {
        Ok(answers) if answers.len() == len => answers,
        Ok(answers) => {
            let error = BackendError::message(
                BackendErrorKind::Protocol,
                format!(
                    "extend_many answered {} results for {len} leases",
                    answers.len()
                ),
            );
            vec![Err(error); len]
        }
        Err(_) => {
            timed_out = true;
            let error =
                BackendError::timeout("extension", deadline.saturating_duration_since(sent_at));
            vec![Err(error); len]
        }
    };
    apply(&registry, &batch, sent_at, answers, timed_out);
}

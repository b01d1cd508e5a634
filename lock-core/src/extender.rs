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
//! The task runs on the process's background runtime
//! ([`Background`](crate::Background)), so no caller's runtime being idle,
//! blocked or dropped stops it \[T1\]. With
//! [`LockerOptions::caller_runtime`](crate::LockerOptions::caller_runtime)
//! it runs on the runtime of the call that started it; if that runtime
//! goes away, the task's end is noticed and the next lock taken starts a
//! new one.
//!
//! [`Capabilities::max_extend_batch`]: crate::Capabilities::max_extend_batch

use std::collections::BTreeSet;
use std::sync::{Arc, Weak};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

use crate::backend::{ExtendOutcome, ExtendRequest};
use crate::error::{BackendError, BackendErrorKind, LossCause};
use crate::held::HeldLock;
use crate::metrics::Step;
use crate::registry::{Ending, Entries, Registry};

/// The first pause before an extension that failed is sent again.
fn first_backoff(ttl: Duration) -> Duration {
    (ttl / 30).max(Duration::from_millis(10))
}

/// The extender's plan for one held lock, kept with it in the registry.
#[derive(Default)]
pub(crate) struct Plan {
    /// When its next extension is due, if one is scheduled.
    due: Option<Instant>,
    /// The pause before a failed extension is sent again; zero until one
    /// failed (then [`first_backoff`]).
    backoff: Duration,
    last_error: Option<BackendError>,
    /// The store may have freed the lock while an extension was on its
    /// way \[L5\]: that extension's answer may predate it, so the lock is
    /// checked again as soon as it is answered.
    recheck: bool,
}

/// What the registry must do for the extender after a lock was taken.
pub(crate) enum Nudge {
    Nothing,
    /// Wake it: the lock is due before it looks next.
    Wake,
    /// Start it: none runs.
    Start,
}

/// The extender's timetable, kept under the registry's lock (a lock's
/// plan and its place here change with its stay in the registry), and
/// changed only here.
#[derive(Default)]
pub(crate) struct Timetable {
    /// The extensions due, by time.
    due: BTreeSet<(Instant, u64)>,
    /// Callbacks' locks taken since the extender last looked, not yet in
    /// `due`: most are released before their first extension is due, and
    /// then never cost a timetable entry. Ids of locks already gone are
    /// skipped when the extender looks.
    unscheduled: Vec<u64>,
    /// A callback's lock was taken since the extender last looked.
    taken_since_look: bool,
    /// The ttl of the last callback's lock taken.
    last_ttl: Duration,
    running: bool,
    /// When the extender looks at the timetable next; `None` while it
    /// waits for a wake-up. A lock due later needs no wake-up.
    wakes_at: Option<Instant>,
    /// Shutdown ended every lock: the extender stops.
    closed: bool,
}

impl Timetable {
    /// Whether an extender task runs.
    pub(crate) fn is_running(&self) -> bool {
        self.running
    }

    /// A callback's lock `id` was taken, its first extension due at
    /// `first_due`.
    pub(crate) fn taken(
        &mut self,
        entries: &Entries,
        id: u64,
        first_due: Instant,
        ttl: Duration,
    ) -> Nudge {
        // Put in `due` when the extender next looks, which it does by
        // `wakes_at`: woken only to look earlier.
        if self.unscheduled.len() >= 64 && self.unscheduled.len() > 2 * entries.len() {
            self.unscheduled.retain(|id| entries.contains_key(id));
        }
        self.unscheduled.push(id);
        self.taken_since_look = true;
        self.last_ttl = ttl;
        let wake = self.wakes_at.is_none_or(|at| first_due < at);
        if wake {
            self.wakes_at = Some(first_due);
        }
        if !self.running {
            self.running = true;
            Nudge::Start
        } else if wake {
            Nudge::Wake
        } else {
            Nudge::Nothing
        }
    }

    /// A lock left the registry with `plan`.
    pub(crate) fn left(&mut self, id: u64, plan: &Plan) {
        if let Some(due) = plan.due {
            self.due.remove(&(due, id));
        }
    }

    /// Shutdown ended every lock.
    pub(crate) fn close(&mut self) {
        self.closed = true;
        self.due.clear();
        self.unscheduled.clear();
    }

    /// Schedules an extension; returns whether the extender must be woken
    /// to see it in time.
    fn schedule(&mut self, entries: &mut Entries, id: u64, due: Instant) -> bool {
        let Some(e) = entries.get_mut(&id) else {
            return false;
        };
        e.plan.due = Some(due);
        self.due.insert((due, id));
        if self.wakes_at.is_none_or(|at| due < at) {
            self.wakes_at = Some(due);
            return true;
        }
        false
    }

    /// Schedules the first extension of every lock in `unscheduled` that is
    /// still held.
    fn schedule_taken(&mut self, entries: &mut Entries) {
        let mut taken = std::mem::take(&mut self.unscheduled);
        for &id in &taken {
            let due = match entries.get(&id) {
                Some(e) if e.plan.due.is_none() => e.held.extension_due(),
                _ => continue,
            };
            self.schedule(entries, id, due);
        }
        taken.clear();
        self.unscheduled = taken;
    }

    /// Makes sure lock `id` is checked by `by` \[L5\]: the extension's
    /// answer tells, still ours or lost (`Taken`). A lock already due by
    /// then is left as it is, so that checks of locks taken together go
    /// out in one batch with their extensions; an extension on its way is
    /// answered first, then the lock is checked again at once. `None` once
    /// the lock left the registry, else whether to wake the extender.
    pub(crate) fn check_within(
        &mut self,
        entries: &mut Entries,
        id: u64,
        by: Instant,
    ) -> Option<bool> {
        let e = entries.get_mut(&id)?;
        Some(match e.plan.due {
            Some(due) if due <= by => false,
            Some(due) => {
                self.due.remove(&(due, id));
                self.schedule(entries, id, by)
            }
            None if e.held.is_extending() => {
                e.plan.recheck = true;
                false
            }
            // Not scheduled yet: its first extension, if due by then.
            None if e.held.extension_due() <= by => false,
            None => self.schedule(entries, id, by),
        })
    }
}

/// Starts the extender of `registry` where its background work runs.
pub(crate) fn start(registry: &Arc<Registry>) {
    let running = Running(Arc::downgrade(registry));
    registry.spawn(run(running, Arc::clone(&registry.wake)));
}

/// Marks the extender stopped when its task ends or is dropped with its
/// runtime.
struct Running(Weak<Registry>);

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(registry) = self.0.upgrade() {
            let mut s = registry.lock();
            let (_, timetable) = s.for_extender();
            timetable.running = false;
            timetable.wakes_at = None;
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
            let Some((batches, next)) = take_due(&registry, Instant::now()) else {
                return;
            };
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
/// ends as lost those whose validity ran out before an extension could be
/// sent, and says when to wake next. `None` once shutdown closed the
/// registry: the extender stops.
fn take_due(registry: &Arc<Registry>, now: Instant) -> Option<(Vec<Batch>, Option<Instant>)> {
    let mut s = registry.lock();
    let (entries, tt) = s.for_extender();
    if tt.closed {
        return None;
    }
    tt.schedule_taken(entries);
    let mut due_now = Vec::new();
    let mut lost = Vec::new();
    while let Some(&(due, id)) = tt.due.first() {
        let Some(e) = entries.get_mut(&id) else {
            tt.due.pop_first();
            continue;
        };
        let ttl = e.held.ttl;
        // A retry after a failure waits out its backoff: taken early, one
        // due at the end of the validity would be sent again at once, in
        // a loop, as long as a store fails fast.
        let early = if e.plan.backoff.is_zero() {
            ttl / 12
        } else {
            Duration::ZERO
        };
        if due > now + early {
            break;
        }
        tt.due.pop_first();
        e.plan.due = None;
        let valid_until = e.held.valid_until();
        if now >= valid_until {
            let error = e.plan.last_error.clone().unwrap_or_else(|| {
                BackendError::message(
                    BackendErrorKind::Timeout,
                    "the lock's validity ran out before an extension could be sent",
                )
            });
            lost.push((id, LossCause::Backend(error)));
            continue;
        }
        let request = ExtendRequest {
            lease: e.held.lease.clone(),
            ttl,
        };
        let held = Arc::clone(&e.held);
        held.extension_sent();
        // Sent after any release announced so far.
        e.plan.recheck = false;
        due_now.push((id, held, request, valid_until));
    }
    // With nothing to extend right after locks were taken (most are
    // released before a first extension), look again in a quarter of a
    // ttl rather than wait to be woken: the locks taken meanwhile are due
    // later, so taking them wakes nobody. Only a look that saw no lock
    // taken since the last one lets the extender sleep until woken.
    let next = match tt.due.first() {
        Some(&(due, _)) => Some(due),
        None if tt.taken_since_look => Some(now + tt.last_ttl / 4),
        None => None,
    };
    tt.taken_since_look = false;
    tt.wakes_at = next;
    drop(s);
    for (id, cause) in lost {
        registry.end(id, Ending::Lost(cause));
    }
    Some((batches(registry, due_now), next))
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

/// Applies the answer to one batch sent at `sent_at`. `timed_out`: the
/// error is the driver's own deadline, not the store's answer.
fn apply(
    registry: &Arc<Registry>,
    batch: &Batch,
    sent_at: Instant,
    answers: Vec<Result<ExtendOutcome, BackendError>>,
    timed_out: bool,
) {
    let now = Instant::now();
    let mut s = registry.lock();
    let (entries, tt) = s.for_extender();
    let mut lost = Vec::new();
    let mut wake = false;
    for (&id, answer) in batch.ids.iter().zip(answers) {
        let Some(e) = entries.get_mut(&id) else {
            continue; // released while the batch was in flight
        };
        // Each lease's own answer \[L4\].
        let result = answer.as_ref().copied();
        let key = e.held.lease.key_arc();
        registry.meter.extension(key, result);
        if result.is_err() {
            registry.meter.backend_error(key, Step::Extend);
        }
        let plan = &mut e.plan;
        match result {
            Ok(ExtendOutcome::Extended) => {
                e.held.confirm(sent_at);
                plan.backoff = Duration::ZERO;
                plan.last_error = None;
                tracing::trace!(key = %e.held.lease.key(), fencing_token = e.held.lease.fencing_token(), "lock extended");
                // [L5] A release announced while it was on its way: the
                // answer may predate it.
                let due = if std::mem::take(&mut plan.recheck) {
                    now
                } else {
                    e.held.extension_due()
                };
                wake |= tt.schedule(entries, id, due);
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
                tracing::debug!(key = %e.held.lease.key(), error = %crate::ErrorChain(error), "lock extension failed; retrying");
                // A last try cut short by the validity deadline says less
                // than the store's own error before it.
                let error = match (&plan.last_error, timed_out) {
                    (Some(earlier), true) => earlier.clone(),
                    _ => error.clone(),
                };
                plan.last_error = Some(error.clone());
                let valid_until = e.held.valid_until();
                if now >= valid_until {
                    lost.push((id, LossCause::Backend(error)));
                } else {
                    let backoff = if plan.backoff.is_zero() {
                        first_backoff(e.held.ttl)
                    } else {
                        plan.backoff
                    };
                    let due = (now + backoff).min(valid_until);
                    plan.backoff = (backoff * 2).min(e.held.ttl / 6);
                    wake |= tt.schedule(entries, id, due);
                }
            }
        }
    }
    drop(s);
    for (id, cause) in lost {
        registry.end(id, Ending::Lost(cause));
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

impl Timetable {
    /// The extensions scheduled and the locks taken but not yet looked at
    /// \[T2\]: one per held lock at most (the unscheduled list drops the
    /// ids of locks gone once it is twice as long as the held locks).
    pub(crate) fn counts(&self) -> [(&'static str, usize); 2] {
        [
            ("extender: scheduled", self.due.len()),
            ("extender: unscheduled", self.unscheduled.len()),
        ]
    }
}

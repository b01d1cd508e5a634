//! The registry of the locks a locker holds and of the releases it owes.
//!
//! A lock is in the registry from the moment it is taken until its release
//! is sent, or it is lost. A release is owed from the moment the lock leaves
//! the registry to be released until the store answered it (or the release
//! was given up). Shutdown waits on both: first for the callbacks, then for
//! every owed release \[S1\].

use std::collections::BTreeSet;
use std::future::Future;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tokio::runtime::Handle;
use tokio::sync::Notify;
use tokio::time::Instant;

use crate::backend::{DynLockBackend, Lease, ReleaseOutcome};
use crate::error::{BackendError, LossCause};
use crate::held::{HeldLock, Holder};
use crate::metrics::Meter;
use crate::release::{Cleanup, OwedRelease};
use crate::task::Signal;

/// A held lock, with the extender's bookkeeping for it.
pub(crate) struct Entry {
    pub(crate) held: Arc<HeldLock>,
    /// When its next extension is due, if one is scheduled.
    pub(crate) due: Option<Instant>,
    /// The pause before a failed extension is sent again; zero until one
    /// failed (then [`first_backoff`](crate::extender::first_backoff)).
    pub(crate) backoff: Duration,
    pub(crate) last_error: Option<BackendError>,
    /// The store may have freed the lock while an extension was on its
    /// way \[L5\]: that extension's answer may predate it, so the lock is
    /// checked again as soon as it is answered.
    pub(crate) recheck: bool,
}

/// The held locks, by id: a slab. An id is its slot's index in the low 32
/// bits and the slot's generation, counted up at every removal, in the high
/// 32, so that an id kept after its lock left (by the schedule, or by an
/// extension in flight) never finds the lock that took its slot next.
/// Taking and leaving a slot costs no hashing, and the slots of released
/// locks are reused.
#[derive(Default)]
pub(crate) struct Entries {
    slots: Vec<Slot>,
    /// Indexes of the empty slots.
    vacant: Vec<u32>,
    len: usize,
}

#[derive(Default)]
struct Slot {
    generation: u32,
    entry: Option<Entry>,
}

impl Entries {
    fn split(id: u64) -> (usize, u32) {
        // Truncations meant: the two halves of the id.
        ((id & u64::from(u32::MAX)) as usize, (id >> 32) as u32)
    }

    fn slot(&self, id: u64) -> Option<&Slot> {
        let (index, generation) = Self::split(id);
        self.slots
            .get(index)
            .filter(|slot| slot.generation == generation)
    }

    fn slot_mut(&mut self, id: u64) -> Option<&mut Slot> {
        let (index, generation) = Self::split(id);
        self.slots
            .get_mut(index)
            .filter(|slot| slot.generation == generation)
    }

    pub(crate) fn get(&self, id: &u64) -> Option<&Entry> {
        self.slot(*id)?.entry.as_ref()
    }

    pub(crate) fn get_mut(&mut self, id: &u64) -> Option<&mut Entry> {
        self.slot_mut(*id)?.entry.as_mut()
    }

    pub(crate) fn contains_key(&self, id: &u64) -> bool {
        self.get(id).is_some()
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Stores `entry` in a free slot; returns its id.
    fn insert(&mut self, entry: Entry) -> u64 {
        let index = match self.vacant.pop() {
            Some(index) => index,
            None => {
                // A registry of 2^32 locks at once would have run out of
                // memory long before.
                let index = u32::try_from(self.slots.len()).unwrap_or(u32::MAX);
                self.slots.push(Slot::default());
                index
            }
        };
        let slot = &mut self.slots[index as usize];
        slot.entry = Some(entry);
        self.len += 1;
        (u64::from(slot.generation) << 32) | u64::from(index)
    }

    fn remove(&mut self, id: &u64) -> Option<Entry> {
        let slot = self.slot_mut(*id)?;
        let entry = slot.entry.take()?;
        slot.generation = slot.generation.wrapping_add(1);
        // The low half of the id is the slot's index.
        self.vacant.push((*id & u64::from(u32::MAX)) as u32);
        self.len -= 1;
        Some(entry)
    }

    /// Takes every entry out.
    fn drain(&mut self) -> Vec<Entry> {
        let mut drained = Vec::with_capacity(self.len);
        self.len = 0;
        self.vacant.clear();
        for (index, slot) in (0..).zip(&mut self.slots) {
            if let Some(entry) = slot.entry.take() {
                slot.generation = slot.generation.wrapping_add(1);
                drained.push(entry);
            }
            self.vacant.push(index);
        }
        drained
    }
}

#[derive(Default)]
pub(crate) struct State {
    pub(crate) entries: Entries,
    /// The extensions due, by time.
    pub(crate) schedule: BTreeSet<(Instant, u64)>,
    /// Callbacks' locks taken since the extender last looked, not yet in
    /// `schedule`: most are released before their first extension is due,
    /// and then never cost a schedule entry. Ids of locks already gone are
    /// skipped when the extender looks.
    pub(crate) unscheduled: Vec<u64>,
    /// A callback's lock was taken since the extender last looked.
    pub(crate) taken_since_look: bool,
    /// The ttl of the last callback's lock taken.
    pub(crate) last_ttl: Duration,
    callbacks: usize,
    owed: usize,
    /// Owed releases that failed or were given up since shutdown began.
    failed_while_closing: usize,
    pub(crate) extender_running: bool,
    /// When the extender looks at the schedule next; `None` while it waits
    /// for a wake-up. A lock due later needs no wake-up.
    pub(crate) extender_wakes_at: Option<Instant>,
    /// Shutdown began: no new locks.
    no_new: bool,
    /// Shutdown drained the registry: the extender stops.
    pub(crate) closed: bool,
    /// The runtime that last took a lock, for releases started outside one.
    runtime: Option<Handle>,
}

impl State {
    /// Schedules an extension; returns whether the extender must be woken
    /// to see it in time.
    pub(crate) fn schedule(&mut self, id: u64, due: Instant) -> bool {
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

    /// Schedules the first extension of every lock in `unscheduled` that is
    /// still held.
    pub(crate) fn schedule_taken(&mut self) {
        let mut taken = std::mem::take(&mut self.unscheduled);
        for &id in &taken {
            let due = match self.entries.get(&id) {
                Some(e) if e.due.is_none() => e.held.extension_due(),
                _ => continue,
            };
            self.schedule(id, due);
        }
        taken.clear();
        self.unscheduled = taken;
    }

    /// Takes a lock out; returns its record.
    pub(crate) fn remove(&mut self, id: u64) -> Option<Arc<HeldLock>> {
        let e = self.entries.remove(&id)?;
        if let Some(due) = e.due {
            self.schedule.remove(&(due, id));
        }
        if e.held.holder == Holder::Callback {
            self.callbacks -= 1;
        }
        Some(e.held)
    }
}

pub(crate) struct Registry {
    state: Mutex<State>,
    /// Wakes the extender when the schedule changed or the registry closed.
    pub(crate) wake: Arc<Notify>,
    /// Wakes shutdown when the callbacks or the owed releases changed. Every
    /// change is made under `state`'s lock, and every waiter's condition
    /// reads it under that lock.
    changed: Signal,
    pub(crate) backend: Arc<DynLockBackend>,
    pub(crate) max_batch: usize,
    pub(crate) cleanup: Arc<Cleanup>,
    pub(crate) meter: Meter,
}

impl Registry {
    pub(crate) fn new(backend: Arc<DynLockBackend>, meter: Meter) -> Self {
        let max_batch = backend.capabilities().max_extend_batch.max(1);
        Self {
            state: Mutex::default(),
            wake: Arc::new(Notify::new()),
            changed: Signal::default(),
            cleanup: Arc::new(Cleanup::new(Arc::clone(&backend), meter.clone())),
            backend,
            max_batch,
            meter,
        }
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Records a lock just taken. Returns `None` once shutdown began: the
    /// caller must then release it itself.
    pub(crate) fn insert(self: &Arc<Self>, held: Arc<HeldLock>) -> Option<u64> {
        let mut s = self.lock();
        if s.no_new {
            return None;
        }
        // The runtime of the extender, or of the call if none runs: a
        // runtime that ended took its extender with it.
        if s.runtime.is_none() || !s.extender_running {
            if let Ok(runtime) = Handle::try_current() {
                s.runtime = Some(runtime);
            }
        }
        let (holder, ttl) = (held.holder, held.ttl);
        let first_due = (holder == Holder::Callback).then(|| held.extension_due());
        let id = s.entries.insert(Entry {
            backoff: Duration::ZERO,
            held,
            due: None,
            last_error: None,
            recheck: false,
        });
        if let Some(first_due) = first_due {
            s.callbacks += 1;
            // Scheduled when the extender next looks, which it does by
            // `extender_wakes_at`: woken only to look earlier.
            if s.unscheduled.len() >= 64 && s.unscheduled.len() > 2 * s.entries.len() {
                let State {
                    unscheduled,
                    entries,
                    ..
                } = &mut *s;
                unscheduled.retain(|id| entries.contains_key(id));
            }
            s.unscheduled.push(id);
            s.taken_since_look = true;
            s.last_ttl = ttl;
            let wake = s.extender_wakes_at.is_none_or(|at| first_due < at);
            if wake {
                s.extender_wakes_at = Some(first_due);
            }
            if !s.extender_running {
                s.extender_running = true;
                drop(s);
                crate::extender::start(self);
            } else if wake {
                self.wake.notify_one();
            }
        }
        Some(id)
    }

    /// Makes sure a callback's lock is checked within `within` from now:
    /// the store may have freed the key without this node (an operator's
    /// force release) \[L5\]. The extension's answer tells: still ours, or
    /// lost (`Taken`). A lock already due by then is left as it is, so
    /// that checks of locks taken together go out in one batch with their
    /// extensions; an extension on its way is answered first, then the
    /// lock is checked again at once. False once the lock left the
    /// registry.
    pub(crate) fn check_within(&self, id: u64, within: Duration) -> bool {
        let mut s = self.lock();
        let Some(e) = s.entries.get_mut(&id) else {
            return false;
        };
        let by = Instant::now() + within;
        let wake = match e.due {
            Some(due) if due <= by => false,
            Some(due) => {
                s.schedule.remove(&(due, id));
                s.schedule(id, by)
            }
            None if e.held.is_extending() => {
                e.recheck = true;
                false
            }
            // Not scheduled yet: its first extension, if due by then.
            None if e.held.extension_due() <= by => false,
            None => s.schedule(id, by),
        };
        drop(s);
        if wake {
            self.wake.notify_one();
        }
        true
    }

    /// Takes a lock out that was lost: no release is owed for it.
    pub(crate) fn forget(&self, id: u64) -> Option<Arc<HeldLock>> {
        let held = self.lock().remove(id)?;
        self.changed.notify_waiters_after_locked_change();
        Some(held)
    }

    /// Takes a lock out to release it. `None` if it was already taken out
    /// (lost, or released by shutdown). The release is owed until the
    /// returned value is sent and answered, or dropped.
    pub(crate) fn take_for_release(self: &Arc<Self>, id: u64) -> Option<OwedRelease> {
        let held = self.take_owed(id)?;
        self.changed.notify_waiters_after_locked_change();
        Some(OwedRelease::new(Arc::clone(self), held.lease.clone()))
    }

    /// As [`take_for_release`](Self::take_for_release), for a lock whose
    /// call was dropped: its record is marked ended once it is taken out.
    /// (A lock already taken out was lost, or released by shutdown, which
    /// marked its record lost.)
    pub(crate) fn take_ended_for_release(self: &Arc<Self>, id: u64) -> Option<OwedRelease> {
        let held = self.take_owed(id)?;
        held.mark_ended();
        self.changed.notify_waiters_after_locked_change();
        Some(OwedRelease::new(Arc::clone(self), held.lease.clone()))
    }

    /// Takes a lock out to leave it to its minimum hold \[H7\]: its hold
    /// step is owed like a release (shutdown waits for it) until
    /// [`release_settled`](Self::release_settled). False if it was already
    /// taken out (lost, or released by shutdown).
    pub(crate) fn take_for_hold(&self, id: u64) -> bool {
        let taken = self.take_owed(id).is_some();
        if taken {
            self.changed.notify_waiters_after_locked_change();
        }
        taken
    }

    /// Takes a lock out, its release counted as owed from now on; those
    /// waiting for the registry to change are not told yet.
    fn take_owed(&self, id: u64) -> Option<Arc<HeldLock>> {
        let mut s = self.lock();
        let held = s.remove(id)?;
        s.owed += 1;
        Some(held)
    }

    /// Takes a lock out to release it (`None` as
    /// [`take_for_release`](Self::take_for_release)) and sends the release
    /// to a backend that answers at once: then the answer, settled. Else
    /// the release, owed from now on, with the failed answer if there was
    /// one (to hand to [`OwedRelease::send_until`]).
    #[allow(clippy::type_complexity)]
    pub(crate) fn release_at_once(
        self: &Arc<Self>,
        id: u64,
        now: Instant,
    ) -> Option<Result<Result<ReleaseOutcome, BackendError>, (OwedRelease, Option<BackendError>)>>
    {
        // Owed from the moment it leaves the registry, so that shutdown
        // waits for it; the backend is called with no lock held.
        let held = self.take_owed(id)?;
        match self.backend.release_now(&held.lease, now) {
            Some(Ok(outcome)) => {
                self.release_settled(true);
                tracing::debug!(key = %held.lease.key(), fencing_token = held.lease.fencing_token(), ?outcome, "released");
                Some(Ok(Ok(outcome)))
            }
            answer => {
                self.changed.notify_waiters_after_locked_change();
                let owed = OwedRelease::new(Arc::clone(self), held.lease.clone());
                Some(Err((owed, answer.and_then(Result::err))))
            }
        }
    }

    /// Owes the release of a lease that was never registered (taken after
    /// shutdown began, or answered too late to use).
    pub(crate) fn owe_release(self: &Arc<Self>, lease: Lease) -> OwedRelease {
        self.lock().owed += 1;
        OwedRelease::new(Arc::clone(self), lease)
    }

    /// Records that an owed release was answered (`ok`) or failed or was
    /// given up.
    pub(crate) fn release_settled(&self, ok: bool) {
        let mut s = self.lock();
        s.owed -= 1;
        if !ok && s.no_new {
            s.failed_while_closing += 1;
        }
        drop(s);
        self.changed.notify_waiters_after_locked_change();
    }

    /// Wakes whoever waits in [`wait_until`](Self::wait_until), after a
    /// change made through [`lock`](Self::lock).
    pub(crate) fn notify_changed(&self) {
        self.changed.notify_waiters_after_locked_change();
    }

    /// How many locks are held, by callbacks and handles.
    pub(crate) fn len(&self) -> usize {
        self.lock().entries.len()
    }

    /// Resolves once `done` holds for the registry's state.
    pub(crate) async fn wait_until(&self, done: impl Fn(&State) -> bool) {
        self.changed
            .wait_until(move || done(&self.lock()).then_some(()))
            .await;
    }

    /// Resolves once no callback holds a lock.
    pub(crate) async fn callbacks_done(&self) {
        self.wait_until(|s| s.callbacks == 0).await;
    }

    /// Resolves once every owed release was answered or given up.
    pub(crate) async fn releases_done(&self) {
        self.wait_until(|s| s.owed == 0).await;
    }

    /// How many releases are owed now, and how many failed since shutdown
    /// began.
    pub(crate) fn release_counts(&self) -> (usize, usize) {
        let s = self.lock();
        (s.owed, s.failed_while_closing)
    }

    /// Refuses new locks from now on; held ones are still extended.
    pub(crate) fn close_to_new(&self) {
        self.lock().no_new = true;
    }

    /// Takes out every lock still held, marks each lost with `cause`, and
    /// returns their releases, owed from now on.
    pub(crate) fn drain(self: &Arc<Self>, cause: &LossCause) -> Vec<OwedRelease> {
        let mut s = self.lock();
        s.no_new = true;
        s.closed = true;
        s.schedule.clear();
        s.unscheduled.clear();
        s.callbacks = 0;
        let drained: Vec<Arc<HeldLock>> = s.entries.drain().into_iter().map(|e| e.held).collect();
        s.owed += drained.len();
        drop(s);
        self.changed.notify_waiters_after_locked_change();
        self.wake.notify_one();
        drained
            .into_iter()
            .map(|held| {
                held.mark_lost(cause.clone());
                OwedRelease::new(Arc::clone(self), held.lease.clone())
            })
            .collect()
    }

    /// Runs `task` in the background: on the current runtime, else on the
    /// one that last took a lock (a handle dropped outside any runtime).
    /// Returns false when there is no runtime to run it on.
    pub(crate) fn spawn(&self, task: impl Future<Output = ()> + Send + 'static) -> bool {
        let runtime = Handle::try_current()
            .ok()
            .or_else(|| self.lock().runtime.clone());
        match runtime {
            Some(runtime) => {
                runtime.spawn(task);
                true
            }
            None => false,
        }
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        self.wake.notify_one();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::OwnerToken;

    fn entry() -> Entry {
        let lease = Lease::new("k", OwnerToken::new("n"), 1);
        let held = HeldLock::new(
            0,
            lease,
            Duration::from_secs(30),
            Instant::now(),
            Holder::Callback,
            Meter::new("test", false),
        );
        Entry {
            held: Arc::new(held),
            due: None,
            backoff: Duration::ZERO,
            last_error: None,
            recheck: false,
        }
    }

    #[test]
    fn an_id_kept_after_its_lock_left_never_finds_the_next_one_in_its_slot() {
        let mut entries = Entries::default();
        let first = entries.insert(entry());
        assert!(entries.contains_key(&first));
        assert!(entries.remove(&first).is_some());
        assert!(entries.remove(&first).is_none());
        let second = entries.insert(entry());
        assert_ne!(first, second, "the slot is reused under a new generation");
        assert!(entries.get(&first).is_none());
        assert!(entries.get_mut(&first).is_none());
        assert!(entries.remove(&first).is_none());
        assert!(entries.contains_key(&second));
        let third = entries.insert(entry());
        assert_eq!(entries.len(), 2);
        let drained = entries.drain();
        assert_eq!(drained.len(), 2);
        assert_eq!(entries.len(), 0);
        assert!(!entries.contains_key(&second) && !entries.contains_key(&third));
        let fourth = entries.insert(entry());
        assert!(![first, second, third].contains(&fourth));
        assert!(entries.contains_key(&fourth));
    }
}

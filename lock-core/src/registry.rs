//! The life of a held lock: the registry of the locks a locker holds and
//! of the releases it owes.
//!
//! A lock enters with [`Registry::insert`] when it is taken and leaves
//! through [`Registry::end`] with its [`Ending`]: released by its call,
//! left to its minimum hold, dropped, or lost (shutdown ends all at once,
//! [`Registry::end_all_for_shutdown`]). That one function takes it out,
//! counts what it owes, marks its record and hands on what remains (the
//! release, the clean-up of a key a failure may have left ours). While it
//! is held, the extender keeps it alive on its own timetable
//! ([`crate::extender`]), and ends it there if an extension finds it lost.
//!
//! A release is owed from the moment the lock leaves the registry to be
//! released until the store answered it (or the release was given up).
//! Shutdown waits on both: first for the callbacks, then for every owed
//! release \[S1\].

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tokio::runtime::Handle;
use tokio::sync::Notify;
use tokio::time::Instant;

use crate::backend::{DynLockBackend, Lease, ReleaseOutcome};
use crate::background::Background;
use crate::error::{BackendError, LossCause};
use crate::extender::{self, Nudge, Plan, Timetable};
use crate::held::{HeldLock, Holder};
use crate::metrics::Meter;
use crate::release::{Cleanup, OwedRelease};
use crate::task::Signal;

/// A held lock, with the extender's plan for it.
pub(crate) struct Entry {
    pub(crate) held: Arc<HeldLock>,
    pub(crate) plan: Plan,
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

/// How a held lock leaves the registry. Every way out is one of these,
/// through [`Registry::end`] (or, for all locks at once,
/// [`Registry::end_all_for_shutdown`]).
#[derive(Debug)]
pub(crate) enum Ending {
    /// The call that took it releases it and waits for the store's answer
    /// \[H3\]: the release is owed from now on, and handed to the caller,
    /// who settles the record with [`settle_release`] once it is answered.
    Released,
    /// Its callback settled before its minimum hold ended \[H7\]: it is
    /// left to expire then, not released. The hold's step is owed, as a
    /// release is, and handed to the caller.
    LeftToMinimum,
    /// Its call, handle or guard was dropped, or its callback gave it up
    /// after a loss \[C2\]: the record is marked ended and the release goes
    /// on in the background, owed.
    Dropped,
    /// Lost \[L1, L2\]: an extension or a renewal found it expired or
    /// taken (a key found freed after a release notification is `Taken`:
    /// the watch's check is an extension \[L5\]), or its validity ran out
    /// while the store failed. Nothing is owed; after a backend error the
    /// key may still carry this node's token, so the clean-up frees it
    /// while it may.
    Lost(LossCause),
}

/// Settles the record of a lock its call released (or left to its minimum
/// hold), with the store's answer to a step sent at `sent_at`: a key found
/// not ours was taken while the lock was valid, else it expired \[O6\];
/// an error proves nothing either way. Then the record is ended.
pub(crate) fn settle_release(
    held: &HeldLock,
    answer: Option<&Result<ReleaseOutcome, BackendError>>,
    sent_at: Instant,
) {
    if let Some(Ok(ReleaseOutcome::NotHeld)) = answer {
        held.mark_lost(if held.is_valid_at(sent_at) {
            LossCause::Taken
        } else {
            LossCause::Expired
        });
    }
    held.mark_ended();
}

/// \[O6\] A callback that settled after its lock's validity ran out (a
/// holder that stalled past its ttl) lost the lock, even when no extension
/// ran meanwhile: marked before the lock ends.
pub(crate) fn outlived(held: &HeldLock, settled_at: Instant) {
    if !held.is_valid_at(settled_at) {
        held.mark_lost(LossCause::Expired);
    }
}

#[derive(Default)]
pub(crate) struct State {
    entries: Entries,
    timetable: Timetable,
    callbacks: usize,
    owed: usize,
    /// Owed releases that failed or were given up since shutdown began.
    failed_while_closing: usize,
    /// Shutdown began: no new locks.
    no_new: bool,
    /// With [`Runs::Caller`]: the runtime that last took a lock, for
    /// releases started outside one.
    runtime: Option<Handle>,
}

impl State {
    /// The held locks and the extender's timetable, for the extender.
    pub(crate) fn for_extender(&mut self) -> (&mut Entries, &mut Timetable) {
        (&mut self.entries, &mut self.timetable)
    }

    /// Takes a lock out; returns its record.
    fn remove(&mut self, id: u64) -> Option<Arc<HeldLock>> {
        let e = self.entries.remove(&id)?;
        self.timetable.left(id, &e.plan);
        if e.held.holder == Holder::Callback {
            self.callbacks -= 1;
        }
        Some(e.held)
    }
}

/// The locks a locker holds, and the one way each of them ends.
pub(crate) struct Registry {
    state: Mutex<State>,
    /// Wakes the extender when the timetable changed or the registry closed.
    pub(crate) wake: Arc<Notify>,
    /// Wakes shutdown when the callbacks or the owed releases changed. Every
    /// change is made under `state`'s lock, and every waiter's condition
    /// reads it under that lock.
    changed: Signal,
    pub(crate) backend: Arc<DynLockBackend>,
    pub(crate) max_batch: usize,
    pub(crate) cleanup: Arc<Cleanup>,
    pub(crate) meter: Meter,
    runs: Runs,
    /// Acquisition attempts whose answer is not yet settled: shutdown
    /// waits for them \[S1\]. An atomic, not a field of `state`: every
    /// attempt counts itself, and the state's lock is not taken for it.
    attempts: AtomicUsize,
}

/// Where a locker's background work runs \[T1\].
pub(crate) enum Runs {
    /// On the process's background runtime, whatever runtime the callers
    /// are on.
    Background(Background),
    /// On the runtime of the call that took the latest lock
    /// ([`LockerOptions::caller_runtime`](crate::LockerOptions::caller_runtime)).
    Caller,
}

impl Runs {
    pub(crate) fn new(caller_runtime: bool) -> Self {
        if caller_runtime {
            Self::Caller
        } else {
            Self::Background(Background::default())
        }
    }
}

impl Registry {
    pub(crate) fn new(backend: Arc<DynLockBackend>, meter: Meter, runs: Runs) -> Self {
        let max_batch = backend.capabilities().max_extend_batch.max(1);
        Self {
            state: Mutex::default(),
            wake: Arc::new(Notify::new()),
            changed: Signal::default(),
            cleanup: Arc::new(Cleanup::new(Arc::clone(&backend), meter.clone())),
            backend,
            max_batch,
            meter,
            runs,
            attempts: AtomicUsize::new(0),
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
        // On the caller's runtime: the runtime of the extender, or of the
        // call if none runs: a runtime that ended took its extender with it.
        if matches!(self.runs, Runs::Caller) && (s.runtime.is_none() || !s.timetable.is_running()) {
            if let Ok(runtime) = Handle::try_current() {
                s.runtime = Some(runtime);
            }
        }
        let (holder, ttl) = (held.holder, held.ttl);
        let first_due = (holder == Holder::Callback).then(|| held.extension_due());
        let id = s.entries.insert(Entry {
            held,
            plan: Plan::default(),
        });
        if let Some(first_due) = first_due {
            s.callbacks += 1;
            let State {
                entries, timetable, ..
            } = &mut *s;
            match timetable.taken(entries, id, first_due, ttl) {
                Nudge::Nothing => {}
                Nudge::Wake => {
                    drop(s);
                    self.wake.notify_one();
                }
                Nudge::Start => {
                    drop(s);
                    extender::start(self);
                }
            }
        }
        Some(id)
    }

    /// Makes sure a callback's lock is checked within `within` from now:
    /// the store may have freed the key without this node (an operator's
    /// force release) \[L5\]. False once the lock left the registry.
    pub(crate) fn check_within(&self, id: u64, within: Duration) -> bool {
        let mut s = self.lock();
        let State {
            entries, timetable, ..
        } = &mut *s;
        let Some(wake) = timetable.check_within(entries, id, Instant::now() + within) else {
            return false;
        };
        drop(s);
        if wake {
            self.wake.notify_one();
        }
        true
    }

    /// Ends a lock's stay in the registry, the one way out for a single
    /// lock: takes it out, counts what it owes, marks its record, and hands
    /// on what remains to do. Gives the owed step for [`Ending::Released`]
    /// and [`Ending::LeftToMinimum`]; `None` for the others, and when the
    /// lock had already left (lost, or ended by shutdown, which marked its
    /// record).
    pub(crate) fn end(self: &Arc<Self>, id: u64, ending: Ending) -> Option<OwedRelease> {
        let owes = !matches!(ending, Ending::Lost(_));
        let held = {
            let mut s = self.lock();
            let held = s.remove(id);
            if held.is_some() && owes {
                s.owed += 1;
            }
            held
        };
        let held = held?;
        self.changed.notify_waiters_after_locked_change();
        match ending {
            Ending::Released | Ending::LeftToMinimum => {
                Some(OwedRelease::new(Arc::clone(self), held.lease.clone()))
            }
            Ending::Dropped => {
                held.mark_ended();
                OwedRelease::new(Arc::clone(self), held.lease.clone()).in_background();
                None
            }
            Ending::Lost(cause) => {
                self.lost(&held, cause);
                None
            }
        }
    }

    /// Marks a lock that left the registry lost, and has its key cleaned
    /// up when the cause leaves it possibly ours.
    fn lost(&self, held: &HeldLock, cause: LossCause) {
        if held.holder == Holder::Callback {
            tracing::warn!(
                key = %held.lease.key(),
                fencing_token = held.lease.fencing_token(),
                cause = %crate::ErrorChain(&cause),
                "lock lost"
            );
        }
        let backend_failed = matches!(cause, LossCause::Backend(_));
        held.mark_lost(cause);
        if backend_failed {
            // The key may still carry our token, and an extension still on
            // its way may lengthen it: free it while it may.
            self.cleanup.add(
                self,
                held.lease.key_arc(),
                held.lease.owner().clone(),
                Instant::now() + held.ttl,
            );
        }
    }

    /// Ends every lock still held, for shutdown \[S1\]: each is marked
    /// lost with [`LossCause::Shutdown`] and its release, owed from now
    /// on, is returned for shutdown to send. No lock is taken after it.
    pub(crate) fn end_all_for_shutdown(self: &Arc<Self>) -> Vec<OwedRelease> {
        let mut s = self.lock();
        s.no_new = true;
        s.timetable.close();
        s.callbacks = 0;
        let drained: Vec<Arc<HeldLock>> = s.entries.drain().into_iter().map(|e| e.held).collect();
        s.owed += drained.len();
        drop(s);
        self.changed.notify_waiters_after_locked_change();
        self.wake.notify_one();
        drained
            .into_iter()
            .map(|held| {
                held.mark_lost(LossCause::Shutdown);
                OwedRelease::new(Arc::clone(self), held.lease.clone())
            })
            .collect()
    }

    /// Owes the release of a lease that was never registered (taken after
    /// shutdown began, or answered too late to use).
    pub(crate) fn owe_release(self: &Arc<Self>, lease: Lease) -> OwedRelease {
        self.lock().owed += 1;
        OwedRelease::new(Arc::clone(self), lease)
    }

    /// Records that an owed release was answered (`ok`) or failed or was
    /// given up. Called by [`OwedRelease`] only.
    pub(crate) fn release_settled(&self, ok: bool) {
        let mut s = self.lock();
        s.owed -= 1;
        if !ok && s.no_new {
            s.failed_while_closing += 1;
        }
        drop(s);
        self.changed.notify_waiters_after_locked_change();
    }

    /// Counts an acquisition attempt in flight until the guard is dropped,
    /// which its owner does once the answer is settled: the lock entered
    /// the registry, its release is owed, or its key's clean-up is
    /// pending \[S1\].
    pub(crate) fn attempt_started(self: &Arc<Self>) -> AttemptInFlight {
        self.attempts.fetch_add(1, Ordering::SeqCst);
        AttemptInFlight(Arc::clone(self))
    }

    /// Resolves once no acquisition attempt is in flight.
    pub(crate) async fn attempts_done(&self) {
        self.changed
            .wait_until(|| (self.attempts_in_flight() == 0).then_some(()))
            .await;
    }

    /// How many acquisition attempts are in flight now.
    pub(crate) fn attempts_in_flight(&self) -> usize {
        self.attempts.load(Ordering::SeqCst)
    }

    /// How many locks are held, by callbacks and handles.
    pub(crate) fn len(&self) -> usize {
        self.lock().entries.len()
    }

    /// Resolves once `done` holds for the registry's state.
    async fn wait_until(&self, done: impl Fn(&State) -> bool) {
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

    /// The background runtime's handle, unless the background work runs
    /// on the caller's runtime.
    pub(crate) fn background_handle(&self) -> Option<&Handle> {
        match &self.runs {
            Runs::Background(background) => Some(background.handle()),
            Runs::Caller => None,
        }
    }

    /// Runs `task` in the background \[T1\]: on the process's background
    /// runtime; with [`Runs::Caller`], on the current runtime, else on the
    /// one that last took a lock (a handle dropped outside any runtime).
    /// Returns false when there is no runtime to run it on.
    pub(crate) fn spawn(&self, task: impl Future<Output = ()> + Send + 'static) -> bool {
        if let Runs::Background(background) = &self.runs {
            background.spawn(task);
            return true;
        }
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

/// An acquisition attempt counted in flight while this lives; see
/// [`Registry::attempt_started`].
pub(crate) struct AttemptInFlight(Arc<Registry>);

impl Drop for AttemptInFlight {
    fn drop(&mut self) {
        self.0.attempts.fetch_sub(1, Ordering::SeqCst);
        self.0.changed.notify_waiters();
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        self.wake.notify_one();
    }
}

impl Registry {
    /// Each per-lock structure of the registry, the extender's timetable
    /// and the clean-up, and its size \[T2\]. The slab keeps a slot per
    /// lock held at once at its peak (about 80 bytes each, reused by the
    /// next locks, never given back): it follows the locks held at once,
    /// not the keys ever locked.
    pub(crate) fn counts(&self) -> Vec<(&'static str, usize)> {
        let s = self.lock();
        let mut counts = vec![
            ("registry: held locks", s.entries.len),
            ("registry: slab slots", s.entries.slots.len()),
            ("registry: vacant slots", s.entries.vacant.len()),
            ("registry: attempts in flight", self.attempts_in_flight()),
        ];
        counts.extend(s.timetable.counts());
        drop(s);
        counts.extend(self.cleanup.counts());
        counts
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::backend::{
        AcquireOutcome, Capabilities, ExtendOutcome, ExtendRequest, Hold, LockBackend, OwnerToken,
    };
    use crate::notify::ReleaseWatch;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// Answers every step at once; counts the releases sent.
    #[derive(Debug, Default)]
    struct Counting {
        releases: AtomicUsize,
    }

    #[async_trait::async_trait]
    impl LockBackend for Counting {
        fn capabilities(&self) -> Capabilities {
            Capabilities::default()
        }
        async fn try_acquire(
            &self,
            _: &str,
            _: &OwnerToken,
            _: Duration,
        ) -> Result<AcquireOutcome, BackendError> {
            Ok(AcquireOutcome::Acquired { fencing_token: 1 })
        }
        async fn extend(&self, _: &Lease, _: Duration) -> Result<ExtendOutcome, BackendError> {
            Ok(ExtendOutcome::Extended)
        }
        async fn extend_many(
            &self,
            requests: &[ExtendRequest],
        ) -> Vec<Result<ExtendOutcome, BackendError>> {
            vec![Ok(ExtendOutcome::Extended); requests.len()]
        }
        fn failure_domain(&self, _: &str) -> u64 {
            0
        }
        async fn release(&self, _: &Lease) -> Result<ReleaseOutcome, BackendError> {
            self.releases.fetch_add(1, Ordering::Relaxed);
            Ok(ReleaseOutcome::Released)
        }
        async fn hold(&self, _: &Lease, _: Hold) -> Result<ExtendOutcome, BackendError> {
            Ok(ExtendOutcome::Extended)
        }
        async fn watch_release(&self, _: &str) -> Result<ReleaseWatch, BackendError> {
            Err(BackendError::message(
                crate::error::BackendErrorKind::Protocol,
                "no notifications",
            ))
        }
    }

    /// A registry on a backend that answers every step at once, its
    /// background work on the caller's runtime.
    pub(crate) fn registry_for_tests() -> Arc<Registry> {
        let backend: Arc<DynLockBackend> = Arc::new(Counting::default());
        Arc::new(Registry::new(
            backend,
            Meter::new("test", false),
            Runs::Caller,
        ))
    }

    fn handle_lock(registry: &Arc<Registry>, key: &str) -> (u64, Arc<HeldLock>) {
        let lease = Lease::new(key, OwnerToken::new("n"), 1);
        let held = Arc::new(HeldLock::new(
            0,
            lease,
            Duration::from_secs(30),
            Instant::now(),
            Holder::Handle,
            Meter::new("test", false),
        ));
        let id = registry.insert(Arc::clone(&held)).unwrap();
        (id, held)
    }

    /// Every ending takes the lock out once, owes exactly what it says and
    /// marks the record as it says; a second ending of the same lock finds
    /// nothing.
    #[tokio::test]
    async fn every_ending_owes_and_marks_what_it_says_once() {
        let backend = Arc::new(Counting::default());
        let dyn_backend: Arc<DynLockBackend> = backend.clone();
        let registry = Arc::new(Registry::new(
            dyn_backend,
            Meter::new("test", false),
            Runs::Caller,
        ));
        let releases = || backend.releases.load(Ordering::Relaxed);

        let (released, r) = handle_lock(&registry, "released");
        let owed = registry.end(released, Ending::Released).unwrap();
        assert_eq!(registry.release_counts().0, 1, "owed until answered");
        assert!(registry.end(released, Ending::Dropped).is_none());
        assert_eq!(
            registry.release_counts().0,
            1,
            "a second ending owes nothing"
        );
        let answer = owed.send().await;
        settle_release(&r, Some(&answer), Instant::now());
        assert_eq!(registry.release_counts().0, 0);
        assert!(r.is_ended() && r.loss_cause().is_none());

        let (dropped, d) = handle_lock(&registry, "dropped");
        let before = releases();
        assert!(registry.end(dropped, Ending::Dropped).is_none());
        assert!(d.is_ended());
        assert_eq!(releases(), before + 1, "released in the background");
        assert_eq!(registry.release_counts().0, 0, "and settled");

        let (lost, l) = handle_lock(&registry, "lost");
        let before = releases();
        assert!(registry.end(lost, Ending::Lost(LossCause::Taken)).is_none());
        assert!(matches!(l.loss_cause(), Some(LossCause::Taken)));
        assert_eq!(registry.release_counts().0, 0, "a loss owes nothing");
        assert_eq!(releases(), before, "and sends nothing");

        let (held, _) = handle_lock(&registry, "held");
        let owed = registry.end(held, Ending::LeftToMinimum).unwrap();
        assert_eq!(registry.release_counts().0, 1);
        owed.settled_by_hold(true);
        assert_eq!(registry.release_counts().0, 0);

        let (_, s) = handle_lock(&registry, "shutdown");
        assert_eq!(registry.len(), 1);
        let owed = registry.end_all_for_shutdown();
        assert_eq!((owed.len(), registry.len()), (1, 0));
        assert!(matches!(s.loss_cause(), Some(LossCause::Shutdown)));
        assert_eq!(registry.release_counts().0, 1);
        drop(owed);
        assert_eq!(registry.release_counts(), (0, 1), "given up while closing");
        assert!(
            registry.insert(Arc::clone(&s)).is_none(),
            "none taken after"
        );
    }

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
            plan: Plan::default(),
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

#![doc = include_str!("../README.md")]

use std::sync::{Arc, MutexGuard, PoisonError};
use std::time::Duration;

use hashbrown::hash_map::{EntryRef, OccupiedEntry};
use hashbrown::HashMap;
// `LockBackend` and `OwnerToken` come in with the re-exports below.
use lock_core::{
    async_trait, AcquireOutcome, Capabilities, ExtendOutcome, ExtendRequest, Grant, Hold, Lease,
    QueueTerms, ReleaseHub, ReleaseOutcome, ReleaseWatch,
};
use tokio::time::Instant;

mod admin;

// `lock_core` itself and everything a user needs from it (one list for
// every backend crate), so that this one dependency is enough.
lock_core::reexport_core!();

/// A lock backend in this process's memory, with release notifications.
///
/// Cheap to clone; clones share the same locks. Fencing tokens come from one
/// counter for all keys, so they strictly increase per key while released
/// keys need no record. The entries of the last [`KEPT_FREE`] keys freed
/// are kept for their next acquisition (which then allocates and hashes
/// nothing new); a key freed beyond that takes no memory. An entry whose
/// lock expired without a release is freed by the next step on its key or
/// by the next sweep (see the crate docs) \[T2\].
#[derive(Clone, Default)]
pub struct MemoryBackend {
    inner: Arc<Inner>,
}

#[derive(Default)]
struct Inner {
    state: std::sync::Mutex<State>,
    hub: ReleaseHub,
}

/// How many freed keys keep their entry, for reuse.
pub const KEPT_FREE: usize = 1024;

/// The fewest entries at which the table is swept of expired ones.
const FIRST_SWEEP: usize = 2 * KEPT_FREE;

/// How often a new key sweeps a table of more than [`KEPT_FREE`] entries
/// at most, whatever its growth.
const SWEEP_EVERY: Duration = Duration::from_secs(1);

#[derive(Default)]
struct State {
    // hashbrown for `entry_ref`: one hash per call, and a key is allocated
    // only when its entry is made. foldhash, its default hasher, is seeded
    // per map but only "minimally DoS-resistant", unlike std's SipHash.
    held: HashMap<Box<str>, Holder>,
    fence: u64,
    /// How many entries are kept free (with no owner).
    free: usize,
    /// The table's length at which a new key sweeps it of expired entries
    /// (twice its length after the last sweep, [`FIRST_SWEEP`] at least).
    sweep_at: usize,
    /// When a new key sweeps the table next, whatever its length.
    next_sweep: Option<Instant>,
    /// The fair queue of each key with waiters \[F1\], in arrival order;
    /// a key's entry goes when its last place does.
    queues: HashMap<Box<str>, Queue>,
}

/// After grants in a row for this long, a release leaves the key free for
/// [`GAP`] instead of granting it, and the queue's head waits the gap out,
/// so that callers outside the queue (`no_queue()`) are not starved
/// \[F5\]: the numbers of the Redis backend.
const STREAK: Duration = Duration::from_secs(10);
const GAP: Duration = Duration::from_millis(600);

/// A key's fair queue.
#[derive(Default)]
struct Queue {
    /// The places, in arrival order.
    places: std::collections::VecDeque<Place>,
    /// When the key's current run of grants began.
    streak: Option<Instant>,
    /// Until when the key is left free for callers outside the queue.
    gap_until: Option<Instant>,
}

impl Queue {
    /// Whether the queue holds nothing worth keeping.
    fn is_idle(&self) -> bool {
        self.places.is_empty() && self.streak.is_none() && self.gap_until.is_none()
    }
}

/// A waiter's place in a key's queue.
struct Place {
    owner: OwnerToken,
    /// Renewed by each of the waiter's attempts \[F2\].
    alive_until: Instant,
    /// How long a grant to it lasts unless taken up \[F3\].
    claim: Duration,
}

struct Holder {
    /// `None` once released: the entry is kept free for reuse, counted in
    /// `State::free`, and its last owner token is let go, so that the
    /// driver can draw its next one in the same allocation.
    owner: Option<OwnerToken>,
    /// At or before a free entry's release: a free entry reads as expired.
    expires_at: Instant,
    /// The fencing token of the entry's last acquisition, for the admin.
    fencing_token: u64,
    /// Whether the holder's run ended and the entry is kept to the end of
    /// its minimum hold \[H7\] (`expires_at`), for the admin. Set by the
    /// hold step, cleared by the next acquisition.
    kept: bool,
}

impl MemoryBackend {
    /// An empty backend.
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.inner
            .state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// How many keys are held now (expired ones do not count).
    pub fn held_keys(&self) -> usize {
        let now = Instant::now();
        self.lock()
            .held
            .values()
            .filter(|h| h.expires_at > now)
            .count()
    }

    /// The owner token holding `key` now, if any.
    pub fn holder(&self, key: &str) -> Option<OwnerToken> {
        let now = Instant::now();
        self.lock()
            .held
            .get(key)
            .filter(|h| h.expires_at > now)
            .and_then(|h| h.owner.clone())
    }

    /// How long `key` stays held without an extension, if it is held.
    pub fn remaining_ttl(&self, key: &str) -> Option<Duration> {
        let now = Instant::now();
        self.lock()
            .held
            .get(key)
            .filter(|h| h.expires_at > now)
            .map(|h| h.expires_at - now)
    }

    fn acquire_at(
        &self,
        key: &str,
        owner: &OwnerToken,
        ttl: Duration,
        now: Instant,
    ) -> AcquireOutcome {
        let mut state = self.lock();
        Self::acquire_locked(&mut state, key, owner, ttl, now)
    }

    fn acquire_locked(
        state: &mut State,
        key: &str,
        owner: &OwnerToken,
        ttl: Duration,
        now: Instant,
    ) -> AcquireOutcome {
        let State {
            held,
            fence,
            free,
            sweep_at,
            next_sweep,
            ..
        } = state;
        let holder = Holder {
            owner: Some(owner.clone()),
            expires_at: now + ttl,
            fencing_token: *fence + 1,
            kept: false,
        };
        match held.entry_ref(key) {
            EntryRef::Occupied(slot) if slot.get().expires_at > now => {
                return AcquireOutcome::busy(Some(slot.get().expires_at - now));
            }
            // An expired holder's or a free entry is reused, key and all.
            EntryRef::Occupied(mut slot) => {
                if slot.get().owner.is_none() {
                    *free -= 1;
                }
                *slot.get_mut() = holder;
            }
            EntryRef::Vacant(place) => {
                place.insert(holder);
                let grown = held.len() >= (*sweep_at).max(FIRST_SWEEP);
                let due = held.len() > KEPT_FREE && next_sweep.is_none_or(|at| now >= at);
                if grown || due {
                    Self::sweep(held, free, now);
                    *sweep_at = 2 * held.len();
                    *next_sweep = Some(now + SWEEP_EVERY);
                }
            }
        }
        *fence += 1;
        AcquireOutcome::Acquired {
            fencing_token: *fence,
        }
    }

    fn release_at(&self, lease: &Lease, now: Instant) -> ReleaseOutcome {
        let mut state = self.lock();
        let (outcome, granted) = Self::release_locked(&mut state, lease.key(), lease.owner(), now);
        drop(state);
        self.announce(lease.key(), outcome, granted);
        outcome
    }

    /// Frees `key` if `owner` holds it, granting it to the first live place
    /// of its queue, if any \[F1\].
    fn release_locked(
        state: &mut State,
        key: &str,
        owner: &OwnerToken,
        now: Instant,
    ) -> (ReleaseOutcome, Option<Grant>) {
        let State {
            held,
            free,
            fence,
            queues,
            ..
        } = state;
        let outcome = match held.entry_ref(key) {
            EntryRef::Occupied(slot) if slot.get().owner.is_none() => ReleaseOutcome::NotHeld,
            EntryRef::Occupied(slot) if slot.get().expires_at <= now => {
                // Expired: free, and this lease no longer holds it.
                Self::keep_free(slot, free, now);
                ReleaseOutcome::NotHeld
            }
            EntryRef::Occupied(mut slot) if slot.get().owner.as_ref() == Some(owner) => {
                match Self::next_place(queues, key, now) {
                    Some(place) => {
                        *fence += 1;
                        let holder = slot.get_mut();
                        let grant = Grant::new(place.owner.as_str(), *fence, place.claim);
                        *holder = Holder {
                            owner: Some(place.owner),
                            expires_at: now + place.claim,
                            fencing_token: *fence,
                            kept: false,
                        };
                        return (ReleaseOutcome::Released, Some(grant));
                    }
                    None => Self::keep_free(slot, free, now),
                }
                ReleaseOutcome::Released
            }
            EntryRef::Occupied(_) | EntryRef::Vacant(_) => ReleaseOutcome::NotHeld,
        };
        Self::give_back_room(held);
        (outcome, None)
    }

    /// Wakes the watchers of a key released: its grantee alone, or every
    /// waiter when nobody was queued.
    fn announce(&self, key: &str, outcome: ReleaseOutcome, granted: Option<Grant>) {
        match granted {
            Some(grant) => self.inner.hub.grant(key, grant),
            None if outcome == ReleaseOutcome::Released => self.inner.hub.notify(key),
            None => {}
        }
    }

    /// Takes the first live place off `key`'s queue, dropping the places
    /// whose waiters stopped renewing them \[F2\]; none when nobody live
    /// waits (the queue goes), or when the key is to be left free for a
    /// gap after a long run of grants \[F5\].
    fn next_place(queues: &mut HashMap<Box<str>, Queue>, key: &str, now: Instant) -> Option<Place> {
        let queue = queues.get_mut(key)?;
        let Some(next) =
            std::iter::from_fn(|| queue.places.pop_front()).find(|place| place.alive_until > now)
        else {
            queues.remove(key);
            return None;
        };
        match queue.streak {
            None => queue.streak = Some(now),
            Some(since) if now.saturating_duration_since(since) >= STREAK => {
                queue.streak = None;
                queue.gap_until = Some(now + GAP);
                queue.places.push_front(next);
                return None;
            }
            Some(_) => {}
        }
        Some(next)
    }

    /// One attempt of a queued waiter \[F1\]; see
    /// [`LockBackend::try_acquire_queued`].
    fn acquire_queued_at(
        &self,
        key: &str,
        owner: &OwnerToken,
        ttl: Duration,
        terms: QueueTerms,
        now: Instant,
    ) -> AcquireOutcome {
        let mut state = self.lock();
        let state = &mut *state;
        let queue = state.queues.entry_ref(key).or_default();
        queue.places.retain(|place| place.alive_until > now);
        let ours = queue.places.iter().position(|place| place.owner == *owner);
        let first = queue.places.front().map(|place| &place.owner);
        let ahead = first.is_some_and(|first| first != owner);
        // [F5] A gap left for callers outside the queue: waited out.
        let gap = queue.gap_until.filter(|until| *until > now);
        queue.gap_until = gap;
        // A grant to this waiter: taken up.
        if let Some(holder) = state.held.get_mut(key) {
            if holder.expires_at > now && holder.owner.as_ref() == Some(owner) {
                holder.expires_at = now + ttl;
                let fencing_token = holder.fencing_token;
                Self::drop_place(&mut state.queues, key, owner);
                return AcquireOutcome::Acquired { fencing_token };
            }
        }
        if !ahead && gap.is_none() {
            let answer = Self::acquire_locked(state, key, owner, ttl, now);
            if matches!(answer, AcquireOutcome::Acquired { .. }) {
                // Taken free, not granted: the run of grants ends.
                if let Some(queue) = state.queues.get_mut(key) {
                    queue.streak = None;
                }
                Self::drop_place(&mut state.queues, key, owner);
                return answer;
            }
        }
        let queue = state.queues.entry_ref(key).or_default();
        let alive_until = now + terms.ticket_ttl;
        match ours {
            Some(i) => queue.places[i].alive_until = alive_until,
            None => queue.places.push_back(Place {
                owner: owner.clone(),
                alive_until,
                claim: terms.claim,
            }),
        }
        let head = queue
            .places
            .front()
            .is_some_and(|place| place.owner == *owner);
        let expires_in = match gap {
            Some(until) => head.then(|| until - now),
            None => state
                .held
                .get(key)
                .filter(|holder| head && holder.expires_at > now)
                .map(|holder| holder.expires_at - now),
        };
        AcquireOutcome::Busy {
            expires_in,
            last_token: Some(state.fence),
        }
    }

    fn drop_place(queues: &mut HashMap<Box<str>, Queue>, key: &str, owner: &OwnerToken) {
        if let Some(queue) = queues.get_mut(key) {
            queue.places.retain(|place| place.owner != *owner);
            if queue.is_idle() {
                queues.remove(key);
            }
        }
    }

    /// Leaves `owner`'s place; a grant it did not take up is handed on as
    /// a release would.
    fn leave_at(&self, key: &str, owner: &OwnerToken, now: Instant) {
        let mut state = self.lock();
        Self::drop_place(&mut state.queues, key, owner);
        let granted = state
            .held
            .get(key)
            .is_some_and(|holder| holder.expires_at > now && holder.owner.as_ref() == Some(owner));
        if granted {
            let (outcome, grant) = Self::release_locked(&mut state, key, owner, now);
            drop(state);
            self.announce(key, outcome, grant);
        }
    }

    /// Frees the entry of `slot`: kept for reuse while fewer than
    /// [`KEPT_FREE`] are, else removed.
    fn keep_free<S: std::hash::BuildHasher>(
        mut slot: OccupiedEntry<'_, Box<str>, Holder, S>,
        free: &mut usize,
        now: Instant,
    ) {
        if *free >= KEPT_FREE {
            slot.remove();
            return;
        }
        *free += 1;
        let holder = slot.get_mut();
        holder.owner = None;
        holder.expires_at = holder.expires_at.min(now);
    }

    /// Frees every entry whose lock expired without a release (kept for
    /// reuse while fewer than [`KEPT_FREE`] are, else removed), and gives
    /// back the table's room once it is less than a quarter full.
    fn sweep(held: &mut HashMap<Box<str>, Holder>, free: &mut usize, now: Instant) {
        held.retain(|_, holder| {
            if holder.owner.is_none() || holder.expires_at > now {
                return true;
            }
            if *free >= KEPT_FREE {
                return false;
            }
            *free += 1;
            holder.owner = None;
            true
        });
        Self::give_back_room(held);
    }

    fn give_back_room<S: std::hash::BuildHasher>(held: &mut HashMap<Box<str>, Holder, S>) {
        let len = held.len();
        if held.capacity() > 4 * KEPT_FREE && len < held.capacity() / 4 {
            held.shrink_to(2 * len);
        }
    }

    /// Extends `lease` to `ttl` from `now`; `kept`: the step is the hold
    /// step \[H7\], recorded for the admin.
    fn extend_one(
        state: &mut State,
        lease: &Lease,
        ttl: Duration,
        now: Instant,
        kept: bool,
    ) -> ExtendOutcome {
        let State { held, free, .. } = state;
        match held.entry_ref(lease.key()) {
            EntryRef::Occupied(slot) if slot.get().expires_at <= now => {
                // Freed now, not left for the key's next acquisition.
                if slot.get().owner.is_some() {
                    Self::keep_free(slot, free, now);
                }
                ExtendOutcome::Expired
            }
            EntryRef::Occupied(mut slot) if slot.get().owner.as_ref() == Some(lease.owner()) => {
                let holder = slot.get_mut();
                holder.expires_at = now + ttl;
                holder.kept = kept;
                ExtendOutcome::Extended
            }
            EntryRef::Occupied(_) => ExtendOutcome::Taken,
            EntryRef::Vacant(_) => ExtendOutcome::Expired,
        }
    }

    /// Test-only: each per-key structure of the backend and its size
    /// \[T2\]: the table's entries (held, kept free, and expired but not
    /// yet freed), its room, and the release hub's.
    #[doc(hidden)]
    pub fn state_counts(&self) -> Vec<(&'static str, usize)> {
        let now = Instant::now();
        let state = self.lock();
        let expired = state
            .held
            .values()
            .filter(|h| h.owner.is_some() && h.expires_at <= now)
            .count();
        let mut counts = vec![
            ("memory: entries", state.held.len()),
            ("memory: free entries", state.free),
            ("memory: expired entries", expired),
            ("memory: table capacity", state.held.capacity()),
            ("memory: queued keys", state.queues.len()),
        ];
        drop(state);
        counts.extend(self.inner.hub.state_counts());
        counts
    }
}

impl std::fmt::Debug for MemoryBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryBackend")
            .field("held_keys", &self.held_keys())
            .finish()
    }
}

#[async_trait]
impl LockBackend for MemoryBackend {
    fn capabilities(&self) -> Capabilities {
        Capabilities::default()
            .with_name("memory")
            .with_release_notifications(true)
            .with_max_extend_batch(10_000)
            .with_fair_queue(true)
    }

    async fn try_acquire_queued(
        &self,
        key: &str,
        owner: &OwnerToken,
        ttl: Duration,
        terms: QueueTerms,
    ) -> Result<AcquireOutcome, BackendError> {
        Ok(self.acquire_queued_at(key, owner, ttl, terms, Instant::now()))
    }

    async fn leave_queue(&self, key: &str, owner: &OwnerToken) -> Result<(), BackendError> {
        self.leave_at(key, owner, Instant::now());
        Ok(())
    }

    async fn try_acquire(
        &self,
        key: &str,
        owner: &OwnerToken,
        ttl: Duration,
    ) -> Result<AcquireOutcome, BackendError> {
        Ok(self.acquire_at(key, owner, ttl, Instant::now()))
    }

    async fn extend(&self, lease: &Lease, ttl: Duration) -> Result<ExtendOutcome, BackendError> {
        Ok(Self::extend_one(
            &mut self.lock(),
            lease,
            ttl,
            Instant::now(),
            false,
        ))
    }

    async fn extend_many(
        &self,
        requests: &[ExtendRequest],
    ) -> Vec<Result<ExtendOutcome, BackendError>> {
        let now = Instant::now();
        let mut state = self.lock();
        requests
            .iter()
            .map(|r| Ok(Self::extend_one(&mut state, &r.lease, r.ttl, now, false)))
            .collect()
    }

    /// One process: one domain.
    fn failure_domain(&self, _key: &str) -> u64 {
        0
    }

    async fn release(&self, lease: &Lease) -> Result<ReleaseOutcome, BackendError> {
        Ok(self.release_at(lease, Instant::now()))
    }

    /// The expiry counts from the driver's clock: the time left of the
    /// minimum hold \[H7\]. The entry records the hold for the admin.
    async fn hold(&self, lease: &Lease, hold: Hold) -> Result<ExtendOutcome, BackendError> {
        Ok(Self::extend_one(
            &mut self.lock(),
            lease,
            hold.from_now,
            Instant::now(),
            true,
        ))
    }

    // Every step answers at once, without waiting: the driver takes these
    // fast paths, with its own clock reading, and needs no boxed future.
    fn try_acquire_now(
        &self,
        key: &str,
        owner: &OwnerToken,
        ttl: Duration,
        now: Instant,
    ) -> Option<Result<AcquireOutcome, BackendError>> {
        Some(Ok(self.acquire_at(key, owner, ttl, now)))
    }

    fn release_now(
        &self,
        lease: &Lease,
        now: Instant,
    ) -> Option<Result<ReleaseOutcome, BackendError>> {
        Some(Ok(self.release_at(lease, now)))
    }

    async fn watch_release(&self, key: &str) -> Result<ReleaseWatch, BackendError> {
        Ok(self.inner.hub.watch(key))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// \[F5\] Two waiters of the queue take turns without a pause; after
    /// grants in a row for `STREAK`, a release leaves the key free for
    /// `GAP`: a caller outside the queue takes it then, and the queue's
    /// head is told to wait the gap out.
    #[tokio::test(start_paused = true)]
    async fn f5_a_long_run_of_grants_leaves_the_key_free_for_a_gap() {
        let backend = MemoryBackend::new();
        let (ttl, terms) = (Duration::from_secs(30), QueueTerms::DEFAULT);
        let owners = [OwnerToken::new("a"), OwnerToken::new("b")];
        let mut holder = Lease::new(
            "k",
            owners[0].clone(),
            match backend.try_acquire("k", &owners[0], ttl).await.unwrap() {
                AcquireOutcome::Acquired { fencing_token } => fencing_token,
                AcquireOutcome::Busy { .. } => panic!("k is busy"),
            },
        );
        let mut next = 1;
        let mut grants = 0;
        loop {
            // The other waiter queues, the holder releases a second later.
            let waiter = &owners[next];
            assert!(backend
                .try_acquire_queued("k", waiter, ttl, terms)
                .await
                .unwrap()
                .is_busy());
            tokio::time::advance(Duration::from_secs(1)).await;
            backend.release(&holder).await.unwrap();
            match backend.holder("k") {
                Some(granted) => {
                    assert_eq!(&granted, waiter);
                    let token = match backend
                        .try_acquire_queued("k", waiter, ttl, terms)
                        .await
                        .unwrap()
                    {
                        AcquireOutcome::Acquired { fencing_token } => fencing_token,
                        AcquireOutcome::Busy { .. } => panic!("the grant is taken up"),
                    };
                    holder = Lease::new("k", waiter.clone(), token);
                    grants += 1;
                    next = 1 - next;
                }
                None => break,
            }
        }
        assert!((10..=12).contains(&grants), "{grants} grants in a row");
        // The queue's head waits the gap out; a caller outside takes it.
        match backend
            .try_acquire_queued("k", &owners[next], ttl, terms)
            .await
            .unwrap()
        {
            AcquireOutcome::Busy { expires_in, .. } => {
                assert_eq!(expires_in, Some(GAP), "the head is told the gap");
            }
            AcquireOutcome::Acquired { .. } => panic!("the head took the gap"),
        }
        assert!(!backend
            .try_acquire("k", &OwnerToken::new("outside"), ttl)
            .await
            .unwrap()
            .is_busy());
    }

    #[tokio::test(start_paused = true)]
    async fn expiry_follows_tokios_paused_clock() {
        let backend = MemoryBackend::new();
        let a = OwnerToken::new("a");
        let b = OwnerToken::new("b");
        let ttl = Duration::from_secs(30);
        assert!(matches!(
            backend.try_acquire("k", &a, ttl).await.unwrap(),
            AcquireOutcome::Acquired { .. }
        ));
        assert!(matches!(
            backend.try_acquire("k", &b, ttl).await.unwrap(),
            AcquireOutcome::Busy { .. }
        ));
        tokio::time::advance(ttl).await;
        assert_eq!(backend.held_keys(), 0);
        assert!(matches!(
            backend.try_acquire("k", &b, ttl).await.unwrap(),
            AcquireOutcome::Acquired { .. }
        ));
    }

    #[tokio::test(start_paused = true)]
    async fn release_frees_the_entry_of_its_holder_or_of_an_expired_one() {
        let backend = MemoryBackend::new();
        let entries = || backend.lock().held.len();
        let free = || backend.lock().free;
        let a = OwnerToken::new("a");
        let ttl = Duration::from_secs(30);
        let take = |owner: &OwnerToken| {
            let (backend, owner) = (backend.clone(), owner.clone());
            async move {
                match backend.try_acquire("k", &owner, ttl).await.unwrap() {
                    AcquireOutcome::Acquired { fencing_token } => {
                        Lease::new("k", owner, fencing_token)
                    }
                    AcquireOutcome::Busy { .. } => panic!("k is busy"),
                }
            }
        };

        let first = take(&a).await;
        let foreign = Lease::new("k", OwnerToken::new("b"), first.fencing_token());
        let mut watch = backend.watch_release("k").await.unwrap();
        assert_eq!(
            backend.release(&foreign).await.unwrap(),
            ReleaseOutcome::NotHeld
        );
        assert_eq!(entries(), 1, "a foreign release leaves the entry");
        assert_eq!(
            backend.release(&first).await.unwrap(),
            ReleaseOutcome::Released
        );
        assert_eq!(
            (entries(), free()),
            (1, 1),
            "a released key's entry is kept free"
        );
        assert_eq!(backend.holder("k"), None);
        assert_eq!(backend.held_keys(), 0);
        assert_eq!(
            backend.release(&first).await.unwrap(),
            ReleaseOutcome::NotHeld,
            "released twice"
        );
        assert_eq!(
            backend.extend(&first, ttl).await.unwrap(),
            ExtendOutcome::Expired
        );
        tokio::time::timeout(Duration::from_secs(1), watch.released())
            .await
            .unwrap();

        let second = take(&OwnerToken::new("b")).await;
        assert!(second.fencing_token() > first.fencing_token());
        assert_eq!((entries(), free()), (1, 0), "the free entry is reused");
        tokio::time::advance(ttl).await;
        let c = OwnerToken::new("c");
        let third = take(&c).await;
        assert!(third.fencing_token() > second.fencing_token());
        assert_eq!(entries(), 1, "an expired entry is reused");
        assert_eq!(
            backend.release(&second).await.unwrap(),
            ReleaseOutcome::NotHeld
        );
        assert_eq!(
            backend.holder("k"),
            Some(c),
            "the expired holder frees nothing"
        );

        tokio::time::advance(ttl).await;
        assert_eq!(
            backend.release(&third).await.unwrap(),
            ReleaseOutcome::NotHeld
        );
        assert_eq!(
            (entries(), free()),
            (1, 1),
            "an expired entry found by release is freed"
        );
        assert!(
            tokio::time::timeout(Duration::from_secs(1), watch.released())
                .await
                .is_err(),
            "only a release that answered Released notifies"
        );
    }

    #[tokio::test]
    async fn beyond_kept_free_a_released_key_takes_no_memory() {
        let backend = MemoryBackend::new();
        let ttl = Duration::from_secs(30);
        let owner = OwnerToken::new("a");
        let n = KEPT_FREE + 10;
        for i in 0..n {
            let key = format!("k{i}");
            let token = match backend.try_acquire(&key, &owner, ttl).await.unwrap() {
                AcquireOutcome::Acquired { fencing_token } => fencing_token,
                AcquireOutcome::Busy { .. } => panic!("{key} is busy"),
            };
            let lease = Lease::new(key.as_str(), owner.clone(), token);
            assert_eq!(
                backend.release(&lease).await.unwrap(),
                ReleaseOutcome::Released
            );
        }
        let (entries, free) = {
            let state = backend.lock();
            (state.held.len(), state.free)
        };
        assert_eq!((entries, free), (KEPT_FREE, KEPT_FREE));
        assert_eq!(backend.held_keys(), 0);
        // Every key, kept or not, is free to take.
        for i in [0, n - 1] {
            let other = OwnerToken::new("b");
            assert!(matches!(
                backend
                    .try_acquire(&format!("k{i}"), &other, ttl)
                    .await
                    .unwrap(),
                AcquireOutcome::Acquired { .. }
            ));
        }
        assert_eq!(backend.lock().free, KEPT_FREE - 1);
    }

    #[tokio::test]
    async fn a_key_used_again_gets_a_new_owner_token_and_a_kept_context_keeps_its_lock() {
        let backend = MemoryBackend::new();
        let locker = Locker::new(backend.clone());
        let holder_text = |backend: &MemoryBackend| {
            backend
                .holder("k")
                .map(|owner| owner.as_str().to_owned())
                .unwrap()
        };
        // Records and owner tokens of a key are used again: each lock still
        // has its own owner token and a greater fencing token.
        let mut seen = Vec::new();
        for _ in 0..3 {
            let (owner, fencing) = locker
                .with_lock("k", |ctx| {
                    let owner = holder_text(&backend);
                    async move { (owner, ctx.fencing_token()) }
                })
                .await
                .unwrap();
            seen.push((owner, fencing));
        }
        assert!(seen[0].0 != seen[1].0 && seen[1].0 != seen[2].0 && seen[0].0 != seen[2].0);
        assert!(seen[0].1 < seen[1].1 && seen[1].1 < seen[2].1);
        // A context the callback gave away stays that of its own lock.
        let kept = locker
            .with_lock("k", |ctx| async move { ctx })
            .await
            .unwrap();
        let kept_token = kept.fencing_token();
        assert!(!kept.is_held());
        let next = locker
            .with_lock("k", |ctx| async move {
                assert!(ctx.is_held());
                ctx.fencing_token()
            })
            .await
            .unwrap();
        assert!(next > kept_token);
        assert_eq!(kept.fencing_token(), kept_token);
        assert!(!kept.is_held() && !kept.is_lost());
        assert_eq!(backend.held_keys(), 0);
    }

    /// A memory backend whose `release_now` calls back into the locker
    /// that uses it, and records what it saw there.
    #[derive(Debug)]
    struct CallsBack {
        backend: MemoryBackend,
        locker: std::sync::OnceLock<Locker>,
        held_seen: std::sync::Mutex<Vec<usize>>,
    }

    lock_core::forward_lock_backend!(CallsBack => backend {
        fn release_now(
            &self,
            lease: &Lease,
            now: Instant,
        ) -> Option<Result<ReleaseOutcome, BackendError>> {
            if let Some(locker) = self.locker.get() {
                // Takes the locker's record of its locks.
                let held = locker.held();
                self.held_seen.lock().unwrap().push(held);
            }
            self.backend.release_now(lease, now)
        }
    });

    #[test]
    fn the_fast_paths_run_with_none_of_the_lockers_locks_held() {
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        // On a thread of its own: a driver that called `release_now` with
        // its registry locked would deadlock there.
        std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            let backend = Arc::new(CallsBack {
                backend: MemoryBackend::new(),
                locker: std::sync::OnceLock::new(),
                held_seen: std::sync::Mutex::default(),
            });
            let locker = Locker::new(Arc::clone(&backend));
            backend.locker.set(locker.clone()).unwrap();
            runtime.block_on(async {
                for _ in 0..2 {
                    locker.with_lock("k", |_| async {}).await.unwrap();
                }
            });
            let seen = backend.held_seen.lock().unwrap().clone();
            done_tx.send((seen, backend.backend.held_keys())).unwrap();
        });
        let (seen, held_keys) = done_rx
            .recv_timeout(Duration::from_secs(20))
            .expect("the release's fast path could not call back into the locker");
        // The lock had left the locker's record when its release was sent.
        assert_eq!(seen, [0, 0]);
        assert_eq!(held_keys, 0);
    }
}

//! Acquiring a lock for a callback: the per-key wait list, then the backend
//! attempts, spaced with jitter and woken by release notifications
//! \[A1–A7, H6\].

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use tracing::Instrument;

use crate::backend::{AcquireOutcome, Lease, OwnerToken, QueueTerms, EXPIRY_MARGIN};
use crate::config::{LockConfig, RetryAttempts};
use crate::error::{BackendError, BackendErrorKind, LockError};
use crate::gate::GatePass;
use crate::held::{HeldLock, Holder};
use crate::locker::queue::Place;
use crate::locker::{Inner, Locker};
use crate::metrics::{Acquisition, Step, Stopwatch};
use crate::notify::ReleaseWatch;
use crate::registry::{AttemptInFlight, Ending, Registry};
use crate::task::{finish_even_if_dropped, never};

impl Inner {
    /// One acquisition attempt that cannot strand a lock \[C1, O3\]: if it
    /// is dropped and its answer says the key was taken, the key is
    /// released; if it fails on an error after its request may have reached
    /// the store (a hung server runs it when it wakes up), the key's
    /// clean-up releases it with the same owner token until its ttl has run
    /// out.
    ///
    /// `sent_at` is the clock read just before; the second value says
    /// whether the backend answered at once, without awaiting
    /// ([`LockBackend::try_acquire_now`](crate::LockBackend::try_acquire_now)).
    /// The third counts the attempt in flight for shutdown \[S1\]: the
    /// caller drops it once an acquired lease is in the registry or owed
    /// a release.
    pub(crate) async fn attempt(
        &self,
        key: &Arc<str>,
        owner: &OwnerToken,
        ttl: Duration,
        sent_at: Instant,
    ) -> (Result<AcquireOutcome, BackendError>, bool, AttemptInFlight) {
        let in_flight = self.registry.attempt_started();
        if let Some(answer) = self
            .registry
            .backend
            .try_acquire_now(key, owner, ttl, sent_at)
        {
            if let Err(error) = &answer {
                self.failed(key, owner, ttl, error);
            }
            return (answer, true, in_flight);
        }
        let (answer, in_flight) = self
            .attempt_in_flight(key, owner, ttl, None, in_flight)
            .await;
        (answer, false, in_flight)
    }

    /// As [`attempt`](Self::attempt), for a waiter of the fair queue
    /// \[F1\]: one queued attempt, which may make or renew the waiter's
    /// place. Dropped with the step pending, a place it made is left in
    /// the background.
    pub(crate) async fn attempt_queued(
        &self,
        key: &Arc<str>,
        owner: &OwnerToken,
        ttl: Duration,
        terms: QueueTerms,
    ) -> (Result<AcquireOutcome, BackendError>, AttemptInFlight) {
        let in_flight = self.registry.attempt_started();
        self.attempt_in_flight(key, owner, ttl, Some(terms), in_flight)
            .await
    }

    /// Counts a failed attempt, and has the key cleaned up if the attempt
    /// may have taken it.
    fn failed(&self, key: &Arc<str>, owner: &OwnerToken, ttl: Duration, error: &BackendError) {
        self.registry.meter.backend_error(key, Step::TryAcquire);
        if error.may_have_reached_store() {
            let until = Instant::now() + ttl;
            self.registry
                .cleanup
                .add(&self.registry, key, owner.clone(), until);
        }
    }

    async fn attempt_in_flight(
        &self,
        key: &Arc<str>,
        owner: &OwnerToken,
        ttl: Duration,
        queue: Option<QueueTerms>,
        in_flight: AttemptInFlight,
    ) -> (Result<AcquireOutcome, BackendError>, AttemptInFlight) {
        let (registry, k, o) = (Arc::clone(&self.registry), Arc::clone(key), owner.clone());
        // The step hands what it owns back with its answer, for the orphan;
        // the attempt stays counted in flight until the orphan has settled
        // it \[S1\].
        let step = async move {
            let answer = match queue {
                None => registry.backend.try_acquire(&k, &o, ttl).await,
                Some(terms) => {
                    registry
                        .backend
                        .try_acquire_queued(&k, &o, ttl, terms)
                        .await
                }
            };
            (answer, registry, k, o, in_flight)
        };
        let orphan = move |(answer, registry, k, o, _in_flight): (
            _,
            Arc<Registry>,
            Arc<str>,
            _,
            AttemptInFlight,
        )| match answer {
            Ok(AcquireOutcome::Acquired { fencing_token }) => {
                registry
                    .owe_release(Lease::new(k, o, fencing_token))
                    .in_background();
            }
            // A place the dropped waiter may have made is left.
            Ok(AcquireOutcome::Busy { .. }) => {
                if let Some(terms) = queue {
                    crate::locker::queue::leave(&registry, k, o, terms);
                }
            }
            Err(error) => {
                let error: BackendError = error;
                if let Some(terms) = queue {
                    crate::locker::queue::leave(&registry, Arc::clone(&k), o.clone(), terms);
                }
                registry.meter.backend_error(&k, Step::TryAcquire);
                if error.may_have_reached_store() {
                    registry.cleanup.add(&registry, &k, o, Instant::now() + ttl);
                }
            }
        };
        let (answer, .., in_flight) = finish_even_if_dropped(&self.registry, step, orphan).await;
        if let Err(error) = &answer {
            self.failed(key, owner, ttl, error);
        }
        (answer, in_flight)
    }

    /// A new record of a callback's lock just taken under `owner`.
    fn record(
        &self,
        key: &Arc<str>,
        owner: OwnerToken,
        fencing_token: u64,
        ttl: Duration,
        sent_at: Instant,
    ) -> Arc<HeldLock> {
        let lease = Lease::new(Arc::clone(key), owner, fencing_token);
        let meter = self.registry.meter.clone();
        Arc::new(HeldLock::new(
            self.id,
            lease,
            ttl,
            sent_at,
            Holder::Callback,
            meter,
        ))
    }

    /// Turns an acquired lease into a held lock, unless its answer came too
    /// late to use \[H6\]: then it is released and the attempt counts as
    /// failed. A lock taken after shutdown began is released too, and the
    /// call never settles \[S2\]. An answer given `at_once` came at
    /// `sent_at`: the backend's expiry counts from the same clock reading.
    /// The attempt stops counting in flight once the lock is held or its
    /// release owed \[S1\].
    pub(crate) async fn hold(
        &self,
        lease: Lease,
        ttl: Duration,
        sent_at: Instant,
        at_once: bool,
        holder: Holder,
        in_flight: AttemptInFlight,
    ) -> Result<(u64, Arc<HeldLock>), BackendError> {
        let meter = self.registry.meter.clone();
        let held = Arc::new(HeldLock::new(self.id, lease, ttl, sent_at, holder, meter));
        self.hold_record(held, sent_at, at_once, in_flight).await
    }

    /// As [`hold`](Self::hold), for a record already made.
    async fn hold_record(
        &self,
        held: Arc<HeldLock>,
        sent_at: Instant,
        at_once: bool,
        in_flight: AttemptInFlight,
    ) -> Result<(u64, Arc<HeldLock>), BackendError> {
        let answered_at = if at_once { sent_at } else { Instant::now() };
        if !held.is_valid_at(answered_at) {
            tracing::debug!(key = %held.lease.key(), "acquisition answered after the lease's validity ran out; releasing it");
            self.registry
                .meter
                .backend_error(held.lease.key_arc(), Step::TryAcquire);
            self.registry
                .owe_release(held.lease.clone())
                .in_background();
            drop(in_flight);
            return Err(BackendError::message(
                BackendErrorKind::Timeout,
                "the acquisition was answered after the lease's validity had run out",
            ));
        }
        match self.registry.insert(Arc::clone(&held)) {
            Some(id) => {
                drop(in_flight);
                tracing::debug!(fencing_token = held.lease.fencing_token(), "acquired");
                Ok((id, held))
            }
            None => {
                self.registry
                    .owe_release(held.lease.clone())
                    .in_background();
                drop(in_flight);
                never().await
            }
        }
    }
}

/// The owner token of an attempt: that of the key's spare record, which
/// nobody else holds, or a new one.
enum Token<'r> {
    Spare(&'r mut HeldLock),
    Fresh(OwnerToken),
}

/// How long a callback holds its lock before its key's release
/// notifications are watched \[L5\].
pub(crate) const WATCH_OWN_KEY_AFTER: Duration = Duration::from_millis(250);

/// How soon after the watch is in place a held lock is checked once, for a
/// release announced before \[L5\]: with the delay, within a second of
/// the acquisition. Not at once, so that the checks of locks taken
/// together join their extensions' batches rather than wake the extender
/// one by one \[P4\].
const FIRST_CHECK_WITHIN: Duration = Duration::from_millis(750);

/// A lock held for a callback, with the key's pass. Dropping it releases
/// the lock in the background \[C2\], then lets the next task of this
/// node in (the fields drop in this order).
pub(crate) struct Holding<'a> {
    release_on_drop: ReleaseOnDrop<'a>,
    pub(crate) held: Arc<HeldLock>,
    pass: Option<GatePass<'a>>,
}

/// Releases a lock of the registry in the background when dropped armed.
struct ReleaseOnDrop<'a> {
    inner: &'a Inner,
    id: u64,
    armed: bool,
}

impl Drop for ReleaseOnDrop<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.inner.registry.end(self.id, Ending::Dropped);
        }
    }
}

/// How a callback's lock ended, as the call sees it: the store's answer
/// (`None` when the lock was no longer the call's: lost, or released by
/// shutdown), the lock's record, and the key's pass (dropping it lets the
/// next task in).
pub(crate) type Ended<'a> = (
    Option<Result<crate::backend::ReleaseOutcome, BackendError>>,
    Arc<HeldLock>,
    Option<GatePass<'a>>,
);

impl<'a> Holding<'a> {
    /// Takes the lock out of its drop guard for the call to end it itself:
    /// the locker, the lock's id in the registry, its record and the
    /// key's pass.
    fn disarm(self) -> (&'a Inner, u64, Arc<HeldLock>, Option<GatePass<'a>>) {
        let Self {
            mut release_on_drop,
            held,
            pass,
        } = self;
        release_on_drop.armed = false;
        (release_on_drop.inner, release_on_drop.id, held, pass)
    }

    /// Releases the lock and waits for the store's answer \[H3\]. A release
    /// that fails is sent again while the lock is still valid, so that the
    /// answer can say whether the key was found taken \[O6\]; once a try
    /// failed after it may have reached the store, no answer can say so any
    /// more, and the call gets that error while the release goes on in the
    /// background. `None` when the
    /// lock was no longer this call's to release (lost, or released by
    /// shutdown). `now` is the clock read just before.
    ///
    /// The lock's record and the key's pass are given back with the answer:
    /// dropping the pass lets the next task in.
    pub(crate) async fn release(self, now: Instant) -> Ended<'a> {
        let (inner, id, held, pass) = self.disarm();
        let Some(owed) = inner.registry.end(id, Ending::Released) else {
            return (None, held, pass);
        };
        let (owed, failed) = match owed.at_once(now) {
            Ok(answer) => return (Some(answer), held, pass),
            Err(owed) => owed,
        };
        let deadline = held.valid_until();
        // Dropped before the answer, it sends the release again in the
        // background: a release can be repeated.
        let answer = owed
            .sent_again_if_dropped()
            .send_until_taken_or_failed(deadline, now, failed)
            .await;
        (Some(answer), held, pass)
    }

    /// Leaves the lock to expire at `ends`, the end of its minimum hold of
    /// `at_least` \[H7\], instead of releasing it; answers as
    /// [`release`](Self::release) does. The step goes on to its end if
    /// this future is dropped: it is owed, as a release is.
    pub(crate) async fn hold_to_minimum(self, at_least: Duration, ends: Instant) -> Ended<'a> {
        let (inner, id, held, pass) = self.disarm();
        let Some(owed) = inner.registry.end(id, Ending::LeftToMinimum) else {
            return (None, held, pass);
        };
        let step = crate::hold::leave_to_minimum(
            owed,
            Arc::clone(&inner.registry),
            Arc::clone(&held),
            at_least,
            ends,
        );
        let answer = finish_even_if_dropped(&inner.registry, step, |_| {}).await;
        (Some(answer), held, pass)
    }

    /// Watches the key's release notifications while the callback holds
    /// the lock \[L5\], so that a lock freed by someone else (an
    /// operator's force release) is found lost within about a second, not
    /// at its next extension: each notification moves the next extension
    /// to now. The watch begins once the lock was held for
    /// [`WATCH_OWN_KEY_AFTER`] (most locks are released sooner and never
    /// cost one), and the lock is checked once when it is in place, which
    /// covers a release announced before. Never resolves; a backend
    /// without notifications leaves it to the extensions.
    pub(crate) async fn watch_own_key(&self) -> std::convert::Infallible {
        let ReleaseOnDrop { inner, id, .. } = self.release_on_drop;
        if inner.caps.release_notifications {
            tokio::time::sleep(WATCH_OWN_KEY_AFTER).await;
            loop {
                match inner.backend.watch_release(self.held.lease.key()).await {
                    Ok(mut watch) => {
                        // Once in place, a release announced before it is
                        // found by a check within the bound (or by the
                        // extension due by then); after that each
                        // notification is checked at once, at most one
                        // per watch delay (a watch broken and rebuilt
                        // wakes every watcher).
                        let mut within = FIRST_CHECK_WITHIN;
                        while inner.registry.check_within(id, within) {
                            within = Duration::ZERO;
                            tokio::time::sleep(WATCH_OWN_KEY_AFTER).await;
                            watch.released().await;
                        }
                        break;
                    }
                    // The subscription is down: the extensions still check
                    // the lock meanwhile.
                    Err(error) => {
                        tracing::debug!(key = %self.held.lease.key(), error = %crate::ErrorChain(&error), "cannot watch a held key's releases yet");
                        tokio::time::sleep(WATCH_OWN_KEY_AFTER * 4).await;
                    }
                }
            }
        }
        std::future::pending().await
    }
}

impl Locker {
    /// Acquires `key` for a callback.
    pub(crate) async fn acquire(
        &self,
        key: &str,
        config: &LockConfig,
    ) -> Result<Holding<'_>, LockError> {
        let inner = self.inner();
        // [A6] The key's gate: its pass, or a place in line if another task
        // of this locker holds or tries the key. The gate shares the key's
        // string with the call.
        let (key, entered) = inner.gates.enter(key);
        let key = &key;
        // Not even made when nobody listens: its fields cost, and so does
        // dropping an empty span.
        let span = tracing::enabled!(tracing::Level::DEBUG)
            .then(|| tracing::debug_span!("acquire", key = %key))
            .filter(|span| !span.is_disabled());
        let since = Stopwatch::start();
        let acquired = async move {
            let limit = match config.retry_attempts {
                RetryAttempts::Limited(n) => Some(n),
                RetryAttempts::Unlimited => None,
            };
            let exhausted = |counted: u32| limit.is_some_and(|n| counted > n);
            let mut counted: u32 = 0;
            // When the next attempt that counts is due: at once, so the
            // first attempt's send time when it does not wait in line.
            let mut next_slot = None;

            // [A6] Another task of this locker holds or tries the key: wait
            // in line. Each slot that passes counts as an attempt that found
            // the key busy, so the give-up time stays as configured.
            let mut pass = match entered {
                Ok(pass) => pass,
                Err(mut place) => loop {
                    tokio::select! {
                        biased;
                        pass = place.wait() => break pass,
                        () = inner.shutdown.started() => return never().await,
                        () = tokio::time::sleep_until(*next_slot.get_or_insert_with(Instant::now)) => {
                            counted += 1;
                            if exhausted(counted) {
                                tracing::debug!(attempts = counted, "not acquired: held by another task of this node");
                                return Err(not_acquired(key, counted, None));
                            }
                            next_slot = next_slot.map(|slot| slot + config.retry_delay);
                        }
                    }
                },
            };
            // The record of this key's last lock, if its gate kept one: its
            // owner token is drawn anew in place for each attempt, and the
            // record is renewed for the lock taken, so that a key used
            // again allocates neither.
            let mut spare = pass.take_spare();
            let mut watch = None;
            // The last attempt that failed on a backend error, if any did.
            let mut last_error = None;
            // When a release notification woke this call, until the attempt
            // it triggers answers.
            let mut woken = None;
            // [F1] The fair queue's terms, when this call may queue; it
            // queues once it found the key busy, with one owner token for
            // the rest of its wait, and its place is left if it ends
            // without the lock.
            let mut queue = inner.queue_for(config.queue_terms());
            let mut place: Option<(OwnerToken, Place)> = None;
            // When the queued waiter's next attempt is due: its heartbeat
            // [F2], or the holder's expiry plus the margin [A9].
            let mut due: Option<Instant>;
            // The send time of the last queued attempt answered busy: a
            // grant came after it [F1].
            let mut asked = None;
            // [F1] A key found held elsewhere by its last call here is
            // likely held now: this call watches it and queues from its
            // first attempt, sparing a round trip and an attempt.
            let mut busy_before = false;
            // Whether this call found the key held elsewhere, for the next.
            let mut saw_busy = false;
            if queue.is_some() && pass.contended() {
                match inner.backend.watch_release(key).await {
                    Ok(w) => {
                        watch = Some(w);
                        busy_before = true;
                    }
                    Err(error) => {
                        inner.registry.meter.backend_error(key, Step::WatchRelease);
                        tracing::debug!(error = %crate::ErrorChain(&error), "release watch failed; waiting on the retry timer");
                    }
                }
            }
            loop {
                if inner.shutdown.is_started() {
                    // [F2, S2] The call never settles; its place is left.
                    drop(place.take());
                    return never().await;
                }
                let queued = queue.filter(|_| busy_before);
                // The place is this waiter's from its first queued attempt,
                // whatever that attempt's answer (a place made by an
                // attempt whose answer was lost is renewed, or left).
                if let (Some(terms), None) = (queued, &place) {
                    let owner = OwnerToken::draw(&inner.node_id);
                    let left = Place::new(&inner.registry, key, &owner, terms);
                    place = Some((owner, left));
                }
                // A new owner token for each unqueued attempt: the spare
                // record's, redrawn (in place unless a clone of it was
                // kept), when nobody else holds the record, which is then
                // renewed for the lock taken; else a new one. A queued
                // waiter keeps its place's token [F1].
                let token = match (&place, spare.as_mut().and_then(Arc::get_mut)) {
                    (Some((owner, _)), _) => Token::Fresh(owner.clone()),
                    (None, Some(record)) => {
                        record.lease.owner_mut().redraw(&inner.node_id);
                        Token::Spare(record)
                    }
                    (None, None) => Token::Fresh(OwnerToken::draw(&inner.node_id)),
                };
                let owner = match &token {
                    Token::Spare(record) => record.lease.owner(),
                    Token::Fresh(owner) => owner,
                };
                let sent_at = Instant::now();
                let next_slot = next_slot.get_or_insert(sent_at);
                let slot_due = sent_at >= *next_slot;
                // Set again by a busy answer; else the next attempt is at
                // the next slot.
                due = None;
                let (answer, at_once, in_flight) = match queued {
                    None => inner.attempt(key, owner, config.ttl, sent_at).await,
                    Some(terms) => {
                        let (answer, in_flight) =
                            inner.attempt_queued(key, owner, config.ttl, terms).await;
                        (answer, false, in_flight)
                    }
                };
                // Settled when the lock is held or owed a release, or below.
                let mut in_flight = Some(in_flight);
                if let Some(woken) = woken.take() {
                    inner.registry.meter.notification_lag(key, &woken);
                }
                let busy = match answer {
                    Ok(AcquireOutcome::Acquired { fencing_token }) => {
                        let new_record =
                            |owner| inner.record(key, owner, fencing_token, config.ttl, sent_at);
                        let held = match token {
                            Token::Spare(record) => {
                                record.renew(fencing_token, config.ttl, sent_at, Holder::Callback);
                                // Not `None`: the record renewed is the spare.
                                spare
                                    .take()
                                    .unwrap_or_else(|| new_record(OwnerToken::draw(&inner.node_id)))
                            }
                            Token::Fresh(owner) => new_record(owner),
                        };
                        // Taking the key removed the place.
                        if let Some((_, place)) = place.take() {
                            place.taken();
                        }
                        let in_flight = in_flight.take().expect("counted once");
                        pass.found_contended(saw_busy);
                        match inner.hold_record(held, sent_at, at_once, in_flight).await {
                            Ok((id, held)) => return Ok(holding(inner, id, held, pass)),
                            Err(late) => {
                                last_error = Some(late);
                                false
                            }
                        }
                    }
                    Ok(AcquireOutcome::Busy {
                        expires_in,
                        last_token,
                    }) => {
                        saw_busy = true;
                        pass.found_contended(true);
                        if let Some(terms) = queued {
                            due = Some(sent_at + terms.heartbeat());
                            asked = last_token.map(|token| (sent_at, token));
                        }
                        // [A9] Never past the holder's expiry: an extra
                        // attempt then, without jitter.
                        if let Some(left) = expires_in {
                            let expiry = sent_at + left + EXPIRY_MARGIN;
                            due = Some(due.map_or(expiry, |due| due.min(expiry)));
                        }
                        true
                    }
                    // [F6] The store refuses the queue (a missing table or
                    // right): wait unqueued, at once.
                    Err(error)
                        if error.is_permanent()
                            && queued.is_some()
                            && !config.require_fair_queue =>
                    {
                        inner.refuse_queue(&error);
                        queue = None;
                        place = None;
                        continue;
                    }
                    // [A8] A setup error is said at once: no attempt after
                    // it could do better.
                    Err(error) if error.is_permanent() => {
                        tracing::warn!(error = %crate::ErrorChain(&error), "acquisition refused by the backend's setup; not retried");
                        return Err(not_acquired(key, counted + 1, Some(error)));
                    }
                    Err(error) => {
                        tracing::debug!(error = %crate::ErrorChain(&error), "acquisition attempt failed");
                        // [F2, C1] An attempt that may have taken the key
                        // is cleaned up with its owner token (released
                        // until its ttl has run out), so this waiter must
                        // never hold under that token again: its place is
                        // left (handing on what the attempt may have
                        // taken) and it queues again at the tail, under a
                        // new one.
                        if place.is_some() && error.may_have_reached_store() {
                            place = None;
                        }
                        last_error = Some(error);
                        false
                    }
                };
                // Settled: busy, or failed with its clean-up pending.
                drop(in_flight);
                if slot_due {
                    counted += 1;
                    if exhausted(counted) {
                        tracing::debug!(attempts = counted, "not acquired");
                        return Err(not_acquired(key, counted, last_error.take()));
                    }
                    *next_slot = sent_at.max(*next_slot) + config.jittered_delay();
                }
                // A failing store would fail the subscription too: watch
                // only once the key was found held.
                if busy && inner.caps.release_notifications && watch.is_none() {
                    busy_before = true;
                    // Subscribe only once the key was found busy, so an
                    // uncontended call pays nothing for it; then try again at
                    // once, which sees any release made before the watch
                    // existed, while the watch sees every one after (and,
                    // with the queue, takes this waiter's place).
                    match inner.backend.watch_release(key).await {
                        Ok(w) => {
                            watch = Some(w);
                            continue;
                        }
                        Err(error) => {
                            inner.registry.meter.backend_error(key, Step::WatchRelease);
                            tracing::debug!(error = %crate::ErrorChain(&error), "release watch failed; waiting on the retry timer");
                            // Without notifications no grant would reach
                            // this waiter: it waits unqueued.
                            queue = None;
                        }
                    }
                }
                busy_before |= busy;
                tracing::trace!(attempts = counted, "busy; waiting");
                // A queued waiter waits for its grant, its heartbeat or the
                // holder's expiry; the slots it sleeps through count as
                // attempts that found the key busy, so that it gives up on
                // time. An unqueued one tries again at each slot.
                loop {
                    let wake_at = due.map_or(*next_slot, |due| due.min(*next_slot));
                    tokio::select! {
                        biased;
                        () = inner.shutdown.started() => {
                            drop(place.take());
                            return never().await;
                        }
                        () = released(&mut watch) => {
                            // [F1, F4] A grant: the grantee's waiter holds
                            // the lock from it, without a round trip; the
                            // others wait on, as no attempt could take the
                            // key.
                            if let Some(grant) = watch.as_ref().and_then(ReleaseWatch::grant) {
                                let Some((owner, _)) = place.as_ref().filter(|(owner, _)| *grant.owner == *owner.as_str()) else {
                                    continue;
                                };
                                let woke = Stopwatch::start();
                                // Only a grant made after the last busy
                                // answer is taken without a round trip: an
                                // older one (its message slow to come) may
                                // have run out; an attempt takes it up if
                                // it is still this waiter's.
                                let taken = match asked {
                                    Some((asked, floor)) if grant.fencing_token > floor => {
                                        inner.take_grant(key, owner, &grant, asked, config).await
                                    }
                                    _ => None,
                                };
                                // [F2, C1] Released in the background under
                                // this owner token: queue again under a new
                                // one (see the failed attempt's case).
                                if let Some(Err(late)) = taken {
                                    place = None;
                                    last_error = Some(late);
                                    woken = Some(Stopwatch::start());
                                    break;
                                }
                                if let Some(Ok((id, held))) = taken {
                                    inner.registry.meter.notification_lag(key, &woke);
                                    pass.found_contended(true);
                                    if let Some((_, place)) = place.take() {
                                        place.taken();
                                    }
                                    return Ok(holding(inner, id, held, pass));
                                }
                            }
                            woken = Some(Stopwatch::start());
                            break;
                        }
                        () = tokio::time::sleep_until(wake_at) => {
                            let now = Instant::now();
                            if place.is_none() || due.is_none_or(|due| now >= due) {
                                break;
                            }
                            // A slot slept through while queued.
                            counted += 1;
                            if exhausted(counted) {
                                tracing::debug!(attempts = counted, "not acquired: still queued");
                                return Err(not_acquired(key, counted, last_error.take()));
                            }
                            *next_slot = now.max(*next_slot) + config.jittered_delay();
                        }
                    }
                }
            }
        };
        // Polled where it was made, not moved into the await (a copy of the
        // whole state at every call).
        tokio::pin!(acquired);
        // Entering and leaving a span at every poll costs even when nobody
        // listens.
        let acquired = match span {
            None => acquired.await,
            Some(span) => acquired.instrument(span).await,
        };
        let outcome = Acquisition::of(&acquired);
        inner.registry.meter.acquisition(key, outcome, &since);
        acquired
    }
}

/// A lock just held for a callback, released if dropped.
fn holding<'a>(inner: &'a Inner, id: u64, held: Arc<HeldLock>, pass: GatePass<'a>) -> Holding<'a> {
    Holding {
        release_on_drop: ReleaseOnDrop {
            inner,
            id,
            armed: true,
        },
        held,
        pass: Some(pass),
    }
}

fn not_acquired(key: &str, attempts: u32, source: Option<BackendError>) -> LockError {
    LockError::NotAcquired {
        key: key.to_owned(),
        attempts,
        source,
    }
}

async fn released(watch: &mut Option<ReleaseWatch>) {
    match watch {
        Some(w) => w.released().await,
        None => std::future::pending().await,
    }
}

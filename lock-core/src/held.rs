//! `HeldLock`: the one record of a lock this node holds, shared by the call
//! that took it, the extender, shutdown and the callback's `LockContext`.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::OnceLock;
use std::time::Duration;

use tokio::time::Instant;

use crate::backend::Lease;
use crate::error::LossCause;
use crate::metrics::{HeldTimer, Meter};
use crate::task::Signal;

/// How long a request's lease is certainly valid after it was sent: the
/// ttl less the margin for clock drift between this process and the store
/// (1% of the ttl plus 2 ms). And the extension lead (see [`HeldLock`]).
pub(crate) fn validity(ttl: Duration) -> (Duration, Duration) {
    // In whole nanoseconds: `Duration`'s operators check and normalise at
    // every step. MIN_TTL keeps two thirds of the ttl above the margin.
    let ttl_ns = u64::try_from(ttl.as_nanos()).unwrap_or(u64::MAX);
    let drift_ns = ttl_ns / 100 + 2_000_000;
    (
        Duration::from_nanos(ttl_ns.saturating_sub(drift_ns)),
        Duration::from_nanos((ttl_ns / 3 * 2).saturating_sub(drift_ns)),
    )
}

/// What kind of holder a lock has.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Holder {
    /// A `with_lock` callback: extended in the background, waited for by shutdown.
    Callback,
    /// A low-level handle or a `Mutex`: renewed by hand, released by shutdown.
    Handle,
}

/// A lock this node holds: its lease, how long it is valid, and whether it
/// was lost or released.
pub(crate) struct HeldLock {
    pub(crate) lease: Lease,
    pub(crate) ttl: Duration,
    pub(crate) locker_id: u64,
    pub(crate) holder: Holder,
    /// The validity the acquisition gave: its expiry, minus the drift
    /// margin.
    valid_from_acquisition: Instant,
    /// How long the validity of a request lasts after it was sent: the ttl,
    /// less the drift margin.
    valid_for: Duration,
    /// How long before the validity's end an extension is due: two thirds
    /// of the ttl, less the drift margin.
    extension_lead: Duration,
    /// How far extensions moved the validity past that, in nanoseconds:
    /// the last confirmed expiry, minus the drift margin, is the instant
    /// past which another node may hold the key. An atomic, as every call
    /// reads it and only extensions move it, always forward.
    extended_by_nanos: AtomicU64,
    lost: OnceLock<LossCause>,
    ended: AtomicBool,
    /// How many extensions of this lock are on their way: a minimum hold
    /// waits for them before it sets the expiry \[H7\]. Counted up by the
    /// extender under the registry's lock, so none starts after the lock
    /// left the registry.
    extending: AtomicUsize,
    signal: Signal,
    meter: Meter,
    held_for: HeldTimer,
}

impl HeldLock {
    /// A lock taken by a request sent at `sent_at`: the store's expiry is at
    /// the earliest `ttl` after it.
    pub(crate) fn new(
        locker_id: u64,
        lease: Lease,
        ttl: Duration,
        sent_at: Instant,
        holder: Holder,
        meter: Meter,
    ) -> Self {
        let (valid_for, extension_lead) = validity(ttl);
        Self {
            lease,
            ttl,
            locker_id,
            holder,
            valid_from_acquisition: sent_at + valid_for,
            valid_for,
            extension_lead,
            extended_by_nanos: AtomicU64::new(0),
            lost: OnceLock::new(),
            ended: AtomicBool::new(false),
            extending: AtomicUsize::new(0),
            signal: Signal::default(),
            meter,
            held_for: HeldTimer::start(),
        }
    }

    /// Makes this record, which nobody else holds any more, that of a new
    /// acquisition of the same key by the same locker under its lease's
    /// owner token: as [`new`](Self::new), without an allocation.
    pub(crate) fn renew(
        &mut self,
        fencing_token: u64,
        ttl: Duration,
        sent_at: Instant,
        holder: Holder,
    ) {
        // The same ttl as last time, as a key used again mostly has: the
        // spans are those already worked out.
        if ttl != self.ttl {
            (self.valid_for, self.extension_lead) = validity(ttl);
            self.ttl = ttl;
        }
        self.lease.set_fencing_token(fencing_token);
        self.holder = holder;
        self.valid_from_acquisition = sent_at + self.valid_for;
        *self.extended_by_nanos.get_mut() = 0;
        self.lost.take();
        *self.ended.get_mut() = false;
        // The signal is kept: nobody waits on a record nobody holds, and it
        // keeps no permit (it only wakes those waiting).
        self.held_for = HeldTimer::start();
    }

    /// Until when the lock is certainly ours.
    pub(crate) fn valid_until(&self) -> Instant {
        match self.extended_by_nanos.load(Ordering::Acquire) {
            // Not extended yet, as most locks are at every read: no
            // arithmetic on an `Instant`, which normalises and checks.
            0 => self.valid_from_acquisition,
            extended => self.valid_from_acquisition + Duration::from_nanos(extended),
        }
    }

    /// Whether the lock is certainly still ours at `now`.
    pub(crate) fn is_valid_at(&self, now: Instant) -> bool {
        now < self.valid_until()
    }

    /// When the next extension is due: a third of the ttl after the request
    /// that last confirmed the lock was sent.
    pub(crate) fn extension_due(&self) -> Instant {
        self.valid_until() - self.extension_lead
    }

    /// Records an extension sent at `sent_at` that the store confirmed.
    pub(crate) fn confirm(&self, sent_at: Instant) {
        let until = sent_at + self.valid_for;
        let by = until.saturating_duration_since(self.valid_from_acquisition);
        let nanos = u64::try_from(by.as_nanos()).unwrap_or(u64::MAX);
        self.extended_by_nanos.fetch_max(nanos, Ordering::AcqRel);
    }

    /// Counts an extension sent.
    pub(crate) fn extension_sent(&self) {
        self.extending.fetch_add(1, Ordering::AcqRel);
    }

    /// Counts an extension answered (or given up).
    pub(crate) fn extension_answered(&self) {
        if self.extending.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.signal.notify_waiters();
        }
    }

    /// Whether an extension of this lock is on its way.
    pub(crate) fn is_extending(&self) -> bool {
        self.extending.load(Ordering::Acquire) > 0
    }

    /// Resolves once no extension of this lock is on its way.
    pub(crate) async fn extensions_answered(&self) {
        self.signal
            .wait_until(|| (self.extending.load(Ordering::Acquire) == 0).then_some(()))
            .await;
    }

    /// Records the loss; the first cause wins. Returns whether this call set it.
    pub(crate) fn mark_lost(&self, cause: LossCause) -> bool {
        let first = self.lost.set(cause).is_ok();
        if first {
            if let Some(cause) = self.lost.get() {
                self.meter.lost(self.lease.key_arc(), cause);
            }
            self.meter.held(self.lease.key_arc(), &self.held_for, true);
            self.signal.notify_waiters();
        }
        first
    }

    /// Records that the call that took the lock released it (after any
    /// loss its release revealed was marked).
    pub(crate) fn mark_ended(&self) {
        self.ended.store(true, Ordering::Release);
        let lost = self.lost.get().is_some();
        self.meter.held(self.lease.key_arc(), &self.held_for, lost);
        self.signal.notify_waiters();
    }

    pub(crate) fn loss_cause(&self) -> Option<&LossCause> {
        self.lost.get()
    }

    pub(crate) fn is_ended(&self) -> bool {
        self.ended.load(Ordering::Acquire)
    }

    /// Resolves when the lock is lost, with the cause.
    pub(crate) async fn lost(&self) -> LossCause {
        self.lost_or(false).await
    }

    /// Resolves when the lock is lost, or released by the call that took
    /// it ([`LossCause::Released`]): what a task sharing the lock races.
    pub(crate) async fn lost_or_ended(&self) -> LossCause {
        self.lost_or(true).await
    }

    /// The loss (or with `or_ended`, the release) already recorded, if any.
    pub(crate) fn loss_now(&self, or_ended: bool) -> Option<LossCause> {
        if let Some(cause) = self.lost.get() {
            return Some(cause.clone());
        }
        (or_ended && self.is_ended()).then_some(LossCause::Released)
    }

    /// Resolves with [`loss_now`](Self::loss_now) once it gives a cause.
    pub(crate) async fn lost_or(&self, or_ended: bool) -> LossCause {
        self.signal.wait_until(|| self.loss_now(or_ended)).await
    }
}

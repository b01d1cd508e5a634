//! A waiter's part of the fair queue \[F1–F3, F6\]: its place in the
//! store's queue, left when its wait ends without the lock, and a grant
//! turned into the start of a held lock.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use crate::backend::{Lease, OwnerToken, QueueTerms};
use crate::config::LockConfig;
use crate::error::BackendError;
use crate::held::{HeldLock, Holder};
use crate::locker::Inner;
use crate::notify::Grant;
use crate::registry::Registry;

/// The first wait between two tries of a leave that failed; it doubles up
/// to [`LEAVE_BACKOFF_MAX`].
const LEAVE_BACKOFF: Duration = Duration::from_millis(20);
const LEAVE_BACKOFF_MAX: Duration = Duration::from_millis(500);

/// A waiter's place in the key's queue. Dropped armed (the wait gave up,
/// failed, was cancelled or shut down), it is left in the background
/// \[F2\]; a wait that took the lock disarms it (taking the key removed
/// the place).
pub(crate) struct Place {
    registry: Arc<Registry>,
    key: Arc<str>,
    owner: OwnerToken,
    terms: QueueTerms,
    armed: bool,
}

impl Place {
    pub(crate) fn new(
        registry: &Arc<Registry>,
        key: &Arc<str>,
        owner: &OwnerToken,
        terms: QueueTerms,
    ) -> Self {
        Self {
            registry: Arc::clone(registry),
            key: Arc::clone(key),
            owner: owner.clone(),
            terms,
            armed: true,
        }
    }

    /// The place ended with the lock taken: nothing to leave.
    pub(crate) fn taken(mut self) {
        self.armed = false;
    }
}

impl Drop for Place {
    fn drop(&mut self) {
        if self.armed {
            leave(
                &self.registry,
                Arc::clone(&self.key),
                self.owner.clone(),
                self.terms,
            );
        }
    }
}

/// Leaves the place of `owner` in the key's queue, in a task of its own: a
/// leave that fails is sent again, with a backoff, until the place would
/// have lapsed by itself (a ticket ttl from now), so that a connection cut
/// under a waiter does not leave a dead place at the head for the rest of
/// its ticket ttl. Without a runtime the place lapses. Shutdown waits for
/// it as for an attempt in flight \[S1\]: a grant made to the place
/// before the leave arrived is handed on by it, so nothing stays held.
pub(crate) fn leave(registry: &Arc<Registry>, key: Arc<str>, owner: OwnerToken, terms: QueueTerms) {
    let lapses = Instant::now() + terms.ticket_ttl;
    let task_registry = Arc::clone(registry);
    let in_flight = registry.attempt_started();
    let leave = async move {
        let _in_flight = in_flight;
        let mut backoff = LEAVE_BACKOFF;
        loop {
            match task_registry.backend.leave_queue(&key, &owner).await {
                Ok(()) => return,
                Err(error) => {
                    tracing::debug!(key = %key, error = %crate::ErrorChain(&error), "leaving the fair queue failed");
                    if error.is_permanent() || Instant::now() + backoff >= lapses {
                        return;
                    }
                }
            }
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(LEAVE_BACKOFF_MAX);
        }
    };
    registry.spawn(leave);
}

/// The clock reading from which a grant's validity counts, as an
/// acquisition's counts from the moment it was sent, so that the lock is
/// valid until `asked` plus the claim deadline: `asked` is the send time of
/// the waiter's last attempt that the store answered busy, and the grant
/// came after the store answered it, so the store holds the grant at least
/// that long, whenever the grant's message arrived (a process stopped past
/// the claim deadline finds its grant run out, not fresh). With a claim
/// deadline longer than the ttl that reading is after `asked`; it is never
/// after `now` (the lock is then valid for the ttl from now, still within
/// the claim). The first extension, due at once, makes the lock its own
/// ttl. `None` when the clock cannot go back that far.
pub(crate) fn grant_sent_at(
    asked: Instant,
    grant: &Grant,
    ttl: Duration,
    now: Instant,
) -> Option<Instant> {
    match grant.claim.checked_sub(ttl) {
        Some(ahead) => Some((asked + ahead).min(now)),
        None => asked.checked_sub(ttl - grant.claim),
    }
}

impl Inner {
    /// Starts holding the lock `grant` gave `owner` \[F1\], with no round
    /// trip: its validity counts from `asked`, the send time of the
    /// waiter's last attempt answered busy (see [`grant_sent_at`]), and
    /// its first extension, due at once, takes it up. `None` when this
    /// process cannot count the grant valid any more (its message came
    /// late, or the waiter's last busy answer is older than the claim
    /// deadline, as with a long ticket ttl): nothing was done, and the
    /// waiter's next attempt, at once, takes the grant up if the store
    /// still holds it for this owner. An error when it ran out while being
    /// taken (the clock moved on between that check and the record): it
    /// is then released in the background with this owner token, which
    /// the waiter must not hold under again.
    pub(crate) async fn take_grant(
        &self,
        key: &Arc<str>,
        owner: &OwnerToken,
        grant: &Grant,
        asked: Instant,
        config: &LockConfig,
    ) -> Option<Result<(u64, Arc<HeldLock>), BackendError>> {
        let now = Instant::now();
        let sent_at = grant_sent_at(asked, grant, config.ttl, now)?;
        if sent_at + crate::held::validity(config.ttl).0 <= now {
            return None;
        }
        let lease = Lease::new(Arc::clone(key), owner.clone(), grant.fencing_token);
        let in_flight = self.registry.attempt_started();
        Some(
            self.hold(
                lease,
                config.ttl,
                sent_at,
                false,
                Holder::Callback,
                in_flight,
            )
            .await,
        )
    }

    /// The terms of the queue for a call with `terms`, unless the backend
    /// keeps none or this locker found it refused \[F6\].
    pub(crate) fn queue_for(&self, terms: Option<QueueTerms>) -> Option<QueueTerms> {
        terms.filter(|_| self.caps.queues() && !self.queue_refused.load(Ordering::Relaxed))
    }

    /// The store refused the queue with a setup error: this locker waits
    /// unqueued from now on, and the log says so once \[F6\].
    pub(crate) fn refuse_queue(&self, error: &BackendError) {
        if !self.queue_refused.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                backend = self.caps.name,
                error = %crate::ErrorChain(error),
                "the store refused the fair queue; this node waits unqueued from now on \
                 (give the lock user the queue's rights, or run the backend's migration; \
                 see the backend's README)"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn grant(claim: Duration) -> Grant {
        Grant::new("n/0", 7, claim)
    }

    /// The lock a grant starts is valid until the last busy attempt's send
    /// time plus the claim deadline, never past it, and never from a
    /// reading after now: with a ttl shorter than the claim (1 s and 2 s) a
    /// grant arriving 1.5 s after that attempt is still valid for 0.5 s.
    #[test]
    fn a_grant_is_valid_until_the_last_busy_attempt_plus_the_claim() {
        let asked = Instant::now();
        let (second, claim) = (Duration::from_secs(1), Duration::from_secs(2));
        for (ttl, now, valid_until) in [
            // ttl shorter than the claim: up to asked + claim.
            (second, asked + second * 3 / 2, asked + claim),
            // just after the attempt: the ttl from now, within the claim.
            (second, asked + second / 10, asked + second / 10 + second),
            // ttl longer than the claim: asked + claim.
            (second * 30, asked + second / 2, asked + claim),
        ] {
            let sent_at = grant_sent_at(asked, &grant(claim), ttl, now).unwrap();
            assert!(sent_at <= now);
            assert_eq!(sent_at + ttl, valid_until, "ttl {ttl:?}");
            assert!(sent_at + ttl <= asked + claim);
        }
    }
}

//! `Locker::shutdown` \[S1–S3\].

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

use crate::locker::Locker;

/// Whether shutdown began, and a way to wait for it.
#[derive(Default)]
pub(crate) struct ShutdownSignal {
    started: AtomicBool,
    notify: Notify,
}

impl ShutdownSignal {
    fn start(&self) {
        self.started.store(true, Ordering::SeqCst);
        self.notify.notify_waiters();
    }

    pub(crate) fn is_started(&self) -> bool {
        self.started.load(Ordering::SeqCst)
    }

    pub(crate) async fn started(&self) {
        loop {
            let notified = self.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.is_started() {
                return;
            }
            notified.await;
        }
    }
}

/// What [`Locker::shutdown`] did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ShutdownReport {
    /// Every running callback finished within the grace period.
    pub callbacks_finished: bool,
    /// Locks still held after the grace period, released by shutdown.
    pub released: usize,
    /// Releases shutdown waited for (its own, those of callbacks, handles
    /// and drops still in flight, and those of what acquisition attempts in
    /// flight took or may have taken) that failed or were not answered
    /// within [`LockerOptions::release_timeout`](crate::LockerOptions::release_timeout),
    /// and attempts still unanswered by then \[S1\]; these keys expire with
    /// their ttl.
    pub release_failures: usize,
}

impl Locker {
    /// Stops this node: no new acquisitions, running callbacks get up to
    /// `grace` to finish, then every lock the node still holds is released,
    /// so other nodes do not wait for the ttl \[S1\].
    ///
    /// - Calls whose lock is released this way return
    ///   [`LockError::Lost`](crate::LockError::Lost) with
    ///   [`LossCause::Shutdown`](crate::LossCause::Shutdown).
    /// - When it returns, every release the node owes has been answered by
    ///   the store or has failed: the locks shutdown released, and those of
    ///   callbacks that finished, handles, `Mutex`es and drops whose
    ///   releases were still in flight.
    /// - Acquisition attempts in flight are owed too: shutdown waits for
    ///   their answers (within the release timeout) and frees whatever they
    ///   took; an attempt still unanswered by then, and a key it may have
    ///   taken that could not be freed, count in
    ///   [`ShutdownReport::release_failures`] and expire with their ttl.
    /// - From the moment this is called, `with_lock` on this node never
    ///   settles and never runs its callback, nor do calls already waiting
    ///   \[S2\]; handles and `Mutex`es cannot acquire either.
    /// - It returns within `grace` plus
    ///   [`LockerOptions::release_timeout`](crate::LockerOptions::release_timeout),
    ///   even when the backend is down \[S3\].
    ///
    /// # Cancel safety
    ///
    /// Dropping the future stops the waiting; the locker stays shut to new
    /// acquisitions, and locks not yet released expire with their ttl.
    pub async fn shutdown(&self, grace: Duration) -> ShutdownReport {
        let inner = self.inner();
        let registry = &inner.registry;
        tracing::info!(node_id = %inner.node_id, ?grace, "locker shutting down");
        registry.close_to_new();
        inner.shutdown.start();
        let callbacks_finished = tokio::time::timeout(grace, registry.callbacks_done())
            .await
            .is_ok();
        let deadline = Instant::now() + inner.options.release_timeout;
        // [S1] Attempts in flight settle first: what they took is then held
        // (and released below), owed a release, or pending clean-up.
        let _ = tokio::time::timeout_at(deadline, registry.attempts_done()).await;
        let unsettled_attempts = registry.attempts_in_flight();
        let drained = registry.end_all_for_shutdown();
        let released = drained.len();
        let own = futures_util::future::join_all(drained.into_iter().map(|r| r.send()));
        // A release not answered by the deadline is dropped, given up.
        let (_, cleanup_failures) = futures_util::future::join(
            tokio::time::timeout_at(deadline, own),
            registry.cleanup.final_pass(deadline),
        )
        .await;
        let _ = tokio::time::timeout_at(deadline, registry.releases_done()).await;
        let (unanswered, failed) = registry.release_counts();
        let release_failures = unanswered + failed + unsettled_attempts + cleanup_failures;
        tracing::info!(
            released,
            release_failures,
            callbacks_finished,
            "locker shut down"
        );
        ShutdownReport {
            callbacks_finished,
            released,
            release_failures,
        }
    }
}

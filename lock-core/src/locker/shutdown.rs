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
    /// Releases shutdown waited for (its own, and those of callbacks,
    /// handles and drops still in flight) that failed or were not answered
    /// within [`LockerOptions::release_timeout`](crate::LockerOptions::release_timeout);
    /// these keys expire with their ttl.
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
        let drained = registry.end_all_for_shutdown();
        let released = drained.len();
        let own = futures_util::future::join_all(drained.into_iter().map(|r| r.send()));
        let clean_up = registry.cleanup.final_pass();
        // A release not answered by the deadline is dropped, given up.
        let _ = tokio::time::timeout_at(deadline, futures_util::future::join(own, clean_up)).await;
        let _ = tokio::time::timeout_at(deadline, registry.releases_done()).await;
        let (unanswered, failed) = registry.release_counts();
        let release_failures = unanswered + failed;
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

//! Running a backend step so that dropping its caller cannot strand a lock,
//! and the cheap signal the driver notifies on every release.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use tokio::runtime::Handle;
use tokio::sync::Notify;

use crate::registry::Registry;

/// Runs `step` in place, and to its end even if this future is dropped.
///
/// The step is polled by the caller's own task, so the common path costs no
/// task hop, but inside the background runtime's context: the timers and
/// connections it makes belong there, not to the caller's runtime. If the
/// future is dropped while the step is still pending (its request may
/// already be on the wire), the step moves into a task of its own, on
/// `registry`'s background runtime \[T1\], and its answer goes to `orphan`
/// there; it goes on after the caller's runtime has ended.
pub(crate) fn finish_even_if_dropped<S, O>(
    registry: &Arc<Registry>,
    step: S,
    orphan: O,
) -> FinishEvenIfDropped<S, O>
where
    S: Future + Send + 'static,
    S::Output: Send + 'static,
    O: FnOnce(S::Output) + Send + Unpin + 'static,
{
    FinishEvenIfDropped {
        registry: Arc::clone(registry),
        step: Some(Box::pin(step)),
        orphan: Some(orphan),
    }
}

/// The future of [`finish_even_if_dropped`].
pub(crate) struct FinishEvenIfDropped<S, O>
where
    S: Future + Send + 'static,
    S::Output: Send + 'static,
    O: FnOnce(S::Output) + Send + Unpin + 'static,
{
    registry: Arc<Registry>,
    step: Option<Pin<Box<S>>>,
    orphan: Option<O>,
}

impl<S, O> Future for FinishEvenIfDropped<S, O>
where
    S: Future + Send + 'static,
    S::Output: Send + 'static,
    O: FnOnce(S::Output) + Send + Unpin + 'static,
{
    type Output = S::Output;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<S::Output> {
        let this = &mut *self;
        let Some(step) = this.step.as_mut() else {
            panic!("FinishEvenIfDropped polled after it finished");
        };
        let _inside = this.registry.background_handle().map(Handle::enter);
        let answer = std::task::ready!(step.as_mut().poll(cx));
        drop(_inside);
        this.step = None;
        Poll::Ready(answer)
    }
}

impl<S, O> Drop for FinishEvenIfDropped<S, O>
where
    S: Future + Send + 'static,
    S::Output: Send + 'static,
    O: FnOnce(S::Output) + Send + Unpin + 'static,
{
    fn drop(&mut self) {
        let (Some(step), Some(orphan)) = (self.step.take(), self.orphan.take()) else {
            return;
        };
        self.registry.spawn(async move { orphan(step.await) });
    }
}

/// A [`Notify`] for waiters that check a condition, whose notifications
/// cost one atomic operation while nobody waits: the driver signals on
/// every release, and somebody waits only now and then (shutdown, a task
/// carried into a lock's scope, a callback still running at a loss).
#[derive(Default)]
pub(crate) struct Signal {
    notify: Notify,
    /// How many `wait_until` calls are in progress.
    waiting: AtomicUsize,
}

impl Signal {
    /// Wakes every `wait_until` in progress, after a change of the state
    /// their condition reads.
    pub(crate) fn notify_waiters(&self) {
        // A read-modify-write, not a load: it orders the caller's change of
        // the state before it, so that a waiter that counted itself after
        // this reads the change in its condition.
        if self.waiting.fetch_add(0, Ordering::SeqCst) > 0 {
            self.notify.notify_waiters();
        }
    }

    /// As [`notify_waiters`](Self::notify_waiters), after a change made
    /// under a mutex that every waiter's condition also takes: then a load
    /// is enough. A waiter counted itself before its check took the mutex;
    /// if that check ran before the change, the mutex orders its count
    /// before this load, which sees it; if after, the check saw the change.
    pub(crate) fn notify_waiters_after_locked_change(&self) {
        if self.waiting.load(Ordering::Relaxed) > 0 {
            self.notify.notify_waiters();
        }
    }

    /// Resolves with the first `Some` that `check` gives, checked now and
    /// after every notification.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe.
    pub(crate) async fn wait_until<T>(&self, mut check: impl FnMut() -> Option<T>) -> T {
        let mut notified = std::pin::pin!(self.notify.notified());
        // Made before counting in: a notification after the count is seen
        // completes it.
        let _counted = Counted::new(&self.waiting);
        loop {
            notified.as_mut().enable();
            if let Some(value) = check() {
                return value;
            }
            notified.as_mut().await;
            notified.set(self.notify.notified());
        }
    }
}

/// One waiter counted in a [`Signal`] while it lives.
struct Counted<'a>(&'a AtomicUsize);

impl<'a> Counted<'a> {
    fn new(count: &'a AtomicUsize) -> Self {
        count.fetch_add(1, Ordering::SeqCst);
        Self(count)
    }
}

impl Drop for Counted<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A future that never settles: what `with_lock` becomes on a locker that
/// shut down \[S2\].
pub(crate) async fn never<T>() -> T {
    std::future::pending().await
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;
    use tokio::sync::oneshot;

    #[tokio::test]
    async fn a_ready_step_answers_in_place() {
        let registry = crate::registry::tests::registry_for_tests();
        assert_eq!(
            finish_even_if_dropped(&registry, async { 7 }, |_| {}).await,
            7
        );
    }

    #[tokio::test]
    async fn a_dropped_caller_hands_the_answer_to_orphan() {
        let (done_tx, done_rx) = oneshot::channel();
        let (go_tx, go_rx) = oneshot::channel::<()>();
        let registry = crate::registry::tests::registry_for_tests();
        let caller = finish_even_if_dropped(
            &registry,
            async move {
                let _ = go_rx.await;
                5
            },
            move |v| {
                let _ = done_tx.send(v);
            },
        );
        assert!(tokio::time::timeout(Duration::from_millis(10), caller)
            .await
            .is_err());
        go_tx.send(()).unwrap();
        let orphaned = tokio::time::timeout(Duration::from_secs(5), done_rx).await;
        assert_eq!(orphaned.unwrap().unwrap(), 5);
    }
}

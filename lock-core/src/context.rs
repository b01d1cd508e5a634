//! The lock context a callback receives, and the task-local record of the
//! locks a task holds, which makes `with_lock` reentrant.

use std::fmt;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use tokio::sync::Notify;
use tokio::task::futures::TaskLocalFuture;

use crate::error::LossCause;

/// The state of one held lease that the driver, the extender and the
/// callback share.
pub(crate) struct LeaseState {
    pub(crate) locker_id: u64,
    pub(crate) key: Arc<str>,
    pub(crate) fencing_token: u64,
    lost: OnceLock<LossCause>,
    ended: AtomicBool,
    notify: Notify,
}

impl LeaseState {
    pub(crate) fn new(locker_id: u64, key: Arc<str>, fencing_token: u64) -> Self {
        Self {
            locker_id,
            key,
            fencing_token,
            lost: OnceLock::new(),
            ended: AtomicBool::new(false),
            notify: Notify::new(),
        }
    }

    /// Records the loss; the first cause wins. Returns whether this call set it.
    pub(crate) fn mark_lost(&self, cause: LossCause) -> bool {
        let first = self.lost.set(cause).is_ok();
        if first {
            self.notify.notify_waiters();
        }
        first
    }

    /// Records that the lock was released after its callback settled.
    pub(crate) fn mark_ended(&self) {
        self.ended.store(true, Ordering::Release);
    }

    pub(crate) fn loss_cause(&self) -> Option<&LossCause> {
        self.lost.get()
    }

    pub(crate) fn is_ended(&self) -> bool {
        self.ended.load(Ordering::Acquire)
    }

    pub(crate) async fn lost(&self) -> LossCause {
        loop {
            let notified = self.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if let Some(cause) = self.lost.get() {
                return cause.clone();
            }
            notified.await;
        }
    }
}

/// What a callback knows about the lock it runs under.
///
/// Cheap to clone. Reentrant calls inside the callback see the same context,
/// so the same fencing token.
#[derive(Clone)]
pub struct LockContext {
    pub(crate) state: Arc<LeaseState>,
}

impl LockContext {
    /// The locked key.
    pub fn key(&self) -> &str {
        &self.state.key
    }

    /// The fencing token of this acquisition: strictly greater than every
    /// token given before for this key, on any node. Send it with every
    /// write to a store that can reject writes carrying a smaller token than
    /// one it has seen.
    pub fn fencing_token(&self) -> u64 {
        self.state.fencing_token
    }

    /// Whether the lock has been lost. Check it before an authoritative
    /// side effect when running in the default (detaching) mode.
    pub fn is_lost(&self) -> bool {
        self.state.loss_cause().is_some()
    }

    /// Why the lock was lost, if it was.
    pub fn loss_cause(&self) -> Option<LossCause> {
        self.state.loss_cause().cloned()
    }

    /// Whether the lock is still held: neither lost nor released.
    pub fn is_held(&self) -> bool {
        !self.is_lost() && !self.state.is_ended()
    }

    /// Resolves when the lock is lost, with the cause. Never resolves for a
    /// lock that is released normally.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe.
    pub async fn lost(&self) -> LossCause {
        self.state.lost().await
    }

    /// Runs `fut` as if inside this lock's callback, so that a `with_lock` on
    /// the same key and locker inside it is reentrant. This is how the lock
    /// context is carried into a spawned task, which otherwise waits for the
    /// lock like any other task:
    ///
    /// ```
    /// # use lock_core::Locker;
    /// # async fn demo(locker: Locker) -> Result<(), lock_core::LockError> {
    /// let inner = locker.clone();
    /// locker
    ///     .with_lock("report", move |ctx| async move {
    ///         let task = tokio::spawn(ctx.scope(async move {
    ///             // Runs at once: the context says this task shares the lock.
    ///             inner.with_lock("report", |_| async {}).await
    ///         }));
    ///         task.await.unwrap()
    ///     })
    ///     .await??;
    /// # Ok(()) }
    /// ```
    ///
    /// A carried context whose lock has since been released no longer makes
    /// calls reentrant; one whose lock was lost makes them fail with
    /// [`LockError::Lost`](crate::LockError::Lost).
    pub fn scope<F: Future>(&self, fut: F) -> TaskLocalFuture<Chain, F> {
        HELD.scope(Chain::current().push(self.clone()), fut)
    }
}

impl fmt::Debug for LockContext {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LockContext")
            .field("key", &self.key())
            .field("fencing_token", &self.fencing_token())
            .field("lost", &self.is_lost())
            .finish()
    }
}

/// The locks the current task holds, innermost first. Opaque: it only
/// appears in the type of [`LockContext::scope`]'s future.
#[derive(Clone, Default)]
pub struct Chain(Option<Arc<Link>>);

struct Link {
    ctx: LockContext,
    parent: Chain,
}

tokio::task_local! {
    static HELD: Chain;
}

impl Chain {
    fn current() -> Self {
        HELD.try_with(Clone::clone).unwrap_or_default()
    }

    fn push(self, ctx: LockContext) -> Self {
        Self(Some(Arc::new(Link { ctx, parent: self })))
    }

    fn find(&self, locker_id: u64, key: &str) -> Option<LockContext> {
        let mut link = self.0.as_deref();
        while let Some(l) = link {
            if l.ctx.state.locker_id == locker_id && *l.ctx.state.key == *key {
                return Some(l.ctx.clone());
            }
            link = l.parent.0.as_deref();
        }
        None
    }
}

impl fmt::Debug for Chain {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Chain")
    }
}

/// The context of a lock on `key` of locker `locker_id` that the current task
/// holds, if any.
pub(crate) fn held_by_current_task(locker_id: u64, key: &str) -> Option<LockContext> {
    HELD.try_with(|chain| chain.find(locker_id, key))
        .ok()
        .flatten()
}

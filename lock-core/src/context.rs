//! The lock context a callback receives, and the task-local record of the
//! locks a task holds, which makes `with_lock` reentrant.

use std::fmt;
use std::future::Future;
use std::sync::Arc;

use tokio::task::futures::TaskLocalFuture;

use crate::error::{LockError, LossCause};
use crate::held::HeldLock;

/// A future running inside a lock's task-local scope.
pub(crate) type Scoped<F> = TaskLocalFuture<Chain, F>;

/// What a callback knows about the lock it runs under.
///
/// Cheap to clone. Reentrant calls inside the callback see the same context,
/// so the same fencing token.
#[derive(Clone)]
pub struct LockContext {
    pub(crate) held: Arc<HeldLock>,
}

impl LockContext {
    /// The locked key.
    pub fn key(&self) -> &str {
        self.held.lease.key()
    }

    /// The fencing token of this acquisition: strictly greater than every
    /// token given before for this key, on any node. Send it with every
    /// write to a store that can reject writes carrying a smaller token than
    /// one it has seen.
    pub fn fencing_token(&self) -> u64 {
        self.held.lease.fencing_token()
    }

    /// Whether the lock has been lost. Check it before an authoritative
    /// side effect when running in the default (detaching) mode.
    pub fn is_lost(&self) -> bool {
        self.held.loss_cause().is_some()
    }

    /// Why the lock was lost, if it was.
    pub fn loss_cause(&self) -> Option<LossCause> {
        self.held.loss_cause().cloned()
    }

    /// Whether the lock is still held: neither lost nor released.
    pub fn is_held(&self) -> bool {
        !self.is_lost() && !self.held.is_ended()
    }

    /// Resolves when the lock is lost, with the cause. Never resolves for a
    /// lock that is released normally.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe.
    pub async fn lost(&self) -> LossCause {
        self.held.lost().await
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
    ///         task.await.expect("the task ran")
    ///     })
    ///     .await???;
    /// # Ok(()) }
    /// ```
    ///
    /// The carried task runs only while the lock is held: if the lock is
    /// lost, or released by the call that took it while the task still
    /// runs, `fut` is dropped at its next await point and this gives
    /// [`LockError::Lost`] (with [`LossCause::Released`] for a release).
    ///
    /// # Cancel safety
    ///
    /// Dropping the future drops `fut`; the lock is not affected.
    pub fn scope<F: Future>(&self, fut: F) -> impl Future<Output = Result<F::Output, LockError>> {
        let held = Arc::clone(&self.held);
        let scoped = self.enter(fut);
        async move {
            let loss = held.lost_or_ended();
            tokio::pin!(loss, scoped);
            tokio::select! {
                biased;
                cause = &mut loss => Err(LockError::Lost { key: held.lease.key().to_owned(), cause }),
                out = &mut scoped => Ok(out),
            }
        }
    }

    /// Runs `fut` inside this lock's task-local scope.
    pub(crate) fn enter<F: Future>(&self, fut: F) -> Scoped<F> {
        HELD.scope(Chain::current().push(self.clone()), fut)
    }

    /// Runs the future `callback` makes of this context inside this lock's
    /// task-local scope (one clone of the context fewer than
    /// [`enter`](Self::enter) with a clone for the callback).
    pub(crate) fn run<F: Future>(self, callback: impl FnOnce(Self) -> F) -> Scoped<F> {
        let chain = Chain::current().push(self.clone());
        HELD.scope(chain, callback(self))
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

/// The locks the current task holds, innermost first. The outermost lock
/// of a task is held inline: only a nested one costs an allocation.
#[derive(Clone, Default)]
pub(crate) struct Chain {
    ctx: Option<LockContext>,
    parent: Option<Arc<Chain>>,
}

tokio::task_local! {
    static HELD: Chain;
}

impl Chain {
    fn current() -> Self {
        HELD.try_with(Clone::clone).unwrap_or_default()
    }

    fn push(self, ctx: LockContext) -> Self {
        let parent = self.ctx.is_some().then(|| Arc::new(self));
        Self {
            ctx: Some(ctx),
            parent,
        }
    }

    fn find(&self, locker_id: u64, key: &str) -> Option<LockContext> {
        let mut chain = Some(self);
        while let Some(c) = chain {
            if let Some(ctx) = &c.ctx {
                if ctx.held.locker_id == locker_id && ctx.held.lease.key() == key {
                    return Some(ctx.clone());
                }
            }
            chain = c.parent.as_deref();
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

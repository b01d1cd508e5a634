//! `Locker`, one per node, and `with_lock`.

// The locker's own steps, in files of their own; they alone reach the
// fields of `Inner`.
mod acquire;
mod counts;
pub(crate) mod handle;
mod queue;
pub(crate) mod shutdown;

use std::fmt;
use std::future::Future;
use std::panic::{resume_unwind, AssertUnwindSafe};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::Poll;

use futures_util::FutureExt;
use tokio::time::Instant;

use self::shutdown::ShutdownSignal;
use crate::backend::{Capabilities, DynLockBackend, LockBackend};
use crate::config::{validate_key, LockConfig, LockerOptions};
use crate::context::{held_by_current_task, LockContext, Scoped};
use crate::error::{LockError, LossCause};
use crate::gate::Gates;
use crate::held::HeldLock;
use crate::metrics::Meter;
use crate::registry::{self, Registry, Runs};
use crate::task::never;

static NEXT_LOCKER_ID: AtomicU64 = AtomicU64::new(1);

/// One node's access to a lock backend: runs callbacks under locks that
/// exclude every other locker sharing the backend, on this process or any
/// other.
///
/// Cheap to clone; clones are the same node. Create one per process (or per
/// backend) and share it.
///
/// ```
/// use lock_core::Locker;
/// use lock_memory::MemoryBackend;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), lock_core::LockError> {
/// let locker = Locker::new(MemoryBackend::new());
/// let rows = locker
///     .with_lock("report:rebuild", |lock| async move {
///         // Only one node runs this at any given time.
///         lock.fencing_token()
///     })
///     .await?;
/// assert_eq!(rows, 1);
/// # Ok(()) }
/// ```
#[doc = include_str!("../doc/locker.md")]
#[derive(Clone)]
pub struct Locker {
    inner: Arc<Inner>,
}

pub(crate) struct Inner {
    id: u64,
    backend: Arc<DynLockBackend>,
    caps: Capabilities,
    node_id: Arc<str>,
    options: LockerOptions,
    gates: Gates,
    registry: Arc<Registry>,
    shutdown: ShutdownSignal,
    /// The store refused the fair queue (a missing table or right, or a
    /// backend without it behind a wrapper): this locker waits unqueued
    /// from then on, and said so once \[F6\].
    queue_refused: std::sync::atomic::AtomicBool,
}

impl Locker {
    /// A locker on `backend`, with a drawn node id.
    ///
    /// Several lockers may share one backend (`Arc<B>` is a backend too):
    /// each is a node of its own, excluded from the others.
    pub fn new(backend: impl LockBackend) -> Self {
        Self::with_options(backend, LockerOptions::default())
            .unwrap_or_else(|_| unreachable!("default options are valid"))
    }

    /// A locker on `backend` with `options`.
    ///
    /// # Errors
    ///
    /// [`LockError::InvalidInput`] for an invalid node id.
    pub fn with_options(
        backend: impl LockBackend,
        options: LockerOptions,
    ) -> Result<Self, LockError> {
        let node_id = options.resolved_node_id()?;
        let backend: Arc<DynLockBackend> = Arc::new(backend);
        let caps = backend.capabilities();
        let meter = Meter::new(caps.name, options.metrics_key_label);
        Ok(Self {
            inner: Arc::new(Inner {
                id: NEXT_LOCKER_ID.fetch_add(1, Ordering::Relaxed),
                registry: Arc::new(Registry::new(
                    Arc::clone(&backend),
                    meter,
                    Runs::new(options.caller_runtime),
                )),
                backend,
                caps,
                node_id: node_id.into(),
                options,
                gates: Gates::default(),
                shutdown: ShutdownSignal::default(),
                queue_refused: std::sync::atomic::AtomicBool::new(false),
            }),
        })
    }

    /// This node's id, the first part of every owner token it writes.
    pub fn node_id(&self) -> &str {
        &self.inner.node_id
    }

    /// The backend.
    pub fn backend(&self) -> &Arc<DynLockBackend> {
        &self.inner.backend
    }

    /// How many locks this node holds now, through `with_lock`, handles and
    /// `Mutex`es.
    pub fn held(&self) -> usize {
        self.inner.registry.len()
    }

    /// Whether [`shutdown`](Self::shutdown) has been called.
    pub fn is_shut_down(&self) -> bool {
        self.inner.shutdown.is_started()
    }

    pub(crate) fn inner(&self) -> &Arc<Inner> {
        &self.inner
    }

    /// Runs `callback` while holding the lock on `key`, with the default
    /// [`LockConfig`]: ttl 30 s, 10 retries 200 ms apart.
    ///
    /// Gives back what `callback` gave: a callback returning `Result` gives
    /// `Ok(Err(..))` for its own error, so "busy" and "the task failed" stay
    /// apart. See [`with_lock_config`](Self::with_lock_config) for the rules.
    ///
    /// # Errors
    ///
    /// [`LockError::NotAcquired`] (the callback did not run),
    /// [`LockError::Lost`] (the callback ran and goes on in the background),
    /// [`LockError::InvalidInput`].
    ///
    /// # Cancel safety
    ///
    /// Dropping the future while it waits leaves nothing held; dropping it
    /// while the callback runs stops the callback and releases the lock.
    pub async fn with_lock<T, F, Fut>(&self, key: &str, callback: F) -> Result<T, LockError>
    where
        F: FnOnce(LockContext) -> Fut,
        Fut: Future<Output = T> + Send + 'static,
        T: Send + 'static,
    {
        self.run(key, &LockConfig::DEFAULT, callback, Detach).await
    }

    /// Runs `callback` while holding the lock on `key`, acquired and held as
    /// `config` says.
    ///
    /// - The first attempt is made at once; while the key is held elsewhere,
    ///   up to `retry_attempts` more are made, `retry_delay` apart. A release
    ///   notification triggers an extra attempt at once, which does not count.
    /// - While the callback runs, the lock is extended about every `ttl / 3`.
    /// - The lock is released as soon as the callback settles, also when it
    ///   panics (the panic then resumes here). A failed release is not
    ///   reported: the key expires with its ttl. With
    ///   [`LockConfig::hold_at_least`], a callback that settles sooner
    ///   leaves the lock to expire at the end of that minimum instead.
    /// - If the lock is lost while the callback runs, this returns
    ///   [`LockError::Lost`] at once and the callback keeps running in the
    ///   background, where [`LockContext::is_lost`] tells it. Use
    ///   [`with_lock_cancel_on_loss`](Self::with_lock_cancel_on_loss) to
    ///   stop it instead.
    /// - Inside the callback, a `with_lock` on the same key and locker runs
    ///   at once, with the outer lock and the outer config.
    /// - After [`shutdown`](Self::shutdown) it never settles.
    ///
    /// # Errors
    ///
    /// As [`with_lock`](Self::with_lock).
    ///
    /// # Cancel safety
    ///
    /// As [`with_lock`](Self::with_lock).
    pub async fn with_lock_config<T, F, Fut>(
        &self,
        key: &str,
        config: &LockConfig,
        callback: F,
    ) -> Result<T, LockError>
    where
        F: FnOnce(LockContext) -> Fut,
        Fut: Future<Output = T> + Send + 'static,
        T: Send + 'static,
    {
        self.run(key, config, callback, Detach).await
    }

    /// Like [`with_lock_config`](Self::with_lock_config), but a lost lock
    /// stops the callback at its next await point: it is dropped and this
    /// returns [`LockError::Lost`]. Since the callback never outlives the
    /// call, it may borrow from the caller.
    ///
    /// # Errors
    ///
    /// As [`with_lock`](Self::with_lock).
    ///
    /// # Cancel safety
    ///
    /// As [`with_lock`](Self::with_lock).
    pub async fn with_lock_cancel_on_loss<T, F, Fut>(
        &self,
        key: &str,
        config: &LockConfig,
        callback: F,
    ) -> Result<T, LockError>
    where
        F: FnOnce(LockContext) -> Fut,
        Fut: Future<Output = T>,
    {
        self.run(key, config, callback, Cancel).await
    }

    async fn run<T, F, Fut, M>(
        &self,
        key: &str,
        config: &LockConfig,
        callback: F,
        on_loss: M,
    ) -> Result<T, LockError>
    where
        F: FnOnce(LockContext) -> Fut,
        Fut: Future<Output = T>,
        M: OnLoss<Fut> + OnLoss<Scoped<Fut>>,
    {
        validate_key(key, self.inner.caps.max_key_len)?;
        if let Some(ctx) = held_by_current_task(self.inner.id, key) {
            if let Some(cause) = ctx.held.loss_cause() {
                return Err(lost(key, cause.clone()));
            }
            if !ctx.held.is_ended() {
                // [R1] Reentrant: the outer call holds the lock. This call
                // still races its loss, and its release when this task was
                // carried into another with `LockContext::scope`.
                let held = Arc::clone(&ctx.held);
                let guarded = Box::pin(AssertUnwindSafe(callback(ctx)).catch_unwind());
                return match race(guarded, &held, true, std::future::pending()).await {
                    Ok(Ok(value)) => Ok(value),
                    Ok(Err(panic)) => resume_unwind(panic),
                    Err((guarded, cause)) => {
                        on_loss.lost(guarded);
                        Err(lost(key, cause))
                    }
                };
            }
        }
        config.validate()?;
        if config.require_fair_queue && config.queue_terms().is_some() && !self.inner.caps.queues()
        {
            return Err(crate::InvalidInput::FairQueueUnavailable {
                backend: self.inner.caps.name,
            }
            .into());
        }
        if self.inner.shutdown.is_started() {
            return never().await;
        }
        // A store that grants ttls only in its own units is asked for, and
        // counted on, the ttl it grants.
        let effective;
        let config = if self.inner.caps.adjusts_ttls() {
            effective = LockConfig {
                ttl: self.inner.caps.effective_ttl(config.ttl),
                ..*config
            };
            &effective
        } else {
            config
        };
        let lock = self.acquire(key, config).await?;
        let acquired_at = Instant::now();
        let ctx = LockContext {
            held: Arc::clone(&lock.held),
        };
        // Only the callback holds the context: once it is done, the lock's
        // record can go back to the key's gate.
        let guarded = Box::pin(AssertUnwindSafe(ctx.run(callback)).catch_unwind());
        let raced = race(guarded, &lock.held, false, lock.watch_own_key()).await;
        match raced {
            Ok(out) => {
                // [O6] The output counts only if the lock was ours for the
                // whole callback: still valid when it settled (a holder that
                // stalled past its ttl is told here, even when no extension
                // ran meanwhile), and not found taken by the release.
                let now = Instant::now();
                registry::outlived(&lock.held, now);
                // [H7] Settled before its minimum hold ended: left to
                // expire then, not released.
                let hold = config.hold_at_least;
                let hold_ends = (!hold.is_zero())
                    .then(|| acquired_at + hold)
                    .filter(|&ends| now < ends && lock.held.loss_cause().is_none());
                let in_hold = hold_ends.is_some();
                let (answer, held, pass) = match hold_ends {
                    Some(ends) => lock.hold_to_minimum(hold, ends).await,
                    None => lock.release(now).await,
                };
                // A release (or minimum hold) that failed proves nothing
                // either way: the validity was intact when the callback
                // settled, so its output stands, and the key expires with
                // its ttl.
                if let Some(Err(error)) = &answer {
                    let step = if in_hold { "minimum hold" } else { "release" };
                    tracing::warn!(key = %key, fencing_token = held.lease.fencing_token(), error = %crate::ErrorChain(error), "{step} failed after the callback settled; its output stands and the key expires with its ttl");
                }
                registry::settle_release(&held, answer.as_ref(), now);
                let cause = held.loss_cause().cloned();
                if let Some(cause) = &cause {
                    tracing::warn!(key = %key, fencing_token = held.lease.fencing_token(), cause = %crate::ErrorChain(cause), "lock lost before the callback settled");
                }
                // [H3] The next task of this node goes in; the record goes
                // to the key's gate for the next lock of the key.
                if let Some(mut pass) = pass {
                    pass.keep_spare(held);
                }
                match (out, cause) {
                    (Err(panic), _) => resume_unwind(panic),
                    (Ok(value), None) => Ok(value),
                    (Ok(_), Some(cause)) => Err(lost(key, cause)),
                }
            }
            Err((guarded, cause)) => {
                // Gives the lock up: the extender or shutdown already took
                // it out; if not, it is released in the background.
                drop(lock);
                on_loss.lost(guarded);
                Err(lost(key, cause))
            }
        }
    }
}

impl fmt::Debug for Locker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Locker")
            .field("node_id", &self.inner.node_id)
            .field("backend", &self.inner.backend)
            .field("held", &self.held())
            .field("shut_down", &self.is_shut_down())
            .finish()
    }
}

fn lost(key: &str, cause: LossCause) -> LockError {
    LockError::Lost {
        key: key.to_owned(),
        cause,
    }
}

/// The callback's future as the driver polls it, with panics caught so the
/// lock is released before they resume.
type Guarded<G> = Pin<Box<futures_util::future::CatchUnwind<AssertUnwindSafe<G>>>>;

/// Polls `callback` until it settles or `held` is lost (or with `or_ended`,
/// released) first; a loss seen in the same poll wins, so a cancelled
/// callback is not polled after it. `watch`, which never ends, is polled
/// beside them while the callback runs.
async fn race<G: Future>(
    mut callback: Guarded<G>,
    held: &HeldLock,
    or_ended: bool,
    watch: impl Future<Output = std::convert::Infallible>,
) -> Result<std::thread::Result<G::Output>, (Guarded<G>, LossCause)> {
    if let Some(cause) = held.loss_now(or_ended) {
        return Err((callback, cause));
    }
    // A callback that settles in its first poll never waits for the loss,
    // so it is polled once before the wait is set up.
    let first = std::future::poll_fn(|cx| Poll::Ready(callback.as_mut().poll(cx))).await;
    if let Poll::Ready(out) = first {
        return Ok(out);
    }
    let loss = held.lost_or(or_ended);
    tokio::pin!(loss, watch);
    tokio::select! {
        biased;
        cause = &mut loss => Err((callback, cause)),
        out = &mut callback => Ok(out),
        never = &mut watch => match never {},
    }
}

/// What becomes of a callback whose lock was lost \[L3\].
trait OnLoss<G: Future> {
    fn lost(self, callback: Guarded<G>);
}

/// The default: the callback goes on in a task of its own.
struct Detach;

impl<G> OnLoss<G> for Detach
where
    G: Future + Send + 'static,
    G::Output: Send + 'static,
{
    fn lost(self, callback: Guarded<G>) {
        tokio::spawn(async move {
            if callback.await.is_err() {
                tracing::error!("a callback panicked after its lock was lost");
            }
        });
    }
}

/// The callback is dropped at once.
struct Cancel;

impl<G: Future> OnLoss<G> for Cancel {
    fn lost(self, callback: Guarded<G>) {
        drop(callback);
    }
}

//! `Locker`, one per node, and `with_lock`.

use std::fmt;
use std::future::Future;
use std::panic::{resume_unwind, AssertUnwindSafe};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures_util::future::CatchUnwind;
use futures_util::FutureExt;
use tokio::sync::Notify;
use tokio::task::futures::TaskLocalFuture;
use tokio::time::Instant;
use tracing::Instrument;

use crate::backend::{
    AcquireOutcome, Capabilities, DynLockBackend, Lease, LockBackend, OwnerToken, ReleaseOutcome,
};
use crate::config::{validate_key, LockConfig, LockerOptions, RetryAttempts};
use crate::context::{held_by_current_task, Chain, LeaseState, LockContext};
use crate::error::{BackendError, LockError, LossCause};
use crate::extend::{spawn_release, spawn_uncertain_release, Holder, Registry};
use crate::gate::{GatePass, Gates};
use crate::task::{finish_even_if_dropped, never};

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
#[derive(Clone)]
pub struct Locker {
    inner: Arc<Inner>,
}

pub(crate) struct Inner {
    id: u64,
    pub(crate) backend: Arc<DynLockBackend>,
    caps: Capabilities,
    pub(crate) node_id: Arc<str>,
    options: LockerOptions,
    gates: Arc<Gates>,
    pub(crate) registry: Arc<Registry>,
    shutdown: ShutdownSignal,
}

impl Inner {
    /// One acquisition attempt that cannot strand a lock \[C1, O3\]: if
    /// it is dropped and its answer says the key was taken, the key is
    /// released; if it fails on an error, the request may still have been
    /// applied (a hung server runs it when it wakes up), so the key is
    /// released with the same owner token until its ttl has run out.
    pub(crate) async fn attempt(
        &self,
        key: &Arc<str>,
        owner: &OwnerToken,
        ttl: Duration,
    ) -> Result<AcquireOutcome, BackendError> {
        let sent_at = Instant::now();
        let backend = Arc::clone(&self.backend);
        let (k, o) = (Arc::clone(key), owner.clone());
        let step = async move { backend.try_acquire(&k, &o, ttl).await };
        let backend = Arc::clone(&self.backend);
        let lease = Lease::new(Arc::clone(key), owner.clone(), 0);
        let orphan = move |answer: Result<AcquireOutcome, BackendError>| match answer {
            Ok(AcquireOutcome::Acquired { .. }) => spawn_release(backend, lease),
            Ok(AcquireOutcome::Busy) => {}
            Err(_) => spawn_uncertain_release(backend, lease, sent_at + ttl),
        };
        let answer = finish_even_if_dropped(step, orphan).await;
        if answer.is_err() {
            let lease = Lease::new(Arc::clone(key), owner.clone(), 0);
            spawn_uncertain_release(Arc::clone(&self.backend), lease, sent_at + ttl);
        }
        answer
    }

    /// Releases `lease`, going on to the end if the caller is dropped.
    pub(crate) async fn release(&self, lease: Lease) -> Result<ReleaseOutcome, BackendError> {
        let backend = Arc::clone(&self.backend);
        let step = async move { backend.release(&lease).await };
        finish_even_if_dropped(step, |_| {}).await
    }
}

#[derive(Default)]
struct ShutdownSignal {
    started: AtomicBool,
    notify: Notify,
}

impl ShutdownSignal {
    fn start(&self) {
        self.started.store(true, Ordering::SeqCst);
        self.notify.notify_waiters();
    }

    fn is_started(&self) -> bool {
        self.started.load(Ordering::SeqCst)
    }

    async fn started(&self) {
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
    /// Of those, the releases that failed or did not finish in time; these
    /// keys expire with their ttl.
    pub release_failures: usize,
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
        Ok(Self {
            inner: Arc::new(Inner {
                id: NEXT_LOCKER_ID.fetch_add(1, Ordering::Relaxed),
                registry: Arc::new(Registry::new(Arc::clone(&backend))),
                backend,
                caps,
                node_id: node_id.into(),
                options,
                gates: Arc::default(),
                shutdown: ShutdownSignal::default(),
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
        self.run(key, &LockConfig::default(), callback, Detach)
            .await
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
    ///   reported: the key expires with its ttl.
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
        M: OnLoss<Guarded<Fut>>,
    {
        validate_key(key, self.inner.caps.max_key_len)?;
        if let Some(ctx) = held_by_current_task(self.inner.id, key) {
            if let Some(cause) = ctx.state.loss_cause() {
                return Err(LockError::Lost {
                    key: key.to_owned(),
                    cause: cause.clone(),
                });
            }
            if !ctx.state.is_ended() {
                // [R1] Reentrant: the outer call holds the lock.
                return Ok(callback(ctx).await);
            }
        }
        config.validate()?;
        if self.inner.shutdown.is_started() {
            return never().await;
        }
        let key: Arc<str> = key.into();
        let held = self.acquire(&key, config).await?;
        let ctx = LockContext {
            state: Arc::clone(&held.state),
        };
        let mut guarded: Pin<Box<Guarded<Fut>>> =
            Box::pin(AssertUnwindSafe(ctx.scope(callback(ctx.clone()))).catch_unwind());
        let settled = {
            let lost = held.state.lost();
            tokio::pin!(lost);
            tokio::select! {
                biased;
                out = &mut guarded => Ok(out),
                cause = &mut lost => Err(cause),
            }
        };
        match settled {
            Ok(out) => {
                // A loss seen in the same instant as the callback's end still
                // wins: the output was produced without the lock.
                let lost = held.state.loss_cause().cloned();
                held.release().await;
                if let (Some(cause), Ok(_)) = (lost, &out) {
                    return Err(LockError::Lost {
                        key: key.to_string(),
                        cause,
                    });
                }
                match out {
                    Ok(value) => Ok(value),
                    Err(panic) => resume_unwind(panic),
                }
            }
            Err(cause) => {
                held.abandon();
                on_loss.lost(guarded);
                Err(LockError::Lost {
                    key: key.to_string(),
                    cause,
                })
            }
        }
    }

    /// Acquires `key` for a callback: the per-key wait list, then the
    /// backend attempts \[A1–A6\].
    async fn acquire(&self, key: &Arc<str>, config: &LockConfig) -> Result<Held, LockError> {
        let inner = &self.inner;
        let span = tracing::debug_span!("acquire", key = %key);
        async move {
            let limit = match config.retry_attempts {
                RetryAttempts::Limited(n) => Some(n),
                RetryAttempts::Unlimited => None,
            };
            let exhausted = |counted: u32| limit.is_some_and(|n| counted > n);
            let mut counted: u32 = 0;
            let mut next_slot = Instant::now();

            // [A6] Another task of this locker holds or tries the key: wait
            // in line. Each slot that passes counts as an attempt that found
            // the key busy, so the give-up time stays as configured.
            let pass = match inner.gates.enter(key) {
                Ok(pass) => pass,
                Err(mut place) => loop {
                    tokio::select! {
                        biased;
                        pass = place.wait() => break pass,
                        () = inner.shutdown.started() => return never().await,
                        () = tokio::time::sleep_until(next_slot) => {
                            counted += 1;
                            if exhausted(counted) {
                                tracing::debug!(attempts = counted, "not acquired: held by another task of this node");
                                return Err(not_acquired(key, counted, None));
                            }
                            next_slot += config.retry_delay;
                        }
                    }
                },
            };

            let mut watch = None;
            // The last attempt that failed on a backend error, if any did.
            let mut last_error = None;
            let mut busy;
            loop {
                if inner.shutdown.is_started() {
                    return never().await;
                }
                let owner = OwnerToken::new(&inner.node_id);
                let sent_at = Instant::now();
                let slot_due = sent_at >= next_slot;
                match inner.attempt(key, &owner, config.ttl).await {
                    Ok(AcquireOutcome::Acquired { fencing_token }) => {
                        let lease = Lease::new(Arc::clone(key), owner, fencing_token);
                        return self.hold(lease, config.ttl, sent_at, pass).await;
                    }
                    Ok(AcquireOutcome::Busy) => busy = true,
                    Err(error) => {
                        tracing::debug!(%error, "acquisition attempt failed");
                        last_error = Some(error);
                        busy = false;
                    }
                }
                if slot_due {
                    counted += 1;
                    if exhausted(counted) {
                        tracing::debug!(attempts = counted, "not acquired");
                        return Err(not_acquired(key, counted, last_error.take()));
                    }
                    next_slot = sent_at.max(next_slot) + config.retry_delay;
                }
                // A failing store would fail the subscription too: watch
                // only once the key was found held.
                if busy && inner.caps.release_notifications && watch.is_none() {
                    // Subscribe only once the key was found busy, so an
                    // uncontended call pays nothing for it; then try again at
                    // once, which sees any release made before the watch
                    // existed, while the watch sees every one after.
                    match inner.backend.watch_release(key).await {
                        Ok(w) => {
                            watch = Some(w);
                            continue;
                        }
                        Err(error) => {
                            tracing::debug!(%error, "release watch failed; waiting on the retry timer");
                        }
                    }
                }
                tracing::trace!(attempts = counted, "busy; waiting");
                tokio::select! {
                    biased;
                    () = inner.shutdown.started() => return never().await,
                    () = released(&mut watch) => {}
                    () = tokio::time::sleep_until(next_slot) => {}
                }
            }
        }
        .instrument(span)
        .await
    }

    /// Registers an acquired lease for extension, or gives it back if the
    /// locker is shutting down.
    async fn hold(
        &self,
        lease: Lease,
        ttl: Duration,
        sent_at: Instant,
        pass: GatePass,
    ) -> Result<Held, LockError> {
        let inner = &self.inner;
        let state = Arc::new(LeaseState::new(
            inner.id,
            Arc::clone(lease.key_arc()),
            lease.fencing_token(),
        ));
        let registered = inner.registry.insert(
            lease.clone(),
            ttl,
            sent_at,
            Holder::Callback,
            Some(Arc::clone(&state)),
        );
        match registered {
            Some(id) => {
                tracing::debug!(fencing_token = lease.fencing_token(), "acquired");
                Ok(Held {
                    inner: Arc::clone(inner),
                    id,
                    lease,
                    state,
                    pass: Some(pass),
                    armed: true,
                })
            }
            None => {
                spawn_release(Arc::clone(&inner.backend), lease);
                never().await
            }
        }
    }

    /// Stops this node: no new acquisitions, running callbacks get up to
    /// `grace` to finish, then every lock the node still holds is released,
    /// so other nodes do not wait for the ttl \[S1\].
    ///
    /// - Calls whose lock is released this way return
    ///   [`LockError::Lost`] with [`LossCause::Shutdown`].
    /// - From the moment this is called, `with_lock` on this node never
    ///   settles and never runs its callback, nor do calls already waiting
    ///   \[S2\]; handles and `Mutex`es cannot acquire either.
    /// - It returns within `grace` plus
    ///   [`LockerOptions::release_timeout`], even when the backend is down
    ///   \[S3\].
    ///
    /// # Cancel safety
    ///
    /// Dropping the future stops the waiting; the locker stays shut to new
    /// acquisitions, and locks not yet released expire with their ttl.
    pub async fn shutdown(&self, grace: Duration) -> ShutdownReport {
        let inner = &self.inner;
        tracing::info!(node_id = %inner.node_id, ?grace, "locker shutting down");
        inner.registry.close_to_new();
        inner.shutdown.start();
        let callbacks_finished = tokio::time::timeout(grace, inner.registry.idle())
            .await
            .is_ok();
        let drained = inner.registry.close_and_drain();
        for removed in &drained {
            if let Some(state) = &removed.state {
                state.mark_lost(LossCause::Shutdown);
            }
        }
        let released = drained.len();
        let releases =
            futures_util::future::join_all(drained.iter().map(|r| inner.backend.release(&r.lease)));
        let release_failures =
            match tokio::time::timeout(inner.options.release_timeout, releases).await {
                Ok(answers) => answers.iter().filter(|a| a.is_err()).count(),
                Err(_) => released,
            };
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

fn not_acquired(key: &str, attempts: u32, source: Option<BackendError>) -> LockError {
    LockError::NotAcquired {
        key: key.to_owned(),
        attempts,
        source,
    }
}

async fn released(watch: &mut Option<crate::notify::ReleaseWatch>) {
    match watch {
        Some(w) => w.released().await,
        None => std::future::pending().await,
    }
}

/// The callback's future as the driver polls it: inside the lock's task-local
/// scope, with panics caught so the lock is released before they resume.
type Guarded<Fut> = CatchUnwind<AssertUnwindSafe<TaskLocalFuture<Chain, Fut>>>;

/// What becomes of a callback whose lock was lost \[L3\].
trait OnLoss<G> {
    fn lost(self, callback: Pin<Box<G>>);
}

/// The default: the callback goes on in a task of its own.
struct Detach;

impl<G, T> OnLoss<G> for Detach
where
    G: Future<Output = std::thread::Result<T>> + Send + 'static,
    T: Send + 'static,
{
    fn lost(self, callback: Pin<Box<G>>) {
        tokio::spawn(async move {
            if callback.await.is_err() {
                tracing::error!("a callback panicked after its lock was lost");
            }
        });
    }
}

/// The callback is dropped at once.
struct Cancel;

impl<G> OnLoss<G> for Cancel {
    fn lost(self, callback: Pin<Box<G>>) {
        drop(callback);
    }
}

/// A lease held for a callback, with the key's pass. Dropping it releases
/// the lease in the background \[C2\].
struct Held {
    inner: Arc<Inner>,
    id: u64,
    lease: Lease,
    state: Arc<LeaseState>,
    pass: Option<GatePass>,
    armed: bool,
}

impl Held {
    /// Releases the lease and waits for the answer, then lets the next task
    /// of this node in \[H3\].
    async fn release(mut self) {
        self.armed = false;
        self.state.mark_ended();
        if self.inner.registry.remove(self.id).is_some() {
            match self.inner.release(self.lease.clone()).await {
                Ok(outcome) => {
                    tracing::debug!(key = %self.lease.key(), fencing_token = self.lease.fencing_token(), ?outcome, "released");
                }
                Err(error) => {
                    tracing::debug!(key = %self.lease.key(), %error, "release failed; the key expires with its ttl");
                }
            }
        }
        drop(self.pass.take());
    }

    /// Forgets a lease that was lost; the extender or shutdown already took
    /// it out of the registry.
    fn abandon(mut self) {
        self.armed = false;
        self.inner.registry.remove(self.id);
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        if self.armed {
            self.state.mark_ended();
            if let Some(lease) = self.inner.registry.remove(self.id) {
                spawn_release(Arc::clone(&self.inner.backend), lease);
            }
        }
    }
}

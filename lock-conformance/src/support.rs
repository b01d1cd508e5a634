//! What the cases share: the backend factory, key namespaces, nodes and
//! timing helpers.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use lock_core::{
    DynLockBackend, LockAdmin, LockBackend, LockConfig, LockError, Locker, LockerOptions, LossCause,
};

/// Makes a fresh backend for one case. Every locker of the case shares it,
/// each locker standing for one node.
///
/// Any `Fn() -> impl Future<Output = B>` is a factory, where `B` is both the
/// backend and the admin of its store ([`LockAdmin`]), as every withlock
/// backend is; the admin cases \[D1, D2, L5\] then run on it too. A
/// backend without an admin is declared so with [`without_admin`], and the
/// admin cases pass on it saying so:
///
/// ```
/// # use lock_conformance::{without_admin, BackendFactory};
/// # use lock_memory::MemoryBackend;
/// fn takes(_: impl BackendFactory) {}
/// takes(|| async { MemoryBackend::new() });
/// takes(without_admin(|| async { MemoryBackend::new() }));
/// ```
pub trait BackendFactory: Send + Sync + 'static {
    /// A backend for one case.
    fn backend(&self) -> Pin<Box<dyn Future<Output = Arc<DynLockBackend>> + Send + '_>>;

    /// A backend for one case and the admin of the same store; `None` for
    /// a factory declared [`without_admin`].
    fn with_admin(&self) -> Pin<Box<dyn Future<Output = Option<AdminStore>> + Send + '_>>;
}

/// A backend and the admin of its store, as [`BackendFactory::with_admin`]
/// gives them.
#[derive(Clone)]
pub struct AdminStore {
    /// The backend, for the lockers of the case.
    pub backend: Arc<DynLockBackend>,
    /// The same store's admin functions.
    pub admin: Arc<dyn LockAdmin>,
}

impl<F, Fut, B> BackendFactory for F
where
    F: Fn() -> Fut + Send + Sync + 'static,
    Fut: Future<Output = B> + Send + 'static,
    B: LockBackend + LockAdmin,
{
    fn backend(&self) -> Pin<Box<dyn Future<Output = Arc<DynLockBackend>> + Send + '_>> {
        let made = self();
        Box::pin(async move { Arc::new(made.await) as Arc<DynLockBackend> })
    }

    fn with_admin(&self) -> Pin<Box<dyn Future<Output = Option<AdminStore>> + Send + '_>> {
        let made = self();
        Box::pin(async move {
            let store = Arc::new(made.await);
            Some(AdminStore {
                backend: Arc::clone(&store) as Arc<DynLockBackend>,
                admin: store as Arc<dyn LockAdmin>,
            })
        })
    }
}

/// A factory of backends that have no admin functions: the admin cases
/// pass on it, saying so. See [`BackendFactory`].
pub fn without_admin<F, Fut, B>(factory: F) -> WithoutAdmin<F>
where
    F: Fn() -> Fut + Send + Sync + 'static,
    Fut: Future<Output = B> + Send + 'static,
    B: LockBackend,
{
    WithoutAdmin(factory)
}

/// A factory declared without admin functions; made by [`without_admin`].
#[derive(Clone, Copy, Debug)]
pub struct WithoutAdmin<F>(F);

impl<F, Fut, B> BackendFactory for WithoutAdmin<F>
where
    F: Fn() -> Fut + Send + Sync + 'static,
    Fut: Future<Output = B> + Send + 'static,
    B: LockBackend,
{
    fn backend(&self) -> Pin<Box<dyn Future<Output = Arc<DynLockBackend>> + Send + '_>> {
        let made = (self.0)();
        Box::pin(async move { Arc::new(made.await) as Arc<DynLockBackend> })
    }

    fn with_admin(&self) -> Pin<Box<dyn Future<Output = Option<AdminStore>> + Send + '_>> {
        Box::pin(async { None })
    }
}

/// A random key namespace, so that cases never touch each other's keys,
/// nor anything else on a shared server.
#[derive(Clone, Debug)]
pub struct Namespace(String);

impl Namespace {
    /// A namespace no other case uses.
    pub fn new() -> Self {
        Self(format!("withlock-test:{:016x}:", rand::random::<u64>()))
    }

    /// A key in this namespace.
    pub fn key(&self, name: &str) -> String {
        format!("{}{name}", self.0)
    }
}

impl Default for Namespace {
    fn default() -> Self {
        Self::new()
    }
}

/// A locker named `name` on `backend`: one node.
pub fn node(backend: impl LockBackend, name: &str) -> Locker {
    Locker::with_options(backend, LockerOptions::default().node_id(name))
        .unwrap_or_else(|e| panic!("node {name:?} could not be made: {e}"))
}

/// The ttl used where a case waits for an expiry or an extension.
pub const SHORT_TTL: Duration = Duration::from_millis(400);

/// How much a case stretches its ttl, and the durations tied to it, on
/// `backend`: the backend's [`Capabilities::min_ttl`] over [`SHORT_TTL`],
/// and 1 when that minimum is below [`SHORT_TTL`] (memory, Redis,
/// PostgreSQL: their cases run as written). A store whose leases have a
/// floor (etcd's whole seconds) runs every case, on longer times, instead
/// of skipping it.
///
/// [`Capabilities::min_ttl`]: lock_core::Capabilities::min_ttl
pub fn ttl_scale(backend: &DynLockBackend) -> f64 {
    let min = backend.capabilities().min_ttl;
    (min.as_secs_f64() / SHORT_TTL.as_secs_f64()).max(1.0)
}

/// `duration` stretched by [`ttl_scale`] for `backend`.
pub fn scaled(backend: &DynLockBackend, duration: Duration) -> Duration {
    duration.mul_f64(ttl_scale(backend))
}

/// The retry delay used where a case waits for a lock.
pub const RETRY: Duration = Duration::from_millis(20);

/// A generous bound for things that must happen "soon", so that a loaded
/// machine does not make a case flaky.
pub const SOON: Duration = Duration::from_secs(5);

/// One attempt only.
pub fn once() -> LockConfig {
    LockConfig::default().retry_attempts(0)
}

/// Waits as long as it takes, polling every [`RETRY`].
pub fn patient() -> LockConfig {
    LockConfig::default().wait_forever().retry_delay(RETRY)
}

/// Awaits `fut`, failing the case with `what` if it takes longer than `limit`.
pub async fn within<T>(limit: Duration, what: &str, fut: impl Future<Output = T>) -> T {
    match tokio::time::timeout(limit, fut).await {
        Ok(v) => v,
        Err(_) => panic!("{what}: did not happen within {limit:?}"),
    }
}

/// One attempt by a fresh node to take `key`, released at once if taken.
async fn probe(backend: &Arc<DynLockBackend>, key: &str, why: &str) -> Result<(), LockError> {
    let probe = node(Arc::clone(backend), "probe");
    within(
        SOON,
        why,
        probe.with_lock_config(key, &once(), |_| async {}),
    )
    .await
}

/// Asserts that `key` is free: another node takes it at once.
pub async fn assert_free(backend: &Arc<DynLockBackend>, key: &str, why: &str) {
    let got = probe(backend, key, why).await;
    assert!(got.is_ok(), "{why}: key {key:?} is still held: {got:?}");
}

/// Asserts that `key` is freed soon, well before any ttl of the cases runs
/// out: a patient node takes it within [`SOON`]. For a key a dropped call
/// may still be touching: its attempt in flight finishes in the background
/// and may take the key just after its holder let go, to give it back at
/// once \[C1\].
pub async fn assert_freed_soon(backend: &Arc<DynLockBackend>, key: &str, why: &str) {
    let waiter = node(Arc::clone(backend), "waiter");
    let got = within(
        SOON,
        why,
        waiter.with_lock_config(key, &patient(), |_| async {}),
    )
    .await;
    assert!(got.is_ok(), "{why}: key {key:?} was not freed: {got:?}");
}

/// Asserts that `got` is [`LockError::Lost`] with a cause of the kind of
/// `cause` (any backend error matches a `Backend` cause).
pub fn assert_lost_as<T: std::fmt::Debug>(
    got: &Result<T, LockError>,
    cause: &LossCause,
    what: &str,
) {
    let same = matches!(
        got,
        Err(LockError::Lost { cause: c, .. })
            if std::mem::discriminant(c) == std::mem::discriminant(cause)
    );
    assert!(same, "{what}: expected Lost ({cause}), got {got:?}");
}

/// Asserts that `key` is held: another node cannot take it.
pub async fn assert_held(backend: &Arc<DynLockBackend>, key: &str, why: &str) {
    let got = probe(backend, key, why).await;
    assert!(
        matches!(got, Err(LockError::NotAcquired { .. })),
        "{why}: key {key:?} should be held, got {got:?}"
    );
}

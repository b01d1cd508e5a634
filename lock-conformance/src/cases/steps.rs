//! The backend steps on their own, as the trait's contract states them.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use lock_core::{AcquireOutcome, ExtendOutcome, ExtendRequest, Lease, OwnerToken, ReleaseOutcome};

use crate::support::{within, BackendFactory, Namespace, SOON};

const TTL: Duration = Duration::from_secs(30);

async fn take(
    backend: &lock_core::DynLockBackend,
    key: &str,
    owner: &OwnerToken,
    ttl: Duration,
) -> Lease {
    match backend.try_acquire(key, owner, ttl).await.unwrap() {
        AcquireOutcome::Acquired { fencing_token } => Lease::new(key, owner.clone(), fencing_token),
        AcquireOutcome::Busy { .. } => panic!("key {key:?} should be free"),
    }
}

/// `try_acquire` on a held key is `Busy`, not an error; fencing tokens
/// strictly increase per key, also across release and re-acquisition.
pub async fn step_try_acquire_busy_and_fencing(factory: Arc<dyn BackendFactory>) {
    let backend = factory.backend().await;
    let ns = Namespace::new();
    let key = ns.key("step-acquire");
    let (a, b) = (OwnerToken::new("a"), OwnerToken::new("b"));
    let first = take(&*backend, &key, &a, TTL).await;
    assert!(matches!(
        backend.try_acquire(&key, &b, TTL).await.unwrap(),
        AcquireOutcome::Busy { .. }
    ));
    assert!(
        matches!(
            backend.try_acquire(&key, &a, TTL).await.unwrap(),
            AcquireOutcome::Busy { .. }
        ),
        "a new acquisition is busy even for the same node"
    );
    assert_eq!(
        backend.release(&first).await.unwrap(),
        ReleaseOutcome::Released
    );
    let second = take(&*backend, &key, &b, TTL).await;
    assert!(second.fencing_token() > first.fencing_token());
    backend.release(&second).await.unwrap();
    let third = take(&*backend, &key, &a, TTL).await;
    assert!(third.fencing_token() > second.fencing_token());
    backend.release(&third).await.unwrap();
}

/// `extend` resets the expiry only for the holder, and never re-creates a
/// missing key.
pub async fn step_extend_never_recreates_a_key(factory: Arc<dyn BackendFactory>) {
    let backend = factory.backend().await;
    let ns = Namespace::new();
    let key = ns.key("step-extend");
    let a = OwnerToken::new("a");
    let lease = take(&*backend, &key, &a, Duration::from_millis(300)).await;
    assert_eq!(
        backend.extend(&lease, TTL).await.unwrap(),
        ExtendOutcome::Extended
    );
    // Extended to 30 s: still held well after the first ttl.
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert!(matches!(
        backend
            .try_acquire(&key, &OwnerToken::new("b"), TTL)
            .await
            .unwrap(),
        AcquireOutcome::Busy { .. }
    ));
    backend.release(&lease).await.unwrap();
    assert_eq!(
        backend.extend(&lease, TTL).await.unwrap(),
        ExtendOutcome::Expired,
        "a released key is not re-created"
    );
    let b = take(&*backend, &key, &OwnerToken::new("b"), TTL).await;
    backend.release(&b).await.unwrap();
}

/// `extend_many` answers one outcome per lease, in order, and touches only
/// the leases that still hold their keys.
pub async fn step_extend_many_answers_in_order(factory: Arc<dyn BackendFactory>) {
    let backend = factory.backend().await;
    let ns = Namespace::new();
    let (a, b) = (OwnerToken::new("a"), OwnerToken::new("b"));
    let held = take(&*backend, &ns.key("held"), &a, TTL).await;
    let released = take(&*backend, &ns.key("released"), &a, TTL).await;
    backend.release(&released).await.unwrap();
    let theirs = take(&*backend, &ns.key("theirs"), &b, TTL).await;
    let forged = Lease::new(ns.key("theirs"), a.clone(), theirs.fencing_token());
    let n = backend.capabilities().max_extend_batch.min(3);
    let requests: Vec<_> = [held.clone(), released, forged]
        .into_iter()
        .map(|lease| ExtendRequest { lease, ttl: TTL })
        .collect();
    let mut outcomes = Vec::new();
    for chunk in requests.chunks(n) {
        outcomes.extend(
            backend
                .extend_many(chunk)
                .await
                .into_iter()
                .collect::<Result<Vec<_>, _>>()
                .unwrap(),
        );
    }
    assert_eq!(
        outcomes,
        vec![
            ExtendOutcome::Extended,
            ExtendOutcome::Expired,
            ExtendOutcome::Taken
        ]
    );
    assert_eq!(
        backend.release(&theirs).await.unwrap(),
        ReleaseOutcome::Released
    );
    assert_eq!(
        backend.release(&held).await.unwrap(),
        ReleaseOutcome::Released
    );
}

/// `release` frees only the holder's key, says whether it did, and is
/// idempotent.
pub async fn step_release_is_idempotent(factory: Arc<dyn BackendFactory>) {
    let backend = factory.backend().await;
    let ns = Namespace::new();
    let key = ns.key("step-release");
    let a = OwnerToken::new("a");
    let lease = take(&*backend, &key, &a, TTL).await;
    let forged = Lease::new(key.as_str(), OwnerToken::new("a"), lease.fencing_token());
    assert_eq!(
        backend.release(&forged).await.unwrap(),
        ReleaseOutcome::NotHeld
    );
    assert!(
        matches!(
            backend
                .try_acquire(&key, &OwnerToken::new("b"), TTL)
                .await
                .unwrap(),
            AcquireOutcome::Busy { .. }
        ),
        "a forged release changes nothing"
    );
    assert_eq!(
        backend.release(&lease).await.unwrap(),
        ReleaseOutcome::Released
    );
    assert_eq!(
        backend.release(&lease).await.unwrap(),
        ReleaseOutcome::NotHeld
    );
    // The cleanup lease the driver makes after a lost answer has token 0.
    let again = take(&*backend, &key, &a, TTL).await;
    let cleanup = Lease::new(key.as_str(), a.clone(), 0);
    assert_eq!(
        backend.release(&cleanup).await.unwrap(),
        ReleaseOutcome::Released
    );
    assert_eq!(
        backend.release(&again).await.unwrap(),
        ReleaseOutcome::NotHeld
    );
}

/// Release notifications, as declared: a backend that offers them wakes a
/// watch made before the release; one that does not says so.
pub async fn step_release_notifications_as_declared(factory: Arc<dyn BackendFactory>) {
    let backend = factory.backend().await;
    let ns = Namespace::new();
    let key = ns.key("step-notify");
    let caps = backend.capabilities();
    assert!(caps.max_key_len >= 1, "a backend must accept some keys");
    assert!(caps.max_extend_batch >= 1);
    if !caps.release_notifications {
        return;
    }
    let a = OwnerToken::new("a");
    let lease = take(&*backend, &key, &a, TTL).await;
    let mut watch = backend.watch_release(&key).await.unwrap();
    let mut other = backend
        .watch_release(&ns.key("step-notify-other"))
        .await
        .unwrap();
    assert_eq!(
        backend.release(&lease).await.unwrap(),
        ReleaseOutcome::Released
    );
    within(SOON, "the release notification", watch.released()).await;
    assert!(
        tokio::time::timeout(Duration::from_millis(100), other.released())
            .await
            .is_err(),
        "a release wakes watches of its own key only"
    );
}

/// A wrapper made with `forward_lock_backend!` that writes out
/// `try_acquire` and `release` sees every attempt and every release the
/// driver makes: the backend's fast paths (`try_acquire_now`,
/// `release_now`) are not forwarded past the steps written out.
pub async fn step_a_wrapper_sees_every_attempt_and_release(factory: Arc<dyn BackendFactory>) {
    let backend = factory.backend().await;
    let ns = Namespace::new();
    let counted = Arc::new(Counted {
        backend,
        attempts: AtomicUsize::new(0),
        releases: AtomicUsize::new(0),
    });
    let locker = lock_core::Locker::new(Arc::clone(&counted));
    for i in 0..10 {
        let key = ns.key(&format!("step-wrapped-{i}"));
        within(SOON, "a call", locker.with_lock(&key, |_| async {}))
            .await
            .unwrap();
    }
    let mut handle = locker.handle(&ns.key("step-wrapped-handle"), TTL).unwrap();
    assert!(within(SOON, "a handle's attempt", handle.acquire())
        .await
        .unwrap());
    assert!(within(SOON, "a handle's release", handle.release())
        .await
        .unwrap());
    assert_eq!(
        (
            counted.attempts.load(Ordering::SeqCst),
            counted.releases.load(Ordering::SeqCst)
        ),
        (11, 11),
        "every attempt and every release went through the wrapper's steps"
    );
}

/// Counts the two steps it writes out; forwards the others.
#[derive(Debug)]
struct Counted {
    backend: Arc<lock_core::DynLockBackend>,
    attempts: AtomicUsize,
    releases: AtomicUsize,
}

lock_core::forward_lock_backend!(Counted => backend {
    async fn try_acquire(
        &self,
        key: &str,
        owner: &OwnerToken,
        ttl: Duration,
    ) -> Result<AcquireOutcome, lock_core::BackendError> {
        self.attempts.fetch_add(1, Ordering::SeqCst);
        self.backend.try_acquire(key, owner, ttl).await
    }

    async fn release(&self, lease: &Lease) -> Result<ReleaseOutcome, lock_core::BackendError> {
        self.releases.fetch_add(1, Ordering::SeqCst);
        self.backend.release(lease).await
    }
});

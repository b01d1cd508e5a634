//! The driver's lifecycle: a locker that outlives the runtime that started
//! its extender, handles dropped outside any runtime, and the clean-up of
//! failed attempts (one task per key, none for requests never sent).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use lock_conformance::{CountingBackend, Step};
use lock_core::{
    async_trait, AcquireOutcome, BackendError, BackendErrorKind, Capabilities, ExtendOutcome,
    ExtendRequest, Hold, Lease, LockBackend, LockConfig, Locker, OwnerToken, ReleaseOutcome,
    ReleaseWatch,
};
use lock_memory::MemoryBackend;

/// A runtime of its own (on the real clock: two runtimes' paused clocks
/// would not agree on the lock's expiry).
fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

#[test]
fn a_locker_outliving_its_first_runtime_still_extends() {
    let backend = MemoryBackend::new();
    let seen = CountingBackend::new(backend.clone());
    let locker = Locker::new(seen.clone());
    // A ttl long enough that a loaded machine does not make an extension
    // late: a stall of two thirds of it would.
    let cfg = LockConfig::default().ttl(Duration::from_secs(1));
    // The first runtime starts the extender, then goes away with it.
    runtime().block_on(async {
        locker
            .with_lock_config("job", &cfg, |_| async {
                tokio::time::sleep(Duration::from_millis(150)).await;
            })
            .await
            .unwrap();
    });
    // A second runtime: a callback that runs until its lock has been
    // extended three times more must see it held all along.
    let before = seen.answers(Step::Extend);
    runtime().block_on(async {
        let (l, s) = (locker.clone(), seen.clone());
        let got = l
            .with_lock_config("job", &cfg, |ctx| async move {
                tokio::time::timeout(
                    Duration::from_secs(30),
                    s.until_answered(Step::Extend, before + 3),
                )
                .await
                .expect("three extensions of the lock");
                ctx.is_lost()
            })
            .await;
        assert!(!got.unwrap(), "the lock was extended and never lost");
    });
    assert_eq!(backend.held_keys(), 0);
}

#[test]
fn a_handle_dropped_outside_any_runtime_does_not_panic_and_is_released() {
    let backend = MemoryBackend::new();
    let locker = Locker::new(backend.clone());
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let handle = rt.block_on(async {
        let mut h = locker.handle("k", Duration::from_secs(30)).unwrap();
        assert!(h.acquire().await.unwrap());
        h
    });
    assert_eq!(backend.held_keys(), 1);
    // No runtime on this thread: the release runs on the locker's runtime.
    drop(handle);
    rt.block_on(async {
        for _ in 0..100 {
            if backend.held_keys() == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    });
    assert_eq!(
        backend.held_keys(),
        0,
        "the dropped handle's key was released"
    );
    drop(rt);

    // With its runtime gone too, a drop still does not panic.
    let rt = runtime();
    let handle = rt.block_on(async {
        let mut h = locker.handle("k2", Duration::from_secs(30)).unwrap();
        assert!(h.acquire().await.unwrap());
        h
    });
    drop(rt);
    drop(handle);
}

/// Fails every acquisition with `kind` after applying it (when the kind
/// says the request was sent), and hangs every release, counting them.
#[derive(Debug)]
struct Failing {
    inner: MemoryBackend,
    kind: BackendErrorKind,
    releases: AtomicU64,
    hang_releases: AtomicBool,
}

#[async_trait]
impl LockBackend for Failing {
    fn capabilities(&self) -> Capabilities {
        Capabilities::default()
    }
    async fn try_acquire(
        &self,
        key: &str,
        owner: &OwnerToken,
        ttl: Duration,
    ) -> Result<AcquireOutcome, BackendError> {
        if self.kind != BackendErrorKind::Unavailable {
            let _ = self.inner.try_acquire(key, owner, ttl).await;
        }
        Err(BackendError::message(self.kind, "failing on purpose"))
    }
    async fn extend(&self, lease: &Lease, ttl: Duration) -> Result<ExtendOutcome, BackendError> {
        self.inner.extend(lease, ttl).await
    }
    async fn extend_many(
        &self,
        requests: &[ExtendRequest],
    ) -> Vec<Result<ExtendOutcome, BackendError>> {
        self.inner.extend_many(requests).await
    }
    fn failure_domain(&self, key: &str) -> u64 {
        self.inner.failure_domain(key)
    }
    async fn hold(&self, lease: &Lease, hold: Hold) -> Result<ExtendOutcome, BackendError> {
        self.inner.hold(lease, hold).await
    }
    async fn release(&self, lease: &Lease) -> Result<ReleaseOutcome, BackendError> {
        self.releases.fetch_add(1, Ordering::SeqCst);
        if self.hang_releases.load(Ordering::SeqCst) {
            std::future::pending::<()>().await;
        }
        self.inner.release(lease).await
    }
    async fn watch_release(&self, _key: &str) -> Result<ReleaseWatch, BackendError> {
        Ok(ReleaseWatch::never())
    }
}

fn failing(kind: BackendErrorKind, hang: bool) -> Arc<Failing> {
    Arc::new(Failing {
        inner: MemoryBackend::new(),
        kind,
        releases: AtomicU64::new(0),
        hang_releases: AtomicBool::new(hang),
    })
}

/// A locker whose background work runs on the test's paused clock.
fn on_the_test_clock(backend: impl lock_core::LockBackend) -> Locker {
    Locker::with_options(
        backend,
        lock_core::LockerOptions::default().caller_runtime(true),
    )
    .unwrap()
}

// On the paused clock: the sleep below ends only once every task is idle,
// so each clean-up task has sent its first (hanging) release by then.
#[tokio::test(start_paused = true)]
async fn failed_attempts_are_cleaned_up_by_one_task_per_key() {
    let backend = failing(BackendErrorKind::Timeout, true);
    let locker = on_the_test_clock(Arc::clone(&backend));
    let cfg = LockConfig::default()
        .ttl(Duration::from_secs(30))
        .retry_attempts(20)
        .retry_delay(Duration::from_millis(5))
        .retry_jitter(Duration::ZERO);
    let got = locker.with_lock_config("k", &cfg, |_| async {}).await;
    assert!(got.is_err());
    tokio::time::sleep(Duration::from_millis(100)).await;
    // Twenty-one failed attempts, each of which may have taken the key; the
    // releases hang, so each clean-up task is stuck in its first one.
    assert_eq!(
        backend.releases.load(Ordering::SeqCst),
        1,
        "one clean-up task for the key, not one per attempt"
    );
}

// On the paused clock: the sleep ends only once every task is idle, so any
// clean-up owed has been sent by then.
#[tokio::test(start_paused = true)]
async fn failed_attempts_whose_request_was_never_sent_need_no_clean_up() {
    async fn releases_after_failing_with(kind: BackendErrorKind) -> u64 {
        let backend = failing(kind, false);
        let locker = on_the_test_clock(Arc::clone(&backend));
        let cfg = LockConfig::default()
            .retry_attempts(5)
            .retry_delay(Duration::from_millis(5));
        let got = locker.with_lock_config("k", &cfg, |_| async {}).await;
        assert!(got.unwrap_err().is_not_acquired());
        tokio::time::sleep(Duration::from_millis(100)).await;
        backend.releases.load(Ordering::SeqCst)
    }
    // The count sees a clean-up where one is owed: attempts that may have
    // reached the store (timed out) are released...
    assert!(releases_after_failing_with(BackendErrorKind::Timeout).await >= 1);
    // ...and attempts never sent are not.
    assert_eq!(
        releases_after_failing_with(BackendErrorKind::Unavailable).await,
        0
    );
}

#[tokio::test]
async fn failed_attempts_are_released_once_the_store_answers() {
    let backend = failing(BackendErrorKind::Request, false);
    let locker = Locker::new(Arc::clone(&backend));
    let got = locker
        .with_lock_config("k", &LockConfig::default().retry_attempts(0), |_| async {})
        .await;
    assert!(got.is_err());
    for _ in 0..100 {
        if backend.inner.held_keys() == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(
        backend.inner.held_keys(),
        0,
        "the key the attempt took was freed"
    );
}

#[tokio::test(start_paused = true)]
async fn a_reentrant_call_races_the_loss_of_the_outer_lock() {
    let backend = lock_conformance::FaultInjector::new(MemoryBackend::new());
    let locker = on_the_test_clock(backend.clone());
    let cfg = LockConfig::default().ttl(Duration::from_millis(300));
    let (inner_tx, inner_rx) = tokio::sync::oneshot::channel();
    let (l, b) = (locker.clone(), backend.clone());
    let outer = locker
        .with_lock_config("k", &cfg, move |_| async move {
            b.look_stolen("k", true);
            let inner = l.with_lock("k", |_| std::future::pending::<()>()).await;
            let _ = inner_tx.send(inner);
        })
        .await;
    assert!(outer.unwrap_err().is_lost());
    let inner = tokio::time::timeout(Duration::from_secs(5), inner_rx)
        .await
        .expect("the reentrant call settles on the loss")
        .unwrap();
    assert!(
        matches!(
            inner,
            Err(lock_core::LockError::Lost {
                cause: lock_core::LossCause::Taken,
                ..
            })
        ),
        "got {inner:?}"
    );
}

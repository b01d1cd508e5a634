//! The store's own words reach every message about a failure: the error a
//! call returns (printed with `ErrorChain`) and the driver's log lines,
//! "lock lost" included, with the password of any URL in them redacted
//! \[O3\] \[O4\].

use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use lock_core::{
    AcquireOutcome, BackendError, BackendErrorKind, ErrorChain, ExtendOutcome, ExtendRequest,
    Lease, LockConfig, LockError, Locker, LossCause, OwnerToken,
};
use lock_memory::MemoryBackend;

/// A locker whose background work runs on the test's runtime, under its
/// paused clock.
fn paused_locker(backend: impl lock_core::LockBackend) -> Locker {
    Locker::with_options(
        backend,
        lock_core::LockerOptions::default().caller_runtime(true),
    )
    .unwrap()
}
use tokio::time::Instant;

/// What the store said, as a Redis Cluster says it, naming the URL it was
/// reached at.
const WORDS: &str = "CLUSTERDOWN The cluster is down";
const PASSWORD: &str = "hunter2-secret";

fn store_error(kind: BackendErrorKind) -> BackendError {
    BackendError::new(
        kind,
        std::io::Error::other(format!("{WORDS} (redis://app:{PASSWORD}@10.0.0.1:6379)")),
    )
}

/// The memory backend, with extensions or acquisitions failing on demand
/// with the store's words.
#[derive(Debug, Default)]
struct Failing {
    inner: MemoryBackend,
    extensions_fail: AtomicBool,
    acquisitions_fail: Mutex<Option<BackendErrorKind>>,
}

lock_core::forward_lock_backend!(Failing => inner {
    async fn try_acquire(
        &self,
        key: &str,
        owner: &OwnerToken,
        ttl: Duration,
    ) -> Result<AcquireOutcome, BackendError> {
        let failing = *self.acquisitions_fail.lock().unwrap();
        match failing {
            Some(kind) => Err(store_error(kind)),
            None => self.inner.try_acquire(key, owner, ttl).await,
        }
    }

    // Not the memory backend's fast path: every attempt comes here.
    fn try_acquire_now(
        &self,
        _key: &str,
        _owner: &OwnerToken,
        _ttl: Duration,
        _now: Instant,
    ) -> Option<Result<AcquireOutcome, BackendError>> {
        None
    }

    async fn extend(&self, lease: &Lease, ttl: Duration) -> Result<ExtendOutcome, BackendError> {
        if self.extensions_fail.load(Ordering::SeqCst) {
            return Err(store_error(BackendErrorKind::Request));
        }
        self.inner.extend(lease, ttl).await
    }

    async fn extend_many(
        &self,
        requests: &[ExtendRequest],
    ) -> Vec<Result<ExtendOutcome, BackendError>> {
        if self.extensions_fail.load(Ordering::SeqCst) {
            return vec![Err(store_error(BackendErrorKind::Request)); requests.len()];
        }
        self.inner.extend_many(requests).await
    }
});

#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Captured {
    /// Records every event of this thread until the guard is dropped.
    fn install(&self) -> tracing::subscriber::DefaultGuard {
        let writer = self.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::DEBUG)
            .with_ansi(false)
            .with_writer(move || writer.clone())
            .finish();
        tracing::subscriber::set_default(subscriber)
    }

    /// The lines that contain `message`.
    fn lines_with(&self, message: &str) -> Vec<String> {
        let text = String::from_utf8(self.0.lock().unwrap().clone()).unwrap();
        text.lines()
            .filter(|line| line.contains(message))
            .map(str::to_owned)
            .collect()
    }
}

/// The store's words are in `text` once, and its password is not.
fn assert_words_once(text: &str) {
    assert_eq!(text.matches(WORDS).count(), 1, "{text}");
    assert!(!text.contains(PASSWORD), "the password shows: {text}");
    assert!(
        text.contains("redis://app:<redacted>@10.0.0.1:6379"),
        "{text}"
    );
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn o4_a_loss_to_backend_errors_names_the_stores_words_in_its_log_line_and_error() {
    let captured = Captured::default();
    let _guard = captured.install();
    let backend = Arc::new(Failing::default());
    let locker = paused_locker(Arc::clone(&backend));
    let cfg = LockConfig::default().ttl(Duration::from_secs(3));
    let (inside_tx, inside_rx) = tokio::sync::oneshot::channel();
    let call = {
        let locker = locker.clone();
        tokio::spawn(async move {
            locker
                .with_lock_config("report", &cfg, move |_| async move {
                    let _ = inside_tx.send(());
                    std::future::pending::<()>().await;
                })
                .await
        })
    };
    inside_rx.await.unwrap();
    backend.extensions_fail.store(true, Ordering::SeqCst);
    let error = call.await.unwrap().unwrap_err();

    let Some(LossCause::Backend(backend_error)) = error.loss_cause() else {
        panic!("not a loss to backend errors: {error:?}");
    };
    // The backend error alone says what the store said.
    assert_words_once(&backend_error.to_string());
    // The error's whole chain, as a log line or a message prints it.
    let chain = ErrorChain(&error).to_string();
    assert!(chain.starts_with("lock on key \"report\" lost"), "{chain}");
    assert_words_once(&chain);

    let lost = captured.lines_with("lock lost");
    assert_eq!(lost.len(), 1, "{lost:?}");
    assert!(lost[0].contains("key=report"), "{}", lost[0]);
    assert_words_once(&lost[0]);
    // Each failed extension said it too, and each waited out its backoff:
    // a store that fails at once is not asked again in a loop in the last
    // twelfth of the validity (there, under the paused clock, the loop
    // never let the time pass and this call never ended).
    let failed = captured.lines_with("lock extension failed");
    assert!(
        (2..=20).contains(&failed.len()),
        "{} extension failures",
        failed.len()
    );
    for line in &failed {
        assert_words_once(line);
    }
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn o3_an_acquisition_that_failed_on_the_store_names_its_words() {
    let captured = Captured::default();
    let _guard = captured.install();
    let backend = Arc::new(Failing::default());
    let locker = paused_locker(Arc::clone(&backend));

    // A failure trying again may mend: every attempt logs it, and the
    // error ends with it.
    *backend.acquisitions_fail.lock().unwrap() = Some(BackendErrorKind::Request);
    let cfg = LockConfig::default()
        .retry_attempts(2)
        .retry_delay(Duration::from_millis(50));
    let error = locker
        .with_lock_config("report", &cfg, |_| async {})
        .await
        .unwrap_err();
    assert!(
        matches!(
            error,
            LockError::NotAcquired {
                source: Some(_),
                ..
            }
        ),
        "{error:?}"
    );
    assert_words_once(&ErrorChain(&error).to_string());
    let failed = captured.lines_with("acquisition attempt failed");
    assert_eq!(failed.len(), 3, "{failed:?}");
    for line in &failed {
        assert_words_once(line);
    }

    // A refusal trying again cannot mend: said once, at warn.
    *backend.acquisitions_fail.lock().unwrap() = Some(BackendErrorKind::Setup);
    let error = locker
        .with_lock_config("report", &cfg, |_| async {})
        .await
        .unwrap_err();
    assert_words_once(&ErrorChain(&error).to_string());
    let refused = captured.lines_with("acquisition refused by the backend's setup");
    assert_eq!(refused.len(), 1, "{refused:?}");
    assert!(refused[0].contains("WARN"), "{}", refused[0]);
    assert_words_once(&refused[0]);
}

//! The driver's metrics (feature `metrics`): each one is emitted with its
//! labels, the backend label is the store's through a wrapper, and the key
//! is a label only when asked for.
//!
//! Each test records into a `DebuggingRecorder` of its own, installed for
//! its thread only, on a current-thread runtime with a paused clock: the
//! tests run in parallel without seeing each other's metrics.

#![cfg(feature = "metrics")]

use std::future::Future;
use std::time::Duration;

use lock_conformance::{FaultInjector, Step};
use lock_core::{LockConfig, LockError, Locker, LockerOptions, LossCause};
use lock_memory::MemoryBackend;
use metrics_util::debugging::{DebugValue, DebuggingRecorder};

/// One series the recorder saw.
#[derive(Debug)]
struct Series {
    name: String,
    labels: Vec<(String, String)>,
    value: DebugValue,
}

/// Runs `test` with a recorder of its own and returns what it recorded.
fn recorded(test: impl Future<Output = ()>) -> Vec<Series> {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .unwrap();
    metrics::with_local_recorder(&recorder, || runtime.block_on(test));
    snapshotter
        .snapshot()
        .into_vec()
        .into_iter()
        .map(|(key, _, _, value)| {
            let (name, labels) = key.into_parts().1.into_parts();
            let mut labels: Vec<_> = labels
                .into_iter()
                .map(|l| (l.key().to_owned(), l.value().to_owned()))
                .collect();
            labels.sort();
            Series {
                name: name.as_str().to_owned(),
                labels,
                value,
            }
        })
        .collect()
}

/// The value of the series `name` whose labels are exactly `labels`.
fn value<'a>(all: &'a [Series], name: &str, labels: &[(&str, &str)]) -> &'a DebugValue {
    let mut wanted: Vec<_> = labels
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
    wanted.sort();
    all.iter()
        .find(|s| s.name == name && s.labels == wanted)
        .map(|s| &s.value)
        .unwrap_or_else(|| panic!("no {name} {labels:?} among {all:#?}"))
}

fn count(all: &[Series], name: &str, labels: &[(&str, &str)]) -> u64 {
    match value(all, name, labels) {
        DebugValue::Counter(n) => *n,
        other => panic!("{name} is not a counter: {other:?}"),
    }
}

fn seconds(all: &[Series], name: &str, labels: &[(&str, &str)]) -> Vec<f64> {
    match value(all, name, labels) {
        DebugValue::Histogram(values) => values.iter().map(|v| v.into_inner()).collect(),
        other => panic!("{name} is not a histogram: {other:?}"),
    }
}

/// A locker on a memory backend of its own, behind a fault injector.
fn node(options: LockerOptions) -> (FaultInjector<MemoryBackend>, Locker) {
    let backend = FaultInjector::new(MemoryBackend::new());
    // The background work on the test's paused clock and its recorder.
    let locker = Locker::with_options(backend.clone(), options.caller_runtime(true)).unwrap();
    (backend, locker)
}

const ACQUIRE: &str = "withlock_acquire_seconds";
const HELD: &str = "withlock_held_seconds";
const EXTENSIONS: &str = "withlock_extensions_total";
const LOST: &str = "withlock_lost_total";
const LAG: &str = "withlock_release_notification_lag_seconds";
const ERRORS: &str = "withlock_backend_errors_total";

#[test]
fn every_metric_is_recorded_with_its_labels() {
    let ttl = LockConfig::default().ttl(Duration::from_secs(3));
    let all = recorded(async move {
        // Held for 2.5 s under a 3 s ttl: the extension at 250 ms (when it
        // begins to watch its key [L5]) fails; its retry 100 ms later and
        // the two a second apart after it succeed; a release fails.
        let (faults, locker) = node(LockerOptions::default());
        faults.fail_next(Step::Extend, 1);
        faults.fail_next(Step::Release, 1);
        locker
            .with_lock_config("extended", &ttl, |_| {
                tokio::time::sleep(Duration::from_millis(2500))
            })
            .await
            .unwrap();

        // An attempt fails, the next one 200 ms later acquires.
        let (faults, locker) = node(LockerOptions::default());
        faults.fail_next(Step::TryAcquire, 1);
        let once_more = LockConfig::default()
            .retry_attempts(1)
            .retry_jitter(Duration::ZERO);
        locker
            .with_lock_config("retried", &once_more, |_| async {})
            .await
            .unwrap();

        // Every attempt fails: a give-up with a backend error.
        let (faults, locker) = node(LockerOptions::default());
        faults.fail_always(Step::TryAcquire, true);
        let once = LockConfig::default().retry_attempts(0);
        let failed = locker
            .with_lock_config("failing", &once, |_| async {})
            .await;
        assert!(matches!(
            failed,
            Err(LockError::NotAcquired {
                source: Some(_),
                ..
            })
        ));

        // Held elsewhere on both attempts, and the release watch fails: a
        // busy give-up.
        let (faults, locker) = node(LockerOptions::default());
        let mut holder = locker.handle("busy", Duration::from_secs(60)).unwrap();
        assert!(holder.acquire().await.unwrap());
        faults.fail_next(Step::WatchRelease, 1);
        let other = Locker::with_options(
            faults.clone(),
            LockerOptions::default().caller_runtime(true),
        )
        .unwrap();
        let busy = other
            .with_lock_config("busy", &once_more, |_| async {})
            .await;
        assert!(busy.unwrap_err().is_busy());
        assert!(holder.release().await.unwrap());

        // A waiter woken by the release answers 50 ms later (every attempt
        // takes that long); its retry timer alone would wait 10 s. Unqueued:
        // a queued waiter starts on its grant without an attempt.
        let (faults, locker) = node(LockerOptions::default());
        let mut holder = locker.handle("awaited", Duration::from_secs(60)).unwrap();
        assert!(holder.acquire().await.unwrap());
        faults.delay(Step::TryAcquire, Duration::from_millis(50));
        let patient = LockConfig::default()
            .wait_forever()
            .retry_delay(Duration::from_secs(10))
            .no_queue();
        let waiter = tokio::spawn(async move {
            let other = Locker::with_options(faults, LockerOptions::default().caller_runtime(true))
                .unwrap();
            other
                .with_lock_config("awaited", &patient, |_| async {})
                .await
        });
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert!(holder.release().await.unwrap());
        waiter.await.unwrap().unwrap();

        // The first extension finds the key taken.
        let (faults, locker) = node(LockerOptions::default());
        faults.look_stolen("stolen", true);
        let lost = locker
            .with_lock_config("stolen", &ttl, |_| {
                tokio::time::sleep(Duration::from_secs(10))
            })
            .await;
        assert!(matches!(
            lost.unwrap_err().loss_cause(),
            Some(LossCause::Taken)
        ));

        // Shutdown releases a handle's lock.
        let (_, locker) = node(LockerOptions::default());
        let mut handle = locker.handle("kept", Duration::from_secs(60)).unwrap();
        assert!(handle.acquire().await.unwrap());
        locker.shutdown(Duration::ZERO).await;
    });

    let memory = ("backend", "memory");
    let acquired = seconds(&all, ACQUIRE, &[memory, ("outcome", "acquired")]);
    assert_eq!(acquired.len(), 4, "extended, retried, awaited, stolen");
    assert!(
        acquired.iter().any(|s| (0.2..0.21).contains(s)),
        "the retried acquisition took 200 ms: {acquired:?}"
    );
    assert_eq!(
        seconds(&all, ACQUIRE, &[memory, ("outcome", "busy")]).len(),
        1
    );
    assert_eq!(
        seconds(&all, ACQUIRE, &[memory, ("outcome", "failed")]).len(),
        1
    );

    let released = seconds(&all, HELD, &[memory, ("outcome", "released")]);
    assert!(
        released.iter().any(|s| (2.5..2.6).contains(s)),
        "the extended callback held its lock 2.5 s, until its release: {released:?}"
    );
    let lost = seconds(&all, HELD, &[memory, ("outcome", "lost")]);
    assert_eq!(lost.len(), 2, "stolen, kept");
    assert!(
        lost.iter().any(|s| (1.0..1.01).contains(s)),
        "the stolen lock was lost at its first extension, at ttl / 3, which its key watch's first check joins [L5, P4]: {lost:?}"
    );

    // The 2.5 s callback's two, at 1 s and 2 s: its watch's first check
    // (250 ms in) joins the extension due at 1 s instead of adding one.
    assert_eq!(
        count(&all, EXTENSIONS, &[memory, ("result", "extended")]),
        2
    );
    assert_eq!(count(&all, EXTENSIONS, &[memory, ("result", "error")]), 1);
    assert_eq!(count(&all, EXTENSIONS, &[memory, ("result", "taken")]), 1);

    assert_eq!(count(&all, LOST, &[memory, ("cause", "taken")]), 1);
    assert_eq!(count(&all, LOST, &[memory, ("cause", "shutdown")]), 1);

    let lag = seconds(&all, LAG, &[memory]);
    assert_eq!(lag.len(), 1, "one wake-up: {lag:?}");
    assert!((0.05..0.06).contains(&lag[0]), "{lag:?}");

    assert_eq!(count(&all, ERRORS, &[memory, ("step", "try_acquire")]), 2);
    assert_eq!(count(&all, ERRORS, &[memory, ("step", "extend")]), 1);
    assert_eq!(count(&all, ERRORS, &[memory, ("step", "release")]), 1);
    assert_eq!(count(&all, ERRORS, &[memory, ("step", "watch_release")]), 1);

    assert!(
        all.iter().all(|s| s.labels.iter().all(|(k, _)| k != "key")),
        "a key label without asking for it: {all:#?}"
    );
}

#[test]
fn the_key_is_a_label_when_asked_for() {
    let all = recorded(async {
        let (_, locker) = node(LockerOptions::default().metrics_key_label(true));
        locker
            .with_lock("report:nightly", |_| async {})
            .await
            .unwrap();
    });
    let labels = [
        ("backend", "memory"),
        ("key", "report:nightly"),
        ("outcome", "acquired"),
    ];
    assert_eq!(seconds(&all, ACQUIRE, &labels).len(), 1);
    let labels = [
        ("backend", "memory"),
        ("key", "report:nightly"),
        ("outcome", "released"),
    ];
    assert_eq!(seconds(&all, HELD, &labels).len(), 1);
    assert_eq!(all.len(), 2, "{all:#?}");
}

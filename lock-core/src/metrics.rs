//! The driver's metrics, on the [`metrics`](https://docs.rs/metrics) facade,
//! behind the `metrics` feature. The application installs the recorder (an
//! exporter); with none installed, or without the feature, nothing is
//! recorded. Without the feature every function here is an empty inline
//! function and the types are zero-sized, so call sites carry no `#[cfg]`.
//!
//! Every metric has a `backend` label, [`Capabilities::name`] of the backend
//! the locker was made with (a wrapper forwards its inner backend's
//! capabilities, so the label stays the store's). A `key` label is added
//! only with [`LockerOptions::metrics_key_label`]: one series per key grows
//! without bound.
//!
//! | name | type | labels | meaning |
//! |---|---|---|---|
//! | `withlock_acquire_seconds` | histogram | `outcome`: `acquired`, `busy`, `failed` | How long a `with_lock` call took to take its lock or give up. `busy`: it gave up with every attempt finding the key held. `failed`: it gave up and some attempt failed on a backend error (the source of its `NotAcquired`). Calls dropped or stopped by shutdown while waiting record nothing. |
//! | `withlock_held_seconds` | histogram | `outcome`: `released`, `lost` | From the answer that took a lock to the moment this node stopped holding it: its release (`released`) or its loss (`lost`). `with_lock` callbacks and handles. |
//! | `withlock_extensions_total` | counter | `result`: `extended`, `expired`, `taken`, `error` | Extensions, one per lock: the background ones and `LockHandle::renew`. |
//! | `withlock_lost_total` | counter | `cause`: `expired`, `taken`, `backend`, `shutdown` | Locks lost, once per lock, by [`LossCause`]. |
//! | `withlock_release_notification_lag_seconds` | histogram | | From a release notification waking a waiting `with_lock` call to the answer of the attempt it made on that wake-up: how long a freed key stays unclaimed by a waiter that heard of it. |
//! | `withlock_backend_errors_total` | counter | `step`: `try_acquire`, `extend`, `release`, `watch_release` | Backend steps that failed, one per lock the step was for (an extension batch counts each of its locks), including answers that came too late to use and the driver's extension deadline. |
//!
//! Each locker builds the keys of its series once; with the key label off,
//! recording allocates nothing. The metrics' help texts and units are given
//! to the recorder installed when the locker is made.
//!
//! [`Capabilities::name`]: crate::Capabilities::name
//! [`LockerOptions::metrics_key_label`]: crate::LockerOptions::metrics_key_label

use std::sync::Arc;

use crate::backend::ExtendOutcome;
use crate::error::{BackendError, LockError, LossCause};

/// How a `with_lock` acquisition ended: the `outcome` of
/// `withlock_acquire_seconds`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Acquisition {
    Acquired,
    Busy,
    Failed,
}

impl Acquisition {
    /// The outcome of an acquisition that gave `result`.
    pub(crate) fn of<T>(result: &Result<T, LockError>) -> Self {
        match result {
            Ok(_) => Self::Acquired,
            Err(error) if error.is_busy() => Self::Busy,
            Err(_) => Self::Failed,
        }
    }
}

/// A backend step: the `step` of `withlock_backend_errors_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Step {
    TryAcquire,
    Extend,
    Release,
    WatchRelease,
}

/// One metric, and the label that tells its series apart with that label's
/// values, in the order of the index each recording function passes.
#[cfg_attr(not(feature = "metrics"), allow(dead_code))]
struct Spec {
    name: &'static str,
    histogram: bool,
    help: &'static str,
    label: Option<(&'static str, &'static [&'static str])>,
}

const ACQUIRE: usize = 0;
const HELD: usize = 1;
const EXTENSIONS: usize = 2;
const LOST: usize = 3;
const LAG: usize = 4;
const ERRORS: usize = 5;

#[cfg_attr(not(feature = "metrics"), allow(dead_code))]
const SPECS: [Spec; 6] = [
    Spec {
        name: "withlock_acquire_seconds",
        histogram: true,
        help: "How long a with_lock call took to take its lock or give up.",
        label: Some(("outcome", &["acquired", "busy", "failed"])),
    },
    Spec {
        name: "withlock_held_seconds",
        histogram: true,
        help: "How long a lock was held, until its release or its loss.",
        label: Some(("outcome", &["released", "lost"])),
    },
    Spec {
        name: "withlock_extensions_total",
        histogram: false,
        help: "Lock extensions, by result.",
        label: Some(("result", &["extended", "expired", "taken", "error"])),
    },
    Spec {
        name: "withlock_lost_total",
        histogram: false,
        help: "Locks lost, by cause.",
        label: Some(("cause", &["expired", "taken", "backend", "shutdown"])),
    },
    Spec {
        name: "withlock_release_notification_lag_seconds",
        histogram: true,
        help: "From a release notification waking a waiter to the answer of its attempt.",
        label: None,
    },
    Spec {
        name: "withlock_backend_errors_total",
        histogram: false,
        help: "Backend steps that failed, by step.",
        label: Some((
            "step",
            &["try_acquire", "extend", "release", "watch_release"],
        )),
    },
];

/// Records one locker's metrics. Cheap to clone.
#[derive(Clone)]
pub(crate) struct Meter {
    #[cfg(feature = "metrics")]
    keys: Arc<Keys>,
}

/// When something began, for a duration recorded later.
#[derive(Clone, Copy)]
pub(crate) struct Stopwatch {
    #[cfg(feature = "metrics")]
    started: tokio::time::Instant,
}

/// How long one lock has been held; its duration is recorded once, by the
/// first of its ends.
pub(crate) struct HeldTimer {
    #[cfg(feature = "metrics")]
    since: Stopwatch,
    #[cfg(feature = "metrics")]
    ended: std::sync::atomic::AtomicBool,
}

impl Meter {
    /// `withlock_acquire_seconds`: a `with_lock` acquisition begun at
    /// `since` ended with `outcome`.
    pub(crate) fn acquisition(&self, key: &Arc<str>, outcome: Acquisition, since: &Stopwatch) {
        let value = match outcome {
            Acquisition::Acquired => 0,
            Acquisition::Busy => 1,
            Acquisition::Failed => 2,
        };
        self.observe(ACQUIRE, value, key, since);
    }

    /// `withlock_held_seconds`: this node stopped holding the lock of
    /// `timer`, by a loss or a release. Only the first call per lock counts.
    pub(crate) fn held(&self, key: &Arc<str>, timer: &HeldTimer, lost: bool) {
        if timer.end() {
            self.observe(HELD, usize::from(lost), key, &timer.since());
        }
    }

    /// `withlock_extensions_total`: what one lock's extension found.
    pub(crate) fn extension(&self, key: &Arc<str>, result: Result<ExtendOutcome, &BackendError>) {
        let value = match result {
            Ok(ExtendOutcome::Extended) => 0,
            Ok(ExtendOutcome::Expired) => 1,
            Ok(ExtendOutcome::Taken) => 2,
            Err(_) => 3,
        };
        self.count(EXTENSIONS, value, key);
    }

    /// `withlock_lost_total`: a lock was lost. [`LossCause::Released`] is
    /// what a task sharing a lock sees when its owner released it, not a
    /// loss of the lock: it is not counted.
    pub(crate) fn lost(&self, key: &Arc<str>, cause: &LossCause) {
        let value = match cause {
            LossCause::Expired => 0,
            LossCause::Taken => 1,
            LossCause::Backend(_) => 2,
            LossCause::Shutdown => 3,
            LossCause::Released => return,
        };
        self.count(LOST, value, key);
    }

    /// `withlock_release_notification_lag_seconds`: the attempt made on a
    /// release notification that woke its waiter at `woken` answered.
    pub(crate) fn notification_lag(&self, key: &Arc<str>, woken: &Stopwatch) {
        self.observe(LAG, 0, key, woken);
    }

    /// `withlock_backend_errors_total`: `step` failed for `key`.
    pub(crate) fn backend_error(&self, key: &Arc<str>, step: Step) {
        let value = match step {
            Step::TryAcquire => 0,
            Step::Extend => 1,
            Step::Release => 2,
            Step::WatchRelease => 3,
        };
        self.count(ERRORS, value, key);
    }
}

#[cfg(feature = "metrics")]
mod on {
    use std::borrow::Cow;
    use std::sync::atomic::Ordering;
    use std::sync::Arc;

    use metrics::{Key, KeyName, Label, Level, Metadata, SharedString, Unit};
    use tokio::time::Instant;

    use super::{HeldTimer, Meter, Stopwatch, SPECS};

    static METADATA: Metadata<'static> =
        Metadata::new(module_path!(), Level::INFO, Some(module_path!()));

    /// The keys of one locker's series, built once.
    pub(super) struct Keys {
        key_label: bool,
        /// `by_spec[s][v]`: `SPECS[s]` with the `v`th value of its label.
        by_spec: Vec<Vec<Key>>,
    }

    impl Meter {
        /// The meter of a locker on the backend named `backend`; describes
        /// the metrics to the recorder installed now, if any.
        pub(crate) fn new(backend: &'static str, key_label: bool) -> Self {
            let by_spec = SPECS
                .iter()
                .map(|spec| {
                    let series = |value: Option<Label>| {
                        let labels = std::iter::once(Label::from_static_parts("backend", backend))
                            .chain(value)
                            .collect::<Vec<_>>();
                        // Retained, so a recorder's copies do not allocate.
                        Key::from_parts(spec.name, labels).to_retained()
                    };
                    match spec.label {
                        Some((label, values)) => values
                            .iter()
                            .map(|&v| series(Some(Label::from_static_parts(label, v))))
                            .collect(),
                        None => vec![series(None)],
                    }
                })
                .collect();
            metrics::with_recorder(|recorder| {
                for spec in &SPECS {
                    let (name, help) = (
                        KeyName::from_const_str(spec.name),
                        SharedString::const_str(spec.help),
                    );
                    if spec.histogram {
                        recorder.describe_histogram(name, Some(Unit::Seconds), help);
                    } else {
                        recorder.describe_counter(name, Some(Unit::Count), help);
                    }
                }
            });
            Self {
                keys: Arc::new(Keys { key_label, by_spec }),
            }
        }

        fn key(&self, spec: usize, value: usize, key: &Arc<str>) -> Cow<'_, Key> {
            let series = &self.keys.by_spec[spec][value];
            if self.keys.key_label {
                Cow::Owned(series.with_extra_labels(vec![Label::new("key", Arc::clone(key))]))
            } else {
                Cow::Borrowed(series)
            }
        }

        pub(super) fn count(&self, spec: usize, value: usize, key: &Arc<str>) {
            let key = self.key(spec, value, key);
            metrics::with_recorder(|r| r.register_counter(&key, &METADATA).increment(1));
        }

        pub(super) fn observe(&self, spec: usize, value: usize, key: &Arc<str>, since: &Stopwatch) {
            let seconds = since.started.elapsed().as_secs_f64();
            let key = self.key(spec, value, key);
            metrics::with_recorder(|r| r.register_histogram(&key, &METADATA).record(seconds));
        }
    }

    impl Stopwatch {
        /// Starts now.
        pub(crate) fn start() -> Self {
            Self {
                started: Instant::now(),
            }
        }
    }

    impl HeldTimer {
        /// Starts now.
        pub(crate) fn start() -> Self {
            Self {
                since: Stopwatch::start(),
                ended: false.into(),
            }
        }

        /// Whether this call is the first to end the timer.
        pub(super) fn end(&self) -> bool {
            !self.ended.swap(true, Ordering::AcqRel)
        }

        pub(super) fn since(&self) -> Stopwatch {
            self.since
        }
    }
}

#[cfg(feature = "metrics")]
use on::Keys;

#[cfg(not(feature = "metrics"))]
impl Meter {
    /// A meter that records nothing.
    #[inline]
    pub(crate) fn new(_backend: &'static str, _key_label: bool) -> Self {
        Self {}
    }

    #[inline(always)]
    fn count(&self, _spec: usize, _value: usize, _key: &Arc<str>) {}

    #[inline(always)]
    fn observe(&self, _spec: usize, _value: usize, _key: &Arc<str>, _since: &Stopwatch) {}
}

#[cfg(not(feature = "metrics"))]
impl Stopwatch {
    /// Measures nothing.
    #[inline(always)]
    pub(crate) fn start() -> Self {
        Self {}
    }
}

#[cfg(not(feature = "metrics"))]
impl HeldTimer {
    /// Measures nothing.
    #[inline(always)]
    pub(crate) fn start() -> Self {
        Self {}
    }

    #[inline(always)]
    fn end(&self) -> bool {
        false
    }

    #[inline(always)]
    fn since(&self) -> Stopwatch {
        Stopwatch {}
    }
}

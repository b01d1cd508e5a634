//! Per-call and per-locker settings, as plain data with documented defaults.

use std::time::Duration;

use crate::backend::QueueTerms;
use crate::error::InvalidInput;

/// The shortest ttl accepted: below it an extension every `ttl / 3` has too
/// little time to reach the backend and come back.
pub const MIN_TTL: Duration = Duration::from_millis(100);
/// The longest ttl accepted (7 days).
pub const MAX_TTL: Duration = Duration::from_secs(7 * 24 * 3600);
/// The longest retry delay accepted (1 hour).
pub const MAX_RETRY_DELAY: Duration = Duration::from_secs(3600);

/// How many attempts follow the first one while the key is held elsewhere.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RetryAttempts {
    /// At most this many more attempts; `Limited(0)` is a single attempt.
    Limited(u32),
    /// Wait as long as it takes.
    Unlimited,
}

/// Written as a number of retries, or `"unlimited"`.
#[cfg(feature = "serde")]
impl serde::Serialize for RetryAttempts {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self {
            Self::Limited(n) => serializer.serialize_u32(*n),
            Self::Unlimited => serializer.serialize_str("unlimited"),
        }
    }
}

#[cfg(feature = "serde")]
impl<'de> serde::Deserialize<'de> for RetryAttempts {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl serde::de::Visitor<'_> for Visitor {
            type Value = RetryAttempts;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a number of retries or \"unlimited\"")
            }
            fn visit_u64<E: serde::de::Error>(self, n: u64) -> Result<RetryAttempts, E> {
                u32::try_from(n)
                    .map(RetryAttempts::Limited)
                    .map_err(|_| E::custom("retry_attempts is above 4294967295"))
            }
            fn visit_i64<E: serde::de::Error>(self, n: i64) -> Result<RetryAttempts, E> {
                u64::try_from(n)
                    .map_err(|_| E::custom("retry_attempts is negative"))
                    .and_then(|n| self.visit_u64(n))
            }
            fn visit_str<E: serde::de::Error>(self, s: &str) -> Result<RetryAttempts, E> {
                match s {
                    "unlimited" => Ok(RetryAttempts::Unlimited),
                    other => other.parse().map(RetryAttempts::Limited).map_err(|_| {
                        E::custom(format!(
                            "retry_attempts {other:?} is neither a number nor \"unlimited\""
                        ))
                    }),
                }
            }
        }
        deserializer.deserialize_any(Visitor)
    }
}

impl From<u32> for RetryAttempts {
    fn from(n: u32) -> Self {
        Self::Limited(n)
    }
}

/// How one `with_lock` call acquires and holds its lock.
///
/// ```
/// use std::time::Duration;
/// use lock_core::LockConfig;
///
/// let refuse_if_busy = LockConfig::default().retry_attempts(0);
/// let wait_forever = LockConfig::default().wait_forever();
/// let short = LockConfig::default().ttl(Duration::from_secs(5));
/// # assert!(refuse_if_busy.validate().is_ok() && wait_forever.validate().is_ok() && short.validate().is_ok());
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
#[cfg_attr(
    feature = "serde",
    derive(serde::Serialize, serde::Deserialize),
    serde(default, deny_unknown_fields)
)]
pub struct LockConfig {
    /// How long the lock lives without an extension. The driver extends it
    /// about every `ttl / 3` while the callback runs, so it only matters
    /// when this node stops extending (a crash, a stalled process).
    ///
    /// Default: 30 s. Range: [`MIN_TTL`] to [`MAX_TTL`].
    #[cfg_attr(feature = "serde", serde(with = "humantime_serde"))]
    pub ttl: Duration,
    /// Attempts after the first while the key is held elsewhere.
    ///
    /// Default: `Limited(10)`, so a call gives up after 11 attempts, about 2 s.
    pub retry_attempts: RetryAttempts,
    /// Time between two counted attempts. A release notification triggers an
    /// extra attempt at once, which does not count.
    ///
    /// Default: 200 ms. At most [`MAX_RETRY_DELAY`]; zero only with limited attempts.
    #[cfg_attr(feature = "serde", serde(with = "humantime_serde"))]
    pub retry_delay: Duration,
    /// How far each delay between two counted attempts is moved, at random,
    /// either way: a delay is drawn uniformly from `retry_delay ± retry_jitter`,
    /// so waiters behind a client that publishes no release notifications
    /// do not all fire at the same instant \[A7\]. A jitter above
    /// `retry_delay` acts as `retry_delay`. On average the give-up time stays
    /// `retry_attempts × retry_delay`.
    ///
    /// Default: 100 ms (node-redlock's ±100 ms on 200 ms).
    #[cfg_attr(feature = "serde", serde(with = "humantime_serde"))]
    pub retry_jitter: Duration,
    /// The minimum hold \[H7\] (ShedLock's `lockAtLeastFor`): a callback
    /// that settles sooner than this after the acquisition does not release
    /// the lock; the lock is left to expire when the minimum is over, and
    /// nothing extends it after the callback. So a short job started by
    /// cron on several hosts, whose clocks or start times differ by less
    /// than this, runs once per period. The call still gives the
    /// callback's output at once. It counts from the store's own record of
    /// the acquisition where it keeps one (PostgreSQL's `locked_at`), else
    /// from the moment this node received the acquisition's answer, so the
    /// hold is never shorter.
    ///
    /// Default: zero (release as soon as the callback settles). At most
    /// [`MAX_TTL`].
    #[cfg_attr(feature = "serde", serde(with = "humantime_serde"))]
    pub hold_at_least: Duration,
    /// The fair queue across nodes \[F1–F3\]: a call that waits (more
    /// than one attempt) takes a place in the store's queue once it found
    /// the key busy, where the backend keeps one
    /// ([`Capabilities::fair_queue`](crate::Capabilities::fair_queue));
    /// a release then grants the lock to the node that waited longest and
    /// wakes only it. A try-once call never queues. `None` waits
    /// unqueued: every node's waiter tries again when a release is
    /// announced, and the fastest wins.
    ///
    /// Default: `Some(QueueTerms::DEFAULT)` (ticket ttl 3 s, claim
    /// deadline 2 s).
    pub fair_queue: Option<QueueTerms>,
    /// Whether a call that waits must queue. With `true` it queues with
    /// [`fair_queue`](Self::fair_queue)'s terms (the default terms when
    /// that is `None`); on a backend that keeps no queue (or not with its
    /// release notifications off) the call fails at once with
    /// [`InvalidInput::FairQueueUnavailable`](crate::InvalidInput::FairQueueUnavailable),
    /// touching nothing, and one whose queued attempt the store refuses
    /// (a missing table or right) fails with the store's error instead of
    /// waiting unqueued \[F6\]. A try-once call never queues, required
    /// or not.
    ///
    /// Default: `false` (such calls wait unqueued; the log says so once
    /// when the store refused the queue).
    pub require_fair_queue: bool,
}

impl Default for LockConfig {
    fn default() -> Self {
        Self::DEFAULT
    }
}

impl LockConfig {
    /// The default config, which `with_lock` uses.
    pub(crate) const DEFAULT: Self = Self {
        ttl: Duration::from_secs(30),
        retry_attempts: RetryAttempts::Limited(10),
        retry_delay: Duration::from_millis(200),
        retry_jitter: Duration::from_millis(100),
        hold_at_least: Duration::ZERO,
        fair_queue: Some(QueueTerms::DEFAULT),
        require_fair_queue: false,
    };
}

impl LockConfig {
    /// Sets [`LockConfig::ttl`]. Defaults to 30 s.
    #[must_use]
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.ttl = ttl;
        self
    }

    /// Sets [`LockConfig::retry_attempts`] to a limit. Defaults to 10.
    #[must_use]
    pub fn retry_attempts(mut self, n: u32) -> Self {
        self.retry_attempts = RetryAttempts::Limited(n);
        self
    }

    /// Waits as long as it takes ([`RetryAttempts::Unlimited`]).
    #[must_use]
    pub fn wait_forever(mut self) -> Self {
        self.retry_attempts = RetryAttempts::Unlimited;
        self
    }

    /// Sets [`LockConfig::retry_delay`]. Defaults to 200 ms.
    #[must_use]
    pub fn retry_delay(mut self, delay: Duration) -> Self {
        self.retry_delay = delay;
        self
    }

    /// Sets [`LockConfig::retry_jitter`]. Defaults to 100 ms; zero gives an
    /// exact `retry_delay` grid.
    #[must_use]
    pub fn retry_jitter(mut self, jitter: Duration) -> Self {
        self.retry_jitter = jitter;
        self
    }

    /// Sets [`LockConfig::hold_at_least`]. Defaults to zero.
    #[must_use]
    pub fn hold_at_least(mut self, minimum: Duration) -> Self {
        self.hold_at_least = minimum;
        self
    }

    /// Sets [`LockConfig::fair_queue`] to these terms. Defaults to
    /// [`QueueTerms::DEFAULT`].
    #[must_use]
    pub fn fair_queue(mut self, terms: QueueTerms) -> Self {
        self.fair_queue = Some(terms);
        self
    }

    /// Waits unqueued ([`LockConfig::fair_queue`] `None`, and
    /// [`LockConfig::require_fair_queue`] `false`).
    #[must_use]
    pub fn no_queue(mut self) -> Self {
        self.fair_queue = None;
        self.require_fair_queue = false;
        self
    }

    /// Sets [`LockConfig::require_fair_queue`]: a waiting call fails
    /// rather than wait unqueued. Defaults to `false`.
    #[must_use]
    pub fn require_fair_queue(mut self) -> Self {
        self.require_fair_queue = true;
        self
    }

    /// The queue's terms when this call queues: it waits and asks for the
    /// queue.
    pub(crate) fn queue_terms(&self) -> Option<QueueTerms> {
        match self.retry_attempts {
            RetryAttempts::Limited(0) => None,
            _ if self.require_fair_queue => Some(self.fair_queue.unwrap_or(QueueTerms::DEFAULT)),
            _ => self.fair_queue,
        }
    }

    /// One delay between two counted attempts: `retry_delay ± retry_jitter`,
    /// drawn uniformly.
    pub(crate) fn jittered_delay(&self) -> Duration {
        let jitter = self.retry_jitter.min(self.retry_delay);
        if jitter.is_zero() {
            return self.retry_delay;
        }
        let span = u64::try_from(jitter.as_nanos() * 2).unwrap_or(u64::MAX);
        let offset = Duration::from_nanos(rand::random_range(0..=span));
        self.retry_delay - jitter + offset
    }

    /// Checks the config, as every call does before touching the backend.
    pub fn validate(&self) -> Result<(), InvalidInput> {
        validate_ttl(self.ttl)?;
        if self.retry_delay > MAX_RETRY_DELAY {
            return Err(InvalidInput::RetryDelayTooLong {
                delay: self.retry_delay,
                max: MAX_RETRY_DELAY,
            });
        }
        if self.retry_delay.is_zero() && self.retry_attempts == RetryAttempts::Unlimited {
            return Err(InvalidInput::ZeroDelayUnlimited);
        }
        if let Some(terms) = self.fair_queue {
            let ticket = QueueTerms::MIN_TICKET_TTL..=QueueTerms::MAX_TICKET_TTL;
            let claim = QueueTerms::MIN_CLAIM..=QueueTerms::MAX_CLAIM;
            if !ticket.contains(&terms.ticket_ttl) || !claim.contains(&terms.claim) {
                return Err(InvalidInput::QueueTerms {
                    ticket_ttl: terms.ticket_ttl,
                    claim: terms.claim,
                });
            }
        }
        if self.hold_at_least > MAX_TTL {
            return Err(InvalidInput::HoldTooLong {
                hold: self.hold_at_least,
                max: MAX_TTL,
            });
        }
        Ok(())
    }
}

pub(crate) fn validate_ttl(ttl: Duration) -> Result<(), InvalidInput> {
    if ttl.is_zero() {
        return Err(InvalidInput::ZeroTtl);
    }
    if ttl < MIN_TTL {
        return Err(InvalidInput::TtlTooShort { ttl, min: MIN_TTL });
    }
    if ttl > MAX_TTL {
        return Err(InvalidInput::TtlTooLong { ttl, max: MAX_TTL });
    }
    Ok(())
}

pub(crate) fn validate_key(key: &str, max: usize) -> Result<(), InvalidInput> {
    if key.is_empty() {
        return Err(InvalidInput::EmptyKey);
    }
    if key.as_bytes().contains(&0) {
        return Err(InvalidInput::KeyHasNul);
    }
    if key.len() > max {
        return Err(InvalidInput::KeyTooLong {
            len: key.len(),
            max,
        });
    }
    Ok(())
}

/// Settings of one [`Locker`](crate::Locker), that is of one node.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
#[cfg_attr(
    feature = "serde",
    derive(serde::Serialize, serde::Deserialize),
    serde(default, deny_unknown_fields)
)]
pub struct LockerOptions {
    /// The node id written into every owner token (`<node id>/<32 hex>`),
    /// so that an operator can tell which node holds a key.
    ///
    /// Default: `None`, which draws `withlock-<pid>-<8 hex>`.
    pub node_id: Option<String>,
    /// How long [`Locker::shutdown`](crate::Locker::shutdown) waits for the
    /// releases of the locks still held after its grace period.
    ///
    /// Default: 1 s.
    #[cfg_attr(feature = "serde", serde(with = "humantime_serde"))]
    pub release_timeout: Duration,
    /// Whether the metrics recorded with the `metrics` feature carry a
    /// `key` label. Every key then makes series of its own, so turn it on
    /// only for a small, fixed set of keys. Without the feature it does
    /// nothing.
    ///
    /// Default: false.
    pub metrics_key_label: bool,
    /// Whether the locker runs its background work (the extender, releases
    /// sent in the background, attempts and clean-ups finished after their
    /// caller left) on the runtime of the call that took the latest lock
    /// instead of the process's background runtime
    /// ([`Background`](crate::Background)) \[T1\].
    ///
    /// Turn it on only in tests on tokio's paused clock
    /// (`#[tokio::test(start_paused = true)]`), where the extender must
    /// sleep on the test's clock. Anywhere else it is a trap: while that
    /// runtime is idle (a current-thread runtime between two `block_on`
    /// calls) or blocked, no lock is extended and every lock is lost, and
    /// once it is dropped the next lock taken restarts the work on its
    /// caller's runtime.
    ///
    /// Default: false.
    pub caller_runtime: bool,
}

impl Default for LockerOptions {
    fn default() -> Self {
        Self {
            node_id: None,
            release_timeout: Duration::from_secs(1),
            metrics_key_label: false,
            caller_runtime: false,
        }
    }
}

impl LockerOptions {
    /// Sets [`LockerOptions::node_id`]. Defaults to a drawn id.
    #[must_use]
    pub fn node_id(mut self, id: impl Into<String>) -> Self {
        self.node_id = Some(id.into());
        self
    }

    /// Sets [`LockerOptions::release_timeout`]. Defaults to 1 s.
    #[must_use]
    pub fn release_timeout(mut self, timeout: Duration) -> Self {
        self.release_timeout = timeout;
        self
    }

    /// Sets [`LockerOptions::metrics_key_label`]. Defaults to false.
    #[must_use]
    pub fn metrics_key_label(mut self, yes: bool) -> Self {
        self.metrics_key_label = yes;
        self
    }

    /// Sets [`LockerOptions::caller_runtime`]: for tests on tokio's paused
    /// clock only. Defaults to false.
    #[must_use]
    pub fn caller_runtime(mut self, yes: bool) -> Self {
        self.caller_runtime = yes;
        self
    }

    pub(crate) fn resolved_node_id(&self) -> Result<String, InvalidInput> {
        match &self.node_id {
            Some(id) if id.is_empty() || id.len() > 128 || id.chars().any(char::is_control) => {
                Err(InvalidInput::InvalidNodeId)
            }
            Some(id) => Ok(id.clone()),
            None => Ok(format!(
                "withlock-{}-{:08x}",
                std::process::id(),
                rand::random::<u32>()
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_config_is_valid() {
        // `with_lock` relies on it and does not check it.
        assert_eq!(LockConfig::DEFAULT.validate(), Ok(()));
        assert_eq!(LockConfig::default(), LockConfig::DEFAULT);
    }

    #[test]
    fn defaults_are_the_documented_ones() {
        let c = LockConfig::default();
        assert_eq!(c.ttl, Duration::from_secs(30));
        assert_eq!(c.retry_attempts, RetryAttempts::Limited(10));
        assert_eq!(c.retry_delay, Duration::from_millis(200));
        assert_eq!(c.retry_jitter, Duration::from_millis(100));
        assert!(c.validate().is_ok());
    }

    #[test]
    fn a7_delays_are_jittered_within_bounds() {
        let c = LockConfig::default();
        let delays: Vec<Duration> = (0..200).map(|_| c.jittered_delay()).collect();
        assert!(delays
            .iter()
            .all(|d| *d >= Duration::from_millis(100) && *d <= Duration::from_millis(300)));
        let distinct: std::collections::HashSet<_> = delays.iter().collect();
        assert!(distinct.len() > 100, "delays are spread, not on a grid");
        let mean = delays.iter().sum::<Duration>() / 200;
        assert!(mean > Duration::from_millis(180) && mean < Duration::from_millis(220));
        let exact = c.retry_jitter(Duration::ZERO);
        assert_eq!(exact.jittered_delay(), Duration::from_millis(200));
        let wide = c.retry_jitter(Duration::from_secs(5));
        assert!(wide.jittered_delay() <= Duration::from_millis(400));
    }

    #[test]
    fn bad_configs_are_refused() {
        let c = LockConfig::default();
        assert_eq!(c.ttl(Duration::ZERO).validate(), Err(InvalidInput::ZeroTtl));
        assert!(matches!(
            c.ttl(Duration::from_millis(99)).validate(),
            Err(InvalidInput::TtlTooShort { .. })
        ));
        assert!(matches!(
            c.ttl(MAX_TTL + Duration::from_secs(1)).validate(),
            Err(InvalidInput::TtlTooLong { .. })
        ));
        assert_eq!(
            c.retry_delay(Duration::ZERO).wait_forever().validate(),
            Err(InvalidInput::ZeroDelayUnlimited)
        );
        assert!(c
            .retry_delay(Duration::ZERO)
            .retry_attempts(3)
            .validate()
            .is_ok());
        assert!(c.hold_at_least.is_zero(), "no minimum hold by default");
        assert!(c.hold_at_least(MAX_TTL).validate().is_ok());
        assert!(matches!(
            c.hold_at_least(MAX_TTL + Duration::from_secs(1)).validate(),
            Err(InvalidInput::HoldTooLong { .. })
        ));
        assert!(matches!(
            c.retry_delay(MAX_RETRY_DELAY * 2).validate(),
            Err(InvalidInput::RetryDelayTooLong { .. })
        ));
    }

    #[test]
    fn keys_are_opaque_but_bounded() {
        assert_eq!(validate_key("", 10), Err(InvalidInput::EmptyKey));
        assert!(validate_key("a b {x} * : ' \" ; é", 100).is_ok());
        assert_eq!(validate_key("a\0b", 100), Err(InvalidInput::KeyHasNul));
        assert_eq!(
            validate_key("abc", 2),
            Err(InvalidInput::KeyTooLong { len: 3, max: 2 })
        );
    }

    #[test]
    fn a_nul_is_found_at_every_place_in_keys_of_every_short_length() {
        for len in 1..40 {
            let clean: String = (0..len)
                .map(|i| char::from(b'a' + (i % 26) as u8))
                .collect();
            assert_eq!(
                validate_key(&clean, crate::MAX_KEY_LEN),
                Ok(()),
                "len {len}"
            );
            for at in 0..len {
                let mut with = clean.clone().into_bytes();
                with[at] = 0;
                let with = String::from_utf8(with).unwrap();
                assert_eq!(
                    validate_key(&with, crate::MAX_KEY_LEN),
                    Err(InvalidInput::KeyHasNul),
                    "len {len}, NUL at {at}"
                );
            }
        }
    }

    #[test]
    fn node_ids_are_checked() {
        assert!(LockerOptions::default().resolved_node_id().is_ok());
        assert_eq!(
            LockerOptions::default().node_id("").resolved_node_id(),
            Err(InvalidInput::InvalidNodeId)
        );
        assert_eq!(
            LockerOptions::default().node_id("a\nb").resolved_node_id(),
            Err(InvalidInput::InvalidNodeId)
        );
    }
}

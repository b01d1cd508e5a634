//! The errors of withlock.

use std::error::Error as StdError;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use crate::redact::redact;

/// Everything `with_lock` and the lower-level APIs can fail with.
///
/// | variant | the callback ran? | what to do |
/// |---|---|---|
/// | [`NotAcquired`](Self::NotAcquired) | no | the key is busy elsewhere, or the backend failed on every attempt |
/// | [`Lost`](Self::Lost) | yes, and may still run | do not perform authoritative side effects for this key any more |
/// | [`InvalidInput`](Self::InvalidInput) | no | fix the key or the config; nothing was touched |
/// | [`Backend`](Self::Backend) | (low-level calls only) | a single backend step failed |
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LockError {
    /// Acquisition failed after every attempt. The callback did not run.
    #[error(
        "lock on key {key:?} not acquired after {attempts} attempt(s); the callback did not run"
    )]
    NotAcquired {
        /// The key asked for.
        key: String,
        /// Attempts counted against the budget (`retry_attempts + 1` when the
        /// budget ran out).
        attempts: u32,
        /// The last backend error, when any attempt failed on one rather
        /// than finding the key busy; `None` when every attempt found the
        /// key held.
        #[source]
        source: Option<BackendError>,
    },
    /// The lock was lost while the callback ran. The error is returned as
    /// soon as the loss is detected; the cause says why.
    #[error("lock on key {key:?} lost while the callback ran")]
    Lost {
        /// The key that was held.
        key: String,
        /// Why the lock was lost.
        #[source]
        cause: LossCause,
    },
    /// The key or the config is not acceptable. Nothing was touched.
    #[error(transparent)]
    InvalidInput(#[from] InvalidInput),
    /// A single backend step of the low-level [`LockHandle`](crate::LockHandle)
    /// or the deprecated `Mutex` failed.
    #[error("backend step on key {key:?} failed")]
    Backend {
        /// The key of the step.
        key: String,
        /// The backend's error.
        #[source]
        source: BackendError,
    },
}

impl LockError {
    /// Whether the callback (or the critical section) started before the
    /// error: false for [`NotAcquired`](Self::NotAcquired) and
    /// [`InvalidInput`](Self::InvalidInput).
    pub fn callback_started(&self) -> bool {
        matches!(self, Self::Lost { .. })
    }

    /// The key was busy (or the backend failing) on every attempt.
    pub fn is_not_acquired(&self) -> bool {
        matches!(self, Self::NotAcquired { .. })
    }

    /// The key was held by someone else on every attempt:
    /// [`NotAcquired`](Self::NotAcquired) with no backend error. This is
    /// "the task is already running elsewhere".
    pub fn is_busy(&self) -> bool {
        matches!(self, Self::NotAcquired { source: None, .. })
    }

    /// The lock was lost while held.
    pub fn is_lost(&self) -> bool {
        matches!(self, Self::Lost { .. })
    }

    /// Why the lock was lost, for [`Lost`](Self::Lost).
    pub fn loss_cause(&self) -> Option<&LossCause> {
        match self {
            Self::Lost { cause, .. } => Some(cause),
            _ => None,
        }
    }
}

/// Why a held lock was lost.
#[derive(Clone, Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LossCause {
    /// The lock's validity ran out: the callback settled after the last
    /// confirmed expiry (a stalled holder), or an extension sent after it
    /// found the key gone.
    #[error("the key expired before it was extended")]
    Expired,
    /// Another owner held the key when the driver went to extend or release
    /// it, or the key was found gone while this owner's validity still ran
    /// (deleted, freed by an operator, or lost by the store) \[L1\].
    #[error("another owner took the key, or it was deleted or freed while held")]
    Taken,
    /// Extensions failed on backend errors until the lock's validity ran
    /// out, or the release after the callback settled got no answer while
    /// the lock was valid (or found the key free after a try that may have
    /// freed it), so nothing proves it was held throughout; the source is
    /// the error (the extension's or the release's).
    #[error("backend errors: nothing confirms the lock was held throughout")]
    Backend(#[source] BackendError),
    /// The locker shut down and released the lock.
    #[error("the locker shut down and released the lock")]
    Shutdown,
    /// The call that took the lock released it while a task that shares it
    /// (one carried with [`LockContext::scope`](crate::LockContext::scope))
    /// still ran.
    #[error("the call that took the lock released it while this task still ran")]
    Released,
}

/// The kind of a [`BackendError`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum BackendErrorKind {
    /// The store could not be reached or the request failed.
    Request,
    /// The step did not finish in the time the driver could give it.
    Timeout,
    /// The store answered something the backend does not understand.
    Protocol,
    /// The store could not be reached and the request was never sent (a
    /// refused connection, an empty pool): the step certainly changed
    /// nothing in the store.
    Unavailable,
    /// The store refused the step for a reason that trying again cannot
    /// mend: authentication refused, permission denied, a missing lock
    /// table, a lock table or fencing companion of the wrong type. The
    /// driver does not retry it: the call ends at once with this error as
    /// its source \[A8\].
    Setup,
}

/// An error of a backend step, keeping the store's own error as its source.
///
/// Cheap to clone: a lost lock hands the same error to every observer.
#[derive(Clone)]
pub struct BackendError {
    kind: BackendErrorKind,
    source: Arc<dyn StdError + Send + Sync>,
}

impl BackendError {
    /// A failed request, wrapping the store's error.
    pub fn request(source: impl StdError + Send + Sync + 'static) -> Self {
        Self::new(BackendErrorKind::Request, source)
    }

    /// An error of the given kind, wrapping the store's error.
    pub fn new(kind: BackendErrorKind, source: impl StdError + Send + Sync + 'static) -> Self {
        Self {
            kind,
            source: Arc::new(source),
        }
    }

    /// A step whose request was never sent, because the store could not be
    /// reached: it certainly changed nothing.
    pub fn unavailable(source: impl StdError + Send + Sync + 'static) -> Self {
        Self::new(BackendErrorKind::Unavailable, source)
    }

    /// An error described by a message only.
    pub fn message(kind: BackendErrorKind, message: impl Into<String>) -> Self {
        Self::new(kind, Message(message.into()))
    }

    /// A step that did not finish within `after`.
    pub fn timeout(step: &'static str, after: Duration) -> Self {
        Self::message(
            BackendErrorKind::Timeout,
            format!("{step} did not finish within {after:?}"),
        )
    }

    /// What kind of failure this is.
    pub fn kind(&self) -> BackendErrorKind {
        self.kind
    }

    /// A step the store refused for a reason that trying again cannot mend
    /// (see [`BackendErrorKind::Setup`]).
    pub fn setup(source: impl StdError + Send + Sync + 'static) -> Self {
        Self::new(BackendErrorKind::Setup, source)
    }

    /// Whether trying again cannot help: kind [`BackendErrorKind::Setup`].
    pub fn is_permanent(&self) -> bool {
        self.kind == BackendErrorKind::Setup
    }

    /// Whether the step timed out.
    pub fn is_timeout(&self) -> bool {
        self.kind == BackendErrorKind::Timeout
    }

    /// Whether the request may have reached the store, so that the step may
    /// have been applied (now or later, by a store that was slow to answer).
    /// False only for [`BackendErrorKind::Unavailable`].
    pub fn may_have_reached_store(&self) -> bool {
        self.kind != BackendErrorKind::Unavailable
    }

    /// The store's error, to downcast.
    pub fn inner(&self) -> &(dyn StdError + Send + Sync + 'static) {
        &*self.source
    }
}

impl fmt::Debug for BackendError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BackendError")
            .field("kind", &self.kind)
            .field("source", &self.source)
            .finish()
    }
}

impl fmt::Display for BackendError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let what = match self.kind {
            BackendErrorKind::Request => "lock backend request failed",
            BackendErrorKind::Timeout => "lock backend step timed out",
            BackendErrorKind::Protocol => "lock backend gave an unexpected answer",
            BackendErrorKind::Unavailable => "lock backend unreachable; the request was not sent",
            BackendErrorKind::Setup => {
                "lock backend refused the step: its setup or permissions need fixing"
            }
        };
        // The store's own words end the line, so that a log line or a
        // message that shows only this error still says what went wrong
        // (`source()` gives the same error, for a chain walker:
        // [`ErrorChain`] does not print it twice).
        write!(f, "{what}: {}", redact(&self.source.to_string()))
    }
}

impl StdError for BackendError {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        Some(&*self.source)
    }
}

#[derive(Debug, thiserror::Error)]
#[error("{0}")]
struct Message(String);

/// An error and its sources on one line, `a: b: c`, each text with its
/// passwords redacted (a URL's `user:password@`, a `password=` setting),
/// skipping a source whose text is already in what was printed (a
/// [`BackendError`] ends with its source's text, so the source is not
/// printed again).
///
/// Every log line of the driver about an error or a lost lock prints its
/// error this way, down to the store's own message:
///
/// ```
/// use lock_core::{BackendError, ErrorChain, LockError, LossCause};
///
/// let store = std::io::Error::other("CLUSTERDOWN The cluster is down");
/// let lost = LockError::Lost {
///     key: "report".into(),
///     cause: LossCause::Backend(BackendError::request(store)),
/// };
/// assert_eq!(
///     ErrorChain(&lost).to_string(),
///     "lock on key \"report\" lost while the callback ran: \
///      backend errors: nothing confirms the lock was held throughout: \
///      lock backend request failed: CLUSTERDOWN The cluster is down",
/// );
/// ```
#[derive(Clone, Copy)]
pub struct ErrorChain<'a>(pub &'a (dyn StdError + 'static));

impl fmt::Display for ErrorChain<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut shown = String::new();
        let mut next = Some(self.0);
        while let Some(error) = next {
            next = error.source();
            let text = error.to_string();
            let text = redact(&text);
            if shown.contains(&*text) {
                continue;
            }
            if !shown.is_empty() {
                shown.push_str(": ");
            }
            shown.push_str(&text);
        }
        f.write_str(&shown)
    }
}

impl fmt::Debug for ErrorChain<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

/// Input that `with_lock`, a handle or a config refused, touching nothing.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum InvalidInput {
    /// The key is the empty string.
    #[error("the lock key is empty")]
    EmptyKey,
    /// The key contains a NUL character, which not every store can keep.
    #[error("the lock key contains a NUL character")]
    KeyHasNul,
    /// The key is longer than the backend accepts.
    #[error("the lock key is {len} bytes long; the maximum is {max}")]
    KeyTooLong {
        /// The key's length in bytes.
        len: usize,
        /// The maximum, in bytes.
        max: usize,
    },
    /// The ttl is zero.
    #[error("ttl is zero")]
    ZeroTtl,
    /// The ttl is too short for the lock to be extended in time.
    #[error("ttl {ttl:?} is below the minimum of {min:?}: too short to extend in time")]
    TtlTooShort {
        /// The ttl given.
        ttl: Duration,
        /// The minimum.
        min: Duration,
    },
    /// The ttl is longer than the maximum.
    #[error("ttl {ttl:?} is above the maximum of {max:?}")]
    TtlTooLong {
        /// The ttl given.
        ttl: Duration,
        /// The maximum.
        max: Duration,
    },
    /// The minimum hold is longer than the maximum.
    #[error("hold_at_least {hold:?} is above the maximum of {max:?}")]
    HoldTooLong {
        /// The minimum hold given.
        hold: Duration,
        /// The maximum.
        max: Duration,
    },
    /// The fair queue's terms are out of range: a ticket ttl from
    /// [`QueueTerms::MIN_TICKET_TTL`](crate::QueueTerms::MIN_TICKET_TTL)
    /// to [`QueueTerms::MAX_TICKET_TTL`](crate::QueueTerms::MAX_TICKET_TTL),
    /// a claim deadline from [`QueueTerms::MIN_CLAIM`](crate::QueueTerms::MIN_CLAIM)
    /// to [`QueueTerms::MAX_CLAIM`](crate::QueueTerms::MAX_CLAIM).
    #[error(
        "the fair queue's ticket ttl {ticket_ttl:?} or claim deadline {claim:?} is out of range \
         (ticket ttl 300ms to 60s, claim 100ms to 60s)"
    )]
    QueueTerms {
        /// The ticket ttl given.
        ticket_ttl: Duration,
        /// The claim deadline given.
        claim: Duration,
    },
    /// The call requires the fair queue
    /// ([`LockConfig::require_fair_queue`](crate::LockConfig::require_fair_queue))
    /// and the backend keeps none
    /// ([`Capabilities::fair_queue`](crate::Capabilities::fair_queue), with
    /// [`release_notifications`](crate::Capabilities::release_notifications)).
    #[error(
        "the fair queue is required (LockConfig::require_fair_queue), but the {backend} backend \
         keeps none (or not with its release notifications off)"
    )]
    FairQueueUnavailable {
        /// The backend's name ([`Capabilities::name`](crate::Capabilities::name)).
        backend: &'static str,
    },
    /// A zero retry delay with unlimited attempts would spin on the backend.
    #[error(
        "retry_delay is zero with unlimited retry attempts: the wait would spin on the backend"
    )]
    ZeroDelayUnlimited,
    /// The retry delay is longer than the maximum.
    #[error("retry_delay {delay:?} is above the maximum of {max:?}")]
    RetryDelayTooLong {
        /// The delay given.
        delay: Duration,
        /// The maximum.
        max: Duration,
    },
    /// The node id is empty, too long or has control characters.
    #[error("the node id must be 1 to 128 bytes without control characters")]
    InvalidNodeId,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backend_error_keeps_its_source_chain() {
        let io = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "refused");
        let err = LockError::Lost {
            key: "k".into(),
            cause: LossCause::Backend(BackendError::request(io)),
        };
        let cause = err.source().unwrap();
        assert!(cause.to_string().contains("backend errors"));
        let backend = cause.source().unwrap();
        assert_eq!(backend.to_string(), "lock backend request failed: refused");
        assert_eq!(backend.source().unwrap().to_string(), "refused");
        assert!(err.callback_started());
    }

    #[derive(Debug, thiserror::Error)]
    #[error("dialing {url} failed")]
    struct Dial {
        url: &'static str,
        #[source]
        io: std::io::Error,
    }

    #[test]
    fn the_chain_ends_with_the_stores_words_once_and_no_password() {
        let store = Dial {
            url: "redis://app:hunter2@10.0.0.1:6379",
            io: std::io::Error::other("CLUSTERDOWN The cluster is down"),
        };
        let backend = BackendError::request(store);
        assert_eq!(
            backend.to_string(),
            "lock backend request failed: dialing redis://app:<redacted>@10.0.0.1:6379 failed"
        );
        let lost = LockError::Lost {
            key: "k".into(),
            cause: LossCause::Backend(backend),
        };
        let chain = ErrorChain(&lost).to_string();
        assert_eq!(
            chain,
            "lock on key \"k\" lost while the callback ran: \
             backend errors: nothing confirms the lock was held throughout: \
             lock backend request failed: dialing redis://app:<redacted>@10.0.0.1:6379 failed: \
             CLUSTERDOWN The cluster is down"
        );
        assert!(!format!("{:?}", ErrorChain(&lost)).contains("hunter2"));
    }

    #[test]
    fn a_timeout_says_which_step() {
        let timeout = BackendError::timeout("extend", Duration::from_secs(2));
        assert_eq!(
            ErrorChain(&timeout).to_string(),
            "lock backend step timed out: extend did not finish within 2s"
        );
    }
}

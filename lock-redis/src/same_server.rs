//! Whether the pub/sub client a user gave beside their own pool hears the
//! pool's server: [`RedisBackend::new`](crate::RedisBackend::new) and
//! [`RedisBackend::with_config`](crate::RedisBackend::with_config) take both,
//! and a client that reaches another server would never hear a release.
//!
//! The check is a probe published through the pool that the backend's own
//! subscription must hear within the step timeout. A probe not heard on a
//! busy machine is no proof of a second server, so:
//!
//! - until a probe is heard, each wait probes again, and gets its watch
//!   (which on a second server never fires: the wait polls, as it would
//!   with notifications off);
//! - after [`MISSES_BEFORE_OFF`] probes missed in a row, notifications are
//!   off: the log says so once, with the fix, and waits poll every
//!   `retry_delay` with no error or log line of their own;
//! - while they are off, a probe goes out again in the background every
//!   [`PROBE_AGAIN_AFTER`] health-check intervals; once one is heard,
//!   they are back on;
//! - once a probe is heard, the client and the pool reach the same server,
//!   for good (neither changes).

use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use lock_core::BackendError;
use tokio::time::Instant;

/// How many probes in a row must go unheard before notifications go off.
pub(crate) const MISSES_BEFORE_OFF: u32 = 3;

/// While notifications are off, a probe goes out again after this many
/// health-check intervals ([`RedisConfig::health_check_interval`]: 30 s
/// with the default 5 s).
///
/// [`RedisConfig::health_check_interval`]: crate::RedisConfig::health_check_interval
pub(crate) const PROBE_AGAIN_AFTER: u32 = 6;

/// Where the check stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    /// No probe heard yet; `misses` in a row went unheard.
    Unknown { misses: u32 },
    /// A probe was heard: the same server.
    Heard,
    /// [`MISSES_BEFORE_OFF`] probes went unheard: notifications are off
    /// until a probe sent at `probe_at` or later is heard.
    Off { probe_at: Instant },
}

/// What a wait does now.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Next {
    /// Watch the subscription.
    Watch,
    /// Probe first (inline), then watch; see [`SameServer::probed`].
    Probe,
    /// Poll, and probe in the background: notifications are off and a
    /// probe is due.
    PollAndProbe,
    /// Poll: notifications are off.
    Poll,
}

/// The check's state, shared by the clones of a backend.
pub(crate) struct SameServer {
    state: Mutex<State>,
    /// A probe is on its way: the others do not send their own.
    probing: Mutex<bool>,
    again_after: Duration,
}

impl SameServer {
    /// A check that probes again every `again_after` while notifications
    /// are off.
    pub(crate) fn new(health_check_interval: Duration) -> Self {
        Self {
            state: Mutex::new(State::Unknown { misses: 0 }),
            probing: Mutex::new(false),
            again_after: health_check_interval.saturating_mul(PROBE_AGAIN_AFTER),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// What a wait does now. `Probe` and `PollAndProbe` hand the probe to
    /// this caller, which must report it with [`probed`](Self::probed) (or
    /// [`failed`](Self::failed)).
    pub(crate) fn next(&self) -> Next {
        let state = *self.state();
        match state {
            State::Heard => Next::Watch,
            State::Unknown { .. } => {
                if self.claim() {
                    Next::Probe
                } else {
                    Next::Watch
                }
            }
            State::Off { probe_at } => {
                if Instant::now() >= probe_at && self.claim() {
                    Next::PollAndProbe
                } else {
                    Next::Poll
                }
            }
        }
    }

    /// Takes the probe for this caller, unless one is on its way.
    fn claim(&self) -> bool {
        let mut probing = self.probing.lock().unwrap_or_else(PoisonError::into_inner);
        !std::mem::replace(&mut *probing, true)
    }

    fn release(&self) {
        *self.probing.lock().unwrap_or_else(PoisonError::into_inner) = false;
    }

    /// The probe was `heard` or not; whether the wait watches now.
    /// `channel` names the release channel in the log lines.
    pub(crate) fn probed(&self, heard: bool, channel: &str, timeout: Duration) -> bool {
        let mut state = self.state();
        let was = *state;
        *state = match (was, heard) {
            (_, true) => State::Heard,
            (State::Unknown { misses }, false) if misses + 1 < MISSES_BEFORE_OFF => {
                State::Unknown { misses: misses + 1 }
            }
            (State::Heard, false) => State::Heard,
            (State::Unknown { .. } | State::Off { .. }, false) => State::Off {
                probe_at: Instant::now() + self.again_after,
            },
        };
        let now = *state;
        drop(state);
        self.release();
        match (was, now) {
            (State::Off { .. }, State::Heard) => tracing::info!(
                %channel,
                "the pub/sub client given to RedisBackend hears releases published through the pool again: release notifications are back on"
            ),
            (State::Unknown { .. }, State::Off { .. }) => tracing::error!(
                %channel,
                misses = MISSES_BEFORE_OFF,
                ?timeout,
                probe_again = ?self.again_after,
                "the pub/sub client given to RedisBackend did not hear {MISSES_BEFORE_OFF} probes in a row published through the pool: it reaches another Redis server than the pool (or the machine is very busy). Release notifications are off and waiters poll every retry_delay; the probe is tried again every {:?}. Fix: give RedisBackend a client for the pool's server (or use RedisBackend::from_url)",
                self.again_after
            ),
            _ => {}
        }
        !matches!(now, State::Off { .. })
    }

    /// The probe could not be sent (the pool or the subscription failed):
    /// nothing is learnt, and the next wait probes again. While
    /// notifications are off, the next probe waits its turn.
    pub(crate) fn failed(&self, error: &BackendError) {
        let mut state = self.state();
        if let State::Off { probe_at } = &mut *state {
            *probe_at = Instant::now() + self.again_after;
            tracing::debug!(error = %lock_core::ErrorChain(error), "the probe of the release channel failed; trying again later");
        }
        drop(state);
        self.release();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const EVERY: Duration = Duration::from_secs(5);

    #[tokio::test(start_paused = true)]
    async fn a_miss_is_not_enough_and_a_heard_probe_is_for_good() {
        let check = SameServer::new(EVERY);
        assert_eq!(check.next(), Next::Probe);
        assert_eq!(check.next(), Next::Watch, "one probe at a time");
        assert!(check.probed(false, "c", EVERY), "one miss: still on");
        assert_eq!(check.next(), Next::Probe);
        assert!(check.probed(true, "c", EVERY));
        assert_eq!(check.next(), Next::Watch);
        assert!(check.probed(false, "c", EVERY), "heard once, on for good");
    }

    #[tokio::test(start_paused = true)]
    async fn off_after_the_misses_then_probed_again_and_back_on() {
        let check = SameServer::new(EVERY);
        for _ in 1..MISSES_BEFORE_OFF {
            assert_eq!(check.next(), Next::Probe);
            assert!(check.probed(false, "c", EVERY));
        }
        assert_eq!(check.next(), Next::Probe);
        assert!(!check.probed(false, "c", EVERY), "off");
        assert_eq!(check.next(), Next::Poll);
        tokio::time::advance(EVERY * PROBE_AGAIN_AFTER).await;
        assert_eq!(check.next(), Next::PollAndProbe);
        assert_eq!(check.next(), Next::Poll, "one probe at a time");
        assert!(!check.probed(false, "c", EVERY), "still off");
        assert_eq!(check.next(), Next::Poll);
        tokio::time::advance(EVERY * PROBE_AGAIN_AFTER).await;
        assert_eq!(check.next(), Next::PollAndProbe);
        assert!(check.probed(true, "c", EVERY), "back on");
        assert_eq!(check.next(), Next::Watch);
    }
}

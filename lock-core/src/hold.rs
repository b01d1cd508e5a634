//! The minimum hold \[H7\]: a lock whose callback settled before its
//! acquisition plus [`hold_at_least`](crate::LockConfig::hold_at_least) is
//! not released but left to expire then, so that a short job started on
//! several hosts runs once per period.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use crate::backend::{ExtendOutcome, Hold, ReleaseOutcome};
use crate::error::BackendError;
use crate::held::HeldLock;
use crate::metrics::Step;
use crate::registry::Registry;
use crate::release::{OwedRelease, MAX_RETRY_PAUSE, RETRY_PAUSE};

/// Sets the expiry of `held`, which left the registry with its step owed
/// as `owed` ([`Ending::LeftToMinimum`](crate::registry::Ending)), to its minimum hold's end `ends`
/// (`at_least` after the acquisition), and settles what it owes.
///
/// Any extension still on its way is awaited first, so none moves the
/// expiry after this step. The step is sent again on backend errors while
/// the lock is valid, as a release is. The answer is that of a release:
/// `Released` when the key was still ours (and is now left to its hold, or
/// freed if the hold ended meanwhile), `NotHeld` when it was gone or
/// another owner's, or the error, with the key left to its ttl.
pub(crate) async fn leave_to_minimum(
    owed: OwedRelease,
    registry: Arc<Registry>,
    held: Arc<HeldLock>,
    at_least: Duration,
    ends: Instant,
) -> Result<ReleaseOutcome, BackendError> {
    held.extensions_answered().await;
    let deadline = held.valid_until();
    let mut pause = RETRY_PAUSE;
    // The first failed try that may have reached the store: after it, a
    // "not held" proves nothing (that try may have set a short expiry).
    let mut maybe_applied: Option<BackendError> = None;
    let answer = loop {
        let now = Instant::now();
        if now >= ends {
            // The minimum passed while an extension was on its way or the
            // store failed: a release frees the key and settles the debt.
            return owed.send_until(deadline, now, maybe_applied).await;
        }
        let hold = Hold::new(at_least, ends - now);
        let answer = match registry.backend.hold(&held.lease, hold).await {
            Ok(ExtendOutcome::Extended) => Ok(ReleaseOutcome::Released),
            Ok(ExtendOutcome::Expired | ExtendOutcome::Taken) => match maybe_applied.take() {
                Some(error) => Err(error),
                None => Ok(ReleaseOutcome::NotHeld),
            },
            Err(error) => {
                registry
                    .meter
                    .backend_error(held.lease.key_arc(), Step::Extend);
                if maybe_applied.is_none() && error.may_have_reached_store() {
                    maybe_applied = Some(error.clone());
                }
                Err(error)
            }
        };
        if answer.is_ok() || Instant::now() + pause >= deadline {
            break answer;
        }
        if let Err(error) = &answer {
            tracing::debug!(key = %held.lease.key(), error = %crate::ErrorChain(error), "the minimum hold's step failed; sending it again");
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(MAX_RETRY_PAUSE);
    };
    match &answer {
        Ok(ReleaseOutcome::Released) => {
            tracing::debug!(key = %held.lease.key(), fencing_token = held.lease.fencing_token(), "left to expire at the end of its minimum hold");
        }
        Ok(ReleaseOutcome::NotHeld) => {}
        Err(error) => {
            tracing::debug!(key = %held.lease.key(), error = %crate::ErrorChain(error), "the minimum hold's step failed; the key expires with its ttl");
        }
    }
    owed.settled_by_hold(answer.is_ok());
    answer
}

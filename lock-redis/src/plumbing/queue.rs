//! What the single-node (and Sentinel) and the Cluster backends share of
//! the fair queue \[F1–F3, F6\]: its keys, how a queued attempt's answer
//! reads, the switch that leaves the queue out of releases for a user
//! whose ACL does not reach its keys, and the log of a grant channel the
//! ACL refuses.

use std::sync::atomic::{AtomicBool, Ordering};

use lock_core::{AcquireOutcome, BackendError, BackendErrorKind};
use redis::FromRedisValue;

use crate::plumbing::scripts::{acquire_outcome, unexpected};
use crate::slot::{fence_key, queue_key, waiters_key};

/// The keys of a lock's release and fair-queue steps, in their scripts'
/// order: the lock key, its fencing companion, its queue and its waiters,
/// all in the lock key's hash slot.
pub(crate) fn queue_keys(lock_key: &str) -> [String; 4] {
    [
        lock_key.to_owned(),
        fence_key(lock_key),
        queue_key(lock_key),
        waiters_key(lock_key),
    ]
}

/// The queued acquisition's answer: the fencing token, or busy as the
/// pair `[0 or -2 - PTTL, last token drawn or -1]`.
pub(crate) fn queued_outcome(answer: &redis::Value) -> Result<AcquireOutcome, BackendError> {
    let parse = |value: &redis::Value| {
        i64::from_redis_value(value).map_err(|e| {
            BackendError::message(
                BackendErrorKind::Protocol,
                format!("the queued acquisition script's answer: {e}"),
            )
        })
    };
    match answer {
        redis::Value::Array(pair) if pair.len() == 2 => {
            let expires_in = match acquire_outcome(parse(&pair[0])?)? {
                AcquireOutcome::Busy { expires_in, .. } => expires_in,
                AcquireOutcome::Acquired { .. } => {
                    return Err(unexpected("queued acquisition", parse(&pair[0])?))
                }
            };
            let last_token = u64::try_from(parse(&pair[1])?).ok();
            Ok(AcquireOutcome::Busy {
                expires_in,
                last_token,
            })
        }
        token => acquire_outcome(parse(token)?),
    }
}

/// Whether releases may touch the fair queue's keys: not once the ACL
/// refused them (`NOPERM`) to a release of this backend \[F6\]. Such a
/// user's releases free the key as before the queue, and its waiters
/// wait unqueued (the driver finds that out from their queued attempt).
#[derive(Debug, Default)]
pub(crate) struct QueueRights {
    refused: AtomicBool,
}

impl QueueRights {
    /// Whether the ACL has not refused the queue's keys so far.
    pub(crate) fn allowed(&self) -> bool {
        !self.refused.load(Ordering::Relaxed)
    }

    /// The ACL refused the queue's keys to a release: the releases leave
    /// them out from now on, and the log says so once.
    pub(crate) fn refuse(&self, error: &BackendError) {
        if !self.refused.swap(true, Ordering::Relaxed) {
            tracing::warn!(error = %lock_core::ErrorChain(error), "the ACL refuses the fair queue's keys; releases free the key without granting it to a queued waiter (add the queue's key patterns to the user: see lock-redis's README)");
        }
    }
}

/// The log, once, of grants whose channel the ACL refused to the
/// releasing user \[F4, F6\]: the release script then published the
/// grant on the release channel, as before the grant channels, and
/// answered 2 for 1.
#[derive(Debug, Default)]
pub(crate) struct GrantChannelRights {
    refused: AtomicBool,
}

impl GrantChannelRights {
    /// A release's (or leave's) answer with 2 read as 1, logged once.
    pub(crate) fn read(&self, answer: i64) -> i64 {
        if answer != 2 {
            return answer;
        }
        if !self.refused.swap(true, Ordering::Relaxed) {
            tracing::warn!("the ACL refuses the grant channels to this user; grants go on the release channel, which wakes every node (add `&<prefix>withlock:granted:*` to the user: see lock-redis's README)");
        }
        1
    }
}

//! A backend wrapper of the worker that records every release try of the
//! locks its callbacks hold, and whether the lock context already said lost
//! when the first was sent: what the `lost_after_release` check reads
//! \[O6\]. Every other step is forwarded untouched.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use lock_core::{BackendError, BackendErrorKind, Lease, LockBackend, LockContext, ReleaseOutcome};

use crate::event::{now_us, ReleaseAnswer, ReleaseTrace};

/// The locks being watched, by key and fencing token (unique per key).
#[derive(Debug, Default)]
pub struct Traces {
    map: Mutex<HashMap<(String, u64), Watched>>,
}

struct Watched {
    ctx: LockContext,
    trace: Option<ReleaseTrace>,
}

impl std::fmt::Debug for Watched {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Watched")
            .field("trace", &self.trace)
            .finish_non_exhaustive()
    }
}

impl Traces {
    fn lock(&self) -> MutexGuard<'_, HashMap<(String, u64), Watched>> {
        self.map.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Starts recording the releases of the lock of `ctx` (called by the
    /// callback at its first instant).
    pub fn watch(&self, ctx: &LockContext) {
        self.lock().insert(
            (ctx.key().to_owned(), ctx.fencing_token()),
            Watched {
                ctx: ctx.clone(),
                trace: None,
            },
        );
    }

    /// Stops recording the lock of `key` with `token` and gives what was
    /// recorded; tries after this (a release sent again in the background)
    /// are not.
    pub fn take(&self, key: &str, token: u64) -> Option<ReleaseTrace> {
        self.lock()
            .remove(&(key.to_owned(), token))
            .and_then(|w| w.trace)
    }

    /// A try of `lease` is about to be sent.
    fn sent(&self, lease: &Lease) {
        let mut map = self.lock();
        let key = (lease.key().to_owned(), lease.fencing_token());
        if let Some(w) = map.get_mut(&key) {
            if w.trace.is_none() {
                w.trace = Some(ReleaseTrace {
                    t_sent: now_us(),
                    lost_before: w.ctx.is_lost(),
                    answers: Vec::new(),
                    last_error: None,
                });
            }
        }
    }

    /// The answer to the try of `lease` just sent.
    fn answered(&self, lease: &Lease, answer: &Result<ReleaseOutcome, BackendError>) {
        let mut map = self.lock();
        let key = (lease.key().to_owned(), lease.fencing_token());
        let Some(trace) = map.get_mut(&key).and_then(|w| w.trace.as_mut()) else {
            return;
        };
        trace.answers.push(match answer {
            Ok(ReleaseOutcome::Released) => ReleaseAnswer::Released,
            Ok(_) => ReleaseAnswer::NotHeld,
            Err(e) if e.kind() == BackendErrorKind::Unavailable => ReleaseAnswer::ErrorNotSent,
            Err(_) => ReleaseAnswer::Error,
        });
        if let Err(error) = answer {
            trace.last_error = Some(error.to_string());
        }
    }
}

/// `backend` with the release tries of watched locks recorded in `traces`.
#[derive(Debug)]
pub struct Traced<B> {
    backend: B,
    traces: Arc<Traces>,
}

impl<B> Traced<B> {
    /// Wraps `backend`.
    pub fn new(backend: B, traces: Arc<Traces>) -> Self {
        Self { backend, traces }
    }
}

lock_core::forward_lock_backend!(impl<B: LockBackend> Traced<B> => backend {
    async fn release(&self, lease: &Lease) -> Result<ReleaseOutcome, BackendError> {
        self.traces.sent(lease);
        let answer = self.backend.release(lease).await;
        self.traces.answered(lease, &answer);
        answer
    }
});

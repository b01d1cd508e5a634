//! A backend wrapper of the worker that records every release try of the
//! locks its callbacks hold, and whether the lock context already said lost
//! when the first was sent: what the `lost_after_release` check reads
//! \[O6\]; and each call's queued attempts, by owner token, which is its
//! place in the store's fair queue, with the releases sent under that
//! token: what the `queue_order` check reads \[F1\]. Every other step is
//! forwarded untouched.

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use lock_core::{
    AcquireOutcome, BackendError, BackendErrorKind, Lease, LockBackend, LockContext, OwnerToken,
    QueueTerms, ReleaseOutcome,
};

use crate::event::{now_us, QueuedPlace, ReleaseAnswer, ReleaseTrace};

/// The places of one call, shared by its task and the releases sent under
/// their owner tokens.
type Places = Arc<Mutex<Vec<QueuedPlace>>>;

/// The locks being watched, by key and fencing token (unique per key), and
/// the places of the calls under way, by owner token.
#[derive(Debug, Default)]
pub struct Traces {
    map: Mutex<HashMap<(String, u64), Watched>>,
    places: Mutex<HashMap<String, Places>>,
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

tokio::task_local! {
    /// The places of the call being polled.
    static CALL: Places;
}

impl Traces {
    /// Runs `call` (a `with_lock` call) and gives, with its output, its
    /// places in the fair queue. The driver polls a call's attempts in the
    /// call's own task, and lets one call of a node at a time try a key
    /// \[A6\], so these are exactly this call's; an attempt finished in the
    /// background after its call was dropped is not counted.
    pub async fn queued<F: Future>(&self, call: F) -> (F::Output, Vec<QueuedPlace>) {
        let places = Places::default();
        let output = CALL.scope(Arc::clone(&places), call).await;
        let places = std::mem::take(&mut *locked(&places));
        let mut by_owner = locked(&self.places);
        for place in &places {
            by_owner.remove(&place.owner);
        }
        (output, places)
    }

    /// A queued attempt of `owner` is about to be sent by the call being
    /// polled: its place is made or renewed.
    fn queued_attempt(&self, owner: &OwnerToken) -> Option<Places> {
        let call = CALL.try_with(Arc::clone).ok()?;
        let now = now_us();
        let mut places = locked(&call);
        match places.iter_mut().find(|p| p.owner == owner.as_str()) {
            Some(place) => place.last_sent = now,
            None => {
                places.push(QueuedPlace {
                    owner: owner.as_str().to_owned(),
                    first_sent: now,
                    last_sent: now,
                    ..QueuedPlace::default()
                });
                locked(&self.places).insert(owner.as_str().to_owned(), Arc::clone(&call));
            }
        }
        drop(places);
        Some(call)
    }

    /// A release under `lease`'s owner token is about to be sent.
    fn releasing(&self, lease: &Lease) {
        if lease.fencing_token() == 0 {
            return; // a clean-up's, of a failed attempt: no grant given up
        }
        let Some(call) = locked(&self.places).get(lease.owner().as_str()).cloned() else {
            return;
        };
        let now = now_us();
        let mut places = locked(&call);
        if let Some(place) = places
            .iter_mut()
            .find(|p| p.owner == lease.owner().as_str())
        {
            place.released_at.get_or_insert(now);
        }
    }
}

/// The answer to a queued attempt of `owner` recorded in its call's place.
fn answered(call: &Places, owner: &OwnerToken, answer: &Result<AcquireOutcome, BackendError>) {
    let now = now_us();
    let mut places = locked(call);
    let Some(place) = places.iter_mut().find(|p| p.owner == owner.as_str()) else {
        return;
    };
    match answer {
        Ok(AcquireOutcome::Acquired { .. }) => place.acquired_at = Some(now),
        Err(error) if error.may_have_reached_store() => place.failed_at.push(now),
        _ => {}
    }
}

fn locked<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// `backend` with the release tries of watched locks recorded in `traces`,
/// and each queued attempt and release under its owner token recorded for
/// the call that queued ([`Traces::queued`]).
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
        self.traces.releasing(lease);
        self.traces.sent(lease);
        let answer = self.backend.release(lease).await;
        self.traces.answered(lease, &answer);
        answer
    }

    async fn try_acquire_queued(
        &self,
        key: &str,
        owner: &OwnerToken,
        ttl: Duration,
        terms: QueueTerms,
    ) -> Result<AcquireOutcome, BackendError> {
        let call = self.traces.queued_attempt(owner);
        let answer = self.backend.try_acquire_queued(key, owner, ttl, terms).await;
        if let Some(call) = call {
            answered(&call, owner, &answer);
        }
        answer
    }
});

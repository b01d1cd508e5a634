//! The background task of a release subscription, as the single-node (and
//! Sentinel) and the Cluster backends both run one: started by the first
//! watch, ended when the backend is dropped, reconnecting with backoff and
//! checking its connections with `PING`s; and the hand-off of a released
//! key to the waiters.
//!
//! What the tasks do in between differs, and stays with each: the single
//! node keeps one `SUBSCRIBE` connection to one channel
//! ([`crate::subscription`]); the Cluster keeps one RESP3 connection per
//! master and subscribes, per slot a waiter needs, that slot's shard
//! channel where it is served now ([`crate::cluster_subscription`]).

use std::future::Future;
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use lock_core::{Grant, ReleaseHub};
use tokio::sync::oneshot;
use tokio::time::{Interval, MissedTickBehavior};

use crate::plumbing::driver::Driver;

/// The first wait before a failed connection is made again; it doubles
/// after each failure, up to `max_reconnect_delay`.
pub(crate) const FIRST_RECONNECT_DELAY: Duration = Duration::from_millis(50);

/// A task that the first call of [`start`](Self::start) spawns, given
/// `I`, and that ends when this is dropped (with the backend).
pub(crate) struct OnFirstUse<I> {
    start: Mutex<Option<(oneshot::Receiver<()>, I)>>,
    /// The task ends when this sender is dropped.
    _alive: oneshot::Sender<()>,
}

impl<I> OnFirstUse<I> {
    pub(crate) fn new(input: I) -> Self {
        let (alive, dropped) = oneshot::channel();
        Self {
            start: Mutex::new(Some((dropped, input))),
            _alive: alive,
        }
    }

    /// The first time only: `make(input)` gives a task and what to do when
    /// it ends; the task is spawned on `driver`'s runtime (so that it and
    /// the connections it makes never depend on the caller's), runs until
    /// it returns or this is dropped, and then the second runs.
    pub(crate) fn start<F, E>(&self, driver: &Driver, make: impl FnOnce(I) -> (F, E))
    where
        F: Future<Output = ()> + Send + 'static,
        E: FnOnce() + Send + 'static,
    {
        let start = self
            .start
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some((dropped, input)) = start {
            let (task, ended) = make(input);
            driver.spawn(async move {
                tokio::select! {
                    _ = dropped => {}
                    () = task => {}
                }
                ended();
            });
        }
    }
}

/// A timer that ticks every `every`, a tick that came late delaying the
/// next ones rather than bunching them.
pub(crate) fn ticker(every: Duration) -> Interval {
    let mut ticks = tokio::time::interval(every);
    ticks.set_missed_tick_behavior(MissedTickBehavior::Delay);
    ticks
}

/// Hands a release message (a released Redis key) to the waiters of the
/// key without `prefix`; a key of another prefix, or not UTF-8, is nobody's.
pub(crate) fn deliver(hub: &ReleaseHub, prefix: &str, payload: &[u8]) {
    match std::str::from_utf8(payload) {
        Ok(message) => match message.strip_prefix(GRANT) {
            Some(grant) => match parse_grant(grant) {
                Some((token, claim, owner, key)) => {
                    if let Some(key) = key.strip_prefix(prefix) {
                        hub.grant(key, Grant::new(owner, token, claim));
                    }
                }
                None => tracing::trace!("grant message not understood; ignored"),
            },
            None => {
                if let Some(key) = message.strip_prefix(prefix) {
                    hub.notify(key);
                }
            }
        },
        Err(_) => tracing::trace!("release message is not UTF-8; ignored"),
    }
}

/// How a grant's message begins (see `lua/queue.lua`): no lock key starts
/// with NUL, which the driver refuses in keys.
const GRANT: &str = "\0grant ";

/// `<fencing token> <claim ms> <owner length>\n<owner><lock key>`.
fn parse_grant(message: &str) -> Option<(u64, std::time::Duration, &str, &str)> {
    let (head, rest) = message.split_once('\n')?;
    let mut fields = head.split(' ');
    let token = fields.next()?.parse().ok()?;
    let claim = std::time::Duration::from_millis(fields.next()?.parse().ok()?);
    let owner_len: usize = fields.next()?.parse().ok()?;
    if fields.next().is_some() || !rest.is_char_boundary(owner_len.min(rest.len())) {
        return None;
    }
    let (owner, key) = (rest.get(..owner_len)?, rest.get(owner_len..)?);
    Some((token, claim, owner, key))
}

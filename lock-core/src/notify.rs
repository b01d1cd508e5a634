//! Release notifications: how a waiter learns that a key may have become free.

use hashbrown::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;

/// A grant of the fair queue \[F1\]: a release gave the key to the
/// queue's head, `owner`, with a new fencing token, for the claim
/// deadline. The grantee starts on it without a further round trip; its
/// first extension takes the grant up.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Grant {
    /// The owner token the key was granted to.
    pub owner: Arc<str>,
    /// The grant's fencing token.
    pub fencing_token: u64,
    /// How long the grant lasts from the release, unless taken up.
    pub claim: Duration,
    /// When this process heard of it.
    pub received_at: Instant,
}

impl Grant {
    /// A grant heard of now.
    pub fn new(owner: &str, fencing_token: u64, claim: Duration) -> Self {
        Self {
            owner: owner.into(),
            fencing_token,
            claim,
            received_at: Instant::now(),
        }
    }
}

/// What a key's watchers are sent: a count of wake-ups, and the grant that
/// caused the last one, if a grant did. (Nothing but a reconnect can wake
/// a key between a grant and its grantee's start; the grantee's queued
/// attempt then takes the grant up.)
#[derive(Clone, Debug, Default)]
struct Wake {
    count: u64,
    grant: Option<Grant>,
}

/// Wakes its holder when a key may have become free.
///
/// A backend with release notifications makes these with a [`ReleaseHub`];
/// one without them returns [`ReleaseWatch::never`]. A wake-up is a hint,
/// never a promise: the driver answers it with one more acquisition attempt.
pub struct ReleaseWatch {
    inner: Watch,
}

enum Watch {
    Never,
    Hub(HubWatch),
    Either(Box<ReleaseWatch>, Box<ReleaseWatch>),
}

struct HubWatch {
    rx: Option<watch::Receiver<Wake>>,
    key: Arc<str>,
    hub: Arc<HubShared>,
}

impl ReleaseWatch {
    /// A watch that never wakes, for backends without notifications.
    pub fn never() -> Self {
        Self {
            inner: Watch::Never,
        }
    }

    /// A watch that wakes when either of two watches does, for a backend
    /// wrapper that adds notifications of its own.
    pub fn either(a: ReleaseWatch, b: ReleaseWatch) -> Self {
        Self {
            inner: Watch::Either(Box::new(a), Box::new(b)),
        }
    }

    /// Resolves at the next notification for the key after the watch was
    /// made or last resolved.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: a notification that arrives while no call is waiting is
    /// kept for the next call.
    pub async fn released(&mut self) {
        self.wake().await;
    }

    /// The grant of the fair queue that caused the last wake-up, if a
    /// grant did: the driver's queued waiter looks for its own owner token
    /// in it.
    pub fn grant(&self) -> Option<Grant> {
        match &self.inner {
            Watch::Hub(HubWatch { rx: Some(rx), .. }) => rx.borrow().grant.clone(),
            Watch::Either(a, b) => a.grant().or_else(|| b.grant()),
            Watch::Hub(_) | Watch::Never => None,
        }
    }

    async fn wake(&mut self) {
        match &mut self.inner {
            Watch::Hub(HubWatch { rx: Some(rx), .. }) => {
                if rx.changed().await.is_err() {
                    // The hub is gone: from now on only the retry timer wakes.
                    std::future::pending::<()>().await;
                }
            }
            Watch::Either(a, b) => {
                let (a, b) = (Box::pin(a.released()), Box::pin(b.released()));
                futures_util::future::select(a, b).await;
            }
            Watch::Hub(_) | Watch::Never => std::future::pending().await,
        }
    }
}

impl fmt::Debug for ReleaseWatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.inner {
            Watch::Hub(w) => f.debug_struct("ReleaseWatch").field("key", &w.key).finish(),
            Watch::Either(a, b) => f
                .debug_tuple("ReleaseWatch::either")
                .field(a)
                .field(b)
                .finish(),
            Watch::Never => f.write_str("ReleaseWatch(never)"),
        }
    }
}

impl Drop for HubWatch {
    fn drop(&mut self) {
        let mut map = self.hub.lock();
        drop(self.rx.take());
        if map
            .get(&self.key)
            .is_some_and(|tx| tx.receiver_count() == 0)
        {
            map.remove(&self.key);
            self.hub.watched.store(map.len(), Ordering::SeqCst);
            // The room of a crowd of watched keys goes back once they are
            // gone, at most once per halving.
            let len = map.len();
            if map.capacity() > MIN_ROOM && len < map.capacity() / 4 {
                map.shrink_to(2 * len);
            }
        }
    }
}

/// The room a hub's map keeps however few keys are watched.
const MIN_ROOM: usize = 64;

#[derive(Default)]
struct HubShared {
    keys: Mutex<HashMap<Arc<str>, watch::Sender<Wake>>>,
    /// How many keys are watched: the map's length, stored under its lock
    /// at every change, so that a release with nobody watching takes no
    /// lock. A watch made before a release is counted before it: the
    /// caller watches, then tries the key again, which comes after its
    /// count; if that try found the key held, the release came later and
    /// sees the count.
    watched: AtomicUsize,
}

impl HubShared {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Arc<str>, watch::Sender<Wake>>> {
        self.keys.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The per-key fan-out a backend needs for release notifications: the
/// backend's one subscription calls [`notify`](Self::notify) for each release
/// it hears of, and every [`ReleaseWatch`] on that key wakes.
///
/// Keys nobody watches cost nothing: an entry lives while a watch on it does.
#[derive(Clone, Default)]
pub struct ReleaseHub {
    shared: Arc<HubShared>,
}

impl ReleaseHub {
    /// An empty hub.
    pub fn new() -> Self {
        Self::default()
    }

    /// A watch on `key`; notifications from now on wake it.
    pub fn watch(&self, key: &str) -> ReleaseWatch {
        let mut map = self.shared.lock();
        let rx = match map.get(key) {
            Some(tx) => tx.subscribe(),
            None => {
                let (tx, rx) = watch::channel(Wake::default());
                map.insert(key.into(), tx);
                self.shared.watched.store(map.len(), Ordering::SeqCst);
                rx
            }
        };
        ReleaseWatch {
            inner: Watch::Hub(HubWatch {
                rx: Some(rx),
                key: key.into(),
                hub: Arc::clone(&self.shared),
            }),
        }
    }

    /// Wakes every watch on `key`.
    pub fn notify(&self, key: &str) {
        // Most releases have nobody waiting: no lock and no hashing then.
        if self.shared.watched.load(Ordering::SeqCst) == 0 {
            return;
        }
        if let Some(tx) = self.shared.lock().get(key) {
            tx.send_modify(|wake| {
                wake.count = wake.count.wrapping_add(1);
                wake.grant = None;
            });
        }
    }

    /// Wakes every watch on `key` with a grant of the fair queue \[F1\]:
    /// the watch of the grantee's waiter takes the lock from it, the others
    /// go on waiting without an attempt.
    pub fn grant(&self, key: &str, grant: Grant) {
        if self.shared.watched.load(Ordering::SeqCst) == 0 {
            return;
        }
        if let Some(tx) = self.shared.lock().get(key) {
            tx.send_modify(|wake| {
                wake.count = wake.count.wrapping_add(1);
                wake.grant = Some(grant);
            });
        }
    }

    /// Wakes every watch on every key, for a subscription that reconnected
    /// and may have missed notifications.
    pub fn notify_all(&self) {
        for tx in self.shared.lock().values() {
            tx.send_modify(|wake| {
                wake.count = wake.count.wrapping_add(1);
                wake.grant = None;
            });
        }
    }

    /// Whether anybody watches `key`.
    pub fn is_watched(&self, key: &str) -> bool {
        self.shared.lock().contains_key(key)
    }

    /// How many keys are watched.
    pub fn watched_keys(&self) -> usize {
        self.shared.lock().len()
    }

    /// Test-only: each per-key structure of the hub and its size \[T2\]:
    /// the watched keys (an entry lives exactly as long as a watch on its
    /// key) and the room of their map (given back once it is less than a
    /// quarter full, down to 64).
    #[doc(hidden)]
    pub fn state_counts(&self) -> Vec<(&'static str, usize)> {
        let map = self.shared.lock();
        vec![
            ("hub: watched keys", map.len()),
            ("hub: map capacity", map.capacity()),
        ]
    }
}

impl fmt::Debug for ReleaseHub {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReleaseHub")
            .field("watched_keys", &self.watched_keys())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn a_notification_wakes_every_watch_of_its_key_only() {
        let hub = ReleaseHub::new();
        let mut a = hub.watch("k");
        let mut b = hub.watch("k");
        let mut other = hub.watch("other");
        hub.notify("k");
        tokio::time::timeout(Duration::from_secs(1), a.released())
            .await
            .unwrap();
        tokio::time::timeout(Duration::from_secs(1), b.released())
            .await
            .unwrap();
        assert!(
            tokio::time::timeout(Duration::from_millis(20), other.released())
                .await
                .is_err()
        );
        hub.notify_all();
        tokio::time::timeout(Duration::from_secs(1), other.released())
            .await
            .unwrap();
    }

    #[tokio::test]
    async fn entries_live_as_long_as_their_watches() {
        let hub = ReleaseHub::new();
        let a = hub.watch("k");
        let b = hub.watch("k");
        assert_eq!(hub.watched_keys(), 1);
        drop(a);
        assert!(hub.is_watched("k"));
        drop(b);
        assert_eq!(hub.watched_keys(), 0);
        hub.notify("k");
        // Watched again after nobody watched: notified again.
        let mut c = hub.watch("k");
        hub.notify("k");
        tokio::time::timeout(Duration::from_secs(1), c.released())
            .await
            .unwrap();
    }
}

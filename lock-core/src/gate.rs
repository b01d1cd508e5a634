//! One wait list per key inside a locker, so that the tasks of one process
//! waiting for the same key do not each poll the backend \[A6\].
//!
//! Whoever holds a key's pass is the one task of this locker that tries the
//! backend for that key, then holds the lock. The others wait in arrival
//! order; dropping the pass hands it to the next one.

use std::collections::hash_map::Entry;
use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasher, BuildHasherDefault, Hash, Hasher};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use tokio::sync::oneshot;

type Queues = HashMap<GateKey, VecDeque<oneshot::Sender<()>>, BuildHasherDefault<Hashed>>;

/// A key with its hash, computed once per call and reused by every look-up
/// of the call. The hash is foldhash's, seeded at random per locker: about
/// a sixth of SipHash's cost on a short key, and like it unpredictable from
/// outside the process (foldhash calls itself "minimally DoS-resistant";
/// the map holds only the keys this locker holds or waits for now).
#[derive(Clone)]
pub(crate) struct GateKey {
    hash: u64,
    key: Arc<str>,
}

impl PartialEq for GateKey {
    fn eq(&self, other: &Self) -> bool {
        self.hash == other.hash && self.key == other.key
    }
}

impl Eq for GateKey {}

impl Hash for GateKey {
    fn hash<H: Hasher>(&self, state: &mut H) {
        state.write_u64(self.hash);
    }
}

/// Passes on the hash a [`GateKey`] carries.
#[derive(Default)]
struct Hashed(u64);

impl Hasher for Hashed {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }

    fn write_u64(&mut self, hash: u64) {
        self.0 = hash;
    }
}

#[derive(Default)]
pub(crate) struct Gates {
    queues: Mutex<Queues>,
    hasher: hashbrown::DefaultHashBuilder,
}

impl Gates {
    fn lock(&self) -> MutexGuard<'_, Queues> {
        self.queues.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// `key`, hashed for this locker's wait lists.
    pub(crate) fn key(&self, key: &Arc<str>) -> GateKey {
        GateKey {
            hash: self.hasher.hash_one(&**key),
            key: Arc::clone(key),
        }
    }

    /// Takes the pass of `key` at once, or queues for it.
    pub(crate) fn enter(self: &Arc<Self>, key: GateKey) -> Result<GatePass, GateWait> {
        let mut queues = self.lock();
        match queues.entry(key) {
            Entry::Vacant(place) => {
                let key = place.key().clone();
                place.insert(VecDeque::new());
                Ok(GatePass {
                    gates: Arc::clone(self),
                    key,
                })
            }
            Entry::Occupied(mut queue) => {
                let (tx, rx) = oneshot::channel();
                queue.get_mut().push_back(tx);
                Err(GateWait {
                    rx: Some(rx),
                    gates: Arc::clone(self),
                    key: queue.key().clone(),
                })
            }
        }
    }

    fn hand_over(queues: &mut Queues, key: &GateKey) {
        // Taken out and put back only when somebody waits: the common case,
        // nobody, costs one look-up.
        let Some(mut queue) = queues.remove(key) else {
            return;
        };
        while let Some(next) = queue.pop_front() {
            if next.send(()).is_ok() {
                queues.insert(key.clone(), queue);
                return;
            }
        }
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.lock().len()
    }
}

/// The right to try the backend for one key and to hold its lock.
pub(crate) struct GatePass {
    gates: Arc<Gates>,
    key: GateKey,
}

impl Drop for GatePass {
    fn drop(&mut self) {
        Gates::hand_over(&mut self.gates.lock(), &self.key);
    }
}

/// A place in a key's wait list.
pub(crate) struct GateWait {
    rx: Option<oneshot::Receiver<()>>,
    gates: Arc<Gates>,
    key: GateKey,
}

impl GateWait {
    /// Resolves when the pass reaches this place.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: the place is kept until the `GateWait` is dropped, and a
    /// pass that reached a dropped place goes on to the next one.
    pub(crate) async fn wait(&mut self) -> GatePass {
        if let Some(rx) = self.rx.as_mut() {
            // An error means the sender was dropped without sending, which
            // `hand_over` never does; either way the place is ours now.
            let _ = rx.await;
            self.rx = None;
        }
        GatePass {
            gates: Arc::clone(&self.gates),
            key: self.key.clone(),
        }
    }
}

impl Drop for GateWait {
    fn drop(&mut self) {
        if let Some(mut rx) = self.rx.take() {
            // Under the queue lock no pass can arrive between the check and
            // the drop of the receiver.
            let mut queues = self.gates.lock();
            if rx.try_recv().is_ok() {
                Gates::hand_over(&mut queues, &self.key);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn passes_go_in_arrival_order_and_skip_dropped_places() {
        let gates = Arc::new(Gates::default());
        let key = gates.key(&"k".into());
        let first = gates.enter(key.clone()).ok().unwrap();
        let mut second = gates.enter(key.clone()).err().unwrap();
        let third = gates.enter(key.clone()).err().unwrap();
        let mut fourth = gates.enter(key).err().unwrap();
        drop(third);
        drop(first);
        let pass2 = tokio::time::timeout(Duration::from_secs(1), second.wait())
            .await
            .unwrap();
        assert!(
            tokio::time::timeout(Duration::from_millis(20), fourth.wait())
                .await
                .is_err()
        );
        drop(pass2);
        let pass4 = tokio::time::timeout(Duration::from_secs(1), fourth.wait())
            .await
            .unwrap();
        drop(pass4);
        drop(second);
        drop(fourth);
        assert_eq!(gates.len(), 0);
    }

    #[tokio::test]
    async fn a_pass_that_reached_a_dropped_waiter_moves_on() {
        let gates = Arc::new(Gates::default());
        let key = gates.key(&"k".into());
        let first = gates.enter(key.clone()).ok().unwrap();
        let second = gates.enter(key.clone()).err().unwrap();
        let mut third = gates.enter(key).err().unwrap();
        drop(first); // the pass is now in `second`'s channel, unread
        drop(second);
        tokio::time::timeout(Duration::from_secs(1), third.wait())
            .await
            .unwrap();
    }
}

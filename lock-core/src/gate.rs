//! One wait list per key inside a locker, so that the tasks of one process
//! waiting for the same key do not each poll the backend \[A6\].
//!
//! Whoever holds a key's pass is the one task of this locker that tries the
//! backend for that key, then holds the lock. The others wait in arrival
//! order; dropping the pass hands it to the next one.

use std::collections::VecDeque;
use std::hash::BuildHasher;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use hashbrown::HashTable;
use tokio::sync::oneshot;

use crate::held::HeldLock;

/// How many gates with nobody at them are kept, for the next call on their
/// key: it then allocates nothing, neither the gate nor the call's shared
/// key, which it takes from the gate. Beyond them a gate lives while a
/// call of this locker tries, waits for or holds its key \[T2\]; the table
/// gives back its room once it is less than a quarter full.
pub(crate) const KEPT_IDLE: usize = 1024;

/// One key's gate.
struct Gate {
    key: Arc<str>,
    /// foldhash's, seeded at random per locker: about a sixth of SipHash's
    /// cost on a short key, and like it unpredictable from outside the
    /// process (foldhash calls itself "minimally DoS-resistant"; the table
    /// holds only keys this locker holds, waits for, or used last).
    hash: u64,
    /// A pass is out: its holder tries the backend or holds the lock.
    busy: bool,
    /// Who waits for the pass, in arrival order.
    waiters: VecDeque<oneshot::Sender<()>>,
    /// The record of the last lock of this key, which nobody holds any
    /// more, for the next one to take without an allocation (with its
    /// owner token).
    spare: Option<Arc<HeldLock>>,
    /// The last call on the key found it held elsewhere: the next one
    /// waits in the fair queue from its first attempt \[F1\].
    contended: bool,
}

#[derive(Default)]
struct Table {
    gates: HashTable<Gate>,
    /// Gates not busy, kept for reuse.
    idle: usize,
}

impl Table {
    /// Passes the gate of `key` to its next waiter; with none left, the
    /// gate goes idle, or away beyond [`KEPT_IDLE`] idle ones.
    fn hand_over(&mut self, key: &GateKey, spare: Option<Arc<HeldLock>>, contended: Option<bool>) {
        let Ok(mut entry) = self.gates.find_entry(key.hash, |g| key.is(&g.key)) else {
            return;
        };
        let gate = entry.get_mut();
        if let Some(contended) = contended {
            gate.contended = contended;
        }
        if spare.is_some() {
            gate.spare = spare;
        }
        while let Some(next) = gate.waiters.pop_front() {
            if next.send(()).is_ok() {
                return;
            }
        }
        if self.idle < KEPT_IDLE {
            gate.busy = false;
            if gate.waiters.capacity() > 0 {
                // An idle gate keeps no buffer of a crowd it once had.
                gate.waiters = VecDeque::new();
            }
            self.idle += 1;
        } else {
            entry.remove();
            // After a crowd of keys, the room they took goes back, at most
            // once per halving: rehashing the rest costs no more than the
            // removals that led to it.
            let (len, room) = (self.gates.len(), self.gates.capacity());
            if room > 4 * KEPT_IDLE && len < room / 4 {
                self.gates.shrink_to(2 * len, |g| g.hash);
            }
        }
    }
}

/// A gate's key as a pass or a place in line knows it: its hash and its
/// shared string.
#[derive(Clone)]
pub(crate) struct GateKey {
    hash: u64,
    key: Arc<str>,
}

impl GateKey {
    fn of(hash: u64, key: &Arc<str>) -> Self {
        Self {
            hash,
            key: Arc::clone(key),
        }
    }

    fn is(&self, key: &str) -> bool {
        *self.key == *key
    }
}

#[derive(Default)]
pub(crate) struct Gates {
    table: Mutex<Table>,
    hasher: hashbrown::DefaultHashBuilder,
}

impl Gates {
    fn lock(&self) -> MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Takes the pass of `key` at once, or queues for it; with the key as
    /// the gate's shared string, for the call to use.
    #[allow(clippy::type_complexity)]
    pub(crate) fn enter(&self, key: &str) -> (Arc<str>, Result<GatePass<'_>, GateWait<'_>>) {
        let hash = self.hasher.hash_one(key);
        let mut table = self.lock();
        let Table { gates, idle } = &mut *table;
        let key = match gates.find_mut(hash, |g| &*g.key == key) {
            Some(gate) if gate.busy => {
                let (tx, rx) = oneshot::channel();
                gate.waiters.push_back(tx);
                let place = GateWait {
                    rx: Some(rx),
                    gates: self,
                    key: GateKey::of(hash, &gate.key),
                };
                return (Arc::clone(&gate.key), Err(place));
            }
            Some(gate) => {
                gate.busy = true;
                *idle -= 1;
                let pass = GatePass {
                    gates: self,
                    key: GateKey::of(hash, &gate.key),
                    spare: gate.spare.take(),
                    contended: gate.contended,
                    found: None,
                };
                return (Arc::clone(&gate.key), Ok(pass));
            }
            None => {
                let key: Arc<str> = key.into();
                let gate = Gate {
                    key: Arc::clone(&key),
                    hash,
                    busy: true,
                    waiters: VecDeque::new(),
                    spare: None,
                    contended: false,
                };
                gates.insert_unique(hash, gate, |g| g.hash);
                key
            }
        };
        let pass = GatePass {
            gates: self,
            key: GateKey::of(hash, &key),
            spare: None,
            contended: false,
            found: None,
        };
        (key, Ok(pass))
    }

    /// The gates, the idle ones among them, and the room of their table
    /// \[T2\].
    pub(crate) fn counts(&self) -> [(&'static str, usize); 3] {
        let table = self.lock();
        [
            ("gates", table.gates.len()),
            ("gates: idle", table.idle),
            ("gates: table capacity", table.gates.capacity()),
        ]
    }

    #[cfg(test)]
    fn len(&self) -> (usize, usize) {
        let table = self.lock();
        (table.gates.len(), table.idle)
    }
}

/// The right to try the backend for one key and to hold its lock.
pub(crate) struct GatePass<'a> {
    gates: &'a Gates,
    key: GateKey,
    /// The gate's spare record when the pass was taken, or the one to give
    /// it back when the pass is dropped.
    spare: Option<Arc<HeldLock>>,
    /// Whether the last call on the key found it held elsewhere, when the
    /// pass was taken.
    contended: bool,
    /// What this call found, for the gate when the pass is dropped.
    found: Option<bool>,
}

impl GatePass<'_> {
    /// Whether the key's last call found it held elsewhere (or, for a pass
    /// handed on in this process, whether the call before did): this call
    /// then queues from its first attempt \[F1\].
    pub(crate) fn contended(&self) -> bool {
        self.contended
    }

    /// Records whether this call found the key held elsewhere.
    pub(crate) fn found_contended(&mut self, contended: bool) {
        self.found = Some(contended);
    }

    /// The record of the key's last lock, if the gate kept one: nobody
    /// else holds it.
    pub(crate) fn take_spare(&mut self) -> Option<Arc<HeldLock>> {
        self.spare.take()
    }

    /// Gives `held` to the gate as its spare record when the pass is
    /// dropped, if nobody else holds it by then (a clone kept by a
    /// callback's context, say, keeps it from being used again).
    pub(crate) fn keep_spare(&mut self, held: Arc<HeldLock>) {
        if Arc::strong_count(&held) == 1 && self.key.is(held.lease.key()) {
            self.spare = Some(held);
        }
    }
}

impl Drop for GatePass<'_> {
    fn drop(&mut self) {
        let spare = self.spare.take();
        self.gates.lock().hand_over(&self.key, spare, self.found);
    }
}

/// A place in a key's wait list.
pub(crate) struct GateWait<'a> {
    rx: Option<oneshot::Receiver<()>>,
    gates: &'a Gates,
    key: GateKey,
}

impl<'a> GateWait<'a> {
    /// Resolves when the pass reaches this place.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: the place is kept until the `GateWait` is dropped, and a
    /// pass that reached a dropped place goes on to the next one.
    pub(crate) async fn wait(&mut self) -> GatePass<'a> {
        if let Some(rx) = self.rx.as_mut() {
            // An error means the sender was dropped without sending, which
            // `hand_over` never does; either way the place is ours now.
            let _ = rx.await;
            self.rx = None;
        }
        let contended = self
            .gates
            .lock()
            .gates
            .find(self.key.hash, |g| self.key.is(&g.key))
            .is_some_and(|g| g.contended);
        GatePass {
            gates: self.gates,
            key: self.key.clone(),
            spare: None,
            contended,
            found: None,
        }
    }
}

impl Drop for GateWait<'_> {
    fn drop(&mut self) {
        if let Some(mut rx) = self.rx.take() {
            // Under the table's lock no pass can arrive between the check
            // and the drop of the receiver.
            let mut table = self.gates.lock();
            if rx.try_recv().is_ok() {
                table.hand_over(&self.key, None, None);
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
        let gates = Gates::default();
        let first = gates.enter("k").1.ok().unwrap();
        let mut second = gates.enter("k").1.err().unwrap();
        let third = gates.enter("k").1.err().unwrap();
        let mut fourth = gates.enter("k").1.err().unwrap();
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
        assert_eq!(gates.len(), (1, 1), "the gate is kept, idle");
    }

    #[tokio::test]
    async fn a_pass_that_reached_a_dropped_waiter_moves_on() {
        let gates = Gates::default();
        let first = gates.enter("k").1.ok().unwrap();
        let second = gates.enter("k").1.err().unwrap();
        let mut third = gates.enter("k").1.err().unwrap();
        drop(first); // the pass is now in `second`'s channel, unread
        drop(second);
        tokio::time::timeout(Duration::from_secs(1), third.wait())
            .await
            .unwrap();
    }

    #[test]
    fn an_idle_gate_is_reused_with_its_key_and_kept_idle_ones_are_bounded() {
        let gates = Gates::default();
        let (key, first) = gates.enter("k");
        drop(first);
        let (again_key, again) = gates.enter("k");
        assert!(Arc::ptr_eq(&again_key, &key), "the gate's key is shared");
        let again = again.ok().unwrap();
        assert_eq!(gates.len(), (1, 0));
        drop(again);

        for i in 0..KEPT_IDLE + 10 {
            drop(gates.enter(&format!("k{i}")).1.ok().unwrap());
        }
        assert_eq!(gates.len(), (KEPT_IDLE, KEPT_IDLE));
        // A busy gate is never dropped while idle ones are bounded.
        let held = gates.enter("k0").1.ok().unwrap();
        let waiting = gates.enter("k0").1.err().unwrap();
        assert_eq!(gates.len(), (KEPT_IDLE, KEPT_IDLE - 1));
        drop(waiting);
        drop(held);
        assert_eq!(gates.len(), (KEPT_IDLE, KEPT_IDLE));
    }
}

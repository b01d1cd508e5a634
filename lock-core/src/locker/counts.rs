//! What a locker keeps per key and per held lock, counted for the tests of
//! \[T2\].

use super::Locker;

impl Locker {
    /// Test-only: each per-key or per-lock structure of this locker and
    /// its current size \[T2\].
    ///
    /// | name | what | bound once nothing is held or waited for |
    /// |---|---|---|
    /// | `gates` | one per key a call of this locker tries, waits for or holds, plus idle ones | 1,024 (the idle ones kept for reuse) |
    /// | `gates: idle` | gates kept for the next call on their key | 1,024 |
    /// | `gates: table capacity` | the room of the gates' table | given back below a quarter full, to twice the gates left: under 8,192 |
    /// | `registry: held locks` | locks held | 0 |
    /// | `registry: slab slots` | slots of the held locks' slab | the most locks held at once (reused, kept) |
    /// | `registry: vacant slots` | free slots | as the slab |
    /// | `registry: attempts in flight` | acquisition attempts not yet answered | 0 |
    /// | `extender: scheduled` | extensions scheduled | 0 |
    /// | `extender: unscheduled` | locks taken, not yet scheduled (ids of locks gone are dropped when the extender looks) | 64 |
    /// | `cleanup: keys` | keys a failed attempt may have taken, being freed | 0 one ttl after the last failed attempt |
    /// | `cleanup: map capacity` | the room of that map | given back below a quarter full; 64 |
    #[doc(hidden)]
    pub fn state_counts(&self) -> Vec<(&'static str, usize)> {
        let mut counts = self.inner.gates.counts().to_vec();
        counts.extend(self.inner.registry.counts());
        counts
    }
}

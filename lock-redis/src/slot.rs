//! Redis Cluster hash slots, and the fencing companion key that shares its
//! lock key's slot whatever braces the key contains.
//!
//! Redis Cluster hashes a key to one of 16384 slots with CRC16 (XMODEM) of
//! its *hash tag*: the bytes between the first `{` and the first `}` after
//! it, when there is at least one; otherwise of the whole key. A Lua script
//! may only touch keys of one slot, so the acquisition script, which sets
//! the lock key and increments its counter together, needs the counter in
//! the lock key's slot.

use std::sync::LazyLock;

/// How many hash slots Redis Cluster has.
pub const SLOTS: u16 = 16384;

/// What the fencing companion key's name carries after its hash tag.
pub const FENCE_INFIX: &str = ":withlock-fence:";

/// What the minimum hold's record carries after its hash tag (see
/// [`kept_key`]).
pub const KEPT_INFIX: &str = ":withlock-kept:";

/// CRC16 as Redis Cluster uses it (XMODEM: polynomial 0x1021, initial 0).
pub fn crc16(data: &[u8]) -> u16 {
    let mut crc: u16 = 0;
    for &byte in data {
        crc ^= u16::from(byte) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc
}

/// The hash tag of `key`, if it has one: the non-empty substring between
/// the first `{` and the first `}` after it.
pub fn hash_tag(key: &str) -> Option<&str> {
    let open = key.find('{')?;
    let rest = &key[open + 1..];
    let close = rest.find('}')?;
    (close > 0).then(|| &rest[..close])
}

/// The Redis Cluster hash slot of `key`, as `CLUSTER KEYSLOT` gives it.
pub fn key_slot(key: &str) -> u16 {
    crc16(hash_tag(key).unwrap_or(key).as_bytes()) % SLOTS
}

/// The name of the fencing counter of the Redis key `key`:
/// `{T}:withlock-fence:<key>`, where `T` is
///
/// - the key's hash tag, if it has one;
/// - else the whole key, if it contains no `}`;
/// - else the smallest non-negative integer, written in decimal, whose slot
///   is the key's slot.
///
/// In each case the companion's own hash tag is `T`, so it hashes to the
/// key's slot; and distinct keys give distinct companions.
pub fn fence_key(key: &str) -> String {
    companion(key, FENCE_INFIX)
}

/// The name of the record of the minimum hold \[H7\] of the Redis key
/// `key`: `{T}:withlock-kept:<key>`, with the `T` of [`fence_key`], so in
/// `key`'s hash slot. The hold step writes it, holding the owner token,
/// with the lock's new expiry, in the same script run that sets that
/// expiry; the admin counts it only while it holds the lock's own value.
pub fn kept_key(key: &str) -> String {
    companion(key, KEPT_INFIX)
}

/// The sorted set of `key`'s fair queue \[F1\]: each waiting owner
/// token, scored by its arrival (see `lua/queue.lua`). In `key`'s hash
/// slot, as [`fence_key`] is.
pub fn queue_key(key: &str) -> String {
    companion(key, QUEUE_INFIX)
}

/// The hash of the places of `key`'s fair queue \[F1\]: each waiting
/// owner token and `<alive until ms>:<claim ms>` (see `lua/queue.lua`).
pub fn waiters_key(key: &str) -> String {
    companion(key, WAITERS_INFIX)
}

/// What the name of a lock's fair-queue keys holds between the hash tag
/// and the lock key: the queue's order…
pub const QUEUE_INFIX: &str = ":withlock-queue:";

/// … and its places.
pub const WAITERS_INFIX: &str = ":withlock-waiters:";

/// `{T}<infix><key>`, `T` as [`fence_key`] says.
fn companion(key: &str, infix: &str) -> String {
    let mut out = String::with_capacity(key.len() * 2 + infix.len() + 2);
    out.push('{');
    match hash_tag(key) {
        Some(tag) => out.push_str(tag),
        None if !key.contains('}') => out.push_str(key),
        None => out.push_str(&slot_tag(key_slot(key)).to_string()),
    }
    out.push('}');
    out.push_str(infix);
    out.push_str(key);
    out
}

/// The smallest non-negative integer whose decimal form hashes to `slot`.
pub(crate) fn slot_tag(slot: u16) -> u32 {
    // Built once, on the first key that needs it: about 16384 * 12 CRCs.
    static TABLE: LazyLock<Vec<u32>> = LazyLock::new(|| {
        let mut table = vec![u32::MAX; usize::from(SLOTS)];
        let mut missing = table.len();
        let mut n: u32 = 0;
        while missing > 0 {
            let slot = usize::from(crc16(n.to_string().as_bytes()) % SLOTS);
            if table[slot] == u32::MAX {
                table[slot] = n;
                missing -= 1;
            }
            n += 1;
        }
        table
    });
    TABLE[usize::from(slot % SLOTS)]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc16_matches_the_redis_reference_value() {
        assert_eq!(crc16(b"123456789"), 0x31C3);
    }

    #[test]
    fn slots_follow_the_cluster_spec_examples() {
        // From the Redis Cluster specification's hash tag examples.
        assert_eq!(key_slot("{user1000}.following"), key_slot("user1000"));
        assert_eq!(key_slot("{user1000}.followers"), key_slot("user1000"));
        assert_eq!(key_slot("foo{}{bar}"), crc16(b"foo{}{bar}") % SLOTS);
        assert_eq!(key_slot("foo{{bar}}zap"), key_slot("{bar"));
        assert_eq!(key_slot("foo{bar}{zap}"), key_slot("bar"));
        assert_eq!(hash_tag("{}"), None);
        assert_eq!(hash_tag("}{"), None);
        assert_eq!(hash_tag("a{b}c"), Some("b"));
        // Values CLUSTER KEYSLOT gives.
        assert_eq!(key_slot("foo"), 12182);
        assert_eq!(key_slot("bar"), 5061);
        assert_eq!(key_slot("hello"), 866);
    }

    #[test]
    fn every_slot_has_a_tag() {
        for slot in 0..SLOTS {
            let tag = slot_tag(slot).to_string();
            assert_eq!(key_slot(&tag), slot);
        }
    }

    /// Keys with braces anywhere, no braces, unicode: the companion is
    /// always in the key's slot, is a different key, and contains it.
    #[test]
    fn companion_shares_the_slot_of_every_key() {
        let parts = [
            "", "{", "}", "{}", "}{", "{{", "}}", "a", "b:c", "ü", "鍵", "🔒", "{x}", " ", "*",
            "\n",
        ];
        let mut seen = std::collections::HashSet::new();
        let mut checked = 0;
        for a in parts {
            for b in parts {
                for c in parts {
                    for d in ["", "tail", "}", "{"] {
                        let key = format!("{a}{b}{c}{d}");
                        if key.is_empty() || !seen.insert(key.clone()) {
                            continue;
                        }
                        let fence = fence_key(&key);
                        assert_eq!(
                            key_slot(&fence),
                            key_slot(&key),
                            "key {key:?}, fence {fence:?}"
                        );
                        assert_ne!(fence, key);
                        assert!(fence.ends_with(&key));
                        let kept = kept_key(&key);
                        assert_eq!(key_slot(&kept), key_slot(&key), "key {key:?}");
                        assert!(kept != key && kept != fence && kept.ends_with(&key));
                        checked += 1;
                    }
                }
            }
        }
        // Pseudo-random printable keys with many braces.
        let alphabet: Vec<char> = "{}ab:ü ".chars().collect();
        let mut state: u64 = 0x9E37_79B9_7F4A_7C15;
        for _ in 0..20_000 {
            let mut key = String::new();
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let len = 1 + (state % 12) as usize;
            let mut s = state;
            for _ in 0..len {
                key.push(alphabet[(s % alphabet.len() as u64) as usize]);
                s /= alphabet.len() as u64;
            }
            assert_eq!(key_slot(&fence_key(&key)), key_slot(&key), "key {key:?}");
            checked += 1;
        }
        assert!(checked > 20_000);
    }

    #[test]
    fn distinct_keys_have_distinct_companions() {
        let keys = ["a}", "}a", "{a}", "a", "{}", "}{", "x}y", "{0}", "0"];
        let fences: std::collections::HashSet<_> = keys.iter().map(|k| fence_key(k)).collect();
        assert_eq!(fences.len(), keys.len());
    }
}

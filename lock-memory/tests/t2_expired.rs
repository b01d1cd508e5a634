//! \[T2\] Locks that expire without a release or an extension (a handle
//! forgotten, a holder that stopped) leave no entry behind for long: an
//! extension that finds its lock expired frees the entry at once, and the
//! next new key after a second sweeps the rest, so the table is back
//! within its cache of [`KEPT_FREE`] freed entries.

use std::time::Duration;

use lock_memory::lock_core::{AcquireOutcome, ExtendOutcome, Lease};
use lock_memory::{LockBackend, MemoryBackend, OwnerToken, KEPT_FREE};

const KEYS: usize = 10_000;

fn count(backend: &MemoryBackend, name: &str) -> usize {
    let counts = backend.state_counts();
    counts
        .iter()
        .find(|(n, _)| *n == name)
        .unwrap_or_else(|| panic!("no {name} in {counts:?}"))
        .1
}

async fn take(backend: &MemoryBackend, key: &str, ttl: Duration) -> Lease {
    let owner = OwnerToken::new("t2");
    match backend.try_acquire(key, &owner, ttl).await.unwrap() {
        AcquireOutcome::Acquired { fencing_token } => Lease::new(key, owner, fencing_token),
        AcquireOutcome::Busy { .. } => panic!("{key} is busy"),
    }
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn t2_locks_expired_without_a_release_leave_only_the_cache() {
    let backend = MemoryBackend::new();
    let ttl = Duration::from_secs(1);
    let mut leases = Vec::new();
    for i in 0..KEYS {
        leases.push(take(&backend, &format!("t2:abandoned:{i}"), ttl).await);
    }
    tokio::time::advance(2 * ttl).await;
    assert_eq!(count(&backend, "memory: expired entries"), KEYS);

    // An extension that finds its lock expired frees its entry.
    for lease in &leases[..100] {
        assert_eq!(
            backend.extend(lease, ttl).await.unwrap(),
            ExtendOutcome::Expired
        );
    }
    assert_eq!(count(&backend, "memory: expired entries"), KEYS - 100);

    // The next new key sweeps the others.
    let _last = take(&backend, "t2:next", ttl).await;
    let counts = backend.state_counts();
    eprintln!("{counts:?}");
    assert_eq!(count(&backend, "memory: expired entries"), 0, "{counts:?}");
    assert_eq!(count(&backend, "memory: free entries"), KEPT_FREE);
    assert_eq!(count(&backend, "memory: entries"), KEPT_FREE + 1);
    assert!(
        count(&backend, "memory: table capacity") <= 8 * KEPT_FREE,
        "{counts:?}"
    );
}

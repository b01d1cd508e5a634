//! Reliability under faults (SPEC §5).

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use lock_core::{LockConfig, LockError};
use tokio::time::Instant;

use crate::faults::{FaultInjector, Step};
use crate::support::{node, scaled, within, BackendFactory, Namespace, RETRY, SHORT_TTL, SOON};

/// What the workers saw, shared.
#[derive(Default)]
struct Ledger {
    /// Tokens inside their critical section now.
    inside: HashSet<u64>,
    /// The older token of every overlap of two critical sections.
    overlapped_older: HashSet<u64>,
    /// The highest token the store accepted a write from.
    store_max: u64,
    /// Tokens whose write the store refused as stale.
    refused: HashSet<u64>,
    /// How each call ended, by token: true when it returned `Lost`.
    lost: HashMap<u64, bool>,
    /// Critical sections inside now that hold for longer than the ttl.
    long_inside: usize,
}

/// Mutual exclusion holds under faults: several nodes, extenders starved
/// past the ttl, failing attempts and releases. Every overlap of two
/// critical sections follows a lock-lost error of the older holder, and a
/// store that checks fencing tokens only refuses writes from holders that
/// lost their lock.
pub async fn rel_exclusion_holds_under_faults(factory: Arc<dyn BackendFactory>) {
    let backend = factory.backend().await;
    let ns = Namespace::new();
    let key = ns.key("rel");
    let faults: Vec<_> = (0..3)
        .map(|_| FaultInjector::new(Arc::clone(&backend)))
        .collect();
    let nodes: Vec<_> = faults
        .iter()
        .enumerate()
        .map(|(i, f)| node(f.clone(), &format!("n{i}")))
        .collect();
    let ledger = Arc::new(Mutex::new(Ledger::default()));
    let short_ttl = scaled(&*backend, SHORT_TTL);
    let cfg = LockConfig::default()
        .ttl(short_ttl)
        .wait_forever()
        .retry_delay(RETRY);
    let run_for = scaled(&*backend, Duration::from_secs(3));
    let started = Instant::now();

    // The chaos: whenever a long critical section is inside, every node's
    // extensions hang for longer than the ttl, so that holder's lock
    // expires under it; attempts and releases fail now and then.
    let chaos_faults = faults.clone();
    let chaos_ledger = Arc::clone(&ledger);
    let chaos = tokio::spawn(async move {
        let mut round = 0u32;
        while started.elapsed() < run_for {
            if chaos_ledger.lock().unwrap().long_inside == 0 {
                tokio::time::sleep(Duration::from_millis(5)).await;
                continue;
            }
            for f in &chaos_faults {
                f.hang(Step::Extend, true);
                if round.is_multiple_of(2) {
                    f.fail_next(Step::TryAcquire, 2);
                    f.fail_next(Step::Release, 1);
                }
            }
            tokio::time::sleep(short_ttl * 3 / 2).await;
            for f in &chaos_faults {
                f.hang(Step::Extend, false);
            }
            tokio::time::sleep(short_ttl / 2).await;
            round += 1;
        }
    });

    let mut workers = Vec::new();
    for (i, n) in nodes.iter().enumerate() {
        for w in 0..2u64 {
            let (n, k, ledger) = (n.clone(), key.clone(), Arc::clone(&ledger));
            workers.push(tokio::spawn(async move {
                let mut j = 0u64;
                while started.elapsed() < run_for {
                    j += 1;
                    // Every third section holds for twice the ttl and so
                    // outlives a hang; the others for up to half the ttl.
                    let long = (i as u64 + w + j).is_multiple_of(3);
                    let hold = if long {
                        short_ttl * 2
                    } else {
                        short_ttl * ((i as u32 + j as u32) % 5) / 8
                    };
                    let l = Arc::clone(&ledger);
                    let (token_tx, token_rx) = tokio::sync::oneshot::channel();
                    let call = n
                        .with_lock_config(&k, &cfg, move |ctx| async move {
                            let me = ctx.fencing_token();
                            let _ = token_tx.send(me);
                            {
                                let mut g = l.lock().unwrap();
                                let others: Vec<u64> = g.inside.iter().copied().collect();
                                for other in others {
                                    g.overlapped_older.insert(other.min(me));
                                }
                                g.inside.insert(me);
                                g.long_inside += usize::from(long);
                            }
                            tokio::time::sleep(hold).await;
                            let mut g = l.lock().unwrap();
                            g.long_inside -= usize::from(long);
                            if me >= g.store_max {
                                g.store_max = me;
                            } else {
                                g.refused.insert(me);
                            }
                            g.inside.remove(&me);
                        })
                        .await;
                    if let Ok(token) = token_rx.await {
                        let lost = matches!(call, Err(LockError::Lost { .. }));
                        ledger.lock().unwrap().lost.insert(token, lost);
                    }
                    if let Err(e) = &call {
                        assert!(
                            matches!(e, LockError::Lost { .. }),
                            "only losses are expected under these faults, got {e:?}"
                        );
                    }
                }
            }));
        }
    }
    for w in workers {
        within(run_for + SOON * 2, "workers", w).await.unwrap();
    }
    chaos.await.unwrap();
    for f in &faults {
        f.hang(Step::Extend, false);
    }
    // Detached callbacks of lost locks finish within twice the ttl.
    let deadline = Instant::now() + SOON;
    while !ledger.lock().unwrap().inside.is_empty() {
        assert!(
            Instant::now() < deadline,
            "a detached callback never finished"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    let g = ledger.lock().unwrap();
    let losses = g.lost.values().filter(|lost| **lost).count();
    assert!(
        losses >= 1,
        "the starved extenders cost no lock, so the case proved nothing ({} sections)",
        g.lost.len()
    );
    assert!(
        g.lost.len() >= 6,
        "too few critical sections ran: {}",
        g.lost.len()
    );
    for older in &g.overlapped_older {
        assert_eq!(
            g.lost.get(older),
            Some(&true),
            "critical sections overlapped, but the older holder (token {older}) did not get a lock-lost error"
        );
    }
    for token in &g.refused {
        assert_eq!(
            g.lost.get(token),
            Some(&true),
            "the store refused token {token} as stale, but its holder did not get a lock-lost error"
        );
    }
}

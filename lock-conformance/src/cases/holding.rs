//! While the lock is held: extension, expiry, release and fencing \[H1–H5\].

use std::sync::{Arc, Mutex};
use std::time::Duration;

use lock_core::{AcquireOutcome, ExtendOutcome, Lease, LockConfig, OwnerToken, ReleaseOutcome};
use tokio::time::Instant;

use crate::counting::CountingBackend;
use crate::faults::{FaultInjector, Step};
use crate::support::{
    assert_free, assert_held, node, patient, within, BackendFactory, Namespace, SHORT_TTL, SOON,
};

/// \[H1\] The lock is extended in the background about every third of the
/// ttl, so a callback may run for many times the ttl.
pub async fn h1_lock_is_extended_while_callback_runs(factory: Arc<dyn BackendFactory>) {
    let backend = factory.backend().await;
    let ns = Namespace::new();
    let key = ns.key("h1");
    let counting = CountingBackend::new(Arc::clone(&backend));
    let a = node(counting.clone(), "a");
    let cfg = LockConfig::default().ttl(SHORT_TTL);
    let probe_backend = Arc::clone(&backend);
    let k = key.clone();
    let out = within(
        SOON * 2,
        "a long callback",
        a.with_lock_config(&key, &cfg, move |ctx| async move {
            for _ in 0..4 {
                tokio::time::sleep(SHORT_TTL).await;
                assert_held(&probe_backend, &k, "past the ttl, still extended").await;
            }
            ctx.is_lost()
        }),
    )
    .await;
    assert!(!out.expect("no loss"), "the lock was never lost");
    let extensions = counting.calls(Step::Extend);
    assert!(
        (4..=40).contains(&extensions),
        "running 4 ttls with an extension every ttl / 3 needs about 12 extensions, saw {extensions}"
    );
    assert_free(&backend, &key, "after the long callback").await;
}

/// \[H2\] A node that stops extending loses the lock at most a ttl later, and
/// another node then gets it.
pub async fn h2_stalled_holder_loses_lock_within_ttl(factory: Arc<dyn BackendFactory>) {
    let backend = factory.backend().await;
    let ns = Namespace::new();
    let key = ns.key("h2");
    let a = node(Arc::clone(&backend), "a");
    let ttl = Duration::from_millis(600);
    // A holder that stops without releasing: its extender hangs, as in a
    // stalled process.
    let stalled = FaultInjector::new(Arc::clone(&backend));
    stalled.hang(Step::Extend, true);
    stalled.hang(Step::Release, true);
    let crashed = node(stalled, "crashed");
    let mut h = crashed.handle(&key, ttl).unwrap();
    let taken_at = Instant::now();
    assert!(h.acquire().await.unwrap());
    let crashed_token = h.fencing_token().expect("the handle holds its lock");
    // Dropped without a release ever reaching the store.
    drop(h);

    let b_token = within(
        SOON,
        "another node takes over",
        a.with_lock_config(&key, &patient(), |c| async move { c.fencing_token() }),
    )
    .await
    .expect("the lock expired and was taken");
    let waited = taken_at.elapsed();
    assert!(
        b_token > crashed_token,
        "the new holder's token {b_token} is above the crashed holder's {crashed_token} [H4]"
    );
    assert!(
        waited + Duration::from_millis(50) >= ttl,
        "taken over after {waited:?}, before the ttl of {ttl:?} ran out"
    );
}

/// \[H3\] The lock is released as soon as the callback settles. A release
/// that fails is sent again while the lock is valid; when none is answered,
/// the key expires with its ttl (and the call gives the callback's output,
/// \[O6\]).
pub async fn h3_released_when_callback_settles(factory: Arc<dyn BackendFactory>) {
    let backend = factory.backend().await;
    let ns = Namespace::new();
    let key = ns.key("h3");
    let a = node(Arc::clone(&backend), "a");
    within(SOON, "with_lock", a.with_lock(&key, |_| async {}))
        .await
        .unwrap();
    assert_free(&backend, &key, "right after with_lock returned").await;
    assert_eq!(a.held(), 0);

    let faulty = FaultInjector::new(Arc::clone(&backend));
    faulty.fail_always(Step::Release, true);
    let b = node(faulty.clone(), "b");
    let cfg = LockConfig::default().ttl(SHORT_TTL);
    let released_at = Instant::now();
    let got = within(
        SOON,
        "with_lock",
        b.with_lock_config(&key, &cfg, |_| async { 7 }),
    )
    .await;
    assert_eq!(
        got.unwrap(),
        7,
        "no release answered: the output of a callback that settled in time stands"
    );
    assert_eq!(b.held(), 0);
    within(
        SOON,
        "the key expires with its ttl",
        a.with_lock_config(&key, &patient(), |_| async {}),
    )
    .await
    .unwrap();
    faulty.fail_always(Step::Release, false);
    assert!(
        released_at.elapsed() + Duration::from_millis(50) >= SHORT_TTL,
        "the unreleased key expired after {:?}, before its ttl",
        released_at.elapsed()
    );
}

/// \[H4\] Each acquisition gets a fencing token that strictly increases per
/// key across all nodes; a reentrant call sees its outer call's token.
pub async fn h4_fencing_token_increases_across_nodes(factory: Arc<dyn BackendFactory>) {
    let backend = factory.backend().await;
    let ns = Namespace::new();
    let key = ns.key("h4");
    let nodes: Vec<_> = (0..3)
        .map(|i| node(Arc::clone(&backend), &format!("n{i}")))
        .collect();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for round in 0..8 {
        for n in &nodes {
            let (n, k, seen) = (n.clone(), key.clone(), Arc::clone(&seen));
            tasks.push(tokio::spawn(async move {
                let inner = n.clone();
                n.with_lock_config(&k.clone(), &patient(), move |ctx| async move {
                    let token = ctx.fencing_token();
                    seen.lock().unwrap().push(token);
                    let again = inner
                        .with_lock(&k, |c| async move { c.fencing_token() })
                        .await
                        .unwrap();
                    assert_eq!(again, token, "a reentrant call sees the outer token");
                    if round % 2 == 0 {
                        tokio::task::yield_now().await;
                    }
                })
                .await
            }));
        }
    }
    for t in tasks {
        within(SOON * 2, "every node gets its turn", t)
            .await
            .unwrap()
            .unwrap();
    }
    let seen = seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 24);
    assert!(
        seen.windows(2).all(|w| w[0] < w[1]),
        "tokens in acquisition order must strictly increase: {seen:?}"
    );

    // The low-level handle draws from the same sequence.
    let mut h = nodes[0].handle(&key, SHORT_TTL).unwrap();
    assert!(h.acquire().await.unwrap());
    assert!(h.fencing_token().unwrap() > *seen.last().unwrap());
    h.release().await.unwrap();
}

/// \[H5\] A release, extension or check by an owner that no longer holds the
/// key never changes the key.
pub async fn h5_stale_owner_changes_nothing(factory: Arc<dyn BackendFactory>) {
    let backend = factory.backend().await;
    let ns = Namespace::new();
    let key = ns.key("h5");
    let ttl = Duration::from_millis(200);
    let old = OwnerToken::new("old");
    let AcquireOutcome::Acquired { fencing_token } =
        backend.try_acquire(&key, &old, ttl).await.unwrap()
    else {
        panic!("a free key is acquired");
    };
    let old_lease = Lease::new(key.as_str(), old, fencing_token);
    // Let it expire, then another owner takes the key.
    let new = OwnerToken::new("new");
    let deadline = Instant::now() + SOON;
    let new_lease = loop {
        match backend
            .try_acquire(&key, &new, Duration::from_secs(30))
            .await
            .unwrap()
        {
            AcquireOutcome::Acquired { fencing_token } => {
                break Lease::new(key.as_str(), new.clone(), fencing_token)
            }
            AcquireOutcome::Busy { .. } => {
                assert!(Instant::now() < deadline, "the old lease never expired");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    };
    assert!(new_lease.fencing_token() > old_lease.fencing_token());
    assert_eq!(
        backend.release(&old_lease).await.unwrap(),
        ReleaseOutcome::NotHeld
    );
    assert_eq!(
        backend
            .extend(&old_lease, Duration::from_secs(60))
            .await
            .unwrap(),
        ExtendOutcome::Taken
    );
    assert_held(&backend, &key, "after a stale release and extension").await;
    assert_eq!(
        backend
            .extend(&new_lease, Duration::from_secs(30))
            .await
            .unwrap(),
        ExtendOutcome::Extended,
        "the new owner still holds the key"
    );
    assert_eq!(
        backend.release(&new_lease).await.unwrap(),
        ReleaseOutcome::Released
    );
    assert_free(&backend, &key, "after the owner released").await;
}

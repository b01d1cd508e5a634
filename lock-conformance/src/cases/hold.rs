//! The minimum hold \[H7\]: a callback that settles before its acquisition
//! plus `hold_at_least` leaves the lock to expire then, so a short job run
//! by several hosts runs once per period.

use std::sync::Arc;
use std::time::Duration;

use lock_core::LossCause;
use tokio::sync::oneshot;
use tokio::time::Instant;

use crate::counting::CountingBackend;
use crate::faults::{FaultInjector, Step};
use crate::support::{
    assert_free, assert_held, assert_lost_as, node, once, patient, within, BackendFactory,
    Namespace, SOON,
};

/// The minimum hold of the cases: long against a round trip on a loaded
/// machine, short against the suite's time.
const HOLD: Duration = Duration::from_secs(2);

/// How much earlier than the driver's count a store may free the key: the
/// store rounds expiries to its own unit (Redis: 1 ms).
const STORE_ROUNDING: Duration = Duration::from_millis(5);

/// Waits until another node takes `key`; returns when it got in and the
/// fencing token it got.
async fn taken_by_next(
    backend: &Arc<lock_core::DynLockBackend>,
    key: &str,
    limit: Duration,
) -> (Instant, u64) {
    let b = node(Arc::clone(backend), "next");
    within(
        limit,
        "another node takes the key after the minimum hold",
        b.with_lock_config(key, &patient(), |ctx| async move {
            (Instant::now(), ctx.fencing_token())
        }),
    )
    .await
    .unwrap_or_else(|e| panic!("the next node's call failed: {e:?}"))
}

/// \[H7\] A callback that settles at once gives its output at once, but the
/// key stays held until the minimum hold from its acquisition is over:
/// another node gets it only then, with a greater token, and long before
/// the ttl, since nothing extends it. A callback that outlasts its minimum
/// releases at once, as without one.
pub async fn h7_a_short_callback_holds_the_key_until_its_minimum(factory: Arc<dyn BackendFactory>) {
    let backend = factory.backend().await;
    let ns = Namespace::new();
    let key = ns.key("h7-short");
    let a = node(Arc::clone(&backend), "a");
    let cfg = once().hold_at_least(HOLD);
    let before = Instant::now();
    let token = within(
        SOON,
        "the call",
        a.with_lock_config(&key, &cfg, |ctx| async move { ctx.fencing_token() }),
    )
    .await
    .unwrap_or_else(|e| panic!("the callback's output: {e:?}"));
    assert_held(&backend, &key, "right after the call gave its output").await;
    assert_eq!(a.held(), 0, "the lock is no longer this node's");

    let (got_at, next_token) = taken_by_next(&backend, &key, HOLD + SOON).await;
    let waited = got_at - before;
    assert!(
        waited + STORE_ROUNDING >= HOLD,
        "the key was free after {waited:?}, before its minimum hold of {HOLD:?}"
    );
    assert!(
        waited < cfg.ttl,
        "the key was freed at the minimum hold, not left to its ttl: {waited:?}"
    );
    assert!(next_token > token, "{next_token} after {token}");

    // Past its minimum, a callback releases at once.
    let key = ns.key("h7-long");
    let short = once().hold_at_least(Duration::from_millis(100));
    within(
        SOON,
        "the long call",
        a.with_lock_config(&key, &short, |_| {
            tokio::time::sleep(Duration::from_millis(300))
        }),
    )
    .await
    .unwrap();
    assert_free(&backend, &key, "a callback longer than its minimum").await;
}

/// \[H7\] An extension on its way when the callback settles is awaited
/// before the hold step, so it cannot move the expiry past the minimum
/// hold's end (here it would have set it to a ttl from its arrival).
pub async fn h7_no_extension_in_flight_moves_the_minimum(factory: Arc<dyn BackendFactory>) {
    let backend = factory.backend().await;
    let ns = Namespace::new();
    let key = ns.key("h7-in-flight");
    let faulty = FaultInjector::new(Arc::clone(&backend));
    let counting = CountingBackend::new(faulty.clone());
    // Extensions are due at a third of the ttl (1 s) and reach the store
    // 300 ms after they are sent.
    let ttl = Duration::from_secs(3);
    let delay = Duration::from_millis(300);
    faulty.delay(Step::Extend, delay);
    let a = node(counting.clone(), "a");
    let cfg = once().ttl(ttl).hold_at_least(HOLD);
    let before = Instant::now();
    let c = counting.clone();
    within(
        SOON,
        "the call",
        a.with_lock_config(&key, &cfg, move |_| async move {
            // Settle while the first extension is on its way.
            while c.calls(Step::Extend) == 0 {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }),
    )
    .await
    .unwrap_or_else(|e| panic!("the callback's output: {e:?}"));
    let settled = Instant::now() - before;
    assert!(settled < HOLD, "settled within its minimum: {settled:?}");
    assert_eq!(counting.calls(Step::Hold), 1, "one hold step");

    let (got_at, _) = taken_by_next(&backend, &key, ttl + SOON).await;
    let waited = got_at - before;
    assert!(
        waited + STORE_ROUNDING >= HOLD,
        "the key was free after {waited:?}, before its minimum hold of {HOLD:?}"
    );
    // A late extension would have set the expiry to a ttl after it reached
    // the store: past settled + delay + ttl, which is after 4 s.
    let late_extension = settled + delay + ttl;
    assert!(
        waited < late_extension - Duration::from_millis(500),
        "the key was held until {waited:?}: an extension moved the expiry past the minimum hold (a late one would end at {late_extension:?})"
    );
}

/// \[H7\] The hold step is owed like a release: sent again on backend
/// errors while the lock is valid (the call still gives its output and the
/// key stays held to its minimum), and a hold step that finds the key
/// re-owned makes the call `Lost` with cause `Taken`.
pub async fn h7_the_hold_step_is_owed_like_a_release(factory: Arc<dyn BackendFactory>) {
    let backend = factory.backend().await;
    let ns = Namespace::new();
    let key = ns.key("h7-retried");
    let faulty = FaultInjector::new(Arc::clone(&backend));
    let counting = CountingBackend::new(faulty.clone());
    let a = node(counting.clone(), "a");
    let cfg = once().hold_at_least(HOLD);
    faulty.fail_next(Step::Hold, 2);
    let before = Instant::now();
    within(
        SOON,
        "the call",
        a.with_lock_config(&key, &cfg, |_| async { "done" }),
    )
    .await
    .unwrap_or_else(|e| panic!("the callback's output after two failed hold steps: {e:?}"));
    assert_eq!(counting.calls(Step::Hold), 3, "two failures, then the hold");
    assert_eq!(counting.calls(Step::Release), 0, "never released");
    assert_held(&backend, &key, "after the retried hold step").await;
    let (got_at, _) = taken_by_next(&backend, &key, HOLD + SOON).await;
    assert!(got_at - before + STORE_ROUNDING >= HOLD);

    let key = ns.key("h7-taken");
    let (f, k) = (faulty.clone(), key.clone());
    let short_ttl = cfg.ttl(Duration::from_secs(1));
    let got = within(
        SOON,
        "the call",
        a.with_lock_config(&key, &short_ttl, move |_| async move {
            f.look_stolen(&k, true);
        }),
    )
    .await;
    assert_lost_as(
        &got,
        &LossCause::Taken,
        "a hold step that finds the key re-owned",
    );
    faulty.look_stolen(&key, false);
    // In the store the key is still this node's: it expires with its ttl,
    // untouched, as a release that found it re-owned leaves it.
    taken_by_next(&backend, &key, short_ttl.ttl + SOON).await;
}

/// \[H7, S1\] Shutdown leaves a lock in its minimum hold to expire then (it
/// is no longer a holder's), while a callback its grace cuts off is
/// released as S1 says, its call `Lost` with cause `Shutdown`.
pub async fn h7_shutdown_keeps_minimums_and_releases_cut_callbacks(
    factory: Arc<dyn BackendFactory>,
) {
    let backend = factory.backend().await;
    let ns = Namespace::new();
    let (held_key, cut_key) = (ns.key("h7-kept"), ns.key("h7-cut"));
    let a = node(Arc::clone(&backend), "a");
    let cfg = once().hold_at_least(HOLD);
    let before = Instant::now();
    within(
        SOON,
        "the settled call",
        a.with_lock_config(&held_key, &cfg, |_| async {}),
    )
    .await
    .unwrap();
    let (running_tx, running_rx) = oneshot::channel();
    let (l, k) = (a.clone(), cut_key.clone());
    let cut = tokio::spawn(async move {
        l.with_lock_config(&k, &cfg, move |_| async move {
            let _ = running_tx.send(());
            std::future::pending::<()>().await;
        })
        .await
    });
    within(SOON, "the second callback runs", running_rx)
        .await
        .unwrap();
    let report = within(SOON, "shutdown", a.shutdown(Duration::from_millis(200))).await;
    assert_eq!(report.release_failures, 0, "{report:?}");
    assert_free(&backend, &cut_key, "a callback cut off by the grace").await;
    let got = within(SOON, "the cut call", cut).await.unwrap();
    assert_lost_as(&got, &LossCause::Shutdown, "the call the grace cut off");
    // Not released by shutdown: free only at the end of its minimum.
    let (got_at, _) = taken_by_next(&backend, &held_key, HOLD + SOON).await;
    assert!(got_at - before + STORE_ROUNDING >= HOLD);
}

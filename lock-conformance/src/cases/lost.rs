//! Lost lock: detection, causes and what becomes of the callback \[L1–L3\].

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use lock_core::{DynLockBackend, LockConfig, LockError, LossCause};
use tokio::sync::oneshot;
use tokio::time::Instant;

use crate::faults::{is_injected, FaultInjector, Step};
use crate::support::{
    assert_held, assert_lost_as, node, patient, scaled, within, BackendFactory, Namespace,
    SHORT_TTL, SOON,
};

/// Runs a callback that waits until told, under a lock from `locker`, and
/// returns the pending call with a channel that tells it to finish.
fn hold_in_background(
    locker: &lock_core::Locker,
    key: &str,
    cfg: LockConfig,
) -> (
    tokio::task::JoinHandle<Result<(), LockError>>,
    oneshot::Receiver<()>,
    oneshot::Sender<()>,
) {
    let (started_tx, started_rx) = oneshot::channel();
    let (finish_tx, finish_rx) = oneshot::channel::<()>();
    let (l, k) = (locker.clone(), key.to_owned());
    let call = tokio::spawn(async move {
        l.with_lock_config(&k, &cfg, move |_| async move {
            let _ = started_tx.send(());
            let _ = finish_rx.await;
        })
        .await
    });
    (call, started_rx, finish_tx)
}

async fn lost_with(call: tokio::task::JoinHandle<Result<(), LockError>>) -> LossCause {
    let err = within(SOON, "loss detection", call)
        .await
        .unwrap()
        .expect_err("the lock was lost");
    match err {
        LockError::Lost { cause, .. } => cause,
        other => panic!("expected Lost, got {other:?}"),
    }
}

/// Holds `key` on a node whose extensions are lost on the way (they answer
/// `Extended` without reaching the store), so the key really expires under
/// a holder that cannot know yet.
async fn hold_while_extensions_are_lost(
    backend: &Arc<DynLockBackend>,
    key: &str,
) -> (
    FaultInjector<Arc<DynLockBackend>>,
    tokio::task::JoinHandle<Result<(), LockError>>,
    oneshot::Sender<()>,
) {
    let faulty = FaultInjector::new(Arc::clone(backend));
    let a = node(faulty.clone(), "a");
    faulty.skip_extensions(true);
    let cfg = LockConfig::default().ttl(scaled(&**backend, SHORT_TTL));
    let (call, started, finish) = hold_in_background(&a, key, cfg);
    within(SOON, "callback start", started).await.unwrap();
    (faulty, call, finish)
}

/// \[L1\] The key is gone from the store while the holder's validity
/// still runs (here its extensions were lost on the way, as in a failover
/// to a replica that missed them): lost at the next extension, cause
/// `Taken`, since it cannot have expired; `Expired` is kept for a key found
/// gone after the validity passed.
pub async fn l1_key_gone_while_valid_is_lost_as_taken(factory: Arc<dyn BackendFactory>) {
    let backend = factory.backend().await;
    let key = Namespace::new().key("l1-expired");
    let (faulty, call, _finish) = hold_while_extensions_are_lost(&backend, &key).await;
    tokio::time::sleep(scaled(&*backend, SHORT_TTL * 2)).await;
    assert!(!call.is_finished(), "the holder cannot know yet");
    faulty.skip_extensions(false);
    let cause = lost_with(call).await;
    assert!(matches!(cause, LossCause::Taken), "cause {cause:?}");
}

/// \[L1\] Another owner holds the key: lost at the next extension, cause
/// `Taken`, and the new owner's lock is untouched.
pub async fn l1_taken_key_is_lost_at_next_extension(factory: Arc<dyn BackendFactory>) {
    let backend = factory.backend().await;
    let key = Namespace::new().key("l1-taken");
    let (faulty, call, _finish) = hold_while_extensions_are_lost(&backend, &key).await;
    let b = node(Arc::clone(&backend), "b");
    let mut thief = b.handle(&key, Duration::from_secs(30)).unwrap();
    let deadline = Instant::now() + SOON;
    while !thief.acquire().await.unwrap() {
        assert!(Instant::now() < deadline, "the key never expired");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    faulty.skip_extensions(false);
    assert!(matches!(lost_with(call).await, LossCause::Taken));
    assert!(
        thief.renew().await.unwrap(),
        "the new owner still holds the key"
    );
    thief.release().await.unwrap();
}

/// \[L2\] Extensions failing on backend errors are retried while the lock is
/// valid; transient errors lose nothing, and errors that last past the
/// validity lose the lock with the last backend error as cause.
pub async fn l2_extension_errors_retry_then_lose(factory: Arc<dyn BackendFactory>) {
    let backend = factory.backend().await;
    let ns = Namespace::new();
    let key = ns.key("l2");
    let faulty = FaultInjector::new(Arc::clone(&backend));
    let a = node(faulty.clone(), "a");
    let cfg = LockConfig::default().ttl(SHORT_TTL);

    // Two failures in a row: retried, not lost.
    faulty.fail_next(Step::Extend, 2);
    let out = within(
        SOON,
        "a callback past transient errors",
        a.with_lock_config(&key, &cfg, |ctx| async move {
            tokio::time::sleep(SHORT_TTL * 2).await;
            ctx.is_lost()
        }),
    )
    .await;
    assert!(
        !out.expect("transient errors lose nothing"),
        "no loss on transient errors"
    );

    // Errors that last: lost once the validity ran out.
    faulty.fail_always(Step::Extend, true);
    let started_at = Instant::now();
    let (call, started, _finish) = hold_in_background(&a, &key, cfg);
    within(SOON, "callback start", started).await.unwrap();
    let cause = lost_with(call).await;
    let after = started_at.elapsed();
    match cause {
        LossCause::Backend(e) => assert!(is_injected(&e), "the cause is the last backend error"),
        other => panic!("expected a backend cause, got {other:?}"),
    }
    assert!(
        after + Duration::from_millis(20) >= SHORT_TTL * 2 / 3,
        "lost after {after:?}: too early, the lock was still valid"
    );
    assert!(after < SHORT_TTL * 2 + SOON, "lost after {after:?}");
    faulty.fail_always(Step::Extend, false);
}

/// \[L3\] By default the callback keeps running after the loss, and can watch
/// for the loss through its context.
pub async fn l3_detached_callback_runs_on_and_sees_loss(factory: Arc<dyn BackendFactory>) {
    let backend = factory.backend().await;
    let ns = Namespace::new();
    let key = ns.key("l3-detach");
    let faulty = FaultInjector::new(Arc::clone(&backend));
    let a = node(faulty.clone(), "a");
    let (started_tx, started_rx) = oneshot::channel();
    let (saw_tx, saw_rx) = oneshot::channel();
    let (l, k) = (a.clone(), key.clone());
    let call = tokio::spawn(async move {
        l.with_lock_config(
            &k,
            &LockConfig::default().ttl(SHORT_TTL),
            move |ctx| async move {
                let _ = started_tx.send(());
                let cause = ctx.lost().await;
                // Still running after the loss was reported.
                let _ = saw_tx.send((cause, ctx.is_lost(), ctx.is_held()));
            },
        )
        .await
    });
    within(SOON, "callback start", started_rx).await.unwrap();
    faulty.look_stolen(&key, true);
    assert!(matches!(lost_with(call).await, LossCause::Taken));
    let (cause, is_lost, is_held) = within(SOON, "the detached callback goes on", saw_rx)
        .await
        .unwrap();
    assert!(matches!(cause, LossCause::Taken));
    assert!(is_lost && !is_held);
}

/// \[L3\] In cancel-on-loss mode the callback is dropped at its next await
/// point, and it may borrow from the caller.
pub async fn l3_cancel_on_loss_drops_borrowing_callback(factory: Arc<dyn BackendFactory>) {
    let backend = factory.backend().await;
    let ns = Namespace::new();
    let key = ns.key("l3-cancel");
    let faulty = FaultInjector::new(Arc::clone(&backend));
    let a = node(faulty.clone(), "a");

    struct Dropped<'a>(&'a AtomicBool);
    impl Drop for Dropped<'_> {
        fn drop(&mut self) {
            self.0.store(true, Ordering::SeqCst);
        }
    }
    let dropped = AtomicBool::new(false);
    let mut progress = 0u32; // borrowed mutably by the callback
    let stolen = faulty.clone();
    let k = key.clone();
    let cfg = LockConfig::default().ttl(SHORT_TTL);
    let got = within(
        SOON,
        "loss in cancel mode",
        a.with_lock_cancel_on_loss(&key, &cfg, |_| async {
            let _guard = Dropped(&dropped);
            progress += 1;
            stolen.look_stolen(&k, true);
            std::future::pending::<()>().await;
            progress += 1;
        }),
    )
    .await;
    assert_lost_as(
        &got,
        &LossCause::Taken,
        "a call whose key was taken while it ran",
    );
    assert!(dropped.load(Ordering::SeqCst), "the callback was dropped");
    assert_eq!(progress, 1, "the callback stopped at its await point");
    faulty.look_stolen(&key, false);
    let b = node(Arc::clone(&backend), "b");
    within(
        SOON,
        "the key is free after its ttl",
        b.with_lock_config(&key, &patient(), |_| async {}),
    )
    .await
    .unwrap();
}

/// The ttl of the batch cases \[L4\]: long enough that the healthy leases'
/// extensions ride out a loaded machine.
const BATCH_TTL: Duration = Duration::from_secs(3);

/// How the broken leases of a batch case fail.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Broken {
    /// Their extensions fail with a backend error, in the same
    /// `extend_many` calls as the healthy leases.
    Failing,
    /// Their server hangs: their extensions never answer.
    Hung,
}

/// Six locks on one node, extended in batches; the extensions of two fail
/// or hang. Only those two are reported lost, with a backend error, and
/// only once their validity passed; the other four are extended on time
/// and stay held.
async fn only_broken_leases_are_lost(factory: Arc<dyn BackendFactory>, broken: Broken) {
    let backend = factory.backend().await;
    let ns = Namespace::new();
    let faulty = FaultInjector::new(Arc::clone(&backend));
    let a = node(faulty.clone(), "a");
    let cfg = LockConfig::default().ttl(BATCH_TTL);
    let keys: Vec<String> = (0..6).map(|i| ns.key(&format!("l4-{i}"))).collect();
    let (broken_keys, healthy_keys) = keys.split_at(2);
    // Broken before they are taken: the first extension already meets it.
    for key in broken_keys {
        match broken {
            Broken::Failing => faulty.fail_extensions_of(key, true),
            Broken::Hung => faulty.hang_extensions_of(key, true),
        }
    }
    let before = Instant::now();
    let mut held = Vec::new();
    for key in &keys {
        let (call, started, finish) = hold_in_background(&a, key, cfg);
        within(SOON, "callback start", started).await.unwrap();
        held.push((call, finish));
    }
    let mut healthy = held.split_off(2);
    for (call, _finish) in held {
        let cause = within(BATCH_TTL + SOON, "the broken leases' loss", lost_with(call)).await;
        let lost_after = before.elapsed();
        assert!(
            matches!(&cause, LossCause::Backend(e) if broken == Broken::Hung || is_injected(e)),
            "a broken lease is lost on its backend error, got {cause:?}"
        );
        // Its validity (the ttl from the acquisition, less a drift margin
        // of about a hundredth) had passed.
        assert!(
            lost_after >= BATCH_TTL - BATCH_TTL / 20,
            "reported lost after {lost_after:?}, before its validity of {BATCH_TTL:?} passed"
        );
    }
    // The healthy leases outlived their first ttl: they were extended, and
    // their holders were told nothing.
    tokio::time::sleep(BATCH_TTL / 3).await;
    for ((call, _), key) in healthy.iter().zip(healthy_keys) {
        assert!(
            !call.is_finished(),
            "healthy lease {key:?} was reported lost"
        );
        assert_held(&backend, key, "a healthy lease past its first ttl").await;
    }
    for (call, finish) in healthy.drain(..) {
        let _ = finish.send(());
        within(SOON, "a healthy call", call)
            .await
            .unwrap()
            .expect("a healthy lease was held throughout");
    }
    for key in broken_keys {
        faulty.fail_extensions_of(key, false);
        faulty.hang_extensions_of(key, false);
    }
    for key in &keys {
        crate::support::assert_freed_soon(&backend, key, "after the case").await;
    }
}

/// \[L4\] Some leases of an extension batch fail with a backend error:
/// only those are reported lost, after their validity passed; the others
/// of the same batch get their own answers and stay held.
pub async fn l4_batch_errors_touch_only_their_leases(factory: Arc<dyn BackendFactory>) {
    only_broken_leases_are_lost(factory, Broken::Failing).await;
}

/// \[L4\] Some leases' server hangs: no healthy lease waits behind them;
/// only the hung ones are reported lost, after their validity passed.
pub async fn l4_hung_leases_hold_up_only_themselves(factory: Arc<dyn BackendFactory>) {
    only_broken_leases_are_lost(factory, Broken::Hung).await;
}

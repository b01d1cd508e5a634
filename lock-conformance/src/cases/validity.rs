//! No `Ok` without the lock \[O6, H6\], and a shutdown that returns only
//! once its releases were answered \[S1\].

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use lock_core::{AcquireOutcome, Lease, LockConfig, LockContext, LockError, LossCause, OwnerToken};
use tokio::sync::oneshot;
use tokio::time::Instant;

use crate::counting::CountingBackend;
use crate::faults::{FaultInjector, Step};
use crate::support::{
    assert_free, assert_held, assert_lost_as, node, patient, within, BackendFactory, Namespace,
    SHORT_TTL, SOON,
};

fn assert_lost(got: &Result<(), LockError>, what: &str) {
    assert!(
        matches!(
            got,
            Err(LockError::Lost {
                cause: LossCause::Expired | LossCause::Taken,
                ..
            })
        ),
        "{what}: expected Lost (Expired or Taken), got {got:?}"
    );
}

/// \[O6\] A holder that stalls past its ttl (its whole thread blocked, as in
/// a GC pause or a stopped process, so no extension runs) while another node
/// takes the key is told it lost the lock when its callback settles, and its
/// context agrees.
pub async fn o6_stalled_holder_is_told_lost(factory: Arc<dyn BackendFactory>) {
    let backend = factory.backend().await;
    let ns = Namespace::new();
    let key = ns.key("o6-stall");
    // Node A's process stalls (a GC pause, a stopped process): its store
    // is no longer extended, as its extender would stop with it (the
    // extender runs on the process's background runtime, which a real
    // stall stops too, but a blocked thread does not). The extensions
    // still answer "extended", so only the release can tell.
    let stalled_store = FaultInjector::new(Arc::clone(&backend));
    let a = node(stalled_store.clone(), "a");
    let b = node(Arc::clone(&backend), "b");
    let (b_holds_tx, b_holds_rx) = std::sync::mpsc::channel::<()>();
    let (a_done_tx, a_done_rx) = oneshot::channel::<()>();
    let (ctx_tx, ctx_rx) = oneshot::channel::<LockContext>();
    stalled_store.skip_extensions(true);

    // Node A runs on a one-thread runtime of its own, which its callback
    // blocks. The runtime then runs on
    // until the case ends: connections it opened may be in the backend's
    // pool, and work only while the runtime that opened them drives them.
    let (l, k) = (a.clone(), key.clone());
    let (a_result_tx, a_result_rx) = oneshot::channel();
    let (case_over_tx, case_over_rx) = oneshot::channel::<()>();
    let stalled = std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a runtime for node a");
        runtime.block_on(async move {
            let cfg = LockConfig::default().ttl(SHORT_TTL);
            let got = l
                .with_lock_config(&k, &cfg, move |ctx| {
                    let _ = ctx_tx.send(ctx);
                    async move {
                        // Blocks until node B holds the key, then a little more.
                        let _ = b_holds_rx.recv_timeout(SOON);
                        std::thread::sleep(Duration::from_millis(20));
                    }
                })
                .await;
            let _ = a_result_tx.send(got);
            let _ = case_over_rx.await;
        });
    });
    let ctx = within(SOON, "a's callback starts", ctx_rx).await.unwrap();

    let (l, k) = (b.clone(), key.clone());
    let taker = tokio::spawn(async move {
        l.with_lock_config(&k, &patient(), move |_| async move {
            let _ = b_holds_tx.send(());
            // Holds on until A's call has given its answer: the two overlap.
            let _ = tokio::time::timeout(SOON, a_done_rx).await;
        })
        .await
    });
    let got = within(SOON, "a's call settles", a_result_rx)
        .await
        .expect("node a's thread");
    let _ = a_done_tx.send(());
    assert_lost(&got, "a holder that stalled past its ttl");
    assert!(ctx.is_lost(), "the context agrees with the call");
    within(
        Duration::from_millis(100),
        "lost() of the stalled holder",
        ctx.lost(),
    )
    .await;
    within(SOON, "b's call", taker)
        .await
        .unwrap()
        .expect("b took the key after a's ttl");
    assert_free(&backend, &key, "after both calls").await;
    let _ = case_over_tx.send(());
    tokio::task::spawn_blocking(move || stalled.join())
        .await
        .expect("joining node a's thread")
        .expect("node a's thread");
}

/// \[O6\] A key deleted and taken by another client before the first
/// extension: the release finds another owner's value, so the call is lost
/// with cause `Taken`, not `Ok`.
pub async fn o6_key_replaced_before_first_extension_is_lost(factory: Arc<dyn BackendFactory>) {
    let backend = factory.backend().await;
    let ns = Namespace::new();
    let key = ns.key("o6-replaced");
    let counting = CountingBackend::new(Arc::clone(&backend));
    let a = node(counting.clone(), "a");
    let cfg = LockConfig::default().ttl(Duration::from_secs(30));
    let thief = OwnerToken::new("thief");
    let (thief_backend, k, spy, t) = (
        Arc::clone(&backend),
        key.clone(),
        counting.clone(),
        thief.clone(),
    );
    let (ctx_tx, ctx_rx) = oneshot::channel();
    let got = within(
        SOON,
        "the call",
        a.with_lock_config(&key, &cfg, move |ctx| async move {
            let _ = ctx_tx.send(ctx);
            // Another client deletes the key and sets its own value.
            let ours = spy.last_owner(&k).expect("the acquisition's owner");
            let deleted = thief_backend
                .release(&Lease::new(k.as_str(), ours, 0))
                .await;
            assert!(deleted.is_ok(), "{deleted:?}");
            let taken = thief_backend
                .try_acquire(&k, &t, Duration::from_secs(30))
                .await;
            assert!(
                matches!(taken, Ok(AcquireOutcome::Acquired { .. })),
                "{taken:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }),
    )
    .await;
    assert_lost_as(&got, &LossCause::Taken, "a call whose key was replaced");
    let ctx = ctx_rx.await.unwrap();
    assert!(ctx.is_lost(), "the context agrees with the call");
    assert!(matches!(ctx.loss_cause(), Some(LossCause::Taken)));
    // The thief's lock was left alone: only its owner frees it.
    let probe = backend
        .try_acquire(&key, &OwnerToken::new("probe"), SHORT_TTL)
        .await;
    assert!(
        matches!(probe, Ok(AcquireOutcome::Busy { .. })),
        "{probe:?}"
    );
    let freed = backend.release(&Lease::new(key.as_str(), thief, 0)).await;
    assert!(
        matches!(freed, Ok(lock_core::ReleaseOutcome::Released)),
        "{freed:?}"
    );
}

/// \[H6\] A callback never starts on a lease whose validity ran out before
/// its answer came (an acquisition a paused store applied late): that lease
/// is released and counts as a failed attempt, and the callback runs once,
/// on a later, valid lease.
pub async fn h6_callback_never_starts_on_a_late_lease(factory: Arc<dyn BackendFactory>) {
    let backend = factory.backend().await;
    let ns = Namespace::new();
    let key = ns.key("h6");
    let short_ttl = crate::support::scaled(&*backend, SHORT_TTL);
    let faulty = FaultInjector::new(Arc::clone(&backend));
    let counting = CountingBackend::new(faulty.clone());
    faulty.delay_answers(
        Step::TryAcquire,
        1,
        short_ttl + crate::support::scaled(&*backend, Duration::from_millis(200)),
    );
    let a = node(counting.clone(), "a");
    let runs = Arc::new(AtomicU32::new(0));
    let r = Arc::clone(&runs);
    let cfg = patient().ttl(short_ttl);
    let got = within(
        SOON + short_ttl * 2,
        "the call",
        a.with_lock_config(&key, &cfg, move |ctx| async move {
            r.fetch_add(1, Ordering::SeqCst);
            // Long enough for an extension to be due on a stale lease.
            tokio::time::sleep(short_ttl / 2).await;
            ctx.fencing_token()
        }),
    )
    .await;
    assert!(got.is_ok(), "the callback ran on a valid lease: {got:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the callback ran once");
    assert!(
        counting.calls(Step::TryAcquire) >= 2,
        "the late lease was not used: another attempt took the key"
    );
    assert_free(&backend, &key, "after the call").await;
}

/// \[S1\] When `shutdown` returns, the releases it owes were answered: a
/// callback that finished just before, and a handle dropped just before,
/// whose releases were still in flight. The store is checked at once,
/// before any call's own result is awaited.
pub async fn s1_shutdown_returns_after_owed_releases(factory: Arc<dyn BackendFactory>) {
    let backend = factory.backend().await;
    let ns = Namespace::new();
    let (done_key, handle_key) = (ns.key("s1-done"), ns.key("s1-dropped"));
    let faulty = FaultInjector::new(Arc::clone(&backend));
    faulty.delay(Step::Release, Duration::from_millis(300));
    let a = node(faulty.clone(), "a");

    let (finishing_tx, finishing_rx) = oneshot::channel();
    let (l, k) = (a.clone(), done_key.clone());
    let call = tokio::spawn(async move {
        l.with_lock(&k, move |_| async move {
            let _ = finishing_tx.send(());
        })
        .await
    });
    within(SOON, "the callback finishes", finishing_rx)
        .await
        .unwrap();
    let mut handle = a.handle(&handle_key, Duration::from_secs(30)).unwrap();
    assert!(handle.acquire().await.unwrap());
    drop(handle);
    tokio::time::sleep(Duration::from_millis(50)).await;

    let report = within(SOON, "shutdown", a.shutdown(Duration::from_secs(2))).await;
    for key in [&done_key, &handle_key] {
        assert_free(&backend, key, "right after shutdown returned").await;
    }
    assert_eq!(report.release_failures, 0, "{report:?}");
    assert!(report.callbacks_finished);
    within(SOON, "the call", call).await.unwrap().unwrap();
    assert_eq!(a.held(), 0);
}

/// \[O6\] A release that fails on a backend error proves nothing either
/// way: with the validity intact when the callback settled, the call gives
/// the callback's output (the failure is logged and counted, the key
/// expires with its ttl), and so does a retried release that finds the key
/// gone after a try whose answer was lost (that try may have freed it).
/// The call does not wait for the validity to run out to say so.
pub async fn o6_failed_release_after_a_valid_callback_gives_its_output(
    factory: Arc<dyn BackendFactory>,
) {
    let backend = factory.backend().await;
    let ns = Namespace::new();
    let key = ns.key("o6-release");
    let faulty = FaultInjector::new(Arc::clone(&backend));
    let a = node(faulty.clone(), "a");
    // Long enough that "at once" and "after the ttl" cannot be confused.
    let ttl = Duration::from_secs(10);
    let cfg = LockConfig::default().ttl(ttl);

    faulty.fail_next(Step::Release, 2);
    let got = within(
        SOON,
        "a release that fails twice",
        a.with_lock_config(&key, &cfg, |_| async { 1 }),
    )
    .await;
    assert_eq!(
        got.unwrap(),
        1,
        "the output of a callback whose release failed twice"
    );
    crate::support::assert_freed_soon(
        &backend,
        &key,
        "after the release answered on its third try",
    )
    .await;

    // The first release is applied but its answer lost: the second finds
    // the key free, which proves nothing (the first may have freed it).
    faulty.lose_answers(Step::Release, 1);
    let got = within(
        SOON,
        "a release whose answer is lost",
        a.with_lock_config(&key, &cfg, |_| async { 2 }),
    )
    .await;
    assert_eq!(got.unwrap(), 2, "the output after a lost release answer");
    assert_free(&backend, &key, "after the applied release").await;

    faulty.fail_always(Step::Release, true);
    let (ctx_tx, ctx_rx) = oneshot::channel();
    let started = Instant::now();
    let got = within(
        SOON,
        "a release that never answers",
        a.with_lock_config(&key, &cfg, move |ctx| async move {
            let _ = ctx_tx.send(ctx);
            3
        }),
    )
    .await;
    let answered_after = started.elapsed();
    assert_eq!(got.unwrap(), 3, "the output when no release answers");
    assert!(
        answered_after < ttl / 2,
        "answered after {answered_after:?}: the call waited on the release's retries"
    );
    assert!(!ctx_rx.await.unwrap().is_lost(), "the context agrees");
    // The key stays held by the failed releases' owner until its ttl.
    assert_held(&backend, &key, "after releases that failed").await;
    faulty.fail_always(Step::Release, false);
    // The release goes on in the background while the lock is valid: once
    // the store answers again it frees the key, well before the ttl.
    crate::support::assert_freed_soon(&backend, &key, "after the store answers again").await;
}

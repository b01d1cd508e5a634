//! Outcome: what `with_lock` gives back \[O1–O5\].

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use lock_core::{InvalidInput, LockConfig, LockError, LossCause, MIN_TTL};

use crate::counting::CountingBackend;
use crate::faults::{is_injected, FaultInjector, Step};
use crate::support::{
    assert_free, assert_held, node, within, BackendFactory, Namespace, RETRY, SHORT_TTL, SOON,
};

/// \[O1\] The callback's output is given back; an `Err` from the callback is an
/// ordinary output and the lock is released.
pub async fn o1_callback_output_is_returned(factory: Arc<dyn BackendFactory>) {
    let backend = factory.backend().await;
    let ns = Namespace::new();
    let key = ns.key("o1");
    let a = node(Arc::clone(&backend), "a");

    let v = within(SOON, "with_lock", a.with_lock(&key, |_| async { 42 })).await;
    assert_eq!(v.unwrap(), 42, "the callback's value is given back");

    let v = within(
        SOON,
        "with_lock",
        a.with_lock(&key, |_| async { Err::<(), _>("the task failed") }),
    )
    .await;
    assert_eq!(
        v.expect("a callback's own error is not a lock error"),
        Err("the task failed")
    );
    assert_free(&backend, &key, "after a callback returned Err").await;
}

/// \[O2\] A panicking callback releases the lock, then the panic resumes in
/// the caller, in both loss modes.
pub async fn o2_panic_releases_then_resumes(factory: Arc<dyn BackendFactory>) {
    let backend = factory.backend().await;
    let ns = Namespace::new();
    let key = ns.key("o2");
    let a = node(Arc::clone(&backend), "a");

    let (l, k) = (a.clone(), key.clone());
    let joined = tokio::spawn(async move {
        l.with_lock(&k, |_| async { panic!("callback panicked on purpose") })
            .await
    })
    .await;
    let panic = joined.expect_err("the panic resumes in the caller");
    assert!(panic.is_panic());
    let payload = panic.into_panic();
    assert_eq!(
        payload.downcast_ref::<&str>().copied(),
        Some("callback panicked on purpose"),
        "the original panic payload resumes"
    );
    assert_free(&backend, &key, "after a panicking callback").await;

    let (l, k) = (a.clone(), key.clone());
    let joined = tokio::spawn(async move {
        l.with_lock_cancel_on_loss(&k, &LockConfig::default(), |_| async {
            panic!("cancel mode panicked on purpose")
        })
        .await
    })
    .await;
    assert!(joined.expect_err("the panic resumes").is_panic());
    assert_free(&backend, &key, "after a panicking callback in cancel mode").await;
}

/// \[O3\] Acquisition failed after every attempt: the error says how many
/// attempts were made, carries the last backend error, and the callback did
/// not run.
pub async fn o3_not_acquired_says_attempts_and_cause(factory: Arc<dyn BackendFactory>) {
    let backend = factory.backend().await;
    let ns = Namespace::new();
    let key = ns.key("o3");
    let holder = node(Arc::clone(&backend), "holder");
    let mut held = holder.handle(&key, SHORT_TTL * 25).unwrap();
    assert!(held.acquire().await.unwrap());

    let ran = Arc::new(AtomicBool::new(false));
    let r = Arc::clone(&ran);
    let waiter = node(Arc::clone(&backend), "waiter");
    let cfg = LockConfig::default().retry_attempts(2).retry_delay(RETRY);
    let err = within(
        SOON,
        "giving up",
        waiter.with_lock_config(&key, &cfg, move |_| async move {
            r.store(true, Ordering::SeqCst)
        }),
    )
    .await
    .expect_err("the key is held");
    match &err {
        LockError::NotAcquired {
            attempts, source, ..
        } => {
            assert_eq!(*attempts, 3, "retry_attempts(2) means three attempts");
            assert!(source.is_none(), "a busy key is not a backend error");
        }
        other => panic!("expected NotAcquired, got {other:?}"),
    }
    assert!(!err.callback_started());
    assert!(err.is_busy(), "a busy key is busy");
    assert!(!ran.load(Ordering::SeqCst), "the callback must not run");
    held.release().await.unwrap();

    // Every attempt failing on a backend error: the last one is the source.
    let faulty = FaultInjector::new(Arc::clone(&backend));
    faulty.fail_always(Step::TryAcquire, true);
    let c = node(faulty.clone(), "c");
    let err = within(
        SOON,
        "giving up on errors",
        c.with_lock_config(&key, &cfg, |_| async {}),
    )
    .await
    .expect_err("every attempt fails");
    match err {
        LockError::NotAcquired {
            attempts,
            source: Some(source),
            ..
        } => {
            assert_eq!(attempts, 3);
            assert!(is_injected(&source), "the source is the backend's error");
            assert!(
                !LockError::NotAcquired {
                    key: key.clone(),
                    attempts,
                    source: Some(source)
                }
                .is_busy(),
                "a failing backend is not a busy key"
            );
        }
        other => panic!("expected NotAcquired with a source, got {other:?}"),
    }
    assert_free(&backend, &key, "after failed attempts").await;
}

/// \[O3\] An attempt whose answer was lost may still have taken the key:
/// the driver releases it with the attempt's owner token, so nothing stays
/// held for the ttl.
pub async fn o3_attempt_with_lost_answer_leaves_nothing_held(factory: Arc<dyn BackendFactory>) {
    let backend = factory.backend().await;
    let ns = Namespace::new();
    let key = ns.key("o3-lost-answer");
    let faulty = FaultInjector::new(Arc::clone(&backend));
    faulty.lose_answers(Step::TryAcquire, 1);
    let a = node(faulty.clone(), "a");
    let cfg = crate::support::once().ttl(Duration::from_secs(30));
    let err = within(
        SOON,
        "the attempt",
        a.with_lock_config(&key, &cfg, |_| async {}),
    )
    .await
    .expect_err("the answer was lost");
    assert!(
        matches!(&err, LockError::NotAcquired { source: Some(e), .. } if is_injected(e)),
        "got {err:?}"
    );
    // The attempt did take the key, for 30 s; only a release frees it sooner.
    let b = node(Arc::clone(&backend), "b");
    within(
        SOON,
        "the key the lost answer took is released",
        b.with_lock_config(&key, &crate::support::patient(), |_| async {}),
    )
    .await
    .unwrap();
}

/// \[O4\] A lost lock is reported as soon as it is detected, without waiting
/// for the callback, with its cause.
pub async fn o4_lost_is_reported_without_waiting_for_callback(factory: Arc<dyn BackendFactory>) {
    let backend = factory.backend().await;
    let ns = Namespace::new();
    let key = ns.key("o4");
    let faulty = FaultInjector::new(Arc::clone(&backend));
    let a = node(faulty.clone(), "a");
    let cfg = LockConfig::default().ttl(SHORT_TTL);

    let (started_tx, started_rx) = tokio::sync::oneshot::channel();
    let (finish_tx, finish_rx) = tokio::sync::oneshot::channel::<()>();
    let (l, k) = (a.clone(), key.clone());
    let call = tokio::spawn(async move {
        l.with_lock_config(&k, &cfg, move |_| async move {
            let _ = started_tx.send(());
            // Runs until told, long after the loss.
            let _ = finish_rx.await;
        })
        .await
    });
    within(SOON, "callback start", started_rx).await.unwrap();
    faulty.look_stolen(&key, true);
    let err = within(SOON, "loss detection", call)
        .await
        .unwrap()
        .expect_err("the lock was lost");
    assert!(
        matches!(err.loss_cause(), Some(LossCause::Taken)),
        "cause should be Taken, got {err:?}"
    );
    assert!(err.callback_started());
    drop(finish_tx);
}

/// \[O5\] Bad input gives a clear error and touches nothing.
pub async fn o5_bad_input_is_refused_and_touches_nothing(factory: Arc<dyn BackendFactory>) {
    let backend = factory.backend().await;
    let counting = CountingBackend::new(Arc::clone(&backend));
    let a = node(counting.clone(), "a");
    let ns = Namespace::new();
    let max = backend.capabilities().max_key_len;
    let key = ns.key("o5");
    let long = "k".repeat(max + 1);

    let cases: Vec<(&str, LockConfig, InvalidInput)> = vec![
        ("", LockConfig::default(), InvalidInput::EmptyKey),
        (
            &long,
            LockConfig::default(),
            InvalidInput::KeyTooLong { len: max + 1, max },
        ),
        (
            &key,
            LockConfig::default().ttl(Duration::ZERO),
            InvalidInput::ZeroTtl,
        ),
        (
            &key,
            LockConfig::default().ttl(MIN_TTL / 2),
            InvalidInput::TtlTooShort {
                ttl: MIN_TTL / 2,
                min: MIN_TTL,
            },
        ),
        (
            &key,
            LockConfig::default()
                .retry_delay(Duration::ZERO)
                .wait_forever(),
            InvalidInput::ZeroDelayUnlimited,
        ),
    ];
    for (key, cfg, expected) in cases {
        let ran = Arc::new(AtomicBool::new(false));
        let r = Arc::clone(&ran);
        let got = a
            .with_lock_config(key, &cfg, move |_| async move {
                r.store(true, Ordering::SeqCst)
            })
            .await;
        match got {
            Err(LockError::InvalidInput(e)) => assert_eq!(e, expected),
            other => panic!("expected InvalidInput({expected:?}), got {other:?}"),
        }
        assert!(!ran.load(Ordering::SeqCst));
    }
    assert!(matches!(
        a.handle("", SHORT_TTL),
        Err(LockError::InvalidInput(InvalidInput::EmptyKey))
    ));
    assert!(matches!(
        a.handle(&key, Duration::ZERO),
        Err(LockError::InvalidInput(InvalidInput::ZeroTtl))
    ));
    assert_eq!(
        counting.total_calls(),
        0,
        "bad input must not reach the backend"
    );
    assert_eq!(a.held(), 0);
}

/// \[O5\] Keys are opaque strings: spaces, unicode, braces, globs, quotes and
/// SQL metacharacters work, a key of the maximum length works, and keys that
/// a glob or a prefix would confuse stay apart.
pub async fn o5_keys_are_opaque(factory: Arc<dyn BackendFactory>) {
    let backend = factory.backend().await;
    let ns = Namespace::new();
    let a = node(Arc::clone(&backend), "a");
    let max = backend.capabilities().max_key_len;
    let prefix = ns.key("");
    let mut keys: Vec<String> = [
        "with space",
        "ünïcødé ключ 鍵 🔒",
        "{braces}",
        "}{",
        "{}",
        "a{b}c",
        "glob*",
        "glob?",
        "[set]",
        "colon:sep:arated",
        "quote'single",
        "quote\"double",
        "semi;colon",
        "'; DROP TABLE locks; --",
        "back\\slash",
        "percent%_",
        "new\nline",
    ]
    .iter()
    .map(|k| ns.key(k))
    .collect();
    keys.push(format!("{prefix}{}", "x".repeat(max - prefix.len())));
    // Every key held at once: none may collide with another.
    let mut handles = Vec::new();
    for key in &keys {
        let mut h = a.handle(key, SHORT_TTL * 25).unwrap();
        assert!(
            h.acquire()
                .await
                .unwrap_or_else(|e| panic!("key {key:?}: {e}")),
            "key {key:?} should be free"
        );
        handles.push(h);
    }
    // A glob must not match its look-alikes.
    assert_free(&backend, &ns.key("globX"), "a key a glob would match").await;
    assert_free(&backend, &ns.key("{braces"), "a prefix of a key").await;
    for (key, h) in keys.iter().zip(handles.iter_mut()) {
        assert_held(&backend, key, "an odd key held by a handle").await;
        assert!(h.release().await.unwrap(), "key {key:?} released");
        assert_free(&backend, key, "an odd key after release").await;
    }
    let ran = within(
        SOON,
        "with_lock on an odd key",
        a.with_lock(&keys[1], |c| async move { c.key().to_owned() }),
    )
    .await;
    assert_eq!(ran.unwrap(), keys[1]);
}

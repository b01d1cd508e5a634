//! Acquisition: attempts, retries, waiting and release notifications \[A1–A6\].

use std::sync::{Arc, Mutex};
use std::time::Duration;

use lock_core::{LockConfig, LockError};
use tokio::time::Instant;

use crate::counting::CountingBackend;
use crate::faults::{FaultInjector, Step};
use crate::support::{
    node, once, patient, within, BackendFactory, Namespace, RETRY, SHORT_TTL, SOON,
};

fn attempts_of(err: &LockError) -> u32 {
    match err {
        LockError::NotAcquired { attempts, .. } => *attempts,
        other => panic!("expected NotAcquired, got {other:?}"),
    }
}

/// \[A1\] The first attempt is made at once; while the key is held, up to
/// `retry_attempts` more are made, `retry_delay` apart.
pub async fn a1_first_attempt_at_once_then_spaced_retries(factory: Arc<dyn BackendFactory>) {
    let backend = factory.backend().await;
    let ns = Namespace::new();
    let key = ns.key("a1");

    // A free key is taken by the first attempt, long before any retry delay.
    let a = node(Arc::clone(&backend), "a");
    let slow = LockConfig::default().retry_delay(Duration::from_secs(60));
    within(
        SOON,
        "first attempt on a free key",
        a.with_lock_config(&key, &slow, |_| async {}),
    )
    .await
    .unwrap();

    let mut held = a.handle(&key, SHORT_TTL * 25).unwrap();
    assert!(held.acquire().await.unwrap());
    let counting = CountingBackend::new(Arc::clone(&backend));
    let b = node(counting.clone(), "b");
    let delay = Duration::from_millis(60);
    // Unqueued: a waiter of the fair queue renews its place at its
    // heartbeat instead of trying at every slot (f1_* cases).
    let cfg = LockConfig::default()
        .retry_attempts(3)
        .retry_delay(delay)
        .retry_jitter(Duration::ZERO)
        .no_queue();
    let started = Instant::now();
    let err = within(
        SOON,
        "giving up",
        b.with_lock_config(&key, &cfg, |_| async {}),
    )
    .await
    .expect_err("held elsewhere");
    let elapsed = started.elapsed();
    assert_eq!(attempts_of(&err), 4);
    // With notifications, the first busy answer subscribes and tries once
    // more at once (not counted), so no release before the watch is missed;
    // a wake-up is a hint, so a backend may add a spurious one or two.
    let calls = counting.calls(Step::TryAcquire);
    let extra = if backend.capabilities().release_notifications {
        3
    } else {
        0
    };
    assert!(
        (4..=4 + extra).contains(&calls),
        "one attempt at once and three retries, plus extra attempts on wake-ups only: saw {calls}"
    );
    assert!(
        elapsed >= delay * 3,
        "three retries {delay:?} apart take at least {:?}, took {elapsed:?}",
        delay * 3
    );
    held.release().await.unwrap();
}

/// \[A2\] With the defaults a call gives up after 11 attempts, about 2 s.
pub async fn a2_defaults_give_up_after_eleven_attempts(factory: Arc<dyn BackendFactory>) {
    let backend = factory.backend().await;
    let ns = Namespace::new();
    let key = ns.key("a2");
    let a = node(Arc::clone(&backend), "a");
    let mut held = a.handle(&key, Duration::from_secs(30)).unwrap();
    assert!(held.acquire().await.unwrap());

    let b = node(Arc::clone(&backend), "b");
    let started = Instant::now();
    let err = within(
        Duration::from_secs(15),
        "default give-up",
        b.with_lock(&key, |_| async {}),
    )
    .await
    .expect_err("held elsewhere");
    let elapsed = started.elapsed();
    assert_eq!(attempts_of(&err), 11);
    // Ten delays of 200 ms ± 100 ms: 2 s on average, never under 1 s.
    assert!(
        elapsed >= Duration::from_millis(1000) && elapsed < Duration::from_secs(4),
        "ten retries about 200 ms apart take about 2 s, took {elapsed:?}"
    );
    held.release().await.unwrap();
}

/// \[A3\] `retry_attempts = 0` is a single attempt and an immediate error.
pub async fn a3_retry_zero_is_single_attempt(factory: Arc<dyn BackendFactory>) {
    let backend = factory.backend().await;
    let ns = Namespace::new();
    let key = ns.key("a3");
    let a = node(Arc::clone(&backend), "a");
    let mut held = a.handle(&key, SHORT_TTL * 25).unwrap();
    assert!(held.acquire().await.unwrap());

    let counting = CountingBackend::new(Arc::clone(&backend));
    let b = node(counting.clone(), "b");
    let cfg = once().retry_delay(Duration::from_secs(60));
    let err = within(
        SOON,
        "single attempt",
        b.with_lock_config(&key, &cfg, |_| async {}),
    )
    .await
    .expect_err("held elsewhere");
    assert_eq!(attempts_of(&err), 1);
    assert_eq!(counting.calls(Step::TryAcquire), 1);

    // Within one node too: a second task gives up at once.
    let (inside_tx, inside_rx) = tokio::sync::oneshot::channel();
    let (done_tx, done_rx) = tokio::sync::oneshot::channel::<()>();
    let (l, k) = (b.clone(), ns.key("a3-local"));
    let first = tokio::spawn(async move {
        l.with_lock(&k, move |_| async move {
            let _ = inside_tx.send(());
            let _ = done_rx.await;
        })
        .await
    });
    within(SOON, "first task inside", inside_rx).await.unwrap();
    let err = within(
        SOON,
        "single local attempt",
        b.with_lock_config(&ns.key("a3-local"), &cfg, |_| async {}),
    )
    .await
    .expect_err("held by another task");
    assert_eq!(attempts_of(&err), 1);
    drop(done_tx);
    within(SOON, "first task", first).await.unwrap().unwrap();
    held.release().await.unwrap();
}

/// \[A4\] Unlimited attempts wait as long as it takes: well past what the
/// default budget would allow at the same delay.
pub async fn a4_unlimited_waits_as_long_as_it_takes(factory: Arc<dyn BackendFactory>) {
    let backend = factory.backend().await;
    let ns = Namespace::new();
    let key = ns.key("a4");
    let a = node(Arc::clone(&backend), "a");
    let mut held = a.handle(&key, SHORT_TTL * 25).unwrap();
    assert!(held.acquire().await.unwrap());

    let b = node(Arc::clone(&backend), "b");
    let (l, k) = (b.clone(), key.clone());
    let waiter = tokio::spawn(async move {
        l.with_lock_config(&k, &patient(), |c| async move { c.fencing_token() })
            .await
    });
    // Eleven attempts RETRY apart would have given up by now.
    tokio::time::sleep(RETRY * 30).await;
    assert!(!waiter.is_finished(), "an unlimited waiter must still wait");
    held.release().await.unwrap();
    let token = within(SOON, "the waiter gets the lock", waiter)
        .await
        .unwrap();
    assert!(token.is_ok(), "got {token:?}");
}

/// \[A5\] A release notification triggers an extra attempt at once, so a
/// waiter gets a freed lock long before its retry delay; extra attempts do
/// not use up the budget. A backend without notifications declares it and
/// waiters fall back to the retry timer.
pub async fn a5_release_notification_wakes_waiter(factory: Arc<dyn BackendFactory>) {
    let backend = factory.backend().await;
    let ns = Namespace::new();
    let key = ns.key("a5");
    let notifies = backend.capabilities().release_notifications;
    let a = node(Arc::clone(&backend), "a");
    let mut held = a.handle(&key, SHORT_TTL * 25).unwrap();
    assert!(held.acquire().await.unwrap());

    let seen = CountingBackend::new(Arc::clone(&backend));
    let b = node(seen.clone(), "b");
    // With notifications a 30 s delay must not matter; without them the
    // waiter falls back to its retry timer.
    let cfg = if notifies {
        LockConfig::default()
            .retry_attempts(3)
            .retry_delay(Duration::from_secs(30))
    } else {
        patient()
    };
    let (l, k) = (b.clone(), key.clone());
    let waiter = tokio::spawn(async move { l.with_lock_config(&k, &cfg, |_| async {}).await });
    // The release comes once the waiter waits: it found the key busy and,
    // with notifications, watches it (the attempt right after the watch
    // is in place found it busy too), so only the notification can bring
    // it in before its 30 s delay.
    let busy_answers = if notifies { 2 } else { 1 };
    within(
        SOON,
        "the waiter finds the key busy",
        seen.until_answered(Step::TryAcquire, busy_answers),
    )
    .await;
    if notifies {
        assert_eq!(
            seen.answers(Step::WatchRelease),
            1,
            "the waiter watches the key"
        );
    }
    assert!(!waiter.is_finished(), "the key is held: the waiter waits");
    let released_at = Instant::now();
    assert!(held.release().await.unwrap());
    within(SOON, "the waiter after a release", waiter)
        .await
        .unwrap()
        .expect("the waiter gets the freed lock");
    assert!(
        released_at.elapsed() < SOON,
        "handoff took {:?}",
        released_at.elapsed()
    );

    if notifies {
        // Spurious wake-ups make extra attempts that do not count.
        let faulty = FaultInjector::new(Arc::clone(&backend));
        let counting = CountingBackend::new(faulty.clone());
        let c = node(counting.clone(), "c");
        assert!(held.acquire().await.unwrap());
        let delay = Duration::from_millis(300);
        let cfg = LockConfig::default()
            .retry_attempts(2)
            .retry_delay(delay)
            .retry_jitter(Duration::ZERO);
        let (l, k) = (c.clone(), key.clone());
        let started = Instant::now();
        let waiter = tokio::spawn(async move { l.with_lock_config(&k, &cfg, |_| async {}).await });
        let mut woken = 0;
        while !waiter.is_finished() && woken < 50 {
            tokio::time::sleep(Duration::from_millis(20)).await;
            faulty.notify_without_release(&key);
            woken += 1;
        }
        let err = within(SOON, "giving up", waiter)
            .await
            .unwrap()
            .expect_err("still held");
        assert_eq!(attempts_of(&err), 3, "extra attempts must not count");
        assert!(
            counting.calls(Step::TryAcquire) > 3,
            "wake-ups must trigger extra attempts, saw {}",
            counting.calls(Step::TryAcquire)
        );
        assert!(
            started.elapsed() >= delay * 2,
            "the give-up time stays as configured, took {:?}",
            started.elapsed()
        );
        held.release().await.unwrap();
    }
}

/// \[A6\] Waiters inside one process on one key do not each poll the backend:
/// one wait list per key, served in arrival order, with the lock released in
/// the backend between two holders.
pub async fn a6_local_waiters_queue_without_polling(factory: Arc<dyn BackendFactory>) {
    let backend = factory.backend().await;
    let ns = Namespace::new();
    let key = ns.key("a6");
    let other = node(Arc::clone(&backend), "other");
    let mut held = other.handle(&key, SHORT_TTL * 25).unwrap();
    assert!(held.acquire().await.unwrap());

    let counting = CountingBackend::new(Arc::clone(&backend));
    let local = node(counting.clone(), "local");
    let delay = Duration::from_millis(100);
    let cfg = LockConfig::default()
        .wait_forever()
        .retry_delay(delay)
        .retry_jitter(Duration::ZERO);
    let order = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    let waited = Instant::now();
    for i in 0..5 {
        let (l, k, o) = (local.clone(), key.clone(), Arc::clone(&order));
        tasks.push(tokio::spawn(async move {
            l.with_lock_config(&k, &cfg, move |_| async move {
                o.lock().unwrap().push(i);
            })
            .await
        }));
        // Let each task take its place before the next arrives.
        tokio::time::sleep(Duration::from_millis(40)).await;
    }
    tokio::time::sleep(delay * 5).await;
    let polls = counting.calls(Step::TryAcquire);
    let slots = (waited.elapsed().as_millis() / delay.as_millis()) as u64 + 4;
    assert!(
        polls <= slots,
        "five local waiters made {polls} attempts in {:?}; one poller makes at most {slots}",
        waited.elapsed()
    );
    held.release().await.unwrap();
    for t in tasks {
        within(SOON, "every local waiter runs", t)
            .await
            .unwrap()
            .unwrap();
    }
    assert_eq!(*order.lock().unwrap(), vec![0, 1, 2, 3, 4], "arrival order");
    assert_eq!(
        counting.calls(Step::Release),
        5,
        "each holder releases in the backend, so other nodes get their turn"
    );
}

/// \[A7\] The delays between two counted attempts are jittered around
/// `retry_delay`, so waiters behind a client that publishes nothing do not
/// fire together; each stays within `retry_delay ± retry_jitter`.
pub async fn a7_retry_delays_are_jittered(factory: Arc<dyn BackendFactory>) {
    let backend = factory.backend().await;
    let ns = Namespace::new();
    let key = ns.key("a7");
    let holder = node(Arc::clone(&backend), "holder");
    let mut held = holder.handle(&key, SHORT_TTL * 25).unwrap();
    assert!(held.acquire().await.unwrap());

    let counting = CountingBackend::new(Arc::clone(&backend));
    let waiter = node(counting.clone(), "waiter");
    let delay = Duration::from_millis(40);
    let jitter = Duration::from_millis(20);
    // Unqueued: a waiter of the fair queue is woken by its grant.
    let cfg = LockConfig::default()
        .retry_attempts(12)
        .retry_delay(delay)
        .retry_jitter(jitter)
        .no_queue();
    let err = within(
        SOON,
        "giving up",
        waiter.with_lock_config(&key, &cfg, |_| async {}),
    )
    .await
    .expect_err("held elsewhere");
    assert_eq!(attempts_of(&err), 13);
    // Wake-ups add extra attempts right after a counted one; the counted
    // attempts are those at least `delay - jitter` after the one before.
    let times = counting.attempt_times();
    let mut gaps = Vec::new();
    let mut last = times[0];
    for t in &times[1..] {
        let gap = *t - last;
        if gap + Duration::from_millis(2) >= delay - jitter {
            gaps.push(gap);
            last = *t;
        }
    }
    assert!(gaps.len() >= 10, "counted gaps: {gaps:?}");
    let spread = *gaps.iter().max().unwrap() - *gaps.iter().min().unwrap();
    assert!(
        spread >= Duration::from_millis(8),
        "delays must not sit on an exact grid: {gaps:?}"
    );
    held.release().await.unwrap();
}

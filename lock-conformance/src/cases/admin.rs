//! The operator's functions: list, inspect and force release agree with
//! the locks the nodes hold \[D1\], a forced release changes nothing on a
//! free key \[D2\], and it wakes the key's waiters \[L5\].
//!
//! Each case runs on the admin of the factory's store
//! ([`BackendFactory::with_admin`]); on a factory declared
//! [`without_admin`](crate::without_admin) it passes, saying so.

use std::sync::Arc;
use std::time::Duration;

use lock_core::{LockConfig, LockHandle};

use crate::counting::CountingBackend;
use crate::faults::Step;
use crate::support::{
    assert_free, assert_held, node, once, patient, within, AdminStore, BackendFactory, Namespace,
    SHORT_TTL, SOON,
};

/// The store of the case, or `None` (said on stderr) for a factory
/// declared without an admin.
async fn admin_store(factory: &Arc<dyn BackendFactory>, case: &str) -> Option<AdminStore> {
    let store = factory.with_admin().await;
    if store.is_none() {
        eprintln!("{case}: the factory is declared without admin functions");
    }
    store
}

/// A handle on `key` taken by a node named `name`, and the owner token it
/// holds the key with.
async fn hold(store: &AdminStore, key: &str, name: &str) -> (LockHandle, String) {
    let counting = CountingBackend::new(Arc::clone(&store.backend));
    let mut handle = node(counting.clone(), name)
        .handle(key, SHORT_TTL * 25)
        .unwrap();
    assert!(handle.acquire().await.unwrap(), "{key:?} is free");
    let owner = counting.last_owner(key).expect("an acquisition was made");
    (handle, owner.as_str().to_owned())
}

/// Waits until `waiter` has tried `key` at least `n` times.
async fn tried(waiter: &CountingBackend<Arc<lock_core::DynLockBackend>>, n: u64, what: &str) {
    within(SOON, what, async {
        while waiter.calls(Step::TryAcquire) < n {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await;
}

/// \[D1\] What the admin shows of a held key is its holder's: the owner
/// token, a ttl within the lock's, the fencing token; `list_locks` gives
/// the held keys under a prefix in key order and no free one;
/// `force_release` gives back the holder, and then the key is free, its
/// holder has lost it, and another node takes it with a greater token.
pub async fn d1_list_inspect_force_release_agree_with_the_lock(factory: Arc<dyn BackendFactory>) {
    let Some(store) = admin_store(&factory, "d1").await else {
        return;
    };
    let ns = Namespace::new();
    let (a, b, c) = (ns.key("d1-a"), ns.key("d1-b"), ns.key("d1-c"));
    // Taken in another order than the keys', so that the order is the
    // listing's own.
    let (mut held_b, owner_b) = hold(&store, &b, "node-b").await;
    let (mut held_a, owner_a) = hold(&store, &a, "node-a").await;
    let (mut released, _) = hold(&store, &c, "node-c").await;
    assert!(released.release().await.unwrap());

    let info = store.admin.inspect(&a).await.unwrap();
    assert_eq!(info.key, a);
    assert!(info.is_held(), "{info:?}");
    assert!(info.is_withlock_lock(), "{info:?}");
    assert_eq!(
        info.owner.as_ref().map(|o| o.as_str()),
        Some(owner_a.as_str())
    );
    assert_eq!(info.node_id(), Some("node-a"));
    let ttl = info.ttl.expect("a withlock lock has an expiry");
    assert!(
        ttl > Duration::ZERO && ttl <= SHORT_TTL * 25,
        "ttl {ttl:?} of a {:?} lock",
        SHORT_TTL * 25
    );
    let token_a = held_a.fencing_token().unwrap();
    assert_eq!(info.fencing_token, Some(token_a), "{info:?}");
    assert!(info.last_owner.is_none(), "{info:?}");

    let listed = store.admin.list_locks(&ns.key("")).await.unwrap();
    let keys: Vec<&str> = listed.iter().map(|i| i.key.as_str()).collect();
    assert_eq!(keys, [a.as_str(), b.as_str()], "{listed:?}");
    assert_eq!(listed[0].owner, info.owner);
    assert_eq!(listed[0].fencing_token, Some(token_a));
    assert!(
        listed[0].ttl.is_some_and(|t| t <= SHORT_TTL * 25),
        "{listed:?}"
    );
    assert_eq!(listed[1].node_id(), Some("node-b"));
    assert_eq!(
        listed[1].owner.as_ref().map(|o| o.as_str()),
        Some(owner_b.as_str())
    );
    assert_eq!(listed[1].fencing_token, held_b.fencing_token());
    let narrower = store.admin.list_locks(&ns.key("d1-b")).await.unwrap();
    assert_eq!(narrower.len(), 1, "{narrower:?}");
    assert_eq!(narrower[0].key, b);

    let freed = store
        .admin
        .force_release(&a)
        .await
        .unwrap()
        .expect("a held key is freed and given back");
    assert_eq!(freed.key, a);
    assert_eq!(
        freed.owner.as_ref().map(|o| o.as_str()),
        Some(owner_a.as_str())
    );
    assert_eq!(freed.fencing_token, Some(token_a));
    let after = store.admin.inspect(&a).await.unwrap();
    assert!(!after.is_held(), "{after:?}");
    assert_eq!(after.ttl, None);
    assert_eq!(
        after.fencing_token,
        Some(token_a),
        "the fencing record outlives the lock"
    );
    let listed = store.admin.list_locks(&ns.key("")).await.unwrap();
    let keys: Vec<&str> = listed.iter().map(|i| i.key.as_str()).collect();
    assert_eq!(keys, [b.as_str()], "{listed:?}");
    assert_held(&store.backend, &b, "the other key is untouched").await;
    assert!(
        !held_a.renew().await.unwrap(),
        "the holder finds its lock gone at its next extension"
    );
    let next = node(Arc::clone(&store.backend), "node-next");
    let token = within(
        SOON,
        "another node takes the freed key",
        next.with_lock_config(&a, &once(), |ctx| async move { ctx.fencing_token() }),
    )
    .await
    .expect("the freed key is free");
    assert!(token > token_a, "token {token} after {token_a}");
    assert!(held_b.release().await.unwrap());
}

/// \[D2\] A forced release of a free key, never used or released, gives
/// `None` and changes nothing: the key stays free with the same fencing
/// record, and the listing stays as it was.
pub async fn d2_force_release_of_a_free_key_changes_nothing(factory: Arc<dyn BackendFactory>) {
    let Some(store) = admin_store(&factory, "d2").await else {
        return;
    };
    let ns = Namespace::new();
    let never = ns.key("d2-never");
    assert!(store.admin.force_release(&never).await.unwrap().is_none());
    let info = store.admin.inspect(&never).await.unwrap();
    assert!(!info.is_held() && info.fencing_token.is_none(), "{info:?}");

    let used = ns.key("d2-used");
    let (mut handle, _) = hold(&store, &used, "node-a").await;
    let token = handle.fencing_token();
    assert!(handle.release().await.unwrap());
    let before = store.admin.inspect(&used).await.unwrap();
    assert!(!before.is_held(), "{before:?}");
    assert_eq!(before.fencing_token, token);
    assert!(store.admin.force_release(&used).await.unwrap().is_none());
    assert_eq!(store.admin.inspect(&used).await.unwrap(), before);
    assert!(store
        .admin
        .list_locks(&ns.key(""))
        .await
        .unwrap()
        .is_empty());
    assert_free(&store.backend, &used, "the key is still free").await;
}

/// \[L5\] A forced release announces the key on the release
/// notifications, as a release does: a node waiting for it with a 10 s
/// retry delay gets it at once. A backend without notifications declares
/// so, and its waiters get the key at their next retry.
pub async fn l5_force_release_wakes_waiters(factory: Arc<dyn BackendFactory>) {
    let Some(store) = admin_store(&factory, "l5").await else {
        return;
    };
    let ns = Namespace::new();
    let key = ns.key("l5");
    let (mut held, _) = hold(&store, &key, "node-a").await;
    let notifies = store.backend.capabilities().release_notifications;
    let waiter = CountingBackend::new(Arc::clone(&store.backend));
    let b = node(waiter.clone(), "node-b");
    let cfg = if notifies {
        LockConfig::default()
            .retry_attempts(3)
            .retry_delay(Duration::from_secs(10))
    } else {
        patient()
    };
    let k = key.clone();
    let waiting = tokio::spawn(async move {
        b.with_lock_config(&k, &cfg, |ctx| async move { ctx.fencing_token() })
            .await
    });
    // With notifications the driver watches the key once it is found
    // busy, then tries again: after the second attempt began, the release
    // cannot be missed.
    tried(
        &waiter,
        if notifies { 2 } else { 1 },
        "the waiter tries the key",
    )
    .await;
    assert!(store.admin.force_release(&key).await.unwrap().is_some());
    let token = within(
        SOON,
        "the waiter after a forced release (its retry delay is 10 s)",
        waiting,
    )
    .await
    .unwrap()
    .expect("the waiter gets the freed key");
    assert!(token > held.fencing_token().unwrap());
    if notifies {
        assert!(
            waiter.calls(Step::WatchRelease) >= 1,
            "the waiter watched the key"
        );
    }
    assert!(!held.renew().await.unwrap(), "the holder lost the key");
}

/// \[L5\] A forced release is found by its holder within about a second,
/// not at its next extension: the holder's callback, whose lock's first
/// extension is 10 s away, sees the loss and its call answers `Lost`
/// (`Taken`) soon after. Both when the release comes at once after the
/// acquisition (before the holder watches its key) and when it comes
/// after the holder watched its key. A backend without notifications finds
/// it at its next extension, which the case then makes come sooner.
pub async fn l5_force_release_is_found_by_its_holder_at_once(factory: Arc<dyn BackendFactory>) {
    let Some(store) = admin_store(&factory, "l5").await else {
        return;
    };
    let notifies = store.backend.capabilities().release_notifications;
    // With notifications the first extension comes after SOON: an answer
    // within SOON is the notification's.
    let ttl = if notifies {
        SHORT_TTL * 75
    } else {
        crate::support::scaled(&*store.backend, SHORT_TTL * 5)
    };
    let ns = Namespace::new();
    for (case, after_the_watch) in [("at once", false), ("after the watch", true)] {
        let key = ns.key(if after_the_watch {
            "l5-late"
        } else {
            "l5-soon"
        });
        let counting = CountingBackend::new(Arc::clone(&store.backend));
        let holder = node(counting.clone(), "node-a");
        let (started_tx, started) = tokio::sync::oneshot::channel();
        let k = key.clone();
        let cfg = LockConfig::default().ttl(ttl);
        let call = tokio::spawn(async move {
            holder
                .with_lock_config(&k, &cfg, |ctx| async move {
                    let _ = started_tx.send(ctx.fencing_token());
                    ctx.lost().await;
                })
                .await
        });
        let token = within(SOON, "the holder's callback starts", started)
            .await
            .unwrap();
        // Counted from here: the check the watch makes once in place may
        // already be on its way when the release comes, and its answer
        // then finds the key gone.
        let extensions = counting.calls(Step::Extend);
        if after_the_watch && notifies {
            within(SOON, "the holder watches its key", async {
                while counting.calls(Step::WatchRelease) < 1 {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            })
            .await;
        }
        let freed = store.admin.force_release(&key).await.unwrap();
        assert_eq!(
            freed.and_then(|info| info.fencing_token),
            Some(token),
            "{case}: the forced release freed the holder's lock"
        );
        let got = within(
            SOON,
            &format!("{case}: the holder told of a forced release (its ttl is {ttl:?})"),
            call,
        )
        .await
        .unwrap();
        crate::support::assert_lost_as(&got, &lock_core::LossCause::Taken, case);
        assert!(
            counting.calls(Step::Extend) > extensions,
            "{case}: an extension since the callback began found the key gone"
        );
    }
}

/// \[H7, D1\] The admin tells a lock kept by its minimum hold from a
/// running one. While its callback runs, `inspect` and `list_locks` show
/// the key held with no [`minimum_hold_left`](lock_core::LockInfo::minimum_hold_left);
/// once the callback settled before its minimum, the same holder and
/// token, kept, with the hold's time left. A kept lock that is force
/// released and taken by another node shows that node's run as running
/// (the record of the hold named the old holder), then kept once that
/// run ends too; and after the hold the key is free and shows no hold.
pub async fn h7_the_admin_tells_a_kept_lock_from_a_running_one(factory: Arc<dyn BackendFactory>) {
    let Some(store) = admin_store(&factory, "h7").await else {
        return;
    };
    // Long against the reads below on a loaded machine.
    let hold = Duration::from_secs(5);
    // The most a store may keep the key past the hold: etcd's leases are
    // whole seconds with a floor.
    let bound = hold.max(store.backend.capabilities().min_ttl) + Duration::from_secs(1);
    let ns = Namespace::new();
    let key = ns.key("h7-admin");
    let cfg = once().hold_at_least(hold);

    // A node's run on `key`: told when its callback runs, ended on `go`.
    let run = |name: &str| {
        let locker = node(Arc::clone(&store.backend), name);
        let (running_tx, running) = tokio::sync::oneshot::channel();
        let (go, go_rx) = tokio::sync::oneshot::channel::<()>();
        let (k, cfg) = (key.clone(), cfg);
        let call = tokio::spawn(async move {
            locker
                .with_lock_config(&k, &cfg, move |ctx| async move {
                    let _ = running_tx.send(ctx.fencing_token());
                    let _ = go_rx.await;
                })
                .await
        });
        (running, go, call)
    };
    let check = |info: &lock_core::LockInfo, kept: bool, what: &str| {
        assert!(info.is_held(), "{what}: {info:?}");
        assert_eq!(info.is_kept(), kept, "{what}: {info:?}");
        if let Some(left) = info.minimum_hold_left {
            assert!(
                left > Duration::ZERO && left <= bound,
                "{what}: {left:?} left of a {hold:?} hold: {info:?}"
            );
        }
    };
    let listed = |store: AdminStore| {
        let prefix = ns.key("");
        async move {
            let listed = store.admin.list_locks(&prefix).await.unwrap();
            assert_eq!(listed.len(), 1, "{listed:?}");
            listed.into_iter().next().unwrap()
        }
    };

    let (running, go, call) = run("node-a");
    let token = within(SOON, "the first callback runs", running)
        .await
        .unwrap();
    let info = store.admin.inspect(&key).await.unwrap();
    check(&info, false, "inspect while the callback runs");
    assert_eq!(info.fencing_token, Some(token));
    assert_eq!(info.node_id(), Some("node-a"));
    let owner = info.owner.clone();
    check(&listed(store.clone()).await, false, "listed while running");

    go.send(()).unwrap();
    within(SOON, "the first call", call)
        .await
        .unwrap()
        .expect("the callback's output");
    let kept = store.admin.inspect(&key).await.unwrap();
    check(&kept, true, "inspect after the callback settled");
    assert_eq!(kept.owner, owner, "the same holder");
    assert_eq!(kept.fencing_token, Some(token));
    let listed_kept = listed(store.clone()).await;
    check(&listed_kept, true, "listed after the callback settled");
    assert_eq!(listed_kept.owner, owner);

    let freed = store
        .admin
        .force_release(&key)
        .await
        .unwrap()
        .expect("a kept lock is a withlock lock, and is freed");
    assert_eq!(freed.owner, owner);
    let (running, go, call) = run("node-b");
    let next_token = within(SOON, "the second callback runs", running)
        .await
        .unwrap();
    assert!(next_token > token);
    let info = store.admin.inspect(&key).await.unwrap();
    check(&info, false, "the next node's run, after a forced release");
    assert_eq!(info.node_id(), Some("node-b"));
    check(&listed(store.clone()).await, false, "listed: the next run");
    go.send(()).unwrap();
    within(SOON, "the second call", call)
        .await
        .unwrap()
        .expect("the callback's output");
    let kept = store.admin.inspect(&key).await.unwrap();
    check(&kept, true, "the next node's run ended in its hold too");
    assert_eq!(kept.node_id(), Some("node-b"));

    let waiter = node(Arc::clone(&store.backend), "node-c");
    within(
        bound + SOON,
        "another node takes the key after the hold",
        waiter.with_lock_config(&key, &crate::support::patient(), |_| async {}),
    )
    .await
    .expect("the key is free after its hold");
    let after = store.admin.inspect(&key).await.unwrap();
    assert!(
        !after.is_held() && after.minimum_hold_left.is_none(),
        "{after:?}"
    );
}

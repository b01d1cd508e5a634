//! Reentrancy: same key, same locker, same task \[R1–R4\].

use std::sync::Arc;

use lock_core::{LockError, Locker};

use crate::counting::CountingBackend;
use crate::faults::Step;
use crate::support::{node, once, within, BackendFactory, Namespace, SOON};

async fn nested(locker: Locker, key: String) -> Result<u64, LockError> {
    // Its own config would give up at once if it had to wait.
    locker
        .with_lock_config(&key, &once(), |ctx| async move { ctx.fencing_token() })
        .await
}

/// \[R1\] A `with_lock` on the same key and locker from inside the callback,
/// directly or from anything it awaits, runs at once with no backend round
/// trip; its config is ignored.
pub async fn r1_reentrant_call_runs_without_round_trip(factory: Arc<dyn BackendFactory>) {
    let backend = factory.backend().await;
    let ns = Namespace::new();
    let key = ns.key("r1");
    let counting = CountingBackend::new(Arc::clone(&backend));
    let a = node(counting.clone(), "a");
    let (l, k, c) = (a.clone(), key.clone(), counting.clone());
    let out = within(
        SOON,
        "reentrant calls",
        a.with_lock(&key, move |outer| async move {
            let before = c.total_calls();
            let direct = l
                .with_lock_config(&k, &once(), |ctx| async move { ctx.fencing_token() })
                .await
                .expect("a direct reentrant call runs");
            let through = nested(l.clone(), k.clone())
                .await
                .expect("a reentrant call from an awaited function runs");
            let deeper = l
                .with_lock(&k, |_| nested(l.clone(), k.clone()))
                .await
                .expect("reentrant twice")
                .expect("reentrant twice");
            assert_eq!(c.total_calls(), before, "no backend round trip");
            (outer.fencing_token(), direct, through, deeper)
        }),
    )
    .await
    .unwrap();
    assert_eq!(out.0, out.1);
    assert_eq!(out.0, out.2);
    assert_eq!(out.0, out.3);
    assert_eq!(
        counting.calls(Step::TryAcquire),
        1,
        "one acquisition for the whole nest"
    );
    assert_eq!(
        counting.calls(Step::Release),
        1,
        "one release for the whole nest"
    );
}

/// \[R2\] Any other call on that key, from another task of the same process
/// or from another node, waits for the lock.
pub async fn r2_other_tasks_and_nodes_wait(factory: Arc<dyn BackendFactory>) {
    let backend = factory.backend().await;
    let ns = Namespace::new();
    let key = ns.key("r2");
    let a = node(Arc::clone(&backend), "a");
    let b = node(Arc::clone(&backend), "b");
    let (l, k) = (a.clone(), key.clone());
    within(
        SOON,
        "the outer call",
        a.with_lock(&key, move |_| async move {
            let (l2, k2) = (l.clone(), k.clone());
            let other_task = tokio::spawn(async move { nested(l2, k2).await })
                .await
                .unwrap();
            assert!(
                matches!(other_task, Err(LockError::NotAcquired { .. })),
                "another task of this node must wait, got {other_task:?}"
            );
            let other_node = nested(b, k).await;
            assert!(
                matches!(other_node, Err(LockError::NotAcquired { .. })),
                "another node must wait, got {other_node:?}"
            );
        }),
    )
    .await
    .unwrap();
}

/// \[R3\] A task spawned from inside the callback waits, unless the callback
/// hands it the lock context with `LockContext::scope`; a carried task runs
/// only while the lock is held, and is stopped when the call that took the
/// lock releases it.
pub async fn r3_spawned_task_needs_the_context_carried(factory: Arc<dyn BackendFactory>) {
    let backend = factory.backend().await;
    let ns = Namespace::new();
    let key = ns.key("r3");
    let a = node(Arc::clone(&backend), "a");
    let (l, k) = (a.clone(), key.clone());
    let (lingering_tx, lingering_rx) = tokio::sync::oneshot::channel();
    within(
        SOON,
        "the outer call",
        a.with_lock(&key, move |ctx| async move {
            let plain = tokio::spawn(nested(l.clone(), k.clone())).await.unwrap();
            assert!(
                matches!(plain, Err(LockError::NotAcquired { .. })),
                "a spawned task is another task, got {plain:?}"
            );
            let carried = tokio::spawn(ctx.scope(nested(l.clone(), k.clone())))
                .await
                .unwrap();
            assert_eq!(
                carried
                    .expect("the lock is held while the carried task runs")
                    .expect("a task given the context is reentrant"),
                ctx.fencing_token()
            );
            // A carried task still running when the outer call ends.
            let lingering = tokio::spawn(ctx.scope(std::future::pending::<()>()));
            let _ = lingering_tx.send(lingering);
        }),
    )
    .await
    .unwrap();
    let lingering = within(SOON, "the lingering task", lingering_rx.await.unwrap())
        .await
        .unwrap();
    assert!(
        matches!(
            lingering,
            Err(LockError::Lost {
                cause: lock_core::LossCause::Released,
                ..
            })
        ),
        "a carried task is stopped when the lock is released, got {lingering:?}"
    );
}

/// \[R4\] Two lockers never share reentrancy, even for equal keys.
pub async fn r4_lockers_never_share_reentrancy(factory: Arc<dyn BackendFactory>) {
    let backend = factory.backend().await;
    let ns = Namespace::new();
    let key = ns.key("r4");
    let a = node(Arc::clone(&backend), "a");
    let b = node(Arc::clone(&backend), "b");
    let k = key.clone();
    within(
        SOON,
        "the outer call",
        a.with_lock(&key, move |_| async move {
            let other = nested(b, k).await;
            assert!(
                matches!(other, Err(LockError::NotAcquired { .. })),
                "another locker is another node, got {other:?}"
            );
        }),
    )
    .await
    .unwrap();
}

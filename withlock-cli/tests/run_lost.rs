//! A lock taken away while the command runs: the command is terminated
//! (SIGTERM, then SIGKILL after --grace) and withlock exits 79, whatever
//! the command returned.

mod common;

use std::time::{Duration, Instant};

use common::{alive, appears, code, stderr, Scratch, Store, Tamper};

/// The command exits 0 on SIGTERM: withlock still says "lost".
async fn a_stolen_lock_terminates_the_command(store: Store) {
    let key = store.key("stolen");
    let scratch = Scratch::new();
    let script = format!(
        "trap 'echo term > {term}; exit 0' TERM; echo $$ > {pid}; \
         while :; do sleep 0.05; done",
        term = scratch.sh("term"),
        pid = scratch.sh("pid"),
    );
    let child = store
        .cmd("run")
        .args([
            "--ttl", "1s", "--grace", "5s", "--key", &key, "--", "sh", "-c", &script,
        ])
        .spawn()
        .unwrap();
    let pid: i32 = appears(&scratch.path("pid")).await.trim().parse().unwrap();
    store.steal(&key).await;
    let stolen_at = Instant::now();
    let output = common::wait(child).await;
    let took = stolen_at.elapsed();
    assert_eq!(code(&output), 79, "{}", stderr(&output));
    assert!(took < Duration::from_secs(3), "noticed after {took:?}");
    assert!(scratch.path("term").exists(), "the command got no SIGTERM");
    assert!(!alive(pid));
    let message = stderr(&output);
    assert!(message.contains("lost the lock"), "{message}");
    assert!(message.contains("another owner"), "{message}");
    // The new owner's lock is left alone.
    assert_eq!(
        store.stored(&key).await.owner.as_deref(),
        Some("thief/0123456789abcdef0123456789abcdef")
    );
}

/// A command (and a child of its own) that ignore SIGTERM are killed
/// after the grace period.
async fn a_command_ignoring_sigterm_is_killed_after_grace(store: Store) {
    let key = store.key("stubborn");
    let scratch = Scratch::new();
    let script = format!(
        "trap '' TERM; sleep 60 & echo $! > {grandchild}; echo $$ > {pid}; \
         while :; do sleep 0.05; done",
        grandchild = scratch.sh("grandchild"),
        pid = scratch.sh("pid"),
    );
    let child = store
        .cmd("run")
        .args([
            "--ttl", "1s", "--grace", "1s", "--key", &key, "--", "sh", "-c", &script,
        ])
        .spawn()
        .unwrap();
    let pid: i32 = appears(&scratch.path("pid")).await.trim().parse().unwrap();
    let grandchild: i32 = appears(&scratch.path("grandchild"))
        .await
        .trim()
        .parse()
        .unwrap();
    store.steal(&key).await;
    let stolen_at = Instant::now();
    let output = common::wait(child).await;
    let took = stolen_at.elapsed();
    assert_eq!(code(&output), 79, "{}", stderr(&output));
    assert!(
        took >= Duration::from_secs(1),
        "killed before the grace: {took:?}"
    );
    assert!(took < Duration::from_secs(4), "killed after {took:?}");
    assert!(!alive(pid), "the command survived");
    assert!(!alive(grandchild), "the command's child survived");
    assert!(stderr(&output).contains("signal: 9"), "{}", stderr(&output));
}

/// SPEC L1: the key deleted or freed by hand while still valid: the
/// command is terminated and withlock names the cause as taken, never as
/// an expiry (the ttl, 6 s, is not over).
async fn l1_a_key_deleted_or_freed_while_valid_is_reported_taken(store: Store) {
    for how in [Tamper::Delete, Tamper::Free] {
        let key = store.key(&format!("{how:?}"));
        let scratch = Scratch::new();
        let script = format!(
            "echo $$ > {pid}; while :; do sleep 0.05; done",
            pid = scratch.sh("pid"),
        );
        let child = store
            .cmd("run")
            .args(["--ttl", "6s", "--key", &key, "--", "sh", "-c", &script])
            .spawn()
            .unwrap();
        let pid: i32 = appears(&scratch.path("pid")).await.trim().parse().unwrap();
        store.tamper(&key, how).await;
        // Found by the next extension (every 2 s) or sooner by the key
        // watch's check: within the ttl either way.
        let output = tokio::time::timeout(Duration::from_secs(6), common::wait(child))
            .await
            .unwrap_or_else(|_| panic!("{how:?}: the loss was not found within the ttl"));
        let message = stderr(&output);
        assert_eq!(code(&output), 79, "{how:?}: {message}");
        assert!(!alive(pid), "{how:?}: the command survived");
        assert!(message.contains("lost the lock"), "{how:?}: {message}");
        assert!(message.contains("deleted or freed"), "{how:?}: {message}");
        assert!(!message.contains("expired"), "{how:?}: {message}");
    }
}

on_every_backend!(
    l1_a_key_deleted_or_freed_while_valid_is_reported_taken,
    a_stolen_lock_terminates_the_command,
    a_command_ignoring_sigterm_is_killed_after_grace,
);

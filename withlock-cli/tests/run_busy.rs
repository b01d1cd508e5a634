//! A lock held elsewhere: `withlock run` exits 75 and the command never
//! runs, after the wait it was given.

mod common;

use std::time::{Duration, Instant};

use common::{run_expecting, stderr, wait_expecting, Scratch, Store};

async fn busy_exits_75_and_the_command_never_runs(store: Store) {
    let key = store.key("busy");
    let (_locker, mut held) = store.hold(&key, "other-host").await;
    let scratch = Scratch::new();
    // That `--no-wait` makes one attempt, not the default's eleven, is
    // `run::tests::waiting_options_map_to_retries`: a time limit here
    // could not tell one attempt from the default's 2 s of retries on a
    // loaded machine.
    let output = run_expecting(
        store.cmd("run").args([
            "--no-wait",
            "--key",
            &key,
            "--",
            "touch",
            &scratch.path("ran").display().to_string(),
        ]),
        75,
    )
    .await;
    assert!(!scratch.path("ran").exists(), "the command ran");
    let message = stderr(&output);
    assert!(
        message.contains("busy") && message.contains("other-host"),
        "{message}"
    );
    assert_eq!(message.lines().count(), 1, "{message}");
    // The holder's lock is untouched.
    assert!(held.renew().await.unwrap());
    held.release().await.unwrap();
}

async fn wait_gives_up_after_about_its_duration(store: Store) {
    let key = store.key("wait-2s");
    let (_locker, mut held) = store.hold(&key, "other-host").await;
    let scratch = Scratch::new();
    let started = Instant::now();
    run_expecting(
        store.cmd("run").args([
            "--wait",
            "2s",
            "--key",
            &key,
            "--",
            "touch",
            &scratch.path("ran").display().to_string(),
        ]),
        75,
    )
    .await;
    let took = started.elapsed();
    assert!(!scratch.path("ran").exists());
    assert!(
        took >= Duration::from_millis(1700) && took < Duration::from_secs(4),
        "gave up after {took:?}"
    );
    held.release().await.unwrap();
}

/// A waiter runs the command as soon as the holder lets go.
async fn a_waiter_runs_once_the_lock_is_free(store: Store) {
    let key = store.key("handoff");
    let (_locker, mut held) = store.hold(&key, "other-host").await;
    let scratch = Scratch::new();
    let child = store
        .cmd("run")
        .args([
            "--wait-forever",
            "--key",
            &key,
            "--",
            "sh",
            "-c",
            &format!("echo ran > {}", scratch.sh("ran")),
        ])
        .spawn()
        .unwrap();
    // Started (its signal handlers are set before it tries the lock); the
    // lock is held, so it cannot have run, however far it got.
    common::catches(
        child.id().unwrap(),
        nix::sys::signal::Signal::SIGTERM as i32,
    )
    .await;
    assert!(!scratch.path("ran").exists(), "ran while the lock was held");
    held.release().await.unwrap();
    wait_expecting(child, 0).await;
    assert!(scratch.path("ran").exists());
    assert_eq!(store.stored(&key).await.owner, None);
}

on_every_backend!(
    busy_exits_75_and_the_command_never_runs,
    wait_gives_up_after_about_its_duration,
    a_waiter_runs_once_the_lock_is_free,
);

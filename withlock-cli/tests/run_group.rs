//! Nothing of the job runs on without the lock: what the command leaves in
//! its process group is swept (SIGTERM, then SIGKILL after --grace) before
//! the lock is released; the group dies with withlock, even of SIGKILL;
//! `--max-runtime` ends it with exit 124.

mod common;

use std::time::{Duration, Instant};

use common::{all_gone, code, number, stderr, Scratch, Store};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

fn send(child: &tokio::process::Child, signal: Signal) {
    let pid = i32::try_from(child.id().unwrap()).unwrap();
    kill(Pid::from_raw(pid), signal).unwrap();
}

/// A background child that outlives a SIGINT (a non-interactive shell's
/// background jobs ignore it) is terminated before the lock is released:
/// a waiter that takes the lock next finds it gone.
async fn a_child_outliving_sigint_is_swept_before_the_release(store: Store) {
    let key = store.key("sweep");
    let scratch = Scratch::new();
    // The background child takes its time on SIGTERM, so that a release
    // that did not wait for it would come first.
    let script = format!(
        "( trap 'sleep 0.3; echo done > {done}; exit 0' TERM; \
           echo $(exec sh -c 'echo $PPID') > {bg}; \
           while :; do sleep 0.05; done ) & \
         echo $$ > {pid}; wait",
        done = scratch.sh("bg-done"),
        bg = scratch.sh("bg"),
        pid = scratch.sh("pid"),
    );
    let first = store
        .cmd("run")
        .args(["--key", &key, "--", "sh", "-c", &script])
        .spawn()
        .unwrap();
    let pid = number(&scratch.path("pid")).await;
    let bg = number(&scratch.path("bg")).await;
    let waiter = store
        .cmd("run")
        .args([
            "--wait-forever",
            "--key",
            &key,
            "--",
            "sh",
            "-c",
            &format!(
                "if [ -e {done} ]; then echo after > {order}; else echo before > {order}; fi",
                done = scratch.sh("bg-done"),
                order = scratch.sh("order"),
            ),
        ])
        .spawn()
        .unwrap();
    send(&first, Signal::SIGINT);
    let output = common::wait(first).await;
    assert_eq!(code(&output), 128 + 2, "{}", stderr(&output));
    assert!(!common::alive(pid) && !common::alive(bg), "the job runs on");
    let output = common::wait(waiter).await;
    assert_eq!(code(&output), 0, "{}", stderr(&output));
    assert_eq!(
        common::appears(&scratch.path("order")).await.trim(),
        "after",
        "the lock was released while the background child still ran"
    );
}

/// A command's child left running when the command exits by itself is
/// terminated too, and one that ignores SIGTERM is killed after --grace.
async fn leftovers_of_a_command_that_exits_are_swept(store: Store) {
    let key = store.key("leftovers");
    let scratch = Scratch::new();
    let script = format!(
        "sh -c 'trap \"\" TERM; echo $$ > {stubborn}; while :; do sleep 0.05; done' & \
         sleep 60 & echo $! > {plain}; \
         while [ ! -s {stubborn} ]; do sleep 0.01; done; exit 5",
        stubborn = scratch.sh("stubborn"),
        plain = scratch.sh("plain"),
    );
    let started = Instant::now();
    let output = common::finish(
        store
            .cmd("run")
            .args(["--grace", "1s", "--key", &key, "--", "sh", "-c", &script]),
    )
    .await;
    assert_eq!(code(&output), 5, "{}", stderr(&output));
    let stubborn = number(&scratch.path("stubborn")).await;
    let plain = number(&scratch.path("plain")).await;
    assert!(!common::alive(stubborn), "the SIGTERM-proof child runs on");
    assert!(!common::alive(plain), "the background child runs on");
    assert!(
        started.elapsed() >= Duration::from_secs(1),
        "killed before the grace"
    );
    assert_eq!(store.stored(&key).await.owner, None, "released");
}

/// withlock killed with SIGKILL: its job's processes are gone within
/// about a second, through the supervisor's parent-death signal.
async fn the_job_dies_with_a_killed_withlock(store: Store) {
    let key = store.key("kill-9");
    let scratch = Scratch::new();
    let script = format!(
        "sleep 60 & echo $! > {bg}; echo $$ > {pid}; wait",
        bg = scratch.sh("bg"),
        pid = scratch.sh("pid"),
    );
    let child = store
        .cmd("run")
        .args(["--key", &key, "--", "sh", "-c", &script])
        .spawn()
        .unwrap();
    let pid = number(&scratch.path("pid")).await;
    let bg = number(&scratch.path("bg")).await;
    send(&child, Signal::SIGKILL);
    let took = all_gone(&[pid, bg], Duration::from_secs(5)).await;
    assert!(took < Duration::from_secs(2), "gone after {took:?}");
    let _ = common::wait(child).await;
}

/// Past --max-runtime the group gets SIGTERM, then SIGKILL after the
/// grace, and withlock exits 124.
async fn max_runtime_ends_the_group_with_124(store: Store) {
    let key = store.key("max-runtime");
    let scratch = Scratch::new();
    let script = format!(
        "trap '' TERM; sleep 60 & echo $! > {bg}; echo $$ > {pid}; \
         while :; do sleep 0.05; done",
        bg = scratch.sh("bg"),
        pid = scratch.sh("pid"),
    );
    let started = Instant::now();
    let output = common::finish(store.cmd("run").args([
        "--max-runtime",
        "1s",
        "--grace",
        "1s",
        "--key",
        &key,
        "--",
        "sh",
        "-c",
        &script,
    ]))
    .await;
    let took = started.elapsed();
    assert_eq!(code(&output), 124, "{}", stderr(&output));
    assert!(
        stderr(&output).contains("--max-runtime"),
        "{}",
        stderr(&output)
    );
    assert!(took >= Duration::from_secs(2), "ended after {took:?}");
    assert!(took < Duration::from_secs(10), "ended after {took:?}");
    let (pid, bg) = (
        number(&scratch.path("pid")).await,
        number(&scratch.path("bg")).await,
    );
    assert!(!common::alive(pid) && !common::alive(bg));
    assert_eq!(store.stored(&key).await.owner, None, "released");
}

/// A forwarded signal the command ignores is followed by SIGKILL after
/// the grace: withlock does not wait forever for it.
async fn a_forwarded_signal_is_followed_by_sigkill_after_grace(store: Store) {
    let key = store.key("ignores-int");
    let scratch = Scratch::new();
    let script = format!(
        "trap '' INT; echo $$ > {pid}; while :; do sleep 0.05; done",
        pid = scratch.sh("pid"),
    );
    let child = store
        .cmd("run")
        .args(["--grace", "1s", "--key", &key, "--", "sh", "-c", &script])
        .spawn()
        .unwrap();
    let pid = number(&scratch.path("pid")).await;
    let sent = Instant::now();
    send(&child, Signal::SIGINT);
    let output = common::wait(child).await;
    let took = sent.elapsed();
    assert_eq!(code(&output), 128 + 9, "{}", stderr(&output));
    assert!(took >= Duration::from_secs(1), "killed after {took:?}");
    assert!(!common::alive(pid));
    assert_eq!(store.stored(&key).await.owner, None, "released");
}

on_every_backend!(
    a_child_outliving_sigint_is_swept_before_the_release,
    leftovers_of_a_command_that_exits_are_swept,
    the_job_dies_with_a_killed_withlock,
    max_runtime_ends_the_group_with_124,
    a_forwarded_signal_is_followed_by_sigkill_after_grace,
);

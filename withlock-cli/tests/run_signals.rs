//! SIGTERM, SIGINT and SIGHUP sent to withlock reach the command; the
//! lock is released after it exits. While waiting, they end the wait.

mod common;

use common::{alive, appears, code, stderr, Scratch, Store};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

fn send(child: &tokio::process::Child, signal: Signal) {
    let pid = i32::try_from(child.id().unwrap()).unwrap();
    kill(Pid::from_raw(pid), signal).unwrap();
}

async fn sigterm_reaches_the_command_and_the_key_is_freed(store: Store) {
    let key = store.key("sigterm");
    let scratch = Scratch::new();
    let script = format!(
        "trap 'echo term > {term}; exit 7' TERM; echo $$ > {pid}; \
         while :; do sleep 0.05; done",
        term = scratch.sh("term"),
        pid = scratch.sh("pid"),
    );
    let child = store
        .cmd("run")
        .args(["--key", &key, "--", "sh", "-c", &script])
        .spawn()
        .unwrap();
    let pid: i32 = appears(&scratch.path("pid")).await.trim().parse().unwrap();
    assert!(store.stored(&key).await.owner.is_some());
    send(&child, Signal::SIGTERM);
    let output = common::wait(child).await;
    assert_eq!(
        code(&output),
        7,
        "the command's own code: {}",
        stderr(&output)
    );
    assert!(scratch.path("term").exists(), "the command got no SIGTERM");
    assert!(!alive(pid));
    assert_eq!(store.stored(&key).await.owner, None, "the key is free");
}

async fn sigint_and_sighup_are_forwarded_too(store: Store) {
    for (signal, name) in [(Signal::SIGINT, "int"), (Signal::SIGHUP, "hup")] {
        let key = store.key(name);
        let scratch = Scratch::new();
        let script = format!("echo $$ > {pid}; exec sleep 30", pid = scratch.sh("pid"));
        let child = store
            .cmd("run")
            .args(["--key", &key, "--", "sh", "-c", &script])
            .spawn()
            .unwrap();
        appears(&scratch.path("pid")).await;
        send(&child, signal);
        let output = common::wait(child).await;
        assert_eq!(code(&output), 128 + signal as i32, "{}", stderr(&output));
        assert_eq!(store.stored(&key).await.owner, None);
    }
}

async fn a_signal_while_waiting_ends_the_wait(store: Store) {
    let key = store.key("waiting");
    let (_locker, mut held) = store.hold(&key, "other-host").await;
    let scratch = Scratch::new();
    let ran = scratch.path("ran").display().to_string();
    let child = store
        .cmd("run")
        .args(["--wait-forever", "--key", &key, "--", "touch", &ran])
        .spawn()
        .unwrap();
    // Once its handler is installed (a signal before would kill it, and
    // fail the code check below): from then on it waits for the lock.
    common::catches(child.id().unwrap(), Signal::SIGTERM as i32).await;
    send(&child, Signal::SIGTERM);
    let output = common::wait(child).await;
    assert_eq!(code(&output), 128 + 15, "{}", stderr(&output));
    assert!(!scratch.path("ran").exists(), "the command ran");
    assert!(stderr(&output).contains("did not run"));
    assert!(held.renew().await.unwrap(), "the holder kept its lock");
    held.release().await.unwrap();
    assert_eq!(store.stored(&key).await.owner, None, "nothing left held");
}

on_every_backend!(
    sigterm_reaches_the_command_and_the_key_is_freed,
    sigint_and_sighup_are_forwarded_too,
    a_signal_while_waiting_ends_the_wait,
);

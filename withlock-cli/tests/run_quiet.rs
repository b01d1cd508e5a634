//! A busy lock can be silent: `-q` prints nothing (the exit code still
//! says busy), and `--busy-exit N` picks that code, so that a host that
//! finds the job running elsewhere sends no cron mail.

mod common;

use common::{code, finish, stderr, stdout, Scratch, Store};

async fn quiet_says_nothing_when_busy(store: Store) {
    let key = store.key("quiet");
    let (_locker, mut held) = store.hold(&key, "other-host").await;
    let scratch = Scratch::new();
    let ran = scratch.path("ran").display().to_string();
    for quiet in ["-q", "--quiet"] {
        let output =
            finish(
                store
                    .cmd("run")
                    .args([quiet, "--no-wait", "--key", &key, "--", "touch", &ran]),
            )
            .await;
        assert_eq!(code(&output), 75, "{}", stderr(&output));
        assert_eq!(stderr(&output), "", "{quiet} printed on stderr");
        assert_eq!(stdout(&output), "");
    }
    assert!(!scratch.path("ran").exists(), "the command ran");
    // Without -q the same run says so.
    let output = finish(
        store
            .cmd("run")
            .args(["--no-wait", "--key", &key, "--", "touch", &ran]),
    )
    .await;
    assert!(stderr(&output).contains("busy"), "{}", stderr(&output));
    assert!(held.renew().await.unwrap());
    held.release().await.unwrap();
}

async fn busy_exit_sets_the_code_of_a_busy_lock(store: Store) {
    let key = store.key("busy-exit");
    let (_locker, mut held) = store.hold(&key, "other-host").await;
    let scratch = Scratch::new();
    let ran = scratch.path("ran").display().to_string();
    for (busy_exit, quiet) in [("0", true), ("3", false)] {
        let mut command = store.cmd("run");
        if quiet {
            command.arg("-q");
        }
        let output = finish(command.args([
            "--busy-exit",
            busy_exit,
            "--no-wait",
            "--key",
            &key,
            "--",
            "touch",
            &ran,
        ]))
        .await;
        assert_eq!(code(&output).to_string(), busy_exit, "{}", stderr(&output));
        assert_eq!(stderr(&output).is_empty(), quiet, "{}", stderr(&output));
    }
    assert!(!scratch.path("ran").exists(), "the command ran");
    // A free lock runs the command and gives its own code.
    held.release().await.unwrap();
    let output = finish(store.cmd("run").args([
        "-q",
        "--busy-exit",
        "0",
        "--key",
        &key,
        "--",
        "sh",
        "-c",
        "exit 4",
    ]))
    .await;
    assert_eq!(code(&output), 4, "{}", stderr(&output));
}

on_every_backend!(
    quiet_says_nothing_when_busy,
    busy_exit_sets_the_code_of_a_busy_lock,
);

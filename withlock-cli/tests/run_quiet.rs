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

/// \[H7\] `--lock-at-least`: a job that ends at once keeps the lock to its
/// minimum, so a second host whose cron fires a moment later finds it busy
/// and does not run the job again; after the minimum the key is free.
///
/// The minimum (10 s) is long enough that the second host's try is inside
/// it on a slow machine too; the store, read after that try, says so.
async fn h7_lock_at_least_runs_a_short_job_once_per_period(store: Store) {
    let key = store.key("at-least");
    let scratch = Scratch::new();
    let first = scratch.path("first").display().to_string();
    let second = scratch.path("second").display().to_string();
    let started = std::time::Instant::now();
    let output = finish(store.cmd("run").args([
        "--lock-at-least",
        "10s",
        "--no-wait",
        "--key",
        &key,
        "--",
        "touch",
        &first,
    ]))
    .await;
    assert_eq!(code(&output), 0, "{}", stderr(&output));
    let output =
        finish(
            store
                .cmd("run")
                .args(["-q", "--no-wait", "--key", &key, "--", "touch", &second]),
        )
        .await;
    assert!(
        store.stored(&key).await.owner.is_some(),
        "the minimum ran out before the second try ended ({:?}): too slow to tell",
        started.elapsed()
    );
    assert_eq!(code(&output), 75, "{}", stderr(&output));
    assert!(!scratch.path("second").exists(), "the job ran twice");
    let output = finish(
        store
            .cmd("run")
            .args(["--wait", "30s", "--key", &key, "--", "touch", &second]),
    )
    .await;
    assert_eq!(code(&output), 0, "{}", stderr(&output));
    assert!(
        started.elapsed() >= std::time::Duration::from_millis(9_990),
        "free only after the minimum: {:?}",
        started.elapsed()
    );
    let output =
        finish(
            store
                .cmd("run")
                .args(["--lock-at-least", "8d", "--key", &key, "--", "true"]),
        )
        .await;
    assert_eq!(code(&output), 64, "{}", stderr(&output));
    assert!(
        stderr(&output).contains("--lock-at-least"),
        "{}",
        stderr(&output)
    );
}

on_every_backend!(
    quiet_says_nothing_when_busy,
    busy_exit_sets_the_code_of_a_busy_lock,
    h7_lock_at_least_runs_a_short_job_once_per_period,
);

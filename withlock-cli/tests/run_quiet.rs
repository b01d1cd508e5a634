//! A busy lock can be silent: `-q` prints nothing (the exit code still
//! says busy), and `--busy-exit N` picks that code, so that a host that
//! finds the job running elsewhere sends no cron mail.

mod common;

use common::{code, finish, stderr, stdout, withlock, Scratch, Store};

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

/// `-q` silences the `--log-format` record of a busy run too (its end
/// line, `... did not run, exit 0, busy`), so that the cron recipe's
/// losing hosts print nothing and cron sends no mail; a run that ran the
/// command is still recorded with `-q`.
async fn quiet_busy_runs_leave_no_record(store: Store) {
    let key = store.key("quiet-record");
    let (_locker, mut held) = store.hold(&key, "other-host").await;
    let scratch = Scratch::new();
    let ran = scratch.path("ran").display().to_string();
    for format in ["text", "json"] {
        let output = finish(store.cmd("run").args([
            "-q",
            "--busy-exit",
            "0",
            "--no-wait",
            "--log-format",
            format,
            "--key",
            &key,
            "--",
            "touch",
            &ran,
        ]))
        .await;
        assert_eq!(code(&output), 0, "{}", stderr(&output));
        assert_eq!(stderr(&output), "", "-q --log-format {format} printed");
        // Without -q the record says busy.
        let output = finish(store.cmd("run").args([
            "--busy-exit",
            "0",
            "--no-wait",
            "--log-format",
            format,
            "--key",
            &key,
            "--",
            "touch",
            &ran,
        ]))
        .await;
        assert!(stderr(&output).contains("busy"), "{}", stderr(&output));
    }
    assert!(!scratch.path("ran").exists(), "the command ran");
    held.release().await.unwrap();
    let output = finish(store.cmd("run").args([
        "-q",
        "--log-format",
        "text",
        "--key",
        &key,
        "--",
        "touch",
        &ran,
    ]))
    .await;
    assert_eq!(code(&output), 0, "{}", stderr(&output));
    let text = stderr(&output);
    assert!(
        text.contains(" started on host ") && text.contains(" ended on host "),
        "{text}"
    );
}

/// The cron line of the README, run as written (its binary aside) on a
/// host that loses the lock: exit 0 and not a byte on stdout or stderr,
/// so cron sends no mail. Its binary is a full path, as cron's default
/// `PATH` (`/usr/bin:/bin`) has no `~/.cargo/bin`.
async fn the_readme_cron_line_is_silent_on_a_losing_host(store: Store) {
    let readme = include_str!("../README.md");
    let line = readme
        .lines()
        .find(|l| l.contains(" run ") && l.contains("--key nightly-import"))
        .expect("the README's cron line");
    let words: Vec<&str> = line.split_whitespace().collect();
    // minute hour day month weekday user, then the command.
    let command = &words[6..];
    assert!(
        command[0].starts_with('/') && command[0].ends_with("/withlock"),
        "the cron line should call withlock by its full path: {line}"
    );
    let key = store.key("nightly-import");
    let (_locker, mut held) = store.hold(&key, "other-host").await;
    let scratch = Scratch::new();
    let ran = scratch.path("ran").display().to_string();
    let end = command.iter().position(|w| *w == "--").unwrap();
    let args: Vec<&str> = command[1..end]
        .iter()
        .map(|w| {
            if *w == "nightly-import" {
                key.as_str()
            } else {
                w
            }
        })
        .collect();
    let url_file = scratch.path("url");
    std::fs::write(&url_file, format!("{}\n", store.args()[1])).unwrap();
    let mut run = withlock(args);
    run.env("WITHLOCK_URL_FILE", &url_file);
    if let Some(schema) = store.args().get(3) {
        run.env("WITHLOCK_PG_SCHEMA", schema);
    }
    let output = finish(run.args(["--", "touch", &ran])).await;
    assert_eq!(code(&output), 0, "{}", stderr(&output));
    assert_eq!(stderr(&output), "", "a losing host printed on stderr");
    assert_eq!(stdout(&output), "");
    assert!(!scratch.path("ran").exists(), "the command ran");
    held.release().await.unwrap();
}

on_every_backend!(
    quiet_says_nothing_when_busy,
    busy_exit_sets_the_code_of_a_busy_lock,
    h7_lock_at_least_runs_a_short_job_once_per_period,
    quiet_busy_runs_leave_no_record,
    the_readme_cron_line_is_silent_on_a_losing_host,
);

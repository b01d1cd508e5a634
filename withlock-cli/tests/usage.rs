//! Bad arguments exit 64 with one line naming the problem, before anything
//! is touched, and `--help` documents the exit codes.

mod common;

use common::{code, finish, stderr, stdout, withlock, Scratch};

/// Runs `withlock ARGS` against an address where nothing listens, so that
/// a run that touched the backend would end with 69, not 64 (the exit code
/// says it, not the time taken, which a busy machine stretches), and checks
/// the one line of stderr.
async fn refused(args: &[&str], names: &str) {
    let output = finish(&mut withlock(args)).await;
    let message = stderr(&output);
    assert_eq!(code(&output), 64, "{args:?}: {message}");
    assert_eq!(message.lines().count(), 1, "{args:?}: {message}");
    assert!(message.starts_with("withlock: "), "{message}");
    assert!(
        message.contains(names),
        "{args:?} should name {names:?}: {message}"
    );
    assert!(stdout(&output).is_empty());
}

const URL: &str = "redis://127.0.0.1:1";

#[tokio::test]
async fn a_command_without_double_dash_is_refused() {
    let scratch = Scratch::new();
    let ran = scratch.path("ran").display().to_string();
    refused(&["run", "--url", URL, "--key", "k", "touch", &ran], "`--`").await;
    assert!(!scratch.path("ran").exists());
    refused(&["run", "--url", URL, "--key", "k", "--"], "CMD").await;
    // An empty command is a bad argument (64), not a command not found.
    refused(&["run", "--url", URL, "--key", "k", "--", ""], "empty").await;
}

#[tokio::test]
async fn an_unknown_scheme_is_named_without_the_url() {
    let args = [
        "run",
        "--url",
        "mysql://root:hunter2@db/app",
        "--key",
        "k",
        "--",
        "true",
    ];
    refused(&args, "\"mysql\"").await;
    let output = finish(&mut withlock(args)).await;
    assert!(!stderr(&output).contains("hunter2"));
    refused(&["list", "--url", "localhost:6379"], "--url").await;
}

#[tokio::test]
async fn a_malformed_duration_is_named() {
    for option in ["--ttl", "--wait", "--grace", "--max-runtime"] {
        refused(
            &[
                "run", "--url", URL, "--key", "k", option, "5x", "--", "true",
            ],
            option,
        )
        .await;
    }
    refused(
        &[
            "run", "--url", URL, "--key", "k", "--ttl", "10ms", "--", "true",
        ],
        "ttl",
    )
    .await;
}

#[tokio::test]
async fn an_empty_key_is_refused() {
    refused(&["run", "--url", URL, "--key", "", "--", "true"], "empty").await;
    refused(&["inspect", "--url", URL, ""], "empty").await;
    refused(&["run", "--url", URL, "--", "true"], "--key").await;
}

#[tokio::test]
async fn conflicting_waits_and_a_missing_url_are_refused() {
    refused(
        &[
            "run",
            "--url",
            URL,
            "--key",
            "k",
            "--wait",
            "1s",
            "--no-wait",
            "--",
            "true",
        ],
        "--no-wait",
    )
    .await;
    refused(&["run", "--key", "k", "--", "true"], "--url").await;
    refused(
        &[
            "run",
            "--url",
            URL,
            "--key",
            "k",
            "--node-id",
            "a\u{7}b",
            "--",
            "true",
        ],
        "--node-id",
    )
    .await;
}

#[tokio::test]
async fn bad_new_options_are_refused() {
    let run = |extra: &'static [&'static str]| {
        let mut args = vec!["run", "--url", URL, "--key", "k"];
        args.extend_from_slice(extra);
        args.extend_from_slice(&["--", "true"]);
        args
    };
    refused(&run(&["--busy-exit", "256"]), "--busy-exit").await;
    refused(&run(&["--busy-exit", "x"]), "--busy-exit").await;
    refused(&run(&["--max-runtime", "0s"]), "--max-runtime").await;
    refused(&run(&["--log-format", "xml"]), "--log-format").await;
    let pg = |option: &'static str, value: &'static str| {
        vec![
            "run", "--url", PG_URL, option, value, "--key", "k", "--", "true",
        ]
    };
    refused(&pg("--table", "a-b"), "plain identifier").await;
    refused(&pg("--schema", "x\"y"), "plain identifier").await;
}

const PG_URL: &str = "postgres://root@127.0.0.1:1/test";

/// Options meant for another backend than the URL's would be ignored:
/// given on the command line they are refused (64), from the environment
/// (a host may export one set for jobs on several backends) they are
/// warned about, except with `run -q`.
#[tokio::test]
async fn options_for_another_backend_are_refused_or_warned() {
    let etcd = "etcd://127.0.0.1:1";
    refused(
        &[
            "run", "--url", URL, "--schema", "s", "--key", "k", "--", "true",
        ],
        "--schema",
    )
    .await;
    refused(&["list", "--url", URL, "--table", "t"], "--table").await;
    refused(&["list", "--url", etcd, "--schema", "public"], "--schema").await;
    refused(
        &["status", "--url", PG_URL, "--redis-prefix", "p:", "k"],
        "--redis-prefix",
    )
    .await;
    refused(
        &["list", "--url", etcd, "--redis-prefix", "p:"],
        "--redis-prefix",
    )
    .await;
    let cluster = "redis+cluster://127.0.0.1:1";
    refused(&["list", "--url", cluster, "--table", "t"], "--table").await;

    for (url, variable) in [
        (PG_URL, "WITHLOCK_REDIS_PREFIX"),
        (URL, "WITHLOCK_PG_SCHEMA"),
        (URL, "WITHLOCK_PG_TABLE"),
    ] {
        let output = finish(withlock(["list", "--url", url]).env(variable, "x")).await;
        let message = stderr(&output);
        assert_eq!(code(&output), 69, "{variable}: {message}");
        assert!(
            message.contains(&format!("warning: {variable} is set but ignored")),
            "{message}"
        );
        let output = finish(
            withlock(["run", "-q", "--url", url, "--key", "k", "--", "true"]).env(variable, "x"),
        )
        .await;
        let message = stderr(&output);
        assert_eq!(code(&output), 69, "{variable}: {message}");
        assert!(!message.contains("warning"), "-q: {message}");
    }
    // The backend's own options are quiet.
    let output = finish(withlock(["list", "--url", URL]).env("WITHLOCK_REDIS_PREFIX", "p:")).await;
    assert!(!stderr(&output).contains("warning"), "{}", stderr(&output));
}

#[tokio::test]
async fn keys_with_control_characters_are_refused() {
    refused(
        &["run", "--url", URL, "--key", "a\nb", "--", "true"],
        "control",
    )
    .await;
    refused(&["status", "--url", URL, "a\u{1b}[2Jb"], "control").await;
    refused(&["inspect", "--url", URL, "tab\there"], "control").await;
    refused(&["status", "--url", URL, ""], "empty").await;
}

#[tokio::test]
async fn url_files_are_checked() {
    let scratch = Scratch::new();
    let missing = scratch.path("missing").display().to_string();
    refused(&["list", "--url-file", &missing], "missing").await;
    let empty = scratch.path("empty");
    std::fs::write(&empty, "\n\n").unwrap();
    let empty = empty.display().to_string();
    refused(&["list", "--url-file", &empty], "holds no URL").await;
    let file = scratch.path("url");
    std::fs::write(&file, format!("{URL}\n")).unwrap();
    let file = file.display().to_string();
    refused(&["list", "--url", URL, "--url-file", &file], "give one").await;
    // A file with a URL of an unknown scheme: named, not shown.
    std::fs::write(scratch.path("mysql"), "mysql://root:hunter2@db/app\n").unwrap();
    let mysql = scratch.path("mysql").display().to_string();
    refused(&["list", "--url-file", &mysql], "\"mysql\"").await;
}

#[tokio::test]
async fn release_without_force_refuses() {
    refused(&["release", "--url", URL, "k"], "--force").await;
    // \[L5\] The holder hears a force release within about a second: the
    // refusal says what the release would do to it, not that it "would
    // go on without the lock until its next extension".
    let output = finish(&mut withlock(["release", "--url", URL, "k"])).await;
    let message = stderr(&output);
    assert!(!message.contains("next extension"), "{message}");
    assert!(
        message.contains("within about a second") && message.contains("79"),
        "{message}"
    );
}

#[tokio::test]
async fn help_documents_the_exit_codes() {
    let output = finish(&mut withlock(["run", "--help"])).await;
    assert_eq!(code(&output), 0);
    let help = stdout(&output);
    for needle in [
        "64",
        "69",
        "75",
        "77",
        "78",
        "79",
        "124",
        "128",
        "withlock migrate",
        "--busy-exit",
        "--max-runtime",
        "--url-file",
        "--log-format",
        "WITHLOCK_FENCING_TOKEN",
        "--table",
        "--schema",
        "postgresql://",
    ] {
        assert!(help.contains(needle), "--help lacks {needle:?}:\n{help}");
    }
}

//! `withlock run` passes the command's exit code through, gives it the lock
//! in its environment, and frees the key when it exits.

mod common;

use common::{code, finish, run_expecting, stderr, wait_expecting, Scratch, Store};

async fn exit_code_passes_through(store: Store) {
    let key = store.key("exit-code");
    for (script, expected) in [("exit 0", 0), ("exit 3", 3), ("exit 255", 255)] {
        run_expecting(
            store
                .cmd("run")
                .args(["--key", &key, "--", "sh", "-c", script]),
            expected,
        )
        .await;
    }
    assert_eq!(
        store.stored(&key).await.owner,
        None,
        "the key is free afterwards"
    );
}

async fn death_by_signal_is_128_plus_the_signal(store: Store) {
    let key = store.key("signalled");
    run_expecting(
        store
            .cmd("run")
            .args(["--key", &key, "--", "sh", "-c", "kill -KILL $$"]),
        128 + 9,
    )
    .await;
    assert_eq!(store.stored(&key).await.owner, None);
}

/// The child sees WITHLOCK_KEY and WITHLOCK_FENCING_TOKEN, and the token
/// is the one the store drew for this acquisition, read while it runs.
async fn environment_carries_the_lock(store: Store) {
    let key = store.key("env key with spaces {x} *");
    let scratch = Scratch::new();
    let script = format!(
        "printf '%s\\n%s\\n' \"$WITHLOCK_KEY\" \"$WITHLOCK_FENCING_TOKEN\" > {env}.tmp && mv {env}.tmp {env}; \
         while [ ! -e {go} ]; do sleep 0.02; done",
        env = scratch.sh("env"),
        go = scratch.sh("go"),
    );
    let child = store
        .cmd("run")
        .args([
            "--node-id",
            "env-test-node",
            "--key",
            &key,
            "--",
            "sh",
            "-c",
            &script,
        ])
        .spawn()
        .unwrap();
    let env = common::appears(&scratch.path("env")).await;
    let lines: Vec<&str> = env.lines().collect();
    assert_eq!(lines[0], key);
    let token: u64 = lines[1].parse().unwrap();
    let stored = store.stored(&key).await;
    assert_eq!(
        stored.fencing_token,
        Some(token),
        "the token the store drew"
    );
    let owner = stored.owner.expect("held while the command runs");
    assert!(owner.starts_with("env-test-node/"), "{owner}");
    std::fs::write(scratch.path("go"), "").unwrap();
    wait_expecting(child, 0).await;
    assert_eq!(store.stored(&key).await.owner, None, "released at exit");
}

/// A command that is not found exits 127 naming it, and one that cannot
/// be executed 126, both found out before the lock is taken: with the key
/// held elsewhere they still give 127 and 126 (not 75), and no fencing
/// token is drawn.
async fn a_missing_command_is_named_before_the_lock_is_taken(store: Store) {
    let key = store.key("missing");
    let (_locker, mut held) = store.hold(&key, "other-host").await;
    let before = store.stored(&key).await;
    let scratch = Scratch::new();
    let not_executable = scratch.path("not-executable");
    std::fs::write(&not_executable, "#!/bin/sh\ntrue\n").unwrap();
    let not_executable = not_executable.display().to_string();
    for (command, expected, names) in [
        (
            "/nonexistent/withlock-test-command",
            127,
            "/nonexistent/withlock-test-command",
        ),
        (
            "withlock-test-no-such-command",
            127,
            "withlock-test-no-such-command",
        ),
        (not_executable.as_str(), 126, not_executable.as_str()),
    ] {
        let output = finish(
            store
                .cmd("run")
                .args(["--no-wait", "--key", &key, "--", command]),
        )
        .await;
        let message = stderr(&output);
        assert_eq!(code(&output), expected, "{command}: {message}");
        assert!(message.contains(names), "{command}: {message}");
        assert!(message.contains("did not run"), "{message}");
        assert_eq!(message.lines().count(), 1, "{message}");
    }
    assert_eq!(store.stored(&key).await, before, "the store was touched");
    assert!(held.renew().await.unwrap(), "the holder kept its lock");
    held.release().await.unwrap();
}

/// A script whose `#!` line names an interpreter that does not exist (a
/// `#!/bin/sh` line with Windows line ends names `/bin/sh\r`) exits 126
/// naming the interpreter, not "No such file or directory" for a file
/// that exists; `#!/usr/bin/env NAME` with `NAME` not on `PATH` exits 127
/// naming it. Both are found out before the lock is taken: no fencing
/// token is drawn, no PostgreSQL row is made. A good script runs.
async fn a_bad_interpreter_is_named_before_the_lock_is_taken(store: Store) {
    use std::os::unix::fs::PermissionsExt;
    let key = store.key("bad-interpreter");
    let scratch = Scratch::new();
    let script = |name: &str, text: &str| {
        let path = scratch.path(name);
        std::fs::write(&path, text).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
        path.display().to_string()
    };
    let crlf = script("crlf.sh", "#!/bin/sh\r\ntrue\r\n");
    let missing = script("missing.sh", "#! /nonexistent/withlock-sh -e\ntrue\n");
    let env = script(
        "env.sh",
        "#!/usr/bin/env withlock-test-no-such-interpreter\ntrue\n",
    );
    for (command, expected, names) in [
        (crlf.as_str(), 126, r#""/bin/sh\r""#),
        (missing.as_str(), 126, "\"/nonexistent/withlock-sh\""),
        (env.as_str(), 127, "withlock-test-no-such-interpreter"),
    ] {
        let output = finish(
            store
                .cmd("run")
                .args(["--no-wait", "--key", &key, "--", command]),
        )
        .await;
        let message = stderr(&output);
        assert_eq!(code(&output), expected, "{command}: {message}");
        assert!(message.contains(command), "{command}: {message}");
        assert!(message.contains(names), "should name {names}: {message}");
        assert!(message.contains("did not run"), "{message}");
        assert!(!message.contains("No such file"), "{message}");
        assert_eq!(message.lines().count(), 1, "{message}");
    }
    assert!(
        stderr(&finish(store.cmd("run").args(["--key", &key, "--", &crlf])).await)
            .contains("Windows line ends"),
        "the \\r is explained"
    );
    assert_eq!(
        store.stored(&key).await,
        common::Stored {
            owner: None,
            fencing_token: None
        },
        "the lock was taken"
    );
    let good = script("good.sh", "#!/bin/sh\nexit 5\n");
    run_expecting(store.cmd("run").args(["--key", &key, "--", &good]), 5).await;
}

/// The command's environment has the lock's key and token but not
/// `WITHLOCK_URL`, which may hold a password.
async fn the_url_is_not_passed_to_the_command(store: Store) {
    let key = store.key("no-url");
    let scratch = Scratch::new();
    let url = store.args()[1].clone();
    let script = format!(
        "printf '%s|%s' \"${{WITHLOCK_URL-unset}}\" \"$WITHLOCK_KEY\" > {env}",
        env = scratch.sh("env")
    );
    let mut command = common::withlock(["run"]);
    command.args(&store.args()[2..]);
    command
        .env("WITHLOCK_URL", &url)
        .args(["--key", &key, "--", "sh", "-c", &script]);
    run_expecting(&mut command, 0).await;
    let env = std::fs::read_to_string(scratch.path("env")).unwrap();
    assert_eq!(env, format!("unset|{key}"));
}

on_every_backend!(
    exit_code_passes_through,
    death_by_signal_is_128_plus_the_signal,
    environment_carries_the_lock,
    a_missing_command_is_named_before_the_lock_is_taken,
    a_bad_interpreter_is_named_before_the_lock_is_taken,
    the_url_is_not_passed_to_the_command,
);

//! `withlock run` passes the command's exit code through, gives it the lock
//! in its environment, and frees the key when it exits.

mod common;

use common::{code, finish, stderr, Scratch, Store};

async fn exit_code_passes_through(store: Store) {
    let key = store.key("exit-code");
    for (script, expected) in [("exit 0", 0), ("exit 3", 3), ("exit 255", 255)] {
        let output = finish(
            store
                .cmd("run")
                .args(["--key", &key, "--", "sh", "-c", script]),
        )
        .await;
        assert_eq!(code(&output), expected, "{script}: {}", stderr(&output));
    }
    assert_eq!(
        store.stored(&key).await.owner,
        None,
        "the key is free afterwards"
    );
}

async fn death_by_signal_is_128_plus_the_signal(store: Store) {
    let key = store.key("signalled");
    let output = finish(
        store
            .cmd("run")
            .args(["--key", &key, "--", "sh", "-c", "kill -KILL $$"]),
    )
    .await;
    assert_eq!(code(&output), 128 + 9, "{}", stderr(&output));
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
    let output = common::wait(child).await;
    assert_eq!(code(&output), 0, "{}", stderr(&output));
    assert_eq!(store.stored(&key).await.owner, None, "released at exit");
}

async fn a_missing_command_is_127_and_frees_the_key(store: Store) {
    let key = store.key("missing");
    let output =
        finish(
            store
                .cmd("run")
                .args(["--key", &key, "--", "/nonexistent/withlock-test-command"]),
        )
        .await;
    assert_eq!(code(&output), 127, "{}", stderr(&output));
    assert!(stderr(&output).contains("cannot run the command"));
    assert_eq!(store.stored(&key).await.owner, None);
}

on_every_backend!(
    exit_code_passes_through,
    death_by_signal_is_128_plus_the_signal,
    environment_carries_the_lock,
    a_missing_command_is_127_and_frees_the_key,
);

//! A backend that cannot be reached: exit 69, the command never runs.

mod common;

use common::{code, finish, stderr, withlock, Scratch};

async fn unreachable(url: &str) {
    // With the default wait the retries run out; with `--wait` the wait
    // does, and the store is asked once more who holds the key.
    for wait in [&[][..], &["--wait", "1s"][..]] {
        let scratch = Scratch::new();
        let ran = scratch.path("ran").display().to_string();
        let mut args = vec!["run", "--url", url, "--key", "k"];
        args.extend_from_slice(wait);
        args.extend_from_slice(&["--", "touch", &ran]);
        let output = finish(&mut withlock(args)).await;
        assert_eq!(code(&output), 69, "{wait:?}: {}", stderr(&output));
        assert!(!scratch.path("ran").exists(), "the command ran");
        let message = stderr(&output);
        assert_eq!(message.lines().count(), 1, "{message}");
        assert!(message.contains("did not run"), "{message}");
        assert!(
            !message.contains("hunter2"),
            "the password leaked: {message}"
        );
    }
}

#[tokio::test]
async fn unreachable_redis_is_69() {
    // Nothing listens on port 1 of the loopback.
    unreachable("redis://:hunter2@127.0.0.1:1").await;
}

#[tokio::test]
async fn unreachable_postgres_is_69() {
    unreachable("postgres://postgres:hunter2@127.0.0.1:1/test").await;
}

#[tokio::test]
async fn admin_commands_are_69_too() {
    for sub in [
        vec!["list"],
        vec!["inspect", "k"],
        vec!["release", "--force", "k"],
    ] {
        let output = finish(withlock(&sub).args(["--url", "redis://127.0.0.1:1"])).await;
        assert_eq!(code(&output), 69, "{sub:?}: {}", stderr(&output));
    }
}

/// A refused PostgreSQL connection says so, with the address, rather than
/// that a pool timed out.
#[tokio::test]
async fn a_refused_postgres_connection_names_the_address() {
    let output = finish(&mut withlock([
        "run",
        "--url",
        "postgres://postgres:hunter2@127.0.0.1:1/test",
        "--key",
        "k",
        "--",
        "true",
    ]))
    .await;
    let message = stderr(&output);
    assert_eq!(code(&output), 69, "{message}");
    assert!(message.contains("connection refused"), "{message}");
    assert!(message.contains("127.0.0.1:1"), "{message}");
    assert!(!message.contains("timed out"), "{message}");
}

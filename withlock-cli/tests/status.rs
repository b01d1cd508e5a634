//! `withlock status KEY`: exit 0 and the holder, fencing token and time
//! left when the key is held, exit 1 when it is free; and `status`, `list`
//! and `inspect` tell a job kept by `--lock-at-least` after it ended from
//! a running one \[H7\].

mod common;

use std::time::Duration;

use common::{appears, code, finish, stderr, stdout, wait_expecting, Scratch, Store};
use tokio::process::Child;

async fn status_is_0_when_held_and_1_when_free(store: Store) {
    let key = store.key("status me");
    let output = finish(store.cmd("status").arg(&key)).await;
    assert_eq!(code(&output), 1, "{}", stderr(&output));
    assert!(stdout(&output).contains("is free"), "{}", stdout(&output));

    let (_locker, mut held) = store.hold(&key, "host-one").await;
    let token = store.stored(&key).await.fencing_token.unwrap();
    let output = finish(store.cmd("status").arg(&key)).await;
    assert_eq!(code(&output), 0, "{}", stderr(&output));
    let text = stdout(&output);
    assert!(text.contains("host-one"), "{text}");
    assert!(text.contains(&token.to_string()), "{text}");
    assert!(text.contains("left"), "{text}");

    let output = finish(store.cmd("status").args(["--json", &key])).await;
    assert_eq!(code(&output), 0, "{}", stderr(&output));
    let value: serde_json::Value = serde_json::from_str(&stdout(&output)).unwrap();
    assert_eq!(value["held"], true);
    assert_eq!(value["node_id"], "host-one");
    assert_eq!(value["fencing_token"], token);

    held.release().await.unwrap();
    let output = finish(store.cmd("status").args(["--json", &key])).await;
    assert_eq!(code(&output), 1, "{}", stderr(&output));
    let value: serde_json::Value = serde_json::from_str(&stdout(&output)).unwrap();
    assert_eq!(value["held"], false);
}

/// A `withlock run --lock-at-least 5m` of a job that says when it runs
/// and then runs until `go` is written to (a FIFO: the test's event, not
/// a sleep).
struct Job {
    child: Child,
    go: std::path::PathBuf,
}

impl Job {
    async fn start(store: &Store, scratch: &Scratch, key: &str, name: &str) -> Self {
        let go = scratch.path(&format!("{name}.go"));
        let made = std::process::Command::new("mkfifo")
            .arg(&go)
            .status()
            .unwrap();
        assert!(made.success(), "mkfifo");
        let started = scratch.path(&format!("{name}.started"));
        let script = format!(
            "echo started > {}; exec cat {} > /dev/null",
            scratch.sh(&format!("{name}.started")),
            scratch.sh(&format!("{name}.go"))
        );
        let child = store
            .cmd("run")
            .args(["--lock-at-least", "5m", "--node-id", name, "--key", key])
            .args(["--", "sh", "-c", &script])
            .spawn()
            .unwrap();
        appears(&started).await;
        Self { child, go }
    }

    /// Ends the job; withlock exits 0, its lock kept to its minimum.
    async fn end(self) {
        let go = self.go.clone();
        tokio::task::spawn_blocking(move || std::fs::write(go, "go\n"))
            .await
            .unwrap()
            .unwrap();
        wait_expecting(self.child, 0).await;
    }
}

/// Whether `text` ends with an RFC 3339 time within two seconds of
/// `until` (two reads of the same hold's end, each rounded up to the
/// second by the clock of its moment).
fn ends_near(text: &str, until: &str) -> bool {
    let at = |t: &str| humantime::parse_rfc3339(t).ok();
    let last = text.trim_end().rsplit([' ', '(']).next().unwrap_or("");
    match (at(last), at(until)) {
        (Some(a), Some(b)) => {
            let gap = a
                .duration_since(b)
                .or_else(|_| b.duration_since(a))
                .unwrap();
            gap <= Duration::from_secs(2)
        }
        _ => false,
    }
}

/// Runs `withlock ARGS` on `store`, expecting `expected`; its stdout.
async fn out(store: &Store, args: &[&str], expected: i32) -> String {
    let output = finish(store.cmd(args[0]).args(&args[1..])).await;
    assert_eq!(code(&output), expected, "{args:?}: {}", stderr(&output));
    stdout(&output)
}

/// \[H7\] A job run with `--lock-at-least` that ended keeps its key held:
/// `status` says until when, after its run ended (exit 0, the key is
/// held), `inspect` has a `kept until` line, `list` a `KEPT UNTIL` column,
/// and `--json` `kept_until` and `minimum_hold_left_ms`; a running job
/// shows none of them, before and beside it. `release --force` frees it
/// and says it was kept.
async fn h7_status_list_and_inspect_tell_a_kept_lock_from_a_running_job(store: Store) {
    let scratch = Scratch::new();
    let (kept, running) = (store.key("first job"), store.key("second job"));
    let first = Job::start(&store, &scratch, &kept, "host-one").await;

    let text = out(&store, &["status", &kept], 0).await;
    assert!(
        text.contains("is held by host-one") && text.contains("left)"),
        "{text}"
    );
    assert!(!text.contains("kept"), "a running job: {text}");
    let value: serde_json::Value =
        serde_json::from_str(&out(&store, &["status", "--json", &kept], 0).await).unwrap();
    assert!(value["kept_until"].is_null(), "{value}");
    assert!(value["minimum_hold_left_ms"].is_null(), "{value}");
    assert!(!out(&store, &["inspect", &kept], 0).await.contains("kept"));

    first.end().await;
    let second = Job::start(&store, &scratch, &running, "host-two").await;

    let text = out(&store, &["status", &kept], 0).await;
    assert!(
        text.contains("is held by host-one (fencing token ")
            && text.contains("), kept until 20")
            && text.trim_end().ends_with("left) after its run ended"),
        "{text}"
    );
    let value: serde_json::Value =
        serde_json::from_str(&out(&store, &["status", "--json", &kept], 0).await).unwrap();
    assert_eq!(value["held"], true);
    let until = value["kept_until"].as_str().expect("kept_until");
    assert!(until.starts_with("20") && until.ends_with('Z'), "{value}");
    let left = value["minimum_hold_left_ms"]
        .as_u64()
        .expect("the hold's time left");
    assert!(left > 200_000 && left <= 300_000, "{value}");
    let text = out(&store, &["inspect", &kept], 0).await;
    let line = text
        .lines()
        .find_map(|l| l.strip_prefix("kept until:         "))
        .unwrap_or_else(|| panic!("no kept until line: {text}"));
    assert!(
        line.ends_with("left) after its run ended (minimum hold)"),
        "{text}"
    );
    assert!(ends_near(line.split(" (").next().unwrap(), until), "{text}");
    let text = out(&store, &["status", &running], 0).await;
    assert!(
        text.contains("host-two") && !text.contains("kept"),
        "{text}"
    );

    let prefix = store.key("");
    let text = out(&store, &["list", "--prefix", &prefix], 0).await;
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 3, "{text}");
    let header: Vec<&str> = lines[0].split_whitespace().collect();
    assert_eq!(
        header,
        ["KEY", "NODE", "TTL", "TOKEN", "KEPT", "UNTIL"],
        "{text}"
    );
    assert!(
        lines[1].contains("host-one") && ends_near(lines[1], until),
        "{text}"
    );
    assert!(
        lines[2].contains("host-two") && !lines[2].contains("Z"),
        "{text}"
    );
    let listed: serde_json::Value =
        serde_json::from_str(&out(&store, &["list", "--json", "--prefix", &prefix], 0).await)
            .unwrap();
    let listed = listed.as_array().unwrap();
    assert_eq!(listed.len(), 2, "{listed:?}");
    assert!(ends_near(listed[0]["kept_until"].as_str().unwrap(), until));
    assert!(listed[1]["kept_until"].is_null(), "{listed:?}");

    let text = out(&store, &["release", "--force", &kept], 0).await;
    assert!(
        text.contains("held by host-one, kept until") && text.contains("after its run ended"),
        "{text}"
    );
    second.end().await;
    let value: serde_json::Value =
        serde_json::from_str(&out(&store, &["status", "--json", &running], 0).await).unwrap();
    let left = value["minimum_hold_left_ms"]
        .as_u64()
        .expect("kept in its turn");
    assert!(
        Duration::from_millis(left) <= Duration::from_secs(300),
        "{value}"
    );
    out(&store, &["release", "--force", &running], 0).await;
}

on_every_backend!(
    status_is_0_when_held_and_1_when_free,
    h7_status_list_and_inspect_tell_a_kept_lock_from_a_running_job,
);

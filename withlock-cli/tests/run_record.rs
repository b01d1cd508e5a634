//! `--url-file` and `--log-format`: the URL read from a file (so no
//! password in `ps`), and one line when the command starts and one when
//! the run ends, naming the host and node that ran it.

mod common;

use common::{code, finish, stderr, stdout, withlock, Scratch, Store};
use serde_json::Value;

async fn the_url_can_come_from_a_file(store: Store) {
    let key = store.key("url-file");
    let scratch = Scratch::new();
    let file = scratch.path("url");
    std::fs::write(&file, format!("{}\n", store.args()[1])).unwrap();
    let mut command = withlock(["run"]);
    command
        .args(&store.args()[2..])
        .arg("--url-file")
        .arg(&file)
        .args(["--key", &key, "--", "sh", "-c", "exit 6"]);
    let output = finish(&mut command).await;
    assert_eq!(code(&output), 6, "{}", stderr(&output));
    // WITHLOCK_URL_FILE too.
    let mut command = withlock(["status"]);
    command
        .args(&store.args()[2..])
        .env("WITHLOCK_URL_FILE", &file)
        .arg(&key);
    let output = finish(&mut command).await;
    assert_eq!(code(&output), 1, "{}", stderr(&output));
}

async fn json_records_name_the_host_node_and_token(store: Store) {
    let key = store.key("record");
    let scratch = Scratch::new();
    let script = format!(
        "echo $WITHLOCK_FENCING_TOKEN > {}; exit 3",
        scratch.sh("token")
    );
    let output = finish(store.cmd("run").args([
        "--log-format",
        "json",
        "--node-id",
        "record-node",
        "--key",
        &key,
        "--",
        "sh",
        "-c",
        &script,
    ]))
    .await;
    assert_eq!(code(&output), 3, "{}", stderr(&output));
    assert_eq!(stdout(&output), "", "withlock wrote to stdout");
    let token: u64 = common::appears(&scratch.path("token"))
        .await
        .trim()
        .parse()
        .unwrap();
    let lines: Vec<Value> = stderr(&output)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect();
    assert_eq!(lines.len(), 2, "{lines:?}");
    let host = nix::unistd::gethostname().unwrap().into_string().unwrap();
    for line in &lines {
        assert_eq!(line["key"], key.as_str());
        assert_eq!(line["node"], "record-node");
        assert_eq!(line["host"], host.as_str());
    }
    assert_eq!(lines[0]["event"], "started");
    assert_eq!(lines[0]["token"], token);
    assert_eq!(lines[1]["event"], "ended");
    assert_eq!(lines[1]["token"], token);
    assert_eq!(lines[1]["exit"], 3);
    assert!(lines[1]["ran_ms"].is_u64(), "{:?}", lines[1]);
    assert!(lines[1]["cause"].is_null(), "{:?}", lines[1]);

    // A busy run records its end, with cause "busy" (not with -q: see
    // run_quiet.rs), then says it is busy.
    let (_locker, mut held) = store.hold(&key, "other-host").await;
    let output = finish(store.cmd("run").args([
        "--log-format",
        "json",
        "--no-wait",
        "--key",
        &key,
        "--",
        "true",
    ]))
    .await;
    assert_eq!(code(&output), 75);
    let text = stderr(&output);
    let mut lines = text.lines();
    let line: Value = serde_json::from_str(lines.next().unwrap()).unwrap();
    assert!(lines.next().unwrap().contains("busy"), "{text}");
    assert_eq!(line["event"], "ended");
    assert_eq!(line["cause"], "busy");
    assert_eq!(line["exit"], 75);
    assert!(line["token"].is_null() && line["ran_ms"].is_null());
    held.release().await.unwrap();
}

async fn text_records_name_the_host_and_node(store: Store) {
    let key = store.key("record-text");
    let output = finish(store.cmd("run").args([
        "--log-format",
        "text",
        "--node-id",
        "text-node",
        "--key",
        &key,
        "--",
        "true",
    ]))
    .await;
    assert_eq!(code(&output), 0, "{}", stderr(&output));
    let text = stderr(&output);
    let host = nix::unistd::gethostname().unwrap().into_string().unwrap();
    let started = text.lines().next().unwrap();
    assert!(started.contains("started"), "{text}");
    assert!(started.contains(&format!("host {host}")), "{text}");
    assert!(started.contains("node text-node"), "{text}");
    assert!(text.lines().nth(1).unwrap().contains("exit 0"), "{text}");
    // Without --log-format, a run that ran says nothing.
    let output = finish(store.cmd("run").args(["--key", &key, "--", "true"])).await;
    assert_eq!(stderr(&output), "");
}

on_every_backend!(
    the_url_can_come_from_a_file,
    json_records_name_the_host_node_and_token,
    text_records_name_the_host_and_node,
);

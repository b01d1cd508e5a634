//! `withlock list`, `inspect` and `release --force`, as text and JSON,
//! against locks other nodes hold.

mod common;

use common::{code, finish, stderr, stdout, Store};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use serde_json::Value;

fn json(text: &str) -> Value {
    serde_json::from_str(text).unwrap_or_else(|e| panic!("not JSON ({e}): {text}"))
}

async fn list_shows_held_locks(store: Store) {
    let (a, b, free) = (
        store.key("list-a"),
        store.key("list-b {x}"),
        store.key("list-free"),
    );
    let (_l1, mut h1) = store.hold(&a, "host-one").await;
    let (_l2, mut h2) = store.hold(&b, "host-two").await;
    let (_l3, mut h3) = store.hold(&free, "host-three").await;
    h3.release().await.unwrap();
    let token_a = store.stored(&a).await.fencing_token.unwrap();
    let token_b = store.stored(&b).await.fencing_token.unwrap();

    let output = finish(store.cmd("list").args(["--prefix", store.prefix()])).await;
    assert_eq!(code(&output), 0, "{}", stderr(&output));
    let text = stdout(&output);
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 3, "{text}");
    assert!(
        lines[0].starts_with("KEY") && lines[0].contains("NODE"),
        "{text}"
    );
    assert!(
        lines[0].contains("TTL") && lines[0].contains("TOKEN"),
        "{text}"
    );
    let row_a = lines.iter().find(|l| l.starts_with(&a)).expect("a listed");
    assert!(
        row_a.contains("host-one") && row_a.contains(&token_a.to_string()),
        "{row_a}"
    );
    let row_b = lines.iter().find(|l| l.starts_with(&b)).expect("b listed");
    assert!(
        row_b.contains("host-two") && row_b.contains(&token_b.to_string()),
        "{row_b}"
    );
    assert!(!text.contains("list-free"), "a free key is listed: {text}");

    let output = finish(
        store
            .cmd("list")
            .args(["--json", "--prefix", store.prefix()]),
    )
    .await;
    assert_eq!(code(&output), 0, "{}", stderr(&output));
    let all = json(&stdout(&output));
    let all = all.as_array().unwrap();
    assert_eq!(all.len(), 2, "{all:?}");
    assert_eq!(all[0]["key"], a.as_str());
    assert_eq!(all[0]["node_id"], "host-one");
    assert_eq!(all[0]["held"], true);
    assert_eq!(all[0]["fencing_token"], token_a);
    assert!(all[0]["owner"].as_str().unwrap().starts_with("host-one/"));
    let ttl = all[0]["ttl_ms"].as_u64().unwrap();
    assert!(ttl > 50_000 && ttl <= 60_000, "ttl {ttl}");
    assert_eq!(all[1]["key"], b.as_str());
    assert_eq!(all[1]["fencing_token"], token_b);

    // A prefix matching nothing.
    let none = format!("{}no-such-prefix*", store.prefix());
    let output = finish(store.cmd("list").args(["--json", "--prefix", &none])).await;
    assert_eq!(json(&stdout(&output)), Value::Array(vec![]));
    h1.release().await.unwrap();
    h2.release().await.unwrap();
}

async fn inspect_shows_one_key(store: Store) {
    let key = store.key("inspect me");
    let (_locker, mut held) = store.hold(&key, "host-one").await;
    let stored = store.stored(&key).await;
    let token = stored.fencing_token.unwrap();

    let output = finish(store.cmd("inspect").arg(&key)).await;
    assert_eq!(code(&output), 0, "{}", stderr(&output));
    let text = stdout(&output);
    assert!(
        text.contains(&format!("key:                {key}\n")),
        "{text}"
    );
    assert!(text.contains("held by:            host-one\n"), "{text}");
    assert!(
        text.contains(&format!("owner token:        {}\n", stored.owner.unwrap())),
        "{text}"
    );
    assert!(
        text.contains(&format!("last fencing token: {token}\n")),
        "{text}"
    );
    assert!(text.contains("ttl:"), "{text}");

    let output = finish(store.cmd("inspect").args(["--json", &key])).await;
    let one = json(&stdout(&output));
    assert_eq!(one["key"], key.as_str());
    assert_eq!(one["held"], true);
    assert_eq!(one["node_id"], "host-one");
    assert_eq!(one["fencing_token"], token);

    held.release().await.unwrap();
    let output = finish(store.cmd("inspect").args(["--json", &key])).await;
    let one = json(&stdout(&output));
    assert_eq!(one["held"], false);
    assert!(one["node_id"].is_null() && one["ttl_ms"].is_null());
    assert_eq!(
        one["fencing_token"], token,
        "the last token outlives the lock"
    );
    let output = finish(store.cmd("inspect").arg(&key)).await;
    assert!(stdout(&output).contains("nobody"), "{}", stdout(&output));

    let never = store.key("never locked");
    let output = finish(store.cmd("inspect").args(["--json", &never])).await;
    let one = json(&stdout(&output));
    assert_eq!(one["held"], false);
    assert!(one["fencing_token"].is_null());
}

async fn release_force_frees_any_holder(store: Store) {
    let key = store.key("release me");
    let (_locker, mut held) = store.hold(&key, "dead-host").await;

    let output = finish(store.cmd("release").arg(&key)).await;
    assert_eq!(code(&output), 64, "{}", stderr(&output));
    assert!(stderr(&output).contains("--force"));
    assert!(
        store.stored(&key).await.owner.is_some(),
        "freed without --force"
    );

    let output = finish(store.cmd("release").args(["--force", &key])).await;
    assert_eq!(code(&output), 0, "{}", stderr(&output));
    let text = stdout(&output);
    assert!(
        text.contains("released") && text.contains("dead-host"),
        "{text}"
    );
    assert_eq!(store.stored(&key).await.owner, None);
    assert!(
        !held.renew().await.unwrap(),
        "the old holder learns it lost the key"
    );

    let output = finish(store.cmd("release").args(["--force", &key])).await;
    assert_eq!(code(&output), 0);
    assert!(
        stdout(&output).contains("was not held"),
        "{}",
        stdout(&output)
    );

    // The key can be taken again, with a greater token.
    let before = store.stored(&key).await.fencing_token.unwrap();
    let (_again, mut next) = store.hold(&key, "new-host").await;
    assert!(next.fencing_token().unwrap() > before);
    next.release().await.unwrap();
}

/// A `withlock run` in progress shows in `list` with its node id.
async fn a_running_job_is_listed(store: Store) {
    let key = store.key("running job");
    let scratch = common::Scratch::new();
    let script = format!(
        "echo $WITHLOCK_FENCING_TOKEN > {t}.tmp && mv {t}.tmp {t}; sleep 30",
        t = scratch.sh("token")
    );
    let child = store
        .cmd("run")
        .args([
            "--node-id",
            "cron-host-7",
            "--key",
            &key,
            "--",
            "sh",
            "-c",
            &script,
        ])
        .spawn()
        .unwrap();
    let token = common::appears(&scratch.path("token")).await;
    let output = finish(
        store
            .cmd("list")
            .args(["--json", "--prefix", store.prefix()]),
    )
    .await;
    let all = json(&stdout(&output));
    assert_eq!(all[0]["key"], key.as_str());
    assert_eq!(all[0]["node_id"], "cron-host-7");
    assert_eq!(all[0]["fencing_token"].to_string(), token.trim());
    let ttl = all[0]["ttl_ms"].as_u64().unwrap();
    assert!(ttl > 15_000, "the default ttl is 30 s and extended: {ttl}");
    let pid = i32::try_from(child.id().unwrap()).unwrap();
    kill(Pid::from_raw(pid), Signal::SIGTERM).unwrap();
    let output = common::wait(child).await;
    assert_eq!(code(&output), 128 + 15, "{}", stderr(&output));
    assert_eq!(store.stored(&key).await.owner, None);
}

/// \[D2\] `release --force` of a Redis LIST refuses with the reason and
/// exit 65, and leaves the list as it was.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn release_force_refuses_a_list_and_leaves_it() {
    let store = Store::redis().await;
    let Store::Redis { url, .. } = &store else {
        unreachable!()
    };
    let key = store.key("a queue");
    let mut conn = lock_redis::redis::Client::open(url.as_str())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let _: () = lock_redis::redis::pipe()
        .rpush(&key, "job-1")
        .rpush(&key, "job-2")
        .query_async(&mut conn)
        .await
        .unwrap();
    let output = finish(store.cmd("release").args(["--force", &key])).await;
    assert_eq!(code(&output), 65, "{}", stderr(&output));
    let text = stderr(&output);
    assert!(
        text.contains("not a withlock lock") && text.contains("a list"),
        "{text}"
    );
    let jobs: Vec<String> = lock_redis::redis::cmd("LRANGE")
        .arg(&key)
        .arg(0)
        .arg(-1)
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(jobs, ["job-1", "job-2"], "the list is left as it was");
}

/// \[D2\] `release --force` of a PostgreSQL row whose holder is in no lock
/// format withlock takes refuses with exit 65 and leaves the row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn release_force_refuses_a_row_of_another_format() {
    let store = Store::postgres().await;
    let Store::Postgres { backend, .. } = &store else {
        unreachable!()
    };
    let key = store.key("held by hand");
    let table = backend.qualified_table();
    lock_postgres::sqlx::query(&format!(
        "INSERT INTO {table} (key, locked_by, locked_at, locked_until) VALUES ($1, 'ops on call', \
         clock_timestamp() AT TIME ZONE 'UTC', clock_timestamp() AT TIME ZONE 'UTC' + interval '1 hour')"
    ))
    .bind(&key)
    .execute(backend.pool())
    .await
    .unwrap();
    let output = finish(store.cmd("release").args(["--force", &key])).await;
    assert_eq!(code(&output), 65, "{}", stderr(&output));
    assert!(
        stderr(&output).contains("not a withlock lock"),
        "{}",
        stderr(&output)
    );
    assert_eq!(
        store.stored(&key).await.owner.as_deref(),
        Some("ops on call")
    );
}

/// \[D1\] The same commands on a Redis Cluster, named by a
/// `redis+cluster://` URL of several nodes: `list` finds locks on every
/// master, `release --force` frees one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_commands_work_on_a_cluster_url() {
    use lock_redis::testing::ScratchClusterBackend;
    use withlock_test_servers::redis::shared_cluster;
    let cluster = tokio::task::block_in_place(shared_cluster);
    let backend = std::sync::Arc::new(ScratchClusterBackend::new(
        &cluster.urls(),
        lock_redis::RedisConfig::default(),
    ));
    let prefix = backend.namespace().prefix().to_owned();
    let locker = lock_core::Locker::with_options(
        std::sync::Arc::clone(&backend),
        lock_core::LockerOptions::default().node_id("cluster-host"),
    )
    .unwrap();
    let mut handles = Vec::new();
    for i in 0..12 {
        let mut handle = locker
            .handle(&format!("job:{i:02}"), std::time::Duration::from_secs(60))
            .unwrap();
        assert!(handle.acquire().await.unwrap());
        handles.push(handle);
    }
    let hosts: Vec<String> = cluster
        .urls()
        .iter()
        .take(2)
        .map(|u| u.trim_start_matches("redis://").to_owned())
        .collect();
    let url = format!("redis+cluster://{}", hosts.join(","));
    let cmd = |sub: &str| {
        let mut command = common::withlock([sub]);
        command.args(["--url", &url, "--redis-prefix", &prefix]);
        command
    };
    let output = finish(cmd("list").arg("--json")).await;
    assert_eq!(code(&output), 0, "{}", stderr(&output));
    let all = json(&stdout(&output));
    let keys: Vec<&str> = all
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["key"].as_str().unwrap())
        .collect();
    let expected: Vec<String> = (0..12).map(|i| format!("job:{i:02}")).collect();
    assert_eq!(keys, expected);
    let output = finish(cmd("release").args(["--force", "job:03"])).await;
    assert_eq!(code(&output), 0, "{}", stderr(&output));
    assert!(
        stdout(&output).contains("cluster-host"),
        "{}",
        stdout(&output)
    );
    assert!(!handles[3].renew().await.unwrap());
    for handle in &mut handles {
        let _ = handle.release().await;
    }
}

/// \[D1\] `list` on a Redis Cluster one master of which does not answer
/// (stopped with SIGSTOP): the locks of the other masters on stdout (text
/// and `--json`, still one array), one warning naming the silent master
/// on stderr (`--json`: `{"unreachable": [{"node", "error"}]}`), exit 69,
/// within the step timeout (2 s) and some margin. A cluster of this
/// test's own: 3 masters, no replicas, so nothing fails over meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn d1_list_on_a_cluster_names_a_master_that_does_not_answer() {
    use std::time::{Duration, Instant};
    use withlock_test_servers::redis::RedisCluster;

    let cluster = tokio::task::block_in_place(|| RedisCluster::start_with(3, 0)).unwrap();
    let backend = lock_redis::RedisClusterBackend::connect(cluster.urls())
        .await
        .unwrap();
    let locker = lock_core::Locker::with_options(
        backend,
        lock_core::LockerOptions::default().node_id("cluster-host"),
    )
    .unwrap();
    // One key on each master, the first on the one to stop.
    let mut keys: Vec<(u16, String)> = Vec::new();
    for i in 0.. {
        let key = format!("job:{i:02}");
        let port = cluster.master_of_key(&key).unwrap().port();
        if keys.iter().all(|(p, _)| *p != port) {
            keys.push((port, key));
        }
        if keys.len() == 3 {
            break;
        }
    }
    let mut handles = Vec::new();
    for (_, key) in &keys {
        let mut handle = locker.handle(key, Duration::from_secs(60)).unwrap();
        assert!(handle.acquire().await.unwrap());
        handles.push(handle);
    }
    let (port, silent_key) = keys[0].clone();
    let mut answering: Vec<&str> = keys[1..].iter().map(|(_, k)| k.as_str()).collect();
    answering.sort_unstable();
    let hosts: Vec<String> = cluster
        .urls()
        .iter()
        .map(|u| u.trim_start_matches("redis://").to_owned())
        .collect();
    let url = format!("redis+cluster://{}", hosts.join(","));
    let cmd = || {
        let mut command = common::withlock(["list"]);
        command.args(["--url", &url]);
        command
    };

    let silent = cluster.node(port).unwrap();
    silent.pause().unwrap();
    let started = Instant::now();
    let text = finish(&mut cmd()).await;
    let took = started.elapsed();
    let json_out = finish(cmd().arg("--json")).await;
    silent.resume().unwrap();

    assert_eq!(code(&text), 69, "{}", stderr(&text));
    assert!(took < Duration::from_secs(5), "took {took:?}");
    let listed = stdout(&text);
    let lines: Vec<&str> = listed.lines().collect();
    assert_eq!(lines.len(), 3, "{listed}");
    assert!(lines[0].starts_with("KEY"), "{listed}");
    for (line, key) in lines[1..].iter().zip(&answering) {
        assert!(
            line.starts_with(key) && line.contains("cluster-host"),
            "{listed}"
        );
    }
    assert!(!listed.contains(&silent_key), "{listed}");
    let warning = stderr(&text);
    assert_eq!(warning.lines().count(), 1, "{warning}");
    assert!(
        warning.starts_with("withlock: warning: Redis Cluster: ")
            && warning.contains(&format!(
                ":{port} did not answer, its locks are not listed: "
            )),
        "{warning}"
    );

    assert_eq!(code(&json_out), 69, "{}", stderr(&json_out));
    let all = json(&stdout(&json_out));
    let listed: Vec<&str> = all
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["key"].as_str().unwrap())
        .collect();
    assert_eq!(listed, answering);
    let unreachable = json(&stderr(&json_out));
    let unreachable = unreachable["unreachable"].as_array().unwrap();
    assert_eq!(unreachable.len(), 1, "{unreachable:?}");
    assert!(unreachable[0]["node"]
        .as_str()
        .unwrap()
        .ends_with(&format!(":{port}")));
    assert!(!unreachable[0]["error"].as_str().unwrap().is_empty());

    // Answering again: the whole list, exit 0.
    let output = finish(cmd().arg("--json")).await;
    assert_eq!(code(&output), 0, "{}", stderr(&output));
    assert_eq!(json(&stdout(&output)).as_array().unwrap().len(), 3);
    for handle in &mut handles {
        let _ = handle.release().await;
    }
}

on_every_backend!(
    list_shows_held_locks,
    inspect_shows_one_key,
    release_force_frees_any_holder,
    a_running_job_is_listed,
);

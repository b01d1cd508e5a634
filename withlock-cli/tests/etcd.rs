//! The `withlock` command on etcd (`etcd://` URLs): `run`, `list`,
//! `inspect`, `status` and `release --force` through the same admin API
//! as on Redis and PostgreSQL \[D1\], etcd's refusals and outages told
//! apart by exit code \[A8\], and `etcdctl lock` holding the same names.
//!
//! Against etcd servers the tests start themselves (withlock-test-servers'
//! `etcd`): one shared server, whose keys each test keeps under a
//! prefix of its own, and a server of its own for the test that turns
//! authentication on.

mod common;

use std::process::Stdio;
use std::time::{Duration, Instant};

use common::{
    alive, appears, code, finish, run_expecting, stderr, stdout, wait_expecting, withlock, Scratch,
};
use lock_core::{LockAdmin, LockHandle, Locker, LockerOptions};
use lock_etcd::{EtcdBackend, EtcdConfig};
use serde_json::Value;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Command;
use withlock_test_servers::etcd::{shared_server, EtcdCluster};

/// A backend on a test cluster's members.
trait Backend {
    /// A backend on every member (member 0 first), with short timeouts
    /// so that it fails over soon: a step timeout of 1 s and a failover
    /// timeout of 300 ms.
    async fn backend(&self) -> EtcdBackend;
}

impl Backend for EtcdCluster {
    async fn backend(&self) -> EtcdBackend {
        let config = EtcdConfig::new(self.endpoints())
            .step_timeout(Duration::from_secs(1))
            .failover_timeout(Duration::from_millis(300))
            .connect_timeout(Duration::from_secs(5));
        EtcdBackend::connect(config)
            .await
            .unwrap_or_else(|e| panic!("no backend on the test etcd: {e:?}"))
    }
}

/// The shared etcd, and a key prefix of this test's own on it.
struct Etcd {
    cluster: &'static EtcdCluster,
    prefix: String,
}

impl Etcd {
    async fn new() -> Self {
        Self {
            cluster: shared_server().await,
            prefix: format!("withlock-cli-test-{:016x}-", rand::random::<u64>()),
        }
    }

    fn key(&self, name: &str) -> String {
        format!("{}{name}", self.prefix)
    }

    /// `withlock SUBCOMMAND --url etcd://…`.
    fn cmd(&self, subcommand: &str) -> Command {
        let mut command = withlock([subcommand]);
        command.args(["--url", &self.cluster.url()]);
        command
    }

    /// Takes `key` as node `node_id` for a minute, as another host would.
    async fn hold(&self, key: &str, node_id: &str) -> (EtcdBackend, Locker, LockHandle) {
        let backend = self.cluster.backend().await;
        let locker =
            Locker::with_options(backend.clone(), LockerOptions::default().node_id(node_id))
                .unwrap();
        let mut handle = locker.handle(key, Duration::from_secs(60)).unwrap();
        assert!(handle.acquire().await.unwrap(), "{key} was not free");
        (backend, locker, handle)
    }
}

fn json(text: &str) -> Value {
    serde_json::from_str(text).unwrap_or_else(|e| panic!("not JSON ({e}): {text}"))
}

/// `withlock run` takes the lock, runs the command with its fencing token
/// and passes its exit code through; the lock is free afterwards, its
/// token kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn d1_run_on_etcd_runs_the_command_and_passes_its_exit_code() {
    let etcd = Etcd::new().await;
    let key = etcd.key("run");
    // A token drawn for the key before the run: the run's comes after it.
    let earlier = Locker::new(etcd.cluster.backend().await)
        .with_lock(&key, |ctx| async move { ctx.fencing_token() })
        .await
        .unwrap();
    let scratch = Scratch::new();
    let script = format!(
        "echo \"$WITHLOCK_KEY $WITHLOCK_FENCING_TOKEN\" > {}; exit 3",
        scratch.sh("ran")
    );
    let output = run_expecting(
        etcd.cmd("run")
            .args(["--key", &key, "--", "sh", "-c", &script]),
        3,
    )
    .await;
    assert_eq!(stderr(&output), "");
    let ran = std::fs::read_to_string(scratch.path("ran")).unwrap();
    let (ran_key, token) = ran.trim().split_once(' ').unwrap();
    assert_eq!(ran_key, key);
    let token: u64 = token.parse().unwrap();
    assert!(
        token > earlier,
        "{ran}: not after the earlier token {earlier}"
    );
    let backend = etcd.cluster.backend().await;
    let view = backend.inspect(&key).await.unwrap();
    assert!(!view.is_held(), "the lock outlived the run: {view:?}");
    assert_eq!(view.fencing_token, Some(token));
}

/// A lock another host holds: `run --no-wait` exits 75 at once with one
/// line naming the holder, and the command never runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn d1_a_busy_lock_on_etcd_exits_75_naming_the_holder() {
    let etcd = Etcd::new().await;
    let key = etcd.key("busy");
    let (_backend, _locker, mut held) = etcd.hold(&key, "other-host").await;
    let scratch = Scratch::new();
    let ran = scratch.path("ran").display().to_string();
    // One attempt, not the default's retries: `run::tests::
    // waiting_options_map_to_retries` (no time limit can tell them apart
    // on a loaded machine).
    let output = run_expecting(
        etcd.cmd("run")
            .args(["--no-wait", "--key", &key, "--", "touch", &ran]),
        75,
    )
    .await;
    let message = stderr(&output);
    assert!(
        message.contains("busy") && message.contains("other-host"),
        "{message}"
    );
    assert_eq!(message.lines().count(), 1, "{message}");

    // `-q --busy-exit 0`: a busy lock is a silent success.
    let output = run_expecting(
        etcd.cmd("run").args([
            "-q",
            "--busy-exit",
            "0",
            "--no-wait",
            "--key",
            &key,
            "--",
            "touch",
            &ran,
        ]),
        0,
    )
    .await;
    assert_eq!(stderr(&output), "");
    assert_eq!(stdout(&output), "");
    assert!(!scratch.path("ran").exists(), "the command ran");
    // The holder's lock is untouched.
    assert!(held.renew().await.unwrap());
    held.release().await.unwrap();
}

/// A `withlock run` in progress shows in `list`, `inspect` and `status`
/// with its node id and the token its command got; once it ends the key
/// is free.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn d1_list_inspect_and_status_show_a_running_job_on_etcd() {
    let etcd = Etcd::new().await;
    let key = etcd.key("job {7}");
    let scratch = Scratch::new();
    let script = format!(
        "echo $WITHLOCK_FENCING_TOKEN > {t}.tmp && mv {t}.tmp {t}; \
         while [ ! -e {stop} ]; do sleep 0.05; done",
        t = scratch.sh("token"),
        stop = scratch.sh("stop"),
    );
    let job = etcd
        .cmd("run")
        .args([
            "--node-id",
            "cron-host-7",
            "--ttl",
            "20s",
            "--key",
            &key,
            "--",
            "sh",
            "-c",
            &script,
        ])
        .spawn()
        .unwrap();
    let token: u64 = appears(&scratch.path("token"))
        .await
        .trim()
        .parse()
        .unwrap();

    let output = run_expecting(etcd.cmd("list").args(["--prefix", &etcd.prefix]), 0).await;
    let text = stdout(&output);
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 2, "{text}");
    assert!(lines[0].starts_with("KEY"), "{text}");
    assert!(
        lines[1].starts_with(&key)
            && lines[1].contains("cron-host-7")
            && lines[1].contains(&token.to_string()),
        "{text}"
    );
    let output = finish(etcd.cmd("list").args(["--json", "--prefix", &etcd.prefix])).await;
    let all = json(&stdout(&output));
    let all = all.as_array().unwrap();
    assert_eq!(all.len(), 1, "{all:?}");
    assert_eq!(all[0]["key"], key.as_str());
    assert_eq!(all[0]["held"], true);
    assert_eq!(all[0]["node_id"], "cron-host-7");
    assert_eq!(all[0]["fencing_token"], token);
    let ttl = all[0]["ttl_ms"].as_u64().unwrap();
    assert!(ttl > 0 && ttl <= 20_000, "ttl {ttl}");

    let output = run_expecting(etcd.cmd("inspect").arg(&key), 0).await;
    let text = stdout(&output);
    assert!(text.contains("held by:            cron-host-7\n"), "{text}");
    assert!(
        text.contains(&format!("last fencing token: {token}\n")),
        "{text}"
    );
    let output = finish(etcd.cmd("inspect").args(["--json", &key])).await;
    let one = json(&stdout(&output));
    assert_eq!(one["held"], true);
    assert!(
        one["owner"].as_str().unwrap().starts_with("cron-host-7/"),
        "{one}"
    );

    let output = run_expecting(etcd.cmd("status").arg(&key), 0).await;
    let text = stdout(&output);
    assert!(
        text.contains("is held by cron-host-7")
            && text.contains(&format!("fencing token {token}"))
            && text.contains("left"),
        "{text}"
    );

    std::fs::write(scratch.path("stop"), "").unwrap();
    wait_expecting(job, 0).await;
    let output = run_expecting(etcd.cmd("status").args(["--json", &key]), 1).await;
    let one = json(&stdout(&output));
    assert_eq!(one["held"], false);
    assert_eq!(
        one["fencing_token"], token,
        "the last token outlives the lock"
    );
    let output = finish(etcd.cmd("list").args(["--prefix", &etcd.prefix])).await;
    assert_eq!(stdout(&output), "no locks held\n");
}

/// `release --force` frees a running job's lock and says who held it;
/// the job hears of it and is terminated long before its next extension,
/// and `withlock run` exits 79.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn l5_d1_release_force_on_etcd_terminates_the_holders_job() {
    let etcd = Etcd::new().await;
    let key = etcd.key("forced");
    let scratch = Scratch::new();
    let script = format!(
        "trap 'echo term > {term}; exit 0' TERM; echo $$ > {pid}; \
         while :; do sleep 0.05; done",
        term = scratch.sh("term"),
        pid = scratch.sh("pid"),
    );
    let holder = etcd
        .cmd("run")
        .args([
            "--node-id",
            "stuck-host",
            "--ttl",
            "30s",
            "--grace",
            "5s",
            "--key",
            &key,
            "--",
            "sh",
            "-c",
            &script,
        ])
        .spawn()
        .unwrap();
    let pid: i32 = appears(&scratch.path("pid")).await.trim().parse().unwrap();

    run_expecting(etcd.cmd("release").arg(&key), 64).await;
    assert!(alive(pid), "the job ended without --force");

    let released = run_expecting(etcd.cmd("release").args(["--force", &key]), 0).await;
    let released_at = Instant::now();
    let text = stdout(&released);
    assert!(
        text.starts_with(&format!("released {key}, held by stuck-host (")),
        "{text}"
    );
    appears(&scratch.path("term")).await;
    let took = released_at.elapsed();
    assert!(
        took < Duration::from_secs(5),
        "the job got SIGTERM {took:?} after the force release (its next extension was 10 s away)"
    );
    let output = wait_expecting(holder, 79).await;
    assert!(!alive(pid), "the job survived");
    assert!(
        stderr(&output).contains("lost the lock"),
        "{}",
        stderr(&output)
    );

    let output = run_expecting(etcd.cmd("release").args(["--force", &key]), 0).await;
    assert!(
        stdout(&output).contains("was not held"),
        "{}",
        stdout(&output)
    );
}

/// `migrate` has nothing to set up on etcd.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn d3_migrate_on_etcd_has_nothing_to_do() {
    let etcd = Etcd::new().await;
    let output = run_expecting(&mut etcd.cmd("migrate"), 0).await;
    assert_eq!(stdout(&output), "etcd needs no setup: nothing to do\n");
}

/// No endpoint answers: every command exits 69, the command never runs,
/// and the password in the URL is never shown.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a8_unreachable_etcd_endpoints_are_69() {
    // Nothing listens on port 1 of the loopback.
    for url in [
        "etcd://app:hunter2@127.0.0.1:1",
        "etcd://127.0.0.1:1,127.0.0.1:2",
    ] {
        let scratch = Scratch::new();
        let ran = scratch.path("ran").display().to_string();
        let output = finish(&mut withlock([
            "run", "--url", url, "--key", "k", "--", "touch", &ran,
        ]))
        .await;
        let message = stderr(&output);
        assert_eq!(code(&output), 69, "{url}: {message}");
        assert!(!scratch.path("ran").exists(), "the command ran");
        assert_eq!(message.lines().count(), 1, "{message}");
        assert!(
            message.contains("could not reach etcd at http://127.0.0.1:1")
                && message.contains("connection refused")
                && message.contains("did not run"),
            "{message}"
        );
        assert!(
            !message.contains("hunter2"),
            "the password leaked: {message}"
        );
    }
    for sub in [
        vec!["list"],
        vec!["inspect", "k"],
        vec!["status", "k"],
        vec!["release", "--force", "k"],
    ] {
        let output = finish(withlock(&sub).args(["--url", "etcd://127.0.0.1:1"])).await;
        assert_eq!(code(&output), 69, "{sub:?}: {}", stderr(&output));
    }
}

/// A malformed `etcd://` URL is a usage error (64) naming what is wrong,
/// found before anything is reached; the password is never shown.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn d1_malformed_etcd_urls_are_64() {
    for (url, says) in [
        ("etcd://", "empty host"),
        ("etcd://127.0.0.1:99999", "port"),
        ("etcd://127.0.0.1:0", "port"),
        ("etcd://app:hunter2@127.0.0.1:12ab", "invalid uri"),
        ("etcd://a b:2379", "invalid uri"),
        ("etcd://a:2379,,b:2379", "empty host"),
        ("etcd://hunter2@127.0.0.1:2379", "no password"),
        ("etcd://127.0.0.1:2379/path", "path"),
        ("etcd://app:%zzhunter2@127.0.0.1:2379", "escape"),
    ] {
        let scratch = Scratch::new();
        let ran = scratch.path("ran").display().to_string();
        // 64, not 69: nothing was reached (nothing listens at these
        // addresses).
        let output = finish(&mut withlock([
            "run", "--url", url, "--key", "k", "--", "touch", &ran,
        ]))
        .await;
        let message = stderr(&output);
        assert_eq!(code(&output), 64, "{url}: {message}");
        assert!(!scratch.path("ran").exists(), "the command ran");
        assert!(
            message.contains("--url") && message.contains(says),
            "{url}: {message}"
        );
        assert!(!message.contains("unknown scheme"), "{url}: {message}");
        assert!(
            !message.contains("hunter2"),
            "the password leaked: {message}"
        );
    }
}

/// Runs `etcdctl ARGS…` against `cluster` and checks that it succeeded.
async fn etcdctl(cluster: &EtcdCluster, args: &[&str]) {
    let mut command = Command::from(cluster.etcdctl());
    let output = command.args(args).output().await.unwrap();
    assert!(
        output.status.success(),
        "etcdctl {args:?}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
}

/// With etcd's authentication on: a wrong password, no user at all, and
/// a user without the rights on the lock's keys all exit 77 and the
/// command never runs; the right password runs it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a8_refused_etcd_credentials_and_rights_are_77() {
    let cluster = EtcdCluster::start(1).await.unwrap();
    etcdctl(
        &cluster,
        &["user", "add", "root", "--new-user-password=r00t"],
    )
    .await;
    etcdctl(&cluster, &["user", "grant-role", "root", "root"]).await;
    // A user with a role that grants nothing.
    etcdctl(
        &cluster,
        &["user", "add", "app", "--new-user-password=app-pw"],
    )
    .await;
    etcdctl(&cluster, &["role", "add", "nothing"]).await;
    etcdctl(&cluster, &["user", "grant-role", "app", "nothing"]).await;
    etcdctl(&cluster, &["auth", "enable"]).await;

    let hosts = cluster.url();
    let hosts = hosts.trim_start_matches("etcd://");
    let scratch = Scratch::new();
    let ran = scratch.path("ran").display().to_string();
    for (user, says) in [
        ("root:hunter2@", "authentication failed"),
        ("", "user name is empty"),
        ("app:app-pw@", "permission denied"),
    ] {
        let url = format!("etcd://{user}{hosts}");
        let started = std::time::Instant::now();
        let output = finish(&mut withlock([
            "run", "--url", &url, "--wait", "30s", "--key", "k", "--", "touch", &ran,
        ]))
        .await;
        let message = stderr(&output);
        assert_eq!(code(&output), 77, "{user}: {message}");
        // Not retried: retries would go on for the 30 s wait; a third of it
        // is one attempt's, however busy the machine.
        assert!(
            started.elapsed() < std::time::Duration::from_secs(10),
            "{user}: took {:?}: retried?",
            started.elapsed()
        );
        assert!(message.contains(says), "{user}: {message}");
        assert!(message.contains("did not run"), "{user}: {message}");
        assert!(
            !message.contains("hunter2"),
            "the password leaked: {message}"
        );
        assert!(!scratch.path("ran").exists(), "the command ran");
    }
    let url = format!("etcd://root:r00t@{hosts}");
    run_expecting(
        &mut withlock(["run", "--url", &url, "--key", "k", "--", "touch", &ran]),
        0,
    )
    .await;
    assert!(scratch.path("ran").exists(), "the command did not run");
    run_expecting(&mut withlock(["list", "--url", &url]), 0).await;
    run_expecting(
        &mut withlock(["list", "--url", &format!("etcd://{hosts}")]),
        77,
    )
    .await;
}

/// A name `etcdctl lock` holds is busy for `withlock run` (the same key
/// layout), shows as held by `<etcd mutex>`, and `release --force`
/// refuses it (exit 65), leaving it held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn d2_a_name_etcdctl_lock_holds_is_busy_and_not_force_released() {
    let etcd = Etcd::new().await;
    let key = etcd.key("etcdctl");
    let mut holder = Command::from(etcd.cluster.etcdctl());
    let mut holder = holder
        .args(["lock", &key])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    // `etcdctl lock NAME` prints its key once it holds the lock.
    let mut lines = BufReader::new(holder.stdout.take().unwrap()).lines();
    let line = tokio::time::timeout(Duration::from_secs(10), lines.next_line())
        .await
        .expect("etcdctl lock never took the lock")
        .unwrap()
        .unwrap();
    assert!(line.starts_with(&format!("{key}/")), "{line}");

    let scratch = Scratch::new();
    let ran = scratch.path("ran").display().to_string();
    let output = finish(
        etcd.cmd("run")
            .args(["--no-wait", "--key", &key, "--", "touch", &ran]),
    )
    .await;
    let message = stderr(&output);
    assert_eq!(code(&output), 75, "{message}");
    assert!(
        message.contains("busy") && message.contains("<etcd mutex>"),
        "{message}"
    );
    assert!(!scratch.path("ran").exists(), "the command ran");

    run_expecting(etcd.cmd("status").arg(&key), 0).await;
    run_expecting(etcd.cmd("release").args(["--force", &key]), 65).await;
    let output = finish(etcd.cmd("status").arg(&key)).await;
    assert_eq!(code(&output), 0, "released anyway: {}", stdout(&output));

    // etcdctl ends its session on SIGTERM, which frees the name.
    let pid = nix::unistd::Pid::from_raw(i32::try_from(holder.id().unwrap()).unwrap());
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).unwrap();
    tokio::time::timeout(Duration::from_secs(10), holder.wait())
        .await
        .expect("etcdctl did not exit")
        .unwrap();
    run_expecting(
        etcd.cmd("run")
            .args(["--wait", "5s", "--key", &key, "--", "touch", &ran]),
        0,
    )
    .await;
    assert!(scratch.path("ran").exists(), "the command did not run");
}

/// etcd while it has no leader (two of three members killed; the third
/// campaigns in vain until one is back): `--no-wait` waits only the
/// connect timeout and exits 69 saying there is no leader, not that etcd
/// is unreachable; `--wait 30s` waits past the connect timeout for the
/// election, then runs the command \[A8\].
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a8_run_waits_for_an_etcd_leader_within_its_wait() {
    let cluster = EtcdCluster::start(3).await.unwrap();
    cluster.kill(0);
    cluster.kill(1);
    let url = cluster.url();
    let scratch = Scratch::new();
    let ran = scratch.path("ran");
    let ran_arg = ran.display().to_string();

    let output = run_expecting(
        &mut withlock([
            "run",
            "--url",
            &url,
            "--no-wait",
            "--key",
            "k",
            "--",
            "touch",
            &ran_arg,
        ]),
        69,
    )
    .await;
    let message = stderr(&output);
    assert!(message.contains("has no leader"), "{message}");
    assert!(!ran.exists(), "the command did not run");

    let child = withlock([
        "run", "--url", &url, "--wait", "30s", "--key", "k", "--", "touch", &ran_arg,
    ])
    .stdout(Stdio::null())
    .stderr(Stdio::piped())
    .spawn()
    .unwrap();
    let pid = i32::try_from(child.id().unwrap()).unwrap();
    // The leader stays missing past the connect timeout (2 s): only a run
    // that waits for it within its wait is still there.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(alive(pid), "withlock gave up before its wait was over");
    cluster.restart(1).unwrap();
    wait_expecting(child, 0).await;
    assert!(ran.exists(), "the command ran once a leader was elected");
}

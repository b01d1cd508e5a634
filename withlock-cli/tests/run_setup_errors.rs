//! A store that refuses for a reason trying again cannot mend ends the
//! command at once, told apart from an outage (69) by its exit code: 77
//! for refused credentials or permissions (`EX_NOPERM`), 78 for a store
//! not set up (`EX_CONFIG`) \[A8, D3\]. The command never runs, and the
//! message never shows the password.

mod common;

use std::time::{Duration, Instant};

use common::{code, finish, hosts_of, stderr, withlock, AclUser, Role, Scratch, Store};

/// Runs `withlock run ARGS -- touch ran` (with a 30 s wait unless ARGS say
/// `--no-wait`) and checks that it exits with `expected`, fast, on one
/// line naming `names`, without running the command or showing `secret`.
async fn refused(args: &[&str], expected: i32, names: &str, secret: &str) -> String {
    let scratch = Scratch::new();
    let ran = scratch.path("ran").display().to_string();
    let started = Instant::now();
    let mut command = withlock(["run"]);
    command.args(args);
    if !args.contains(&"--no-wait") {
        command.args(["--wait", "30s"]);
    }
    command.args(["--", "touch", &ran]);
    let output = finish(&mut command).await;
    let message = stderr(&output);
    assert_eq!(code(&output), expected, "{message}");
    assert!(!scratch.path("ran").exists(), "the command ran");
    assert_eq!(message.lines().count(), 1, "{message}");
    assert!(message.contains(names), "should name {names:?}: {message}");
    assert!(message.contains("did not run"), "{message}");
    assert!(!message.contains(secret), "the password leaked: {message}");
    // Not retried: retries would go on for the 30 s wait; a third of it is
    // one attempt's, however busy the machine.
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "took {:?}: retried?",
        started.elapsed()
    );
    message
}

#[tokio::test]
async fn a8_redis_wrong_password_is_77() {
    let user = AclUser::create("~* &* +@all").await;
    let wrong = format!("{:032x}", rand::random::<u128>());
    let url = user.url_with(&wrong);
    refused(&["--url", &url, "--key", "k"], 77, "authentication", &wrong).await;
    // The admin commands say the same.
    let output = finish(&mut withlock(["list", "--url", &url])).await;
    assert_eq!(code(&output), 77, "{}", stderr(&output));
    // The right password works: the refusal was the password's.
    let key = format!("withlock-test-acl-{:016x}", rand::random::<u64>());
    let right = user.url_with(&user.password);
    let output = finish(&mut withlock([
        "run", "--url", &right, "--key", &key, "--", "true",
    ]))
    .await;
    assert_eq!(code(&output), 0, "{}", stderr(&output));
}

#[tokio::test]
async fn a8_redis_missing_privilege_is_77() {
    // Every command but the scripts the lock runs.
    let user = AclUser::create("~* &* +@all -@scripting").await;
    let url = user.url_with(&user.password);
    let key = format!("withlock-test-acl-{:016x}", rand::random::<u64>());
    refused(&["--url", &url, "--key", &key], 77, "", &user.password).await;
}

#[tokio::test]
async fn a8_redis_database_index_out_of_range_is_78() {
    let url = withlock_test_servers::redis::server_url().await;
    let host = common::authority(&url);
    let message = refused(
        &["--url", &format!("redis://{host}/9999"), "--key", "k"],
        78,
        "DB index is out of range",
        "\u{0}",
    )
    .await;
    assert!(message.contains("Redis"), "{message}");
}

/// `--url`, the role's URL, with the schema of `store`.
fn as_role(store: &Store, role: &Role) -> Vec<String> {
    let mut args = store.args();
    args[1] = role.url();
    args
}

#[tokio::test]
async fn a8_postgres_refused_login_is_77() {
    let store = Store::postgres().await;
    let role = Role::create("NOLOGIN").await;
    let args = as_role(&store, &role);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut all = args.clone();
    all.extend(["--key", "k"]);
    refused(&all, 77, "not permitted to log in", "\u{0}").await;
}

#[tokio::test]
async fn a8_postgres_missing_privilege_is_77() {
    let store = Store::postgres().await;
    // May log in and see the schema, but has no right on the table.
    let role = Role::create("LOGIN").await;
    let schema = store.args()[3].clone();
    common::sql(&format!(
        "GRANT USAGE ON SCHEMA \"{schema}\" TO \"{}\"",
        role.name
    ))
    .await;
    let args = as_role(&store, &role);
    let mut all: Vec<&str> = args.iter().map(String::as_str).collect();
    all.extend(["--no-wait", "--key", "k"]);
    refused(&all, 77, "permission denied", "\u{0}").await;
    assert_eq!(store.stored("k").await.owner, None);
}

#[tokio::test]
async fn a8_postgres_missing_database_is_78() {
    let role = Role::create("LOGIN").await;
    let url = role.url();
    let (base, _) = url.rsplit_once('/').unwrap();
    let url = format!(
        "{base}/withlock_no_such_database_{:08x}",
        rand::random::<u32>()
    );
    refused(
        &["--url", &url, "--key", "k"],
        78,
        "does not exist",
        "\u{0}",
    )
    .await;
}

#[tokio::test]
async fn a8_postgres_narrow_sequence_column_is_78() {
    let store = Store::postgres().await;
    let schema = store.args()[3].clone();
    common::sql(&format!(
        "ALTER TABLE \"{schema}\".\"locks\" ALTER COLUMN sequence TYPE integer"
    ))
    .await;
    let args = store.args();
    let mut all: Vec<&str> = args.iter().map(String::as_str).collect();
    all.extend(["--no-wait", "--key", "k"]);
    refused(&all, 78, "bigint", "\u{0}").await;
}

/// SPEC A8 on Sentinel: the Sentinels' password is the URL's, the data
/// nodes' is the query's. A wrong Sentinel password, and a data node
/// password left out, each exit 77 at once without running the command;
/// with both right the command runs; an unknown query name is 64.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a8_sentinel_refused_credentials_are_77_and_the_right_ones_run() {
    use withlock_test_servers::redis::{SentinelAuth, SentinelGroup, MASTER_NAME};
    let data = format!("{:032x}", rand::random::<u128>());
    let sentinel = format!("{:032x}", rand::random::<u128>());
    let auth = SentinelAuth {
        data_node_password: Some(data.clone()),
        sentinel_password: Some(sentinel.clone()),
    };
    let group = tokio::task::spawn_blocking(move || SentinelGroup::start_with_auth(1, &auth))
        .await
        .unwrap()
        .expect("a Sentinel group with passwords");
    let hosts = hosts_of(&group.sentinel_urls());
    let wrong = format!("{:032x}", rand::random::<u128>());
    let url = format!("redis+sentinel://:{wrong}@{hosts}/{MASTER_NAME}?data_password={data}");
    refused(&["--url", &url, "--key", "k"], 77, "refused", &wrong).await;
    let url = format!("redis+sentinel://:{sentinel}@{hosts}/{MASTER_NAME}");
    refused(&["--url", &url, "--key", "k"], 77, "", &sentinel).await;

    let url = format!("redis+sentinel://:{sentinel}@{hosts}/{MASTER_NAME}?data_password={data}");
    let scratch = Scratch::new();
    let ran = scratch.path("ran").display().to_string();
    let output = finish(&mut withlock([
        "run",
        "--url",
        &url,
        "--key",
        "sentinel-auth",
        "--",
        "touch",
        &ran,
    ]))
    .await;
    assert_eq!(code(&output), 0, "{}", stderr(&output));
    assert!(scratch.path("ran").exists(), "the command ran");

    let output = finish(&mut withlock([
        "run",
        "--url",
        &format!("{url}&password={data}"),
        "--key",
        "k",
        "--",
        "true",
    ]))
    .await;
    assert_eq!(code(&output), 64, "{}", stderr(&output));
    assert!(!stderr(&output).contains(&data), "{}", stderr(&output));
}

/// SPEC A8 on Cluster: a wrong password for an ACL user of every node
/// exits 77 at once; the right one runs the command.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a8_cluster_wrong_password_is_77() {
    let cluster = tokio::task::block_in_place(withlock_test_servers::redis::shared_cluster);
    let name = format!("withlock-test-{:016x}", rand::random::<u64>());
    let password = format!("{:032x}", rand::random::<u128>());
    let acl = |args: &[&str]| {
        for url in cluster.urls() {
            let mut conn = lock_redis::redis::Client::open(url.as_str())
                .unwrap()
                .get_connection()
                .unwrap();
            let mut cmd = lock_redis::redis::cmd("ACL");
            for arg in args {
                cmd.arg(*arg);
            }
            let _: lock_redis::redis::Value = cmd.query(&mut conn).unwrap();
        }
    };
    let secret = format!(">{password}");
    acl(&["SETUSER", &name, "on", &secret, "~*", "&*", "+@all"]);
    let hosts = hosts_of(&cluster.urls());
    let wrong = format!("{:032x}", rand::random::<u128>());
    let url = format!("redis+cluster://{name}:{wrong}@{hosts}");
    refused(&["--url", &url, "--key", "k"], 77, "", &wrong).await;
    let url = format!("redis+cluster://{name}:{password}@{hosts}");
    let key = format!("withlock-test-acl-{:016x}", rand::random::<u64>());
    let output = finish(&mut withlock([
        "run", "--url", &url, "--key", &key, "--", "true",
    ]))
    .await;
    acl(&["DELUSER", &name]);
    assert_eq!(code(&output), 0, "{}", stderr(&output));
}

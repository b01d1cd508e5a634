//! Bad configuration is a clear setup error at construction, never an
//! acquisition retried as busy [A8].

mod common;

use std::time::{Duration, Instant};

use common::EtcdClusterExt;
use lock_etcd::{EtcdBackend, EtcdConfig, LockConfig, LockError, Locker, SetupError};
use withlock_test_servers::etcd::EtcdCluster;

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

#[tokio::test]
async fn a8_no_endpoint_answers_is_a_connect_error() {
    let config = EtcdConfig::new([format!("http://127.0.0.1:{}", free_port())])
        .connect_timeout(Duration::from_secs(1));
    let started = Instant::now();
    let error = EtcdBackend::connect(config).await.unwrap_err();
    assert!(matches!(error, SetupError::Connect { .. }), "{error:?}");
    assert!(
        error.to_string().contains("could not reach etcd"),
        "{error}"
    );
    assert!(started.elapsed() < Duration::from_secs(10));
}

#[tokio::test]
async fn a8_bad_urls_and_configs_are_refused_before_connecting() {
    for url in ["redis://127.0.0.1:2379", "etcd://", "etcd://h/path"] {
        assert!(
            matches!(
                EtcdBackend::from_url(url).await,
                Err(SetupError::InvalidUrl { .. })
            ),
            "{url}"
        );
    }
    let error = EtcdBackend::connect(EtcdConfig::default().step_timeout(Duration::ZERO))
        .await
        .unwrap_err();
    assert!(matches!(
        error,
        SetupError::InvalidConfig {
            field: "step_timeout",
            ..
        }
    ));
}

#[tokio::test]
async fn a8_tls_client_against_a_plain_server_is_a_connect_error() {
    let cluster = EtcdCluster::start(1).await.unwrap();
    let https = cluster.endpoint(0).replace("http://", "https://");
    let config = EtcdConfig::new([https])
        .tls(lock_etcd::etcd_client::TlsOptions::new())
        .connect_timeout(Duration::from_secs(2));
    let error = EtcdBackend::connect(config).await.unwrap_err();
    assert!(matches!(error, SetupError::Connect { .. }), "{error:?}");
}

/// Turns etcd's authentication on: a root user with password `root-pw`,
/// and a user `reader` with password `reader-pw` who may only read.
fn enable_auth(cluster: &EtcdCluster) {
    let run = |args: &[&str], user: Option<&str>| {
        let mut command = cluster.etcdctl();
        if let Some(user) = user {
            command.arg(format!("--user={user}"));
        }
        let out = command.args(args).output().unwrap();
        assert!(
            out.status.success(),
            "etcdctl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    run(
        &["user", "add", "root:root-pw", "--interactive=false"],
        None,
    );
    run(&["auth", "enable"], None);
    let root = Some("root:root-pw");
    run(
        &["user", "add", "reader:reader-pw", "--interactive=false"],
        root,
    );
    run(&["role", "add", "read-only"], root);
    run(
        &[
            "role",
            "grant-permission",
            "read-only",
            "--prefix=true",
            "read",
            "",
        ],
        root,
    );
    run(&["user", "grant-role", "reader", "read-only"], root);
}

#[tokio::test]
async fn a8_wrong_credentials_and_missing_rights_are_setup_errors() {
    let cluster = EtcdCluster::start(1).await.unwrap();
    enable_auth(&cluster);

    let wrong = cluster.config().user("root", "not-the-password");
    let error = EtcdBackend::connect(wrong).await.unwrap_err();
    assert!(matches!(error, SetupError::Refused(_)), "{error:?}");

    // Logged in, but not allowed to write the lock's keys: the first
    // attempt fails with a setup error and the call ends at once.
    let reader = EtcdBackend::connect(cluster.config().user("reader", "reader-pw"))
        .await
        .expect("a user who may grant leases connects");
    let locker = Locker::new(reader);
    let cfg = LockConfig::default().retry_delay(Duration::from_secs(5));
    let started = Instant::now();
    let error = locker
        .with_lock_config("a8-denied", &cfg, |_| async {})
        .await
        .unwrap_err();
    let LockError::NotAcquired {
        attempts, source, ..
    } = &error
    else {
        panic!("not acquired expected, got {error:?}");
    };
    assert_eq!(*attempts, 1, "a permanent error is not retried");
    assert!(
        source.as_ref().is_some_and(|s| s.is_permanent()),
        "{error:?}"
    );
    assert!(started.elapsed() < Duration::from_secs(5));

    // The right password works.
    let root = EtcdBackend::connect(cluster.config().user("root", "root-pw"))
        .await
        .unwrap();
    let root = Locker::new(root);
    let first = root
        .with_lock("a8-root", |ctx| async move { ctx.fencing_token() })
        .await
        .unwrap();
    let second = root
        .with_lock("a8-root", |ctx| async move { ctx.fencing_token() })
        .await
        .unwrap();
    assert!(second > first, "token {second} after {first}");
}

/// A cluster that answers but has no leader (two of three members killed:
/// the third keeps campaigning) is `NoLeader` at the end of the connect
/// timeout, not "could not reach" with the dead members' refused
/// connections; with a connect timeout that outlasts the election, the
/// same connect succeeds once a member is back and a leader elected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a8_a_cluster_without_a_leader_is_no_leader_not_unreachable() {
    let cluster = EtcdCluster::start(3).await.unwrap();
    cluster.kill(0);
    cluster.kill(1);
    let short = cluster.config().connect_timeout(Duration::from_secs(3));
    let error = EtcdBackend::connect(short).await.unwrap_err();
    assert!(matches!(error, SetupError::NoLeader { .. }), "{error:?}");
    assert!(error.to_string().contains("has no leader"), "{error}");

    // A connect made while the leader is missing, with room for the
    // election: member 1 comes back meanwhile.
    let patient = cluster.config().connect_timeout(Duration::from_secs(30));
    let connecting = tokio::spawn(EtcdBackend::connect(patient));
    cluster.restart(1).unwrap();
    let backend = connecting
        .await
        .unwrap()
        .expect("connected once a leader is elected");
    let locker = Locker::new(backend);
    locker
        .with_lock("after-the-election", |_| async {})
        .await
        .expect("the lock works on the new leader");
}

//! Least privilege [D3]: a user whose role has `readwrite` on the lock
//! names' prefix and nothing else takes, releases and inspects locks; a
//! release frees the name at once (it used to be refused for the fencing
//! token's record, silently, leaving the key for its ttl).

mod common;

use std::process::Stdio;
use std::time::{Duration, Instant};

use common::EtcdClusterExt;
use lock_etcd::etcd_client::GetOptions;
use lock_etcd::{EtcdBackend, LockAdmin, LockConfig, Locker, LockerOptions};
use withlock_test_servers::etcd::EtcdCluster;

/// Where a few round trips on a loaded machine fit many times over.
const SOON: Duration = Duration::from_secs(5);

/// A cluster with authentication on and the README's least-privilege
/// role: user `app` with the role `withlock-app`, `readwrite` on the prefix
/// `app/` alone.
async fn cluster() -> EtcdCluster {
    let cluster = EtcdCluster::start(1).await.unwrap();
    cluster.enable_auth().unwrap();
    cluster
        .add_user("app", "withlock-app", "readwrite", &["app/"])
        .unwrap();
    cluster
}

async fn backend(cluster: &EtcdCluster, user: &str) -> EtcdBackend {
    EtcdBackend::connect(cluster.user_config(user))
        .await
        .unwrap_or_else(|e| panic!("{user} connects: {e:?}"))
}

fn node(backend: &EtcdBackend, name: &str) -> Locker {
    Locker::with_options(backend.clone(), LockerOptions::default().node_id(name)).unwrap()
}

/// The keys under `name/`, read as root.
async fn keys_under(root: &EtcdBackend, name: &str) -> Vec<String> {
    let read = root
        .client()
        .kv_client()
        .get(format!("{name}/"), Some(GetOptions::new().with_prefix()))
        .await
        .unwrap();
    read.kvs()
        .iter()
        .map(|kv| String::from_utf8_lossy(kv.key()).into_owned())
        .collect()
}

#[tokio::test]
async fn d3_release_with_rights_on_the_names_alone_frees_the_lock_at_once() {
    let cluster = cluster().await;
    let app = backend(&cluster, "app").await;
    let root = EtcdBackend::connect(cluster.user_config("root"))
        .await
        .unwrap();
    let name = "app/nightly-import";

    // The default ttl (30 s): a key left behind would block the name
    // far longer than any bound below.
    let first = node(&app, "a")
        .with_lock(name, |ctx| async move { ctx.fencing_token() })
        .await
        .unwrap();
    assert_eq!(
        keys_under(&root, name).await,
        Vec::<String>::new(),
        "the release deleted the contender key"
    );

    // Another client of the same user takes it at once: a second backend
    // trying once, then `etcdctl lock`.
    let other = backend(&cluster, "app").await;
    let once = LockConfig::default().retry_attempts(0);
    let second = node(&other, "b")
        .with_lock_config(name, &once, |ctx| async move { ctx.fencing_token() })
        .await
        .expect("the name is free after the release");
    assert!(second > first, "token {second} after {first}");

    let user = "app:app-pw";
    let started = Instant::now();
    let mut etcdctl = tokio::process::Command::from(cluster.etcdctl_as(user));
    let out = etcdctl
        .args(["lock", name, "echo", "held-by-etcdctl"])
        .stdin(Stdio::null())
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(SOON, out)
        .await
        .expect("etcdctl lock gets the name at once")
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("held-by-etcdctl"));
    assert!(started.elapsed() < SOON);

    // Fresh names work, each released at once.
    let locker = node(&app, "a");
    for i in 0..20 {
        let fresh = format!("app/fresh-{i}");
        locker
            .with_lock_config(&fresh, &once, |_| async {})
            .await
            .unwrap_or_else(|e| panic!("{fresh}: {e:?}"));
        assert!(keys_under(&root, &fresh).await.is_empty(), "{fresh}");
    }

    // The admin's view, as the same user: held while held, free (with
    // no token: the user may not read the records) once released.
    let (held_tx, held_rx) = tokio::sync::oneshot::channel();
    let (done_tx, done_rx) = tokio::sync::oneshot::channel::<()>();
    let holder = {
        let locker = locker.clone();
        tokio::spawn(async move {
            locker
                .with_lock(name, |ctx| async move {
                    let _ = held_tx.send(ctx.fencing_token());
                    let _ = done_rx.await;
                })
                .await
        })
    };
    let token = tokio::time::timeout(SOON, held_rx).await.unwrap().unwrap();
    let info = app.inspect(name).await.unwrap();
    assert!(info.is_held(), "{info:?}");
    assert_eq!(info.fencing_token, Some(token));
    done_tx.send(()).unwrap();
    holder.await.unwrap().unwrap();
    let info = app.inspect(name).await.unwrap();
    assert!(!info.is_held(), "{info:?}");
    assert_eq!(info.fencing_token, None, "no record without its rights");
    let listed = app.list_locks("app/").await.unwrap();
    assert!(listed.is_empty(), "{listed:?}");
}

#[tokio::test]
async fn d3_root_still_records_the_last_token_of_a_free_name() {
    let cluster = cluster().await;
    let root = EtcdBackend::connect(cluster.user_config("root"))
        .await
        .unwrap();
    let name = "app/recorded";
    let token = node(&root, "r")
        .with_lock(name, |ctx| async move { ctx.fencing_token() })
        .await
        .unwrap();
    let info = root.inspect(name).await.unwrap();
    assert!(!info.is_held(), "{info:?}");
    assert_eq!(info.fencing_token, Some(token));
}

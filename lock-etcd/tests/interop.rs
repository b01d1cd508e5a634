//! withlock and etcd's own lock (`etcdctl lock`, Go's `concurrency.Mutex`)
//! exclude each other on the same name, both ways: they share its key
//! layout.

mod common;

use std::time::Duration;

use common::{EtcdClusterExt, Etcdctl};
use lock_etcd::etcd_client::GetOptions;
use lock_etcd::{EtcdBackend, LockConfig, Locker, LockerOptions};
use withlock_test_servers::etcd::shared_server;

const SOON: Duration = Duration::from_secs(10);

fn node(backend: &EtcdBackend, name: &str) -> Locker {
    Locker::with_options(backend.clone(), LockerOptions::default().node_id(name)).unwrap()
}

/// The contender keys under `name/`, as etcd's clients see them.
async fn contenders(backend: &EtcdBackend, name: &str) -> Vec<(String, i64)> {
    let read = backend
        .client()
        .kv_client()
        .get(format!("{name}/"), Some(GetOptions::new().with_prefix()))
        .await
        .unwrap();
    read.kvs()
        .iter()
        .map(|kv| {
            (
                String::from_utf8_lossy(kv.key()).into_owned(),
                kv.create_revision(),
            )
        })
        .collect()
}

#[tokio::test]
async fn mutex_interop_etcdctl_holds_withlock_is_busy_then_waits_and_gets_it() {
    let cluster = shared_server().await;
    let backend = cluster.backend().await;
    let name = lock_conformance::Namespace::new().key("etcdctl-holds");
    let mut etcdctl = Etcdctl::start(cluster, &name);
    let their_key = etcdctl.held().await;
    let theirs = contenders(&backend, &name).await;
    assert_eq!(theirs.len(), 1, "{theirs:?}");
    assert_eq!(theirs[0].0, their_key);
    let their_revision = u64::try_from(theirs[0].1).unwrap();

    // Try once: busy, and the attempt's own key is withdrawn.
    let a = node(&backend, "a");
    let once = LockConfig::default().retry_attempts(0);
    let got = a.with_lock_config(&name, &once, |_| async {}).await;
    assert!(got.as_ref().is_err_and(|e| e.is_busy()), "{got:?}");
    assert_eq!(
        contenders(&backend, &name).await,
        theirs,
        "a try-once that found the name busy leaves no key behind"
    );

    // A waiter gets the name once etcdctl lets go.
    let waiter = {
        let (a, name) = (a.clone(), name.clone());
        tokio::spawn(async move {
            let cfg = LockConfig::default()
                .wait_forever()
                .retry_delay(Duration::from_millis(100));
            a.with_lock_config(&name, &cfg, |ctx| async move { ctx.fencing_token() })
                .await
        })
    };
    etcdctl.stop().await;
    let token = tokio::time::timeout(SOON, waiter)
        .await
        .expect("the waiter gets the name after etcdctl unlocked")
        .unwrap()
        .unwrap();
    assert!(
        token > their_revision,
        "token {token} after etcdctl's key revision {their_revision}"
    );
    assert!(contenders(&backend, &name).await.is_empty());
}

#[tokio::test]
async fn mutex_interop_withlock_holds_etcdctl_waits_until_the_release() {
    let cluster = shared_server().await;
    let backend = cluster.backend().await;
    let name = lock_conformance::Namespace::new().key("withlock-holds");
    let a = node(&backend, "a");
    let mut handle = a.handle(&name, Duration::from_secs(30)).unwrap();
    assert!(handle.acquire().await.unwrap());
    let ours = handle.fencing_token().unwrap();

    let mut etcdctl = Etcdctl::start(cluster, &name);
    // etcdctl stands in line: its key appears behind ours.
    let deadline = tokio::time::Instant::now() + SOON;
    let line = loop {
        let now = contenders(&backend, &name).await;
        if now.len() == 2 {
            break now;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "etcdctl never queued: {now:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(u64::try_from(line[0].1).unwrap(), ours);
    // Queued, and not holding: it prints nothing while withlock holds.
    etcdctl.holds_nothing_for(Duration::from_millis(500)).await;
    assert!(handle.renew().await.unwrap(), "withlock still holds it");

    assert!(handle.release().await.unwrap());
    let their_key = etcdctl.held().await;
    assert_eq!(their_key, line[1].0);
    // While etcdctl holds, withlock is busy.
    let once = LockConfig::default().retry_attempts(0);
    let got = a.with_lock_config(&name, &once, |_| async {}).await;
    assert!(got.as_ref().is_err_and(|e| e.is_busy()), "{got:?}");
    etcdctl.stop().await;
}

/// \[H7, D1\] A lock kept by its minimum hold stays in etcd's layout: its
/// key keeps its name, `<name>/<first lease hex>`, and its value, on the
/// hold's own lease, and `etcdctl lock` waits for it until that lease
/// ends. The admin tells it kept by that move alone (the key is on another
/// lease than its name gives, which no acquisition does), and shows
/// etcdctl's holder, whose key is on the lease it names, as running.
#[tokio::test]
async fn h7_a_kept_lock_is_on_another_lease_than_its_name_gives() {
    use lock_etcd::lock_core::LockAdmin;

    let cluster = shared_server().await;
    let backend = cluster.backend().await;
    let name = lock_conformance::Namespace::new().key("kept");
    let hold = Duration::from_secs(3);
    let cfg = LockConfig::default().retry_attempts(0).hold_at_least(hold);
    let started = tokio::time::Instant::now();
    node(&backend, "a")
        .with_lock_config(&name, &cfg, |_| async {})
        .await
        .expect("the run and its hold step");
    let read = backend
        .client()
        .kv_client()
        .get(format!("{name}/"), Some(GetOptions::new().with_prefix()))
        .await
        .unwrap();
    let [kv] = read.kvs() else {
        panic!("one contender key: {:?}", read.kvs());
    };
    let key = String::from_utf8_lossy(kv.key()).into_owned();
    let named = i64::from_str_radix(key.rsplit_once('/').unwrap().1, 16).unwrap();
    assert_ne!(kv.lease(), named, "moved to the hold's lease: {key}");
    let info = backend.inspect(&name).await.unwrap();
    assert!(info.is_kept(), "{info:?}");
    assert_eq!(
        info.owner.as_ref().map(|o| o.as_str().as_bytes()),
        Some(kv.value()),
        "the key's value is the holder's owner token"
    );
    assert_eq!(info.minimum_hold_left, info.ttl);
    let listed = backend.list_locks(&name).await.unwrap();
    assert!(listed.len() == 1 && listed[0].is_kept(), "{listed:?}");

    let mut etcdctl = Etcdctl::start(cluster, &name);
    let their_key = etcdctl.held().await;
    assert!(
        started.elapsed() >= hold - Duration::from_millis(100),
        "etcdctl got the name {:?} after the run, before its minimum hold",
        started.elapsed()
    );
    let info = backend.inspect(&name).await.unwrap();
    assert!(info.is_held() && !info.is_kept(), "{info:?}");
    assert_eq!(
        info.owner.as_ref().map(|o| o.as_str()),
        Some("<etcd mutex>")
    );
    assert!(their_key.starts_with(&format!("{name}/")), "{their_key}");
    etcdctl.stop().await;
}

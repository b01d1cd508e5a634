//! `RedisClusterBackend` on a local Redis Cluster (3 masters, 3 replicas,
//! shared by this binary's tests, namespaced keys): keys land on every
//! master with their counters beside them, extensions are batched per node,
//! releases wake waiters over sharded pub/sub, and bad configuration is
//! refused with an error that names what is wrong.

mod common;

use std::collections::HashSet;
use std::time::{Duration, Instant};

use common::{key_type, node, take_as_a_hash, within};
use lock_core::{
    AcquireOutcome, ExtendOutcome, ExtendRequest, Lease, LockBackend, LockConfig, OwnerToken,
};
use lock_redis::slot::key_slot;
use lock_redis::testing::ScratchClusterBackend;
use lock_redis::{Durability, RedisClusterBackend, RedisConfig, SetupError};
use withlock_test_servers::redis::{shared_cluster, RedisServer};

const LIMIT: Duration = Duration::from_secs(20);
const TTL: Duration = Duration::from_secs(30);

/// 64 keys are spread over all three masters; each lock and its fencing
/// counter live on the master of the key's slot; one `extend_many` extends
/// them all; releases free them all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_spread_over_every_master_with_their_counters() {
    let cluster = shared_cluster();
    let backend = ScratchClusterBackend::new(&cluster.urls(), RedisConfig::default());
    let mut leases = Vec::new();
    let mut masters = HashSet::new();
    for i in 0..64 {
        let key = format!("spread:{i}");
        let owner = OwnerToken::new("spread");
        let AcquireOutcome::Acquired { fencing_token } =
            backend.try_acquire(&key, &owner, TTL).await.unwrap()
        else {
            panic!("{key} is free");
        };
        let lock_key = backend.lock_key(&key);
        let master = cluster.master_of_key(&lock_key).unwrap();
        masters.insert(master.port());
        let mut conn = redis::Client::open(master.url())
            .unwrap()
            .get_multiplexed_async_connection()
            .await
            .unwrap();
        let (value, counter): (Option<String>, Option<u64>) = redis::pipe()
            .get(&lock_key)
            .get(backend.fence_key(&key))
            .query_async(&mut conn)
            .await
            .unwrap();
        assert_eq!(
            value.as_deref(),
            Some(owner.as_str()),
            "{key} on its master"
        );
        assert_eq!(counter, Some(fencing_token), "{key}'s counter beside it");
        assert_eq!(key_slot(&backend.channel(&key)), key_slot(&lock_key));
        leases.push(Lease::new(key, owner, fencing_token));
    }
    assert_eq!(masters.len(), 3, "keys on every master: {masters:?}");

    let requests: Vec<_> = leases
        .iter()
        .map(|lease| ExtendRequest {
            lease: lease.clone(),
            ttl: TTL,
        })
        .collect();
    assert_eq!(
        backend
            .extend_many(&requests)
            .await
            .into_iter()
            .collect::<Result<Vec<_>, _>>()
            .unwrap(),
        vec![ExtendOutcome::Extended; 64]
    );
    // A lease that is not held anymore answers in its place in the batch.
    let mut mixed = requests.clone();
    mixed[7].lease = Lease::new(leases[7].key(), OwnerToken::new("other"), 1);
    let outcomes = backend
        .extend_many(&mixed)
        .await
        .into_iter()
        .collect::<Result<Vec<_>, _>>()
        .unwrap();
    assert_eq!(outcomes[7], ExtendOutcome::Taken);
    assert_eq!(
        outcomes
            .iter()
            .filter(|o| **o == ExtendOutcome::Extended)
            .count(),
        63
    );
    for lease in &leases {
        assert_eq!(
            backend.release(lease).await.unwrap(),
            lock_core::ReleaseOutcome::Released
        );
    }
}

/// A waiter with a 30 s retry delay gets a key released on another node
/// within milliseconds: the release is published with `SPUBLISH` on the
/// key's shard channel, which the waiter's backend subscribed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_wakes_a_waiter_over_sharded_pub_sub() {
    let cluster = shared_cluster();
    let holder_backend = ScratchClusterBackend::new(&cluster.urls(), RedisConfig::default());
    let config = RedisConfig::default().prefix(holder_backend.namespace().prefix());
    let waiter_backend = RedisClusterBackend::from_urls_with(cluster.urls(), config).unwrap();
    let holder = node(holder_backend, "holder");
    let waiter = node(waiter_backend.clone(), "waiter");
    for round in 0..3 {
        let key = format!("wake:{round}");
        let mut held = holder.handle(&key, TTL).unwrap();
        assert!(held.acquire().await.unwrap());
        let slow = LockConfig::default()
            .wait_forever()
            .retry_delay(Duration::from_secs(30));
        let w = waiter.clone();
        let k = key.clone();
        let waiting = tokio::spawn(async move {
            w.with_lock_config(&k, &slow, |_| async { Instant::now() })
                .await
        });
        within(LIMIT, "subscription", async {
            while !waiter_backend.is_subscribed() {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        let released_at = Instant::now();
        assert!(held.release().await.unwrap());
        let ran_at = within(LIMIT, "woken waiter", waiting)
            .await
            .unwrap()
            .unwrap();
        let lag = ran_at - released_at;
        // A third of the 30 s retry delay: only a notification is sooner.
        assert!(lag < Duration::from_secs(10), "woken after {lag:?}");
    }
}

fn closed_port_url() -> String {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    format!("redis://127.0.0.1:{port}")
}

/// Bad configuration is refused by `connect` with an error that names what
/// is wrong, and nothing is touched: no node answers, a node without
/// cluster support, nodes of two clusters, a cluster that serves no slot,
/// an empty list. `from_urls` is lazy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_cluster_configuration_is_refused_with_a_clear_error() {
    let cluster = shared_cluster();
    assert!(matches!(
        RedisClusterBackend::from_urls(Vec::<String>::new()),
        Err(SetupError::NoClusterNodes)
    ));
    assert!(matches!(
        RedisClusterBackend::from_urls(["not a url"]),
        Err(SetupError::InvalidUrl(_))
    ));
    let nowhere = closed_port_url();
    assert!(
        RedisClusterBackend::from_urls([&nowhere]).is_ok(),
        "from_urls is lazy"
    );
    let err = RedisClusterBackend::connect([&nowhere, &closed_port_url()])
        .await
        .expect_err("no node answers");
    assert!(matches!(err, SetupError::Connect(_)), "{err:?}");

    let standalone = RedisServer::start().unwrap();
    let err = RedisClusterBackend::connect([standalone.url()])
        .await
        .expect_err("not a cluster node");
    let message = err.to_string();
    assert!(
        matches!(&err, SetupError::NotACluster { node } if node.ends_with(&standalone.port().to_string())),
        "{err:?}"
    );
    assert!(message.contains("cluster support disabled"), "{message}");

    // A cluster-enabled node that joined no cluster: a cluster of its own,
    // serving no slot.
    let lone = RedisServer::start_cluster_enabled().unwrap();
    let mut urls = cluster.urls();
    urls.push(lone.url());
    let err = RedisClusterBackend::connect(&urls)
        .await
        .expect_err("nodes of two clusters");
    assert!(
        matches!(err, SetupError::ClusterNodesDisagree { .. }),
        "{err:?}"
    );
    assert!(err.to_string().contains("disagree"), "{err}");
    let err = RedisClusterBackend::connect([lone.url()])
        .await
        .expect_err("no slot served");
    assert!(
        matches!(&err, SetupError::ClusterNotReady { state, .. } if state == "fail"),
        "{err:?}"
    );

    // The real cluster, from any one of its nodes.
    let backend = RedisClusterBackend::connect([cluster.urls()[4].clone()])
        .await
        .expect("a node of a healthy cluster");
    assert!(format!("{backend:?}").contains("RedisClusterBackend"));
}

/// A password never shows in `Debug`.
#[test]
fn debug_never_shows_the_password() {
    let backend = RedisClusterBackend::from_urls(["redis://:hunter2@127.0.0.1:7000"]).unwrap();
    let debug = format!("{backend:?}");
    assert!(!debug.contains("hunter2"), "{debug}");
    assert!(
        debug.contains("<redacted>") && debug.contains("127.0.0.1:7000"),
        "{debug}"
    );
}

/// A key that another client keeps its lock in as a hash (Redisson) is
/// another owner's on the cluster too: the acquisition finds it busy, and
/// an extension and a release of a lease on it answer Taken / NotHeld, the
/// hash untouched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_kept_in_a_hash_is_another_owner() {
    let cluster = shared_cluster();
    let backend = ScratchClusterBackend::new(&cluster.urls(), RedisConfig::default());
    let key = "hash-holder";
    let lock_key = backend.lock_key(key);
    let master = cluster.master_of_key(&lock_key).unwrap();
    let mut conn = redis::Client::open(master.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    take_as_a_hash(&mut conn, &lock_key).await;

    let owner = OwnerToken::new("a");
    assert!(matches!(
        backend.try_acquire(key, &owner, TTL).await.unwrap(),
        AcquireOutcome::Busy { .. }
    ));
    let lease = Lease::new(key, owner, 1);
    assert_eq!(
        backend.extend(&lease, TTL).await.unwrap(),
        ExtendOutcome::Taken
    );
    assert_eq!(
        backend.release(&lease).await.unwrap(),
        lock_core::ReleaseOutcome::NotHeld
    );
    let kind = key_type(&mut conn, &lock_key).await;
    assert_eq!(kind, "hash", "the foreign lock is untouched");
}

/// [H4] On every master, as on one server: a companion's expiry is above
/// its held lock's after the acquisition and after extensions (alone and
/// batched per node), an extension puts back a companion deleted by hand,
/// and the release leaves the companion's expiry as it was: more than the
/// idle period away.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h4_companions_expire_after_the_idle_period_never_while_held() {
    let cluster = shared_cluster();
    let idle = Duration::from_secs(3600);
    let idle_ms = i64::try_from(idle.as_millis()).unwrap();
    let backend =
        ScratchClusterBackend::new(&cluster.urls(), RedisConfig::default().fence_idle(idle));
    let owner = OwnerToken::new("idle");
    let mut leases = Vec::new();
    let mut masters = HashSet::new();
    for i in 0..24 {
        let key = format!("idle:{i}");
        let AcquireOutcome::Acquired { fencing_token } =
            backend.try_acquire(&key, &owner, TTL).await.unwrap()
        else {
            panic!("{key} is free");
        };
        masters.insert(
            cluster
                .master_of_key(&backend.lock_key(&key))
                .unwrap()
                .port(),
        );
        leases.push(Lease::new(key, owner.clone(), fencing_token));
    }
    assert_eq!(masters.len(), 3, "keys on every master: {masters:?}");
    // Expiry times on the key's master: (lock, companion), ms since the epoch.
    let expiries = |key: String| {
        let lock_key = backend.lock_key(&key);
        let fence = backend.fence_key(&key);
        let url = cluster.master_of_key(&lock_key).unwrap().url();
        async move {
            let mut conn = redis::Client::open(url)
                .unwrap()
                .get_multiplexed_async_connection()
                .await
                .unwrap();
            let (lock, companion, pttl): (i64, i64, i64) = redis::pipe()
                .cmd("PEXPIRETIME")
                .arg(&lock_key)
                .cmd("PEXPIRETIME")
                .arg(&fence)
                .cmd("PTTL")
                .arg(&fence)
                .query_async(&mut conn)
                .await
                .unwrap();
            (lock, companion, pttl, conn, fence)
        }
    };
    for lease in &leases {
        let (lock, companion, pttl, ..) = expiries(lease.key().to_owned()).await;
        assert!(
            lock > 0 && companion > lock && pttl > idle_ms,
            "{}: acquired: lock at {lock}, companion at {companion}",
            lease.key()
        );
    }
    // One companion lost by hand: the next extension puts it back.
    let (.., mut conn, fence) = expiries(leases[0].key().to_owned()).await;
    let deleted: u64 = redis::cmd("DEL")
        .arg(&fence)
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(deleted, 1);
    assert_eq!(
        backend.extend(&leases[0], TTL).await.unwrap(),
        ExtendOutcome::Extended
    );
    let requests: Vec<_> = leases
        .iter()
        .map(|lease| ExtendRequest {
            lease: lease.clone(),
            ttl: TTL * 2,
        })
        .collect();
    for answer in backend.extend_many(&requests).await {
        assert_eq!(answer.unwrap(), ExtendOutcome::Extended);
    }
    for lease in &leases {
        let (lock, companion, pttl, ..) = expiries(lease.key().to_owned()).await;
        assert!(
            companion > lock && pttl > idle_ms + i64::try_from(TTL.as_millis()).unwrap(),
            "{}: extended: lock at {lock}, companion at {companion}, {pttl} ms",
            lease.key()
        );
    }
    let stored: u64 = redis::cmd("GET")
        .arg(&fence)
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(
        stored,
        leases[0].fencing_token(),
        "put back by the extension"
    );
    for lease in &leases {
        let (_, expires_at, ..) = expiries(lease.key().to_owned()).await;
        backend.release(lease).await.unwrap();
        let (lock, companion, pttl, ..) = expiries(lease.key().to_owned()).await;
        assert!(
            lock == -2 && pttl > idle_ms && companion == expires_at,
            "{}: released: lock {lock}, companion {pttl} ms, at {companion} (was {expires_at})",
            lease.key()
        );
    }
}

/// `durability` on the cluster (one replica per master): with 1, each
/// acquisition is followed by `WAIT` on the connection of the key's
/// master, so the replica of that master has the lock as soon as the
/// acquisition answers, on every master; with 2 (more replicas than any
/// master has) every attempt fails with an error saying how many
/// acknowledged, and leaves nothing held; `connect` refuses it up front.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn durability_waits_for_the_replicas_of_the_key_s_master() {
    let cluster = shared_cluster();
    let timeout = Duration::from_millis(300);
    let one = ScratchClusterBackend::new(
        &cluster.urls(),
        RedisConfig::default().durability(Durability::new(1, Duration::from_secs(2))),
    );
    let mut masters = HashSet::new();
    for i in 0..24 {
        let key = format!("durable:{i}");
        let owner = OwnerToken::new("durable");
        let outcome = one.try_acquire(&key, &owner, TTL).await.unwrap();
        assert!(
            matches!(outcome, AcquireOutcome::Acquired { .. }),
            "{key}: {outcome:?}"
        );
        let lock_key = one.lock_key(&key);
        let slot = key_slot(&lock_key);
        let master = cluster.master_port_of_slot(slot).unwrap();
        masters.insert(master);
        let replicas = cluster.replica_ports_of(master).unwrap();
        assert_eq!(replicas.len(), 1, "{key}: one replica");
        let replica = cluster.node(replicas[0]).unwrap();
        let mut conn = redis::Client::open(replica.url())
            .unwrap()
            .get_connection()
            .unwrap();
        let _: () = redis::cmd("READONLY").query(&mut conn).unwrap();
        let on_replica: Option<String> = redis::cmd("GET").arg(&lock_key).query(&mut conn).unwrap();
        assert_eq!(
            on_replica.as_deref(),
            Some(owner.as_str()),
            "{key}: the replica has the lock once the acquisition answered"
        );
    }
    assert_eq!(masters.len(), 3, "keys on every master: {masters:?}");

    let two = ScratchClusterBackend::new(
        &cluster.urls(),
        RedisConfig::default().durability(Durability::new(2, timeout)),
    );
    for i in 0..6 {
        let key = format!("too-durable:{i}");
        let started = Instant::now();
        let error = two
            .try_acquire(&key, &OwnerToken::new("durable"), TTL)
            .await
            .expect_err("two replicas never acknowledge");
        let message = format!("{error:?}");
        assert!(
            message.contains("reached 1 of the 2 replica(s)") && message.contains("released"),
            "{key}: {message}"
        );
        assert!(started.elapsed() >= timeout, "WAIT waited");
        let lock_key = two.lock_key(&key);
        let mut conn = redis::Client::open(cluster.master_of_key(&lock_key).unwrap().url())
            .unwrap()
            .get_connection()
            .unwrap();
        let held: Option<String> = redis::cmd("GET").arg(&lock_key).query(&mut conn).unwrap();
        assert_eq!(held, None, "{key}: nothing is left held");
    }

    let refused = RedisClusterBackend::connect_with(
        cluster.urls(),
        RedisConfig::default().durability(Durability::new(2, timeout)),
    )
    .await
    .expect_err("no master has two replicas");
    assert!(
        matches!(
            refused,
            SetupError::NotEnoughReplicas {
                wanted: 2,
                available: 1
            }
        ),
        "{refused:?}"
    );
}

/// \[D1\] A listing while one master does not answer: `list_locks_partial`
/// gives the locks of the masters that answer and names the one that does
/// not (`host:port`, with its error), within the step timeout for a
/// paused master (SIGSTOP) and at once for a killed one; `list_locks`
/// fails naming it. Once the master answers again the listing is whole.
/// A cluster of this test's own (3 masters, no replicas, so nothing fails
/// over meanwhile).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn d1_cluster_list_names_a_master_that_does_not_answer() {
    use lock_core::{BackendErrorKind, LockAdmin};
    use withlock_test_servers::redis::RedisCluster;

    let cluster = RedisCluster::start_with(3, 0).unwrap();
    let step = Duration::from_secs(1);
    let backend = RedisClusterBackend::connect_with(
        cluster.urls(),
        RedisConfig::default().step_timeout(step),
    )
    .await
    .unwrap();
    // One key on each master.
    let mut on_master: Vec<(u16, String)> = Vec::new();
    for i in 0.. {
        let key = format!("partial:{i}");
        let port = cluster.master_of_key(&key).unwrap().port();
        if on_master.iter().all(|(p, _)| *p != port) {
            on_master.push((port, key));
        }
        if on_master.len() == 3 {
            break;
        }
    }
    on_master.sort_by(|a, b| a.1.cmp(&b.1));
    for (_, key) in &on_master {
        let owner = OwnerToken::new("partial");
        let got = backend.try_acquire(key, &owner, TTL).await.unwrap();
        assert!(matches!(got, AcquireOutcome::Acquired { .. }), "{key}");
    }
    let whole = backend.list_locks_partial("partial:").await.unwrap();
    assert!(whole.is_whole(), "{:?}", whole.unreachable);
    assert_eq!(whole.locks.len(), 3);

    let (port, silent_key) = on_master[0].clone();
    let others: Vec<&str> = on_master[1..].iter().map(|(_, k)| k.as_str()).collect();
    let silent = cluster.node(port).unwrap();
    silent.pause().unwrap();
    let started = Instant::now();
    let listed = backend.list_locks_partial("partial:").await;
    let took = started.elapsed();
    let strict = backend.list_locks("partial:").await;
    silent.resume().unwrap();
    let listed = listed.expect("the masters that answer are listed");
    assert!(took <= step + Duration::from_secs(2), "took {took:?}");
    let keys: Vec<&str> = listed.locks.iter().map(|i| i.key.as_str()).collect();
    assert_eq!(
        keys, others,
        "the answering masters' locks, not {silent_key}"
    );
    assert_eq!(listed.unreachable.len(), 1, "{:?}", listed.unreachable);
    let named = &listed.unreachable[0];
    assert!(named.node.ends_with(&format!(":{port}")), "{named:?}");
    assert_eq!(named.error.kind(), BackendErrorKind::Timeout, "{named:?}");
    let error = strict.expect_err("list_locks fails while a master is silent");
    let text = lock_core::ErrorChain(&error).to_string();
    assert!(text.contains(&format!(":{port} did not answer")), "{text}");

    // Answering again: whole.
    let again = within(LIMIT, "the listing after SIGCONT", async {
        loop {
            match backend.list_locks_partial("partial:").await {
                Ok(list) if list.is_whole() => break list,
                _ => tokio::task::yield_now().await,
            }
        }
    })
    .await;
    assert_eq!(again.locks.len(), 3);

    // Killed: named at once (the connection is refused).
    silent.kill();
    let started = Instant::now();
    let listed = backend.list_locks_partial("partial:").await.unwrap();
    assert!(started.elapsed() <= step + Duration::from_secs(2));
    let keys: Vec<&str> = listed.locks.iter().map(|i| i.key.as_str()).collect();
    assert_eq!(keys, others);
    assert_eq!(listed.unreachable.len(), 1, "{:?}", listed.unreachable);
    assert!(listed.unreachable[0].node.ends_with(&format!(":{port}")));
}

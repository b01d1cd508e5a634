//! The cluster backend's sharded release subscription on a cluster of this
//! binary's own (its connections are killed, which would disturb the
//! shared cluster's other tests): channels re-subscribed with one request
//! per node after a reconnect, and unsubscribed when their last waiter goes.

mod common;

use std::collections::HashSet;
use std::time::{Duration, Instant};

use common::{node, within};
use lock_core::{AcquireOutcome, Lease, LockBackend, LockConfig, OwnerToken};
use lock_redis::slot::key_slot;
use lock_redis::testing::ScratchClusterBackend;
use lock_redis::{RedisClusterBackend, RedisConfig};
use withlock_test_servers::redis::RedisCluster;

const LIMIT: Duration = Duration::from_secs(60);

/// Closes the connections of `port`'s node that have shard channels
/// subscribed (`ssub=` above 0 in `CLIENT LIST`); gives how many.
fn kill_shard_subscribers(cluster: &RedisCluster, port: u16) -> usize {
    let url = cluster.node(port).unwrap().url();
    let mut conn = redis::Client::open(url).unwrap().get_connection().unwrap();
    let list: String = redis::cmd("CLIENT").arg("LIST").query(&mut conn).unwrap();
    let mut killed = 0;
    for line in list.lines() {
        let field = |name: &str| {
            line.split(' ')
                .find_map(|f| f.strip_prefix(name))
                .map(str::to_owned)
        };
        let subscribed = field("ssub=")
            .and_then(|n| n.parse::<u64>().ok())
            .unwrap_or(0);
        if subscribed > 0 {
            let id = field("id=").unwrap();
            let _: () = redis::cmd("CLIENT")
                .arg("KILL")
                .arg("ID")
                .arg(id)
                .query(&mut conn)
                .unwrap();
            killed += 1;
        }
    }
    killed
}

/// The shard channels with `prefix` that `port`'s node has subscribers for.
fn shard_channels(cluster: &RedisCluster, port: u16, prefix: &str) -> Vec<String> {
    let url = cluster.node(port).unwrap().url();
    let mut conn = redis::Client::open(url).unwrap().get_connection().unwrap();
    redis::cmd("PUBSUB")
        .arg("SHARDCHANNELS")
        .arg(format!("*{prefix}*"))
        .query(&mut conn)
        .unwrap()
}

/// 1,000 waiters on distinct keys held by another node, over every master
/// and hundreds of slots, with a retry delay of two minutes, so only a
/// notification wakes them in time. Every subscription connection is
/// killed while they wait: each master then gets ONE subscription request
/// carrying all its channels (not one per slot), after which the keys are
/// released and every waiter gets its key. Once they are done, every
/// channel is unsubscribed (`SUNSUBSCRIBE`), as the backend's counts and
/// the servers' own `PUBSUB SHARDCHANNELS` say.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reconnect_resubscribes_with_one_request_per_node_and_idle_channels_are_unsubscribed() {
    const N: usize = 1000;
    let cluster = RedisCluster::start().unwrap();
    let urls = cluster.urls();
    let holder = ScratchClusterBackend::new(&urls, RedisConfig::default());
    let prefix = holder.namespace().prefix().to_owned();
    let waiting =
        RedisClusterBackend::from_urls_with(&urls, RedisConfig::default().prefix(&prefix)).unwrap();
    let waiter = node(waiting.clone(), "waiter");

    let mut leases = Vec::new();
    let mut slots = HashSet::new();
    let mut masters = HashSet::new();
    for i in 0..N {
        let key = format!("w{i}");
        let owner = OwnerToken::new("holder");
        let AcquireOutcome::Acquired { fencing_token } = holder
            .try_acquire(&key, &owner, Duration::from_secs(300))
            .await
            .unwrap()
        else {
            panic!("{key} is free");
        };
        let slot = key_slot(&holder.lock_key(&key));
        slots.insert(slot);
        masters.insert(cluster.master_port_of_slot(slot).unwrap());
        leases.push(Lease::new(key, owner, fencing_token));
    }
    assert_eq!(masters.len(), 3, "keys on every master");
    assert!(slots.len() > 500, "{} slots", slots.len());

    let slow = LockConfig::default()
        .wait_forever()
        .retry_delay(Duration::from_secs(120));
    let waiters: Vec<_> = leases
        .iter()
        .map(|lease| {
            let (waiter, key, slow) = (waiter.clone(), lease.key().to_owned(), slow);
            tokio::spawn(async move {
                waiter
                    .with_lock_config(&key, &slow, |_| async { Instant::now() })
                    .await
            })
        })
        .collect();
    let all_subscribed = || async {
        while waiting.subscription_stats().subscribed_channels != slots.len() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    within(LIMIT, "every channel subscribed", all_subscribed()).await;
    let before = waiting.subscription_stats();
    eprintln!("subscribed: {before:?}");

    let mut killed = 0;
    for &port in &masters {
        killed += kill_shard_subscribers(&cluster, port);
    }
    assert_eq!(
        killed,
        masters.len(),
        "one subscription connection per master"
    );
    within(LIMIT, "every channel subscribed again", async {
        // The kills are seen first, then the channels come back.
        while waiting.subscription_stats().subscribe_requests == before.subscribe_requests {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        all_subscribed().await;
    })
    .await;
    let after = waiting.subscription_stats();
    eprintln!("subscribed again: {after:?}");
    assert_eq!(
        after.subscribe_requests - before.subscribe_requests,
        masters.len() as u64,
        "one re-subscription request per node, carrying all its channels"
    );
    for &port in &masters {
        let mine = shard_channels(&cluster, port, &prefix);
        assert!(!mine.is_empty(), "port {port} serves channels again");
    }

    let released_at = Instant::now();
    let releases = leases.iter().map(|lease| holder.release(lease));
    for released in futures_util::future::join_all(releases).await {
        assert_eq!(released.unwrap(), lock_core::ReleaseOutcome::Released);
    }
    let mut slowest = Duration::ZERO;
    for w in waiters {
        let ran_at = within(LIMIT, "woken waiter", w).await.unwrap().unwrap();
        slowest = slowest.max(ran_at.saturating_duration_since(released_at));
    }
    eprintln!("every waiter ran within {slowest:?} of the releases");
    assert!(
        slowest < Duration::from_secs(30),
        "woken by notifications, not the 120 s retry"
    );

    within(LIMIT, "every channel unsubscribed", async {
        while waiting.subscription_stats().subscribed_channels != 0 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    let done = waiting.subscription_stats();
    eprintln!("done: {done:?}");
    assert_eq!(
        done.unsubscribed_channels - after.unsubscribed_channels,
        slots.len() as u64,
        "each channel unsubscribed once its last waiter went"
    );
    for &port in &masters {
        let left = shard_channels(&cluster, port, &prefix);
        assert!(left.is_empty(), "port {port} still has {left:?}");
    }
    drop(holder);
    tokio::task::spawn_blocking(move || drop(cluster))
        .await
        .unwrap();
}

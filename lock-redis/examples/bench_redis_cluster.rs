//! The Redis Cluster line of the Redis benchmarks: on a local Redis Cluster
//! (3 masters, 3 replicas, started here from the installed `redis-server`),
//! the uncontended `with_lock` cycle and 64 tasks on distinct keys spread
//! over the masters, `RedisClusterBackend` vs the same raw commands
//! (`SET NX PX`, then a compare-and-delete script) sent by hand to the same
//! cluster, in the same run, two ways: on the `redis` crate's cluster
//! connection, and on one multiplexed connection per master with each key
//! routed to its master beforehand (the least a client can do; the backend
//! also keeps one connection per master). Run it in release mode:
//!
//! ```text
//! cargo run --release -p lock-redis --example bench_redis_cluster
//! ```

use std::error::Error;
use std::time::Instant;

use lock_core::{Locker, LockerOptions};
use lock_redis::testing::RedisCluster;
use lock_redis::{RedisClusterBackend, RedisConfig};
use redis::Script;

const RAW_RELEASE: &str = "if redis.call('GET', KEYS[1]) == ARGV[1] then \
                           return redis.call('DEL', KEYS[1]) end return 0";

fn node(backend: impl lock_core::LockBackend, name: &str) -> Locker {
    Locker::with_options(backend, LockerOptions::default().node_id(name)).expect("node id")
}

type NodeConn = redis::aio::MultiplexedConnection;

/// One multiplexed connection per master, and which one serves a key.
#[derive(Clone)]
struct Direct {
    masters: std::collections::HashMap<u16, NodeConn>,
}

impl Direct {
    async fn new(cluster: &RedisCluster) -> Result<Self, Box<dyn Error>> {
        let mut masters = std::collections::HashMap::new();
        for port in cluster.master_ports()? {
            let url = cluster.node(port).ok_or("no master")?.url();
            let conn = redis::Client::open(url)?
                .get_multiplexed_async_connection()
                .await?;
            masters.insert(port, conn);
        }
        Ok(Self { masters })
    }

    fn conn_of(&self, cluster: &RedisCluster, key: &str) -> Result<NodeConn, Box<dyn Error>> {
        let port = cluster.master_port_of_slot(lock_redis::slot::key_slot(key))?;
        Ok(self.masters.get(&port).ok_or("no master")?.clone())
    }
}

/// The raw commands of one cycle, `SET NX PX` and the release script, on
/// a master's own connection or the crate's cluster connection alike.
async fn raw_cycle<C: redis::aio::ConnectionLike + Clone + Send + Sync>(
    conn: &C,
    release: &Script,
    key: &str,
    value: &str,
) -> Result<(), Box<dyn Error>> {
    let mut conn = conn.clone();
    let ok: Option<String> = redis::cmd("SET")
        .arg(key)
        .arg(value)
        .arg("NX")
        .arg("PX")
        .arg(30_000)
        .query_async(&mut conn)
        .await?;
    assert!(ok.is_some(), "raw baseline: key busy");
    let _: i64 = release.key(key).arg(value).invoke_async(&mut conn).await?;
    Ok(())
}

/// The cluster line: uncontended cycle and 64 tasks, ours vs raw, in turns.
async fn cluster_line(release: &Script) -> Result<(), Box<dyn Error>> {
    let cluster = match tokio::task::spawn_blocking(RedisCluster::start).await? {
        Ok(cluster) => cluster,
        Err(e) => {
            println!("Cluster: skipped, no local Redis Cluster could be started: {e}");
            return Ok(());
        }
    };
    let urls = cluster.urls();
    let prefix = format!("withlock-bench:{:08x}:", rand::random::<u32>());
    let backend =
        RedisClusterBackend::from_urls_with(&urls, RedisConfig::default().prefix(&prefix))?;
    let locker = node(backend, "cluster");
    let raw = redis::cluster::ClusterClientBuilder::new(urls.clone())
        .retries(0)
        .build()?
        .get_async_connection()
        .await?;
    let direct = Direct::new(&cluster).await?;
    let value = "cl/00000000000000000000000000000000";
    const N: u32 = 2000;
    let key = "p1";
    let raw_key = format!("{prefix}raw:p1");
    let direct_conn = direct.conn_of(&cluster, &raw_key)?;
    for _ in 0..200 {
        raw_cycle(&raw, release, &raw_key, value).await?;
        raw_cycle(&direct_conn, release, &raw_key, value).await?;
        locker.with_lock(key, |_| async {}).await?;
    }
    let (mut raw_t, mut direct_t, mut ours_t) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..5 {
        let t = Instant::now();
        for _ in 0..N {
            raw_cycle(&raw, release, &raw_key, value).await?;
        }
        raw_t.push(t.elapsed() / N);
        let t = Instant::now();
        for _ in 0..N {
            raw_cycle(&direct_conn, release, &raw_key, value).await?;
        }
        direct_t.push(t.elapsed() / N);
        let t = Instant::now();
        for _ in 0..N {
            locker.with_lock(key, |_| async {}).await?;
        }
        ours_t.push(t.elapsed() / N);
    }
    raw_t.sort();
    direct_t.sort();
    ours_t.sort();
    let (r, d, o) = (raw_t[2], direct_t[2], ours_t[2]);
    println!(
        "Cluster uncontended cycle: with_lock {o:?}; raw SET NX PX + release script on the cluster connection {r:?}: ratio {:.3}x; on per-master connections {d:?}: ratio {:.3}x",
        o.as_secs_f64() / r.as_secs_f64(),
        o.as_secs_f64() / d.as_secs_f64()
    );

    const TASKS: usize = 64;
    const CYCLES: u32 = 150;
    let masters: std::collections::HashSet<u16> = (0..TASKS)
        .filter_map(|i| {
            let k = format!("{prefix}p2:{i}");
            cluster
                .master_port_of_slot(lock_redis::slot::key_slot(&k))
                .ok()
        })
        .collect();
    let direct_conns: Vec<NodeConn> = (0..TASKS)
        .map(|i| direct.conn_of(&cluster, &format!("{prefix}raw:p2:{i}")))
        .collect::<Result<_, _>>()?;
    let run_raw = || async {
        let t = Instant::now();
        let mut tasks = Vec::new();
        for i in 0..TASKS {
            let (conn, release, key) =
                (raw.clone(), release.clone(), format!("{prefix}raw:p2:{i}"));
            tasks.push(tokio::spawn(async move {
                let value = format!("p2/{i:032x}");
                for _ in 0..CYCLES {
                    raw_cycle(&conn, &release, &key, &value)
                        .await
                        .expect("raw cycle");
                }
            }));
        }
        for t in tasks {
            t.await.expect("raw task");
        }
        f64::from(CYCLES) * TASKS as f64 / t.elapsed().as_secs_f64()
    };
    let run_direct = || async {
        let t = Instant::now();
        let mut tasks = Vec::new();
        for (i, conn) in direct_conns.iter().enumerate() {
            let (conn, release, key) =
                (conn.clone(), release.clone(), format!("{prefix}raw:p2:{i}"));
            tasks.push(tokio::spawn(async move {
                let value = format!("p2/{i:032x}");
                for _ in 0..CYCLES {
                    raw_cycle(&conn, &release, &key, &value)
                        .await
                        .expect("raw cycle");
                }
            }));
        }
        for t in tasks {
            t.await.expect("raw task");
        }
        f64::from(CYCLES) * TASKS as f64 / t.elapsed().as_secs_f64()
    };
    let run_ours = || async {
        let t = Instant::now();
        let mut tasks = Vec::new();
        for i in 0..TASKS {
            let (locker, key) = (locker.clone(), format!("p2:{i}"));
            tasks.push(tokio::spawn(async move {
                for _ in 0..CYCLES {
                    locker
                        .with_lock(&key, |_| async {})
                        .await
                        .expect("with_lock");
                }
            }));
        }
        for t in tasks {
            t.await.expect("with_lock task");
        }
        f64::from(CYCLES) * TASKS as f64 / t.elapsed().as_secs_f64()
    };
    run_raw().await;
    run_direct().await;
    run_ours().await;
    let (mut raw_r, mut direct_r, mut ours_r) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..3 {
        raw_r.push(run_raw().await);
        direct_r.push(run_direct().await);
        ours_r.push(run_ours().await);
    }
    raw_r.sort_by(f64::total_cmp);
    direct_r.sort_by(f64::total_cmp);
    ours_r.sort_by(f64::total_cmp);
    let (r, d, o) = (raw_r[1], direct_r[1], ours_r[1]);
    println!(
        "Cluster 64 tasks, distinct keys on {} masters: with_lock {o:.0} cycles/s; raw on the cluster connection {r:.0} cycles/s: ratio {:.3}x; raw on per-master connections {d:.0} cycles/s: ratio {:.3}x",
        masters.len(),
        o / r,
        o / d
    );
    drop(locker);
    tokio::task::spawn_blocking(move || drop(cluster)).await?;
    Ok(())
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<(), Box<dyn Error>> {
    let started = Instant::now();
    cluster_line(&Script::new(RAW_RELEASE)).await?;
    println!("total {:.1?}", started.elapsed());
    Ok(())
}

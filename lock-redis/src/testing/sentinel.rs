//! A primary, its replicas and three Sentinels (`down-after-milliseconds`
//! 1000), all `redis-server` children on free loopback ports, killed on drop.

use std::io;
use std::net::TcpListener;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::RedisServer;

/// The master name the Sentinels of a [`SentinelGroup`] monitor.
pub const MASTER_NAME: &str = "withlock-test";

/// A primary with replicas and three Sentinels monitoring it as
/// [`MASTER_NAME`] (quorum 2).
#[derive(Debug)]
pub struct SentinelGroup {
    /// The first primary, then the replicas, in start order.
    servers: Vec<RedisServer>,
    sentinels: Vec<RedisServer>,
}

impl SentinelGroup {
    /// Starts a primary, `replicas` replicas and three Sentinels, and waits
    /// until every Sentinel knows the replicas and the other Sentinels.
    ///
    /// # Errors
    ///
    /// When a server cannot be started or the group does not form in 30 s.
    pub fn start(replicas: usize) -> io::Result<Self> {
        let primary = RedisServer::start()?;
        let mut servers = vec![primary];
        for _ in 0..replicas {
            let port = servers[0].port().to_string();
            servers.push(RedisServer::start_with(&[
                "--replicaof",
                "127.0.0.1",
                &port,
            ])?);
        }
        let sentinels = (0..3)
            .map(|_| sentinel(servers[0].port()))
            .collect::<io::Result<Vec<_>>>()?;
        let group = Self { servers, sentinels };
        group.wait_formed(replicas, Duration::from_secs(30))?;
        Ok(group)
    }

    /// The first primary (after a failover, a replica).
    pub fn primary(&self) -> &RedisServer {
        &self.servers[0]
    }

    /// The first replica (after a failover, perhaps the primary).
    pub fn replica(&self) -> &RedisServer {
        &self.servers[1]
    }

    /// The Sentinels' URLs.
    pub fn sentinel_urls(&self) -> Vec<String> {
        self.sentinels.iter().map(RedisServer::url).collect()
    }

    fn sentinel_query<T: redis::FromRedisValue>(&self, cmd: &redis::Cmd) -> Vec<io::Result<T>> {
        self.sentinels
            .iter()
            .map(|s| {
                s.connection()
                    .and_then(|mut c| cmd.query(&mut c))
                    .map_err(io::Error::other)
            })
            .collect()
    }

    /// The port of the primary as the Sentinels say, when a majority agree.
    pub fn primary_port(&self) -> Option<u16> {
        let answers = self.sentinel_query::<Option<(String, u16)>>(
            redis::cmd("SENTINEL")
                .arg("GET-MASTER-ADDR-BY-NAME")
                .arg(MASTER_NAME),
        );
        let ports: Vec<u16> = answers
            .into_iter()
            .filter_map(|a| a.ok().flatten().map(|(_, port)| port))
            .collect();
        ports
            .iter()
            .find(|p| ports.iter().filter(|q| q == p).count() >= 2)
            .copied()
    }

    fn wait_formed(&self, replicas: usize, limit: Duration) -> io::Result<()> {
        let started = Instant::now();
        loop {
            let replicas_known = self
                .sentinel_query::<Vec<redis::Value>>(
                    redis::cmd("SENTINEL").arg("REPLICAS").arg(MASTER_NAME),
                )
                .into_iter()
                .all(|a| a.is_ok_and(|r| r.len() >= replicas));
            let sentinels_known = self
                .sentinel_query::<Vec<redis::Value>>(
                    redis::cmd("SENTINEL").arg("SENTINELS").arg(MASTER_NAME),
                )
                .into_iter()
                .all(|a| a.is_ok_and(|s| s.len() >= 2));
            let synced = self.servers[1..].iter().all(|r| {
                r.connection()
                    .and_then(|mut c| {
                        redis::cmd("INFO")
                            .arg("replication")
                            .query::<String>(&mut c)
                    })
                    .is_ok_and(|info| info.contains("master_link_status:up"))
            });
            if replicas_known && sentinels_known && synced {
                return Ok(());
            }
            if started.elapsed() > limit {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "the Sentinels did not discover the group",
                ));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Waits until a majority of Sentinels name a primary other than the
    /// one on `old_port`, and that server says it is a master.
    ///
    /// # Errors
    ///
    /// When that does not happen within `limit`.
    pub fn wait_for_failover(&self, old_port: u16, limit: Duration) -> io::Result<u16> {
        let started = Instant::now();
        loop {
            if let Some(port) = self.primary_port().filter(|p| *p != old_port) {
                let is_master = self
                    .servers
                    .iter()
                    .find(|s| s.port() == port)
                    .is_some_and(|s| {
                        s.connection()
                            .and_then(|mut c| {
                                redis::cmd("INFO")
                                    .arg("replication")
                                    .query::<String>(&mut c)
                            })
                            .is_ok_and(|info| info.contains("role:master"))
                    });
                if is_master {
                    return Ok(port);
                }
            }
            if started.elapsed() > limit {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "no failover happened",
                ));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// A Sentinel on a free port, monitoring the primary on `primary_port`.
fn sentinel(primary_port: u16) -> io::Result<RedisServer> {
    let port = TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    let dir = std::env::temp_dir().join(format!(
        "withlock-sentinel-{port}-{:08x}",
        rand::random::<u32>()
    ));
    std::fs::create_dir_all(&dir)?;
    let conf = dir.join("sentinel.conf");
    std::fs::write(
        &conf,
        format!(
            "port {port}\nbind 127.0.0.1\ndir {dir}\n\
             sentinel monitor {MASTER_NAME} 127.0.0.1 {primary_port} 2\n\
             sentinel down-after-milliseconds {MASTER_NAME} 1000\n\
             sentinel failover-timeout {MASTER_NAME} 10000\n\
             sentinel parallel-syncs {MASTER_NAME} 1\n",
            dir = dir.display(),
        ),
    )?;
    let server = RedisServer {
        port,
        dir,
        args: vec![conf.to_string_lossy().into_owned(), "--sentinel".to_owned()],
        running: Mutex::new(None),
    };
    server.spawn()?;
    Ok(server)
}

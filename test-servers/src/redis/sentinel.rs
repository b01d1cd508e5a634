//! A primary, its replicas and three Sentinels (`down-after-milliseconds`
//! 1000), all `redis-server` children on free loopback ports, killed on drop.

use std::io;
use std::time::{Duration, Instant};

use super::{RedisServer, TlsFiles};
use crate::process::{free_port, removing_on_error, scratch_dir, temp_base};

/// The master name the Sentinels of a [`SentinelGroup`] monitor.
pub const MASTER_NAME: &str = "withlock-test";

/// The passwords of a [`SentinelGroup`]: the data nodes' (the primary's
/// and the replicas' `requirepass`, and their `masterauth`, which the
/// Sentinels learn with `sentinel auth-pass`) and the Sentinels' own
/// (`requirepass` in their config).
#[derive(Clone, Debug, Default)]
pub struct SentinelAuth {
    /// The data nodes' password.
    pub data_node_password: Option<String>,
    /// The Sentinels' password.
    pub sentinel_password: Option<String>,
}

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
        Self::start_with_auth(replicas, &SentinelAuth::default())
    }

    /// [`start`](Self::start), with the passwords of `auth`.
    ///
    /// # Errors
    ///
    /// As [`start`](Self::start).
    pub fn start_with_auth(replicas: usize, auth: &SentinelAuth) -> io::Result<Self> {
        Self::start_inner(replicas, auth, None)
    }

    /// [`start_with_auth`](Self::start_with_auth), every server and
    /// Sentinel speaking only TLS with the certificate of `tls` (replicas
    /// and Sentinels reach the data nodes over TLS too).
    ///
    /// # Errors
    ///
    /// As [`start`](Self::start).
    pub fn start_tls(replicas: usize, auth: &SentinelAuth, tls: &TlsFiles) -> io::Result<Self> {
        Self::start_inner(replicas, auth, Some(tls))
    }

    fn start_inner(
        replicas: usize,
        auth: &SentinelAuth,
        tls: Option<&TlsFiles>,
    ) -> io::Result<Self> {
        let mut data_args: Vec<&str> = Vec::new();
        if let Some(password) = &auth.data_node_password {
            data_args.extend(["--requirepass", password, "--masterauth", password]);
        }
        if tls.is_some() {
            data_args.extend(["--tls-replication", "yes"]);
        }
        let start = |extra: &[&str]| match tls {
            Some(tls) => RedisServer::start_tls(tls, extra),
            None => RedisServer::start_with(extra),
        };
        let primary = start(&data_args)?;
        let primary_port = primary.port().to_string();
        let mut servers = vec![primary];
        for _ in 0..replicas {
            let mut args = data_args.clone();
            args.extend(["--replicaof", "127.0.0.1", &primary_port]);
            servers.push(start(&args)?);
        }
        let sentinels = (0..3)
            .map(|_| sentinel(servers[0].port(), auth, tls))
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

    /// The Sentinels' URLs, with the Sentinels' password if they have one.
    pub fn sentinel_urls(&self) -> Vec<String> {
        self.sentinels
            .iter()
            .map(RedisServer::url_with_password)
            .collect()
    }

    /// The primary and the replicas, in start order (after a failover the
    /// first is perhaps a replica).
    pub fn servers(&self) -> &[RedisServer] {
        &self.servers
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

/// A Sentinel on a free port, monitoring the primary on `primary_port`,
/// with the passwords of `auth`, speaking TLS with `tls`.
fn sentinel(
    primary_port: u16,
    auth: &SentinelAuth,
    tls: Option<&TlsFiles>,
) -> io::Result<RedisServer> {
    use std::fmt::Write as _;
    let port = free_port()?;
    let dir = scratch_dir(&temp_base(), "sentinel")?;
    let conf = dir.join("sentinel.conf");
    let mut text = format!("bind 127.0.0.1\ndir {}\n", dir.display());
    match tls {
        Some(tls) => {
            let _ = write!(
                text,
                "port 0\ntls-port {port}\ntls-cert-file {}\ntls-key-file {}\n\
                 tls-ca-cert-file {}\ntls-auth-clients no\ntls-replication yes\n",
                tls.cert.display(),
                tls.key.display(),
                tls.ca.display(),
            );
        }
        None => {
            let _ = writeln!(text, "port {port}");
        }
    }
    if let Some(password) = &auth.sentinel_password {
        // The Sentinels also use it with each other.
        let _ = writeln!(text, "requirepass {password}");
    }
    let _ = write!(
        text,
        "sentinel monitor {MASTER_NAME} 127.0.0.1 {primary_port} 2\n\
         sentinel down-after-milliseconds {MASTER_NAME} 1000\n\
         sentinel failover-timeout {MASTER_NAME} 10000\n\
         sentinel parallel-syncs {MASTER_NAME} 1\n",
    );
    if let Some(password) = &auth.data_node_password {
        let _ = writeln!(text, "sentinel auth-pass {MASTER_NAME} {password}");
    }
    removing_on_error(&dir, std::fs::write(&conf, text))?;
    let args = vec![conf.to_string_lossy().into_owned(), "--sentinel".to_owned()];
    RedisServer::start_in(port, dir, args, auth.sentinel_password.clone(), tls)
}

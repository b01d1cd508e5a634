//! The Redis Cluster lock server of a run: 3 masters with a replica each
//! ([`withlock_test_servers::redis::RedisCluster`]: `cluster-node-timeout` 2 s, no
//! persistence), its faults (a master stopped or killed until its replica
//! is promoted, a master stopped for less than the node timeout, every
//! node's client connections cut), and the keys of a run, spread evenly
//! over the masters.

use std::io;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use lock_redis::slot::{key_slot, SLOTS};
use lock_redis::RedisClusterBackend;
use withlock_test_servers::redis::RedisCluster;

use super::{blocking, Injected, ServerError};
use crate::event::FaultKind;

/// How long a replica may take to be promoted, and the cluster to be whole
/// again afterwards.
const FAILOVER_WAIT: Duration = Duration::from_secs(30);

/// The cluster's `cluster-node-timeout` ([`RedisCluster`]'s): a master
/// stopped for less is not failed over.
pub const NODE_TIMEOUT: Duration = Duration::from_secs(2);

/// The longest short stop of a master: half the node timeout.
pub const SHORT_STOP: Duration = Duration::from_secs(1);

/// How long a short stop of a master lasts, given the long stop of the
/// run (2.5 ttls): half a ttl, at most [`SHORT_STOP`], so that a held
/// lock, whose validity is at least two thirds of a ttl when its
/// extension is due, outlasts it.
pub fn short_stop(stop_for: Duration) -> Duration {
    (stop_for / 5).min(SHORT_STOP)
}

/// A backend on the nodes of `url` (`redis://host:port,redis://…`).
///
/// # Errors
///
/// When a node's URL does not parse.
pub fn backend(url: &str) -> Result<RedisClusterBackend, lock_redis::SetupError> {
    RedisClusterBackend::from_urls(url.split(','))
}

/// Six `redis-server` children in a cluster. Dropping it kills them
/// (SIGKILL, which a stopped node obeys too).
#[derive(Debug)]
pub struct ClusterServer {
    cluster: Arc<RedisCluster>,
    /// Turns over the masters a failover picks.
    next_master: AtomicUsize,
    /// Turns over the masters a short stop picks, apart: with both on one
    /// counter, each kind would pick the same place in the list of masters
    /// round after round.
    next_short: AtomicUsize,
}

impl ClusterServer {
    pub(super) async fn start() -> Result<Self, ServerError> {
        let cluster = blocking(|| Ok(RedisCluster::start()?)).await?;
        Ok(Self {
            cluster: Arc::new(cluster),
            next_master: AtomicUsize::new(0),
            next_short: AtomicUsize::new(0),
        })
    }

    pub(super) fn url(&self) -> String {
        self.cluster.urls().join(",")
    }

    /// `n` keys named `<prefix><i>`, taken in turn from the masters, so
    /// that each master serves as many as the others (give or take one).
    pub(super) async fn keys(&self, prefix: &str, n: u32) -> Result<Vec<String>, ServerError> {
        let c = Arc::clone(&self.cluster);
        let prefix = prefix.to_owned();
        blocking(move || {
            let masters = c.master_ports()?;
            let mut by_master: Vec<Vec<String>> = vec![Vec::new(); masters.len()];
            let wanted = (n as usize).div_ceil(masters.len().max(1));
            for i in 0..n * 1000 {
                if by_master.iter().all(|k| k.len() >= wanted) {
                    break;
                }
                let key = format!("{prefix}{i}");
                let port = c.master_port_of_slot(key_slot(&key))?;
                if let Some(at) = masters.iter().position(|&p| p == port) {
                    if by_master[at].len() < wanted {
                        by_master[at].push(key);
                    }
                }
            }
            // Round robin over the masters, so that the first `n` spread.
            let mut keys = Vec::new();
            for round in 0..wanted {
                keys.extend(by_master.iter().filter_map(|k| k.get(round).cloned()));
            }
            keys.truncate(n as usize);
            Ok(keys)
        })
        .await
    }

    /// Injects `kind` and heals it. `master_stop` and `master_kill` stop or
    /// kill the next master until its replica is promoted, then resume or
    /// restart it (it rejoins as a replica) and wait until the cluster is
    /// whole; `master_stop_short` stops the next master for
    /// [`short_stop`]`(stop_for)`, short of a failover; the fault's keys are
    /// those the master served. `client_kill` cuts every node's normal and
    /// pub/sub connections.
    pub(super) async fn inject(
        &self,
        kind: FaultKind,
        stop_for: Duration,
        keys: &[String],
    ) -> Result<Injected, ServerError> {
        match kind {
            FaultKind::MasterStop | FaultKind::MasterKill => self.fail_over(kind, keys).await,
            FaultKind::MasterStopShort => self.stop_short(short_stop(stop_for), keys).await,
            FaultKind::ClientKill => self.kill_clients().await,
            _ => Err(ServerError::Io(io::Error::other(format!(
                "{} is not a Redis Cluster fault",
                kind.name()
            )))),
        }
    }

    /// The next master, its port and the keys of `keys` it serves.
    fn next_victim(
        c: &RedisCluster,
        turn: usize,
        keys: &[String],
    ) -> io::Result<(u16, Vec<String>)> {
        let masters = c.master_ports()?;
        let victim = masters[turn % masters.len()];
        let mut served = Vec::new();
        for key in keys {
            if c.master_port_of_slot(key_slot(key))? == victim {
                served.push(key.clone());
            }
        }
        Ok((victim, served))
    }

    /// SIGSTOP of the next master for `stop`, then SIGCONT; checks that no
    /// failover came of it. One that did anyway (a loaded machine, a
    /// late resume) is logged as a `master_stop`, so that its losses count
    /// as a failover's.
    async fn stop_short(&self, stop: Duration, keys: &[String]) -> Result<Injected, ServerError> {
        let c = Arc::clone(&self.cluster);
        let turn = self.next_short.fetch_add(1, Ordering::Relaxed);
        let keys = keys.to_vec();
        blocking(move || {
            let (victim, served) = Self::next_victim(&c, turn, &keys)?;
            let node = c
                .node(victim)
                .ok_or_else(|| io::Error::other(format!("no node on port {victim}")))?;
            let started = Instant::now();
            node.pause()?;
            std::thread::sleep(stop);
            node.resume()?;
            let stopped = started.elapsed();
            c.wait_ok(FAILOVER_WAIT)?;
            let masters = c.master_ports()?;
            let failed_over = !masters.contains(&victim);
            Ok(Injected {
                kind: failed_over.then_some(FaultKind::MasterStop),
                target: format!("127.0.0.1:{victim}"),
                detail: format!(
                    "master {victim} ({} of the keys) stopped (SIGSTOP) for {} ms, resumed; {}",
                    served.len(),
                    stopped.as_millis(),
                    if failed_over {
                        "it was failed over all the same: logged as a master_stop"
                    } else {
                        "still a master, no failover"
                    }
                ),
                keys: Some(served),
            })
        })
        .await
    }

    /// `CLIENT KILL TYPE normal`, then `pubsub`, on every node.
    async fn kill_clients(&self) -> Result<Injected, ServerError> {
        let c = Arc::clone(&self.cluster);
        blocking(move || {
            let (mut normal, mut pubsub) = (0, 0);
            for node in c.nodes() {
                normal += node.kill_clients("normal")?;
                pubsub += node.kill_clients("pubsub")?;
            }
            Ok(Injected {
                kind: None,
                target: "every node".to_owned(),
                detail: format!(
                    "CLIENT KILL TYPE normal: {normal} closed, TYPE pubsub: {pubsub} closed, \
                     on {} nodes",
                    c.nodes().len()
                ),
                keys: None,
            })
        })
        .await
    }

    /// A master stopped or killed until its replica is promoted.
    async fn fail_over(&self, kind: FaultKind, keys: &[String]) -> Result<Injected, ServerError> {
        let c = Arc::clone(&self.cluster);
        let turn = self.next_master.fetch_add(1, Ordering::Relaxed);
        let keys = keys.to_vec();
        blocking(move || {
            let (victim, served) = Self::next_victim(&c, turn, &keys)?;
            let slot = match served.first() {
                Some(key) => key_slot(key),
                None => (0..SLOTS)
                    .find(|&s| c.master_port_of_slot(s).is_ok_and(|p| p == victim))
                    .ok_or_else(|| io::Error::other(format!("port {victim} serves no slot")))?,
            };
            let node = c
                .node(victim)
                .ok_or_else(|| io::Error::other(format!("no node on port {victim}")))?;
            let started = Instant::now();
            let promoted = if kind == FaultKind::MasterStop {
                node.pause()?;
                let promoted = c.wait_for_failover(slot, victim, FAILOVER_WAIT);
                // Resumed whatever the wait gave.
                node.resume()?;
                promoted?
            } else {
                node.kill();
                let promoted = c.wait_for_failover(slot, victim, FAILOVER_WAIT);
                node.restart()?;
                promoted?
            };
            let failover = started.elapsed();
            c.wait_ok(FAILOVER_WAIT)?;
            let what = if kind == FaultKind::MasterStop {
                "stopped (SIGSTOP), resumed"
            } else {
                "killed (SIGKILL), restarted empty"
            };
            Ok(Injected {
                kind: None,
                target: format!("127.0.0.1:{victim}"),
                detail: format!(
                    "master {victim} ({} of the keys) {what} once its replica {promoted} \
                     was promoted after {} ms; the cluster whole {} ms later",
                    served.len(),
                    failover.as_millis(),
                    (started.elapsed() - failover).as_millis()
                ),
                keys: Some(served),
            })
        })
        .await
    }
}

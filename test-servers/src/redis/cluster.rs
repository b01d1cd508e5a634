//! A local Redis Cluster for tests: `redis-server` children on free loopback
//! ports, joined with `redis-cli --cluster create`, each killed on drop (and
//! by its watchdog if the test process dies first).

use std::io;
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use super::{RedisServer, TlsFiles};

/// How many hash slots a Redis Cluster has.
const SLOTS: u16 = 16384;

/// A Redis Cluster of `redis-server` children: masters with replicas, no
/// persistence, `cluster-node-timeout` 2 s (a killed master's replica is
/// promoted in about 5 s), `cluster-require-full-coverage no`.
#[derive(Debug)]
pub struct RedisCluster {
    nodes: Vec<RedisServer>,
}

impl RedisCluster {
    /// Starts 3 masters with one replica each and waits until every node
    /// reports `cluster_state:ok` and knows every other node.
    ///
    /// # Errors
    ///
    /// When a server cannot be started or the cluster does not form within
    /// 30 s.
    pub fn start() -> io::Result<Self> {
        Self::start_with(3, 1)
    }

    /// Starts `masters` masters with `replicas` replicas each.
    ///
    /// # Errors
    ///
    /// As [`start`](Self::start).
    pub fn start_with(masters: usize, replicas: usize) -> io::Result<Self> {
        Self::start_inner(masters, replicas, None)
    }

    /// Starts `masters` masters with `replicas` replicas each, every node
    /// speaking only TLS with the certificate of `tls`, to clients, to its
    /// replicas and on the cluster bus (`--tls-cluster yes`).
    ///
    /// # Errors
    ///
    /// As [`start`](Self::start).
    pub fn start_tls(masters: usize, replicas: usize, tls: &TlsFiles) -> io::Result<Self> {
        Self::start_inner(masters, replicas, Some(tls))
    }

    fn start_inner(masters: usize, replicas: usize, tls: Option<&TlsFiles>) -> io::Result<Self> {
        let mut args = vec![
            "--cluster-enabled",
            "yes",
            "--cluster-node-timeout",
            "2000",
            "--cluster-config-file",
            "nodes.conf",
            // As the lock-redis docs advise for production: the healthy
            // masters go on serving their slots while another master's are
            // uncovered, instead of every node answering CLUSTERDOWN.
            "--cluster-require-full-coverage",
            "no",
        ];
        if tls.is_some() {
            args.extend(["--tls-cluster", "yes", "--tls-replication", "yes"]);
        }
        let nodes = (0..masters * (1 + replicas))
            .map(|_| match tls {
                Some(tls) => RedisServer::start_tls(tls, &args),
                None => RedisServer::start_with(&args),
            })
            .collect::<io::Result<Vec<_>>>()?;
        let mut create = Command::new("redis-cli");
        if let Some(tls) = tls {
            create.arg("--tls").arg("--cacert").arg(&tls.ca);
        }
        create.arg("--cluster").arg("create");
        for node in &nodes {
            create.arg(format!("127.0.0.1:{}", node.port()));
        }
        let output = create
            .arg("--cluster-replicas")
            .arg(replicas.to_string())
            .arg("--cluster-yes")
            .stdin(Stdio::null())
            .output()?;
        if !output.status.success() {
            return Err(io::Error::other(format!(
                "redis-cli --cluster create failed: {}",
                String::from_utf8_lossy(&output.stdout)
            )));
        }
        let cluster = Self { nodes };
        cluster.wait_ok(Duration::from_secs(30))?;
        Ok(cluster)
    }

    /// Every node, masters and replicas, in start order.
    pub fn nodes(&self) -> &[RedisServer] {
        &self.nodes
    }

    /// The URLs of the nodes that run.
    pub fn urls(&self) -> Vec<String> {
        self.nodes
            .iter()
            .filter(|n| n.pid().is_some())
            .map(RedisServer::url)
            .collect()
    }

    /// The node on `port`.
    pub fn node(&self, port: u16) -> Option<&RedisServer> {
        self.nodes.iter().find(|n| n.port() == port)
    }

    fn query<T: redis::FromRedisValue>(&self, cmd: &redis::Cmd) -> io::Result<T> {
        let mut last = io::Error::other("no node runs");
        for node in self.nodes.iter().filter(|n| n.pid().is_some()) {
            match node.connection().and_then(|mut c| cmd.query(&mut c)) {
                Ok(answer) => return Ok(answer),
                Err(e) => last = io::Error::other(e),
            }
        }
        Err(last)
    }

    /// The port of the master serving `slot`, as a running node says.
    ///
    /// # Errors
    ///
    /// When no node answers or the slot is not served.
    pub fn master_port_of_slot(&self, slot: u16) -> io::Result<u16> {
        let slots: Vec<redis::Value> = self.query(redis::cmd("CLUSTER").arg("SLOTS"))?;
        for entry in slots {
            let redis::Value::Array(fields) = entry else {
                continue;
            };
            let range: Option<(u16, u16, u16)> = (|| {
                let first = redis::from_redis_value(fields.first()?).ok()?;
                let last = redis::from_redis_value(fields.get(1)?).ok()?;
                let redis::Value::Array(master) = fields.get(2)? else {
                    return None;
                };
                let port = redis::from_redis_value(master.get(1)?).ok()?;
                Some((first, last, port))
            })();
            if let Some((first, last, port)) = range {
                if (first..=last).contains(&slot) {
                    return Ok(port);
                }
            }
        }
        Err(io::Error::other(format!("slot {slot} is not served")))
    }

    /// The ports of the running replicas of the master on `master_port`,
    /// as each node's `ROLE` says (`CLUSTER SLOTS` leaves out replicas
    /// that have not synced yet).
    ///
    /// # Errors
    ///
    /// When a running node cannot be reached.
    pub fn replica_ports_of(&self, master_port: u16) -> io::Result<Vec<u16>> {
        let mut replicas = Vec::new();
        for node in self.nodes.iter().filter(|n| n.pid().is_some()) {
            let role: Vec<redis::Value> = node
                .connection()
                .and_then(|mut c| redis::cmd("ROLE").query(&mut c))
                .map_err(io::Error::other)?;
            let is_replica =
                matches!(role.first(), Some(redis::Value::BulkString(r)) if r == b"slave");
            let of: Option<u16> = role.get(2).and_then(|p| redis::from_redis_value(p).ok());
            if is_replica && of == Some(master_port) {
                replicas.push(node.port());
            }
        }
        Ok(replicas)
    }

    /// Waits until every running replica of the master on `master_port`
    /// has applied every write the master had taken when this was called:
    /// each replica's `slave_repl_offset` reaches the master's
    /// `master_repl_offset` read first. A fault test calls it before it
    /// kills the master, so that what it wrote survives the failover
    /// (Redis replicates asynchronously: a write the replica never got is
    /// lost with its master, a limit the crate's docs state).
    ///
    /// # Errors
    ///
    /// When a node cannot be reached, the master has no running replica,
    /// or the replicas do not catch up within `limit`.
    pub fn wait_replicated(&self, master_port: u16, limit: Duration) -> io::Result<()> {
        let master = self
            .node(master_port)
            .ok_or_else(|| io::Error::other(format!("no node on port {master_port}")))?;
        let offset = repl_offset(master, "master_repl_offset")?;
        let replicas = self.replica_ports_of(master_port)?;
        if replicas.is_empty() {
            return Err(io::Error::other(format!(
                "the master on port {master_port} has no running replica"
            )));
        }
        let started = Instant::now();
        for port in replicas {
            let replica = self.node(port).expect("a node of the cluster");
            while repl_offset(replica, "slave_repl_offset")? < offset {
                if started.elapsed() > limit {
                    return Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        format!("the replica on port {port} did not reach offset {offset}"),
                    ));
                }
                std::thread::sleep(Duration::from_millis(10));
            }
        }
        Ok(())
    }

    /// The master serving the slot of `key`.
    ///
    /// # Errors
    ///
    /// As [`master_port_of_slot`](Self::master_port_of_slot), and when no
    /// node answers `CLUSTER KEYSLOT`.
    pub fn master_of_key(&self, key: &str) -> io::Result<&RedisServer> {
        let slot: u16 = self.query(redis::cmd("CLUSTER").arg("KEYSLOT").arg(key))?;
        let port = self.master_port_of_slot(slot)?;
        self.node(port)
            .ok_or_else(|| io::Error::other(format!("no node on port {port}")))
    }

    /// The ports of the masters that serve slots now.
    ///
    /// # Errors
    ///
    /// When no node answers.
    pub fn master_ports(&self) -> io::Result<Vec<u16>> {
        let mut ports = Vec::new();
        for slot in (0..SLOTS).step_by(64) {
            let port = self.master_port_of_slot(slot)?;
            if !ports.contains(&port) {
                ports.push(port);
            }
        }
        Ok(ports)
    }

    /// Waits until every running node says `cluster_state:ok` and knows
    /// as many nodes as the cluster has, and every master has its replicas
    /// in sync.
    ///
    /// # Errors
    ///
    /// When that does not happen within `limit`.
    pub fn wait_ok(&self, limit: Duration) -> io::Result<()> {
        let started = Instant::now();
        loop {
            if self.is_ok() {
                return Ok(());
            }
            if started.elapsed() > limit {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "the cluster did not reach cluster_state:ok",
                ));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn is_ok(&self) -> bool {
        let known = self.nodes.len().to_string();
        self.nodes.iter().filter(|n| n.pid().is_some()).all(|node| {
            let Ok(mut conn) = node.connection() else {
                return false;
            };
            let info: String = redis::cmd("CLUSTER")
                .arg("INFO")
                .query(&mut conn)
                .unwrap_or_default();
            let replication: String = redis::cmd("INFO")
                .arg("replication")
                .query(&mut conn)
                .unwrap_or_default();
            let synced = !replication.contains("role:slave")
                || replication.contains("master_link_status:up");
            info.contains("cluster_state:ok")
                && info.contains(&format!("cluster_known_nodes:{known}"))
                && synced
        })
    }

    /// Waits until a running master other than `old_port` serves `slot`
    /// (after a failover) and the running nodes other than the old master
    /// (killed, or paused and so not answering) agree the cluster is ok.
    ///
    /// # Errors
    ///
    /// When that does not happen within `limit`.
    pub fn wait_for_failover(&self, slot: u16, old_port: u16, limit: Duration) -> io::Result<u16> {
        let started = Instant::now();
        loop {
            if let Ok(port) = self.master_port_of_slot(slot) {
                let ok = self
                    .nodes
                    .iter()
                    .filter(|n| n.pid().is_some() && n.port() != old_port)
                    .all(|n| {
                        n.connection()
                            .and_then(|mut c| {
                                redis::cmd("CLUSTER").arg("INFO").query::<String>(&mut c)
                            })
                            .is_ok_and(|info| info.contains("cluster_state:ok"))
                    });
                if port != old_port && ok {
                    return Ok(port);
                }
            }
            if started.elapsed() > limit {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("no replica took over slot {slot} from port {old_port}"),
                ));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Moves `slot`, with its keys, from its master to the master on
    /// `to_port`, as `redis-cli --cluster reshard` does: `SETSLOT
    /// IMPORTING` / `MIGRATING`, `MIGRATE` of every key, then `SETSLOT NODE`
    /// on the target, the source and every other master.
    ///
    /// # Errors
    ///
    /// When a step fails.
    pub fn migrate_slot(&self, slot: u16, to_port: u16) -> io::Result<()> {
        fn err(e: redis::RedisError) -> io::Error {
            io::Error::other(e)
        }
        let from = self
            .node(self.master_port_of_slot(slot)?)
            .ok_or_else(|| io::Error::other("no source node"))?;
        let to = self
            .node(to_port)
            .ok_or_else(|| io::Error::other("no target node"))?;
        let mut src = from.connection().map_err(err)?;
        let mut dst = to.connection().map_err(err)?;
        let id = |conn: &mut redis::Connection| -> io::Result<String> {
            redis::cmd("CLUSTER").arg("MYID").query(conn).map_err(err)
        };
        let (src_id, dst_id) = (id(&mut src)?, id(&mut dst)?);
        let setslot = |conn: &mut redis::Connection, state: &str, node: &str| -> io::Result<()> {
            redis::cmd("CLUSTER")
                .arg("SETSLOT")
                .arg(slot)
                .arg(state)
                .arg(node)
                .query::<()>(conn)
                .map_err(err)
        };
        setslot(&mut dst, "IMPORTING", &src_id)?;
        setslot(&mut src, "MIGRATING", &dst_id)?;
        loop {
            let keys: Vec<Vec<u8>> = redis::cmd("CLUSTER")
                .arg("GETKEYSINSLOT")
                .arg(slot)
                .arg(100)
                .query(&mut src)
                .map_err(err)?;
            if keys.is_empty() {
                break;
            }
            redis::cmd("MIGRATE")
                .arg("127.0.0.1")
                .arg(to_port)
                .arg("")
                .arg(0)
                .arg(5000)
                .arg("KEYS")
                .arg(keys)
                .query::<()>(&mut src)
                .map_err(err)?;
        }
        setslot(&mut dst, "NODE", &dst_id)?;
        setslot(&mut src, "NODE", &dst_id)?;
        for port in self.master_ports()? {
            if port != from.port() && port != to_port {
                if let Some(mut conn) = self.node(port).and_then(|n| n.connection().ok()) {
                    setslot(&mut conn, "NODE", &dst_id)?;
                }
            }
        }
        Ok(())
    }
}

/// A replication offset from `node`'s `INFO replication`: `field` is
/// `master_repl_offset` (what a master has taken) or `slave_repl_offset`
/// (what a replica has applied).
fn repl_offset(node: &RedisServer, field: &str) -> io::Result<u64> {
    let info: String = node
        .connection()
        .and_then(|mut c| redis::cmd("INFO").arg("replication").query(&mut c))
        .map_err(io::Error::other)?;
    info.lines()
        .find_map(|line| line.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.trim().parse().ok())
        .ok_or_else(|| {
            io::Error::other(format!(
                "no {field} in INFO replication of port {}",
                node.port()
            ))
        })
}

/// One cluster for the whole test process, started on first use and killed
/// when the process exits (by the servers' watchdogs).
///
/// # Panics
///
/// When the cluster cannot be started.
pub fn shared_cluster() -> &'static RedisCluster {
    static CLUSTER: OnceLock<RedisCluster> = OnceLock::new();
    CLUSTER.get_or_init(|| {
        RedisCluster::start().unwrap_or_else(|e| panic!("no local Redis Cluster: {e}"))
    })
}

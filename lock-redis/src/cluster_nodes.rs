//! The nodes of a Redis Cluster as [`RedisClusterBackend`](crate::RedisClusterBackend)
//! reaches them: one multiplexed connection per node and lane, and the
//! slot map, so that a hung or dead master holds up only the steps for its
//! own slots \[L4\].
//!
//! Why not the `redis` crate's cluster connection: it drives every node's
//! requests from one task, and while it rebuilds its slot map or reconnects
//! a node (after a `MOVED`, a refused or dropped connection) that task
//! dispatches nothing at all. Rebuilding holds its connection table's write
//! lock while it asks the nodes for `CLUSTER SLOTS` one at a time and then
//! `PING`s each one, so a stopped master (which still accepts TCP
//! connections and never answers) stalls every step on every master for up
//! to two response timeouts. Dropping and making that connection again is
//! no better: a new cluster connection first connects to every node given,
//! the stopped one included.
//!
//! Here:
//!
//! - each node has its own connections ([`Lane::Steps`] for the lock steps,
//!   [`Lane::Durable`] for acquisitions followed by `WAIT`, so that a slow
//!   `WAIT` never holds up an extension), made on first use and bounded by
//!   the step timeout; making one waits only for that node;
//! - a step goes to the master its slot map names, follows `MOVED` and
//!   `ASK` to the node the answer names at once, and loads its script on
//!   that node after `NOSCRIPT`;
//! - the slot map is read again in the background (after a redirection, a
//!   timeout, a broken connection), asking every known node at once and
//!   taking the first answer; a step never waits for that, except the very
//!   first ones, while no map is known;
//! - an error that may mean a connection is broken (a timeout, a dropped
//!   or refused connection) drops that node's connection only.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use futures_util::stream::{FuturesUnordered, StreamExt};
use lock_core::{BackendError, BackendErrorKind};
use redis::aio::MultiplexedConnection;
use redis::{AsyncConnectionConfig, ConnectionAddr, ConnectionInfo, ErrorKind, RedisError, Value};
use tokio::sync::watch;
use tokio::time::Instant;

use crate::plumbing::connection::{is_broken, open, ConnectionSlot};
use crate::plumbing::driver::Driver;
use crate::plumbing::errors::map_redis_error;
use crate::plumbing::scripts::Lua;

/// A node's `(host, port)`.
pub(crate) type Node = (String, u16);

/// How many `MOVED` / `ASK` answers one step follows. Such an answer means
/// the command did not run, so following it is routing, not a retry.
const MAX_REDIRECTS: usize = 3;

/// The shortest time between two reads of the slot map.
const MIN_REFRESH_INTERVAL: Duration = Duration::from_millis(100);

/// Which connection of a node a request goes on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Lane {
    /// The lock steps: acquisitions, extensions, releases, admin.
    Steps,
    /// Acquisitions followed by `WAIT`, which blocks its connection until
    /// the replicas acknowledge.
    Durable,
}

/// Which master serves each slot, and their replicas, from `CLUSTER SLOTS`.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct SlotMap {
    /// `(first slot, last slot, master, replicas)`, the master `None` when
    /// the cluster announces no usable address for it.
    ranges: Vec<(u16, u16, Option<Node>, Vec<Node>)>,
}

impl SlotMap {
    pub(crate) fn parse(answer: &Value) -> Result<Self, BackendError> {
        let bad = || {
            BackendError::message(
                BackendErrorKind::Protocol,
                "unexpected CLUSTER SLOTS answer",
            )
        };
        let Value::Array(entries) = answer else {
            return Err(bad());
        };
        let node = |fields: &Value| -> Option<Node> {
            let Value::Array(fields) = fields else {
                return None;
            };
            let host = fields
                .first()
                .and_then(|h| redis::from_redis_value::<String>(h).ok())
                .filter(|h| !h.is_empty() && h != "?")?;
            let port = fields
                .get(1)
                .and_then(|p| redis::from_redis_value::<u16>(p).ok())?;
            Some((host, port))
        };
        let mut ranges = Vec::with_capacity(entries.len());
        for entry in entries {
            let Value::Array(fields) = entry else {
                return Err(bad());
            };
            let (Some(first), Some(last), Some(master)) =
                (fields.first(), fields.get(1), fields.get(2))
            else {
                return Err(bad());
            };
            let first: u16 = redis::from_redis_value(first).map_err(|_| bad())?;
            let last: u16 = redis::from_redis_value(last).map_err(|_| bad())?;
            let replicas = fields.iter().skip(3).filter_map(node).collect();
            ranges.push((first, last, node(master), replicas));
        }
        ranges.sort_by_key(|(first, ..)| *first);
        Ok(Self { ranges })
    }

    /// Every master that serves a slot, once each; `None` stands for the
    /// masters of ranges the cluster announces no usable address for.
    pub(crate) fn masters(&self) -> Vec<Option<Node>> {
        let mut masters: Vec<Option<Node>> = Vec::new();
        for (_, _, master, _) in &self.ranges {
            if !masters.contains(master) {
                masters.push(master.clone());
            }
        }
        masters
    }

    /// The slot ranges whose master the cluster announces no usable
    /// address for, first and last slot of each.
    pub(crate) fn unaddressed(&self) -> Vec<(u16, u16)> {
        self.ranges
            .iter()
            .filter(|(_, _, master, _)| master.is_none())
            .map(|(first, last, ..)| (*first, *last))
            .collect()
    }

    /// The master serving `slot`, if the map names one.
    pub(crate) fn master_of(&self, slot: u16) -> Option<&Node> {
        let i = self.ranges.partition_point(|(first, ..)| *first <= slot);
        let (first, last, master, _) = self.ranges.get(i.checked_sub(1)?)?;
        (*first..=*last)
            .contains(&slot)
            .then_some(master.as_ref())
            .flatten()
    }

    /// The fewest replicas any range has; `None` for an empty map.
    pub(crate) fn fewest_replicas(&self) -> Option<usize> {
        self.ranges.iter().map(|(.., r)| r.len()).min()
    }

    fn nodes(&self) -> impl Iterator<Item = &Node> {
        self.ranges
            .iter()
            .flat_map(|(_, _, master, replicas)| master.iter().chain(replicas))
    }
}

/// The slot map as last read, and how the last read went.
#[derive(Clone, Default)]
pub(crate) struct MapState {
    map: Option<Arc<SlotMap>>,
    /// Counts finished reads; with the error of the last, if it failed.
    reads: u64,
    failed: Option<BackendError>,
}

/// A node's connections, one per lane.
#[derive(Default)]
struct NodeLinks {
    steps: ConnectionSlot,
    durable: ConnectionSlot,
}

impl NodeLinks {
    fn slot(&self, lane: Lane) -> &ConnectionSlot {
        match lane {
            Lane::Steps => &self.steps,
            Lane::Durable => &self.durable,
        }
    }
}

/// The nodes of one cluster, shared by the clones of a backend (and its
/// subscription).
#[derive(Clone)]
pub(crate) struct ClusterNodes {
    inner: Arc<Shared>,
}

struct Shared {
    /// The connection settings of the first node given (credentials,
    /// protocol, TLS); every node is reached with them at its own address.
    template: ConnectionInfo,
    /// The nodes given, asked for the slot map when no known node answers.
    seeds: Vec<Node>,
    timeout: Duration,
    links: Mutex<HashMap<Node, Arc<NodeLinks>>>,
    map: watch::Sender<MapState>,
    /// A read of the slot map runs or is due.
    refreshing: AtomicBool,
    /// Another read was asked for while one ran.
    again: AtomicBool,
    /// Where the node connections are driven and the slot map is read.
    driver: Driver,
}

impl ClusterNodes {
    pub(crate) fn new(infos: &[ConnectionInfo], timeout: Duration) -> Option<Self> {
        let template = infos.first()?.clone();
        let seeds = infos.iter().filter_map(|i| address(&i.addr)).collect();
        let (map, _) = watch::channel(MapState::default());
        Some(Self {
            inner: Arc::new(Shared {
                template,
                seeds,
                timeout,
                links: Mutex::new(HashMap::new()),
                map,
                refreshing: AtomicBool::new(false),
                again: AtomicBool::new(false),
                driver: Driver::default(),
            }),
        })
    }

    /// The slot map as last read, without waiting.
    pub(crate) fn cached_map(&self) -> Option<Arc<SlotMap>> {
        self.inner.map.borrow().map.clone()
    }

    /// Changes at every read of the slot map.
    pub(crate) fn map_changes(&self) -> watch::Receiver<MapState> {
        self.inner.map.subscribe()
    }

    /// The connection settings of `node`: those of the first node given,
    /// at the node's address.
    pub(crate) fn info(&self, node: &Node) -> ConnectionInfo {
        self.inner.info(node)
    }

    /// The runtime that drives the node connections (and the
    /// subscription's).
    pub(crate) fn driver(&self) -> &Driver {
        &self.inner.driver
    }

    /// How many nodes have connections kept (made or not).
    pub(crate) fn linked_nodes(&self) -> usize {
        self.inner.lock_links().len()
    }

    /// Whether some node connection is up.
    pub(crate) fn is_connected(&self) -> bool {
        self.inner
            .lock_links()
            .values()
            .any(|l| l.steps.current().is_some())
    }

    /// The slot map; read first (waiting for that read) when none is known.
    /// A failed read gives its error.
    pub(crate) async fn map(&self) -> Result<Arc<SlotMap>, BackendError> {
        let mut state = self.inner.map.subscribe();
        let reads = {
            let now = state.borrow_and_update();
            if let Some(map) = &now.map {
                return Ok(Arc::clone(map));
            }
            now.reads
        };
        self.refresh();
        let settled = state
            .wait_for(|s| s.map.is_some() || s.reads > reads)
            .await
            .map_err(|_| BackendError::message(BackendErrorKind::Request, "the backend is gone"))?;
        match (&settled.map, &settled.failed) {
            (Some(map), _) => Ok(Arc::clone(map)),
            (None, Some(error)) => Err(error.clone()),
            (None, None) => Err(BackendError::message(
                BackendErrorKind::Unavailable,
                "no cluster node gave the slot map",
            )),
        }
    }

    /// Reads the slot map again in the background, soon (at most one read
    /// at a time, and one every [`MIN_REFRESH_INTERVAL`]).
    pub(crate) fn refresh(&self) {
        self.inner.again.store(true, Ordering::Release);
        if self.inner.refreshing.swap(true, Ordering::AcqRel) {
            return;
        }
        let inner = Arc::downgrade(&self.inner);
        // On the backend's own runtime: a step that waits for the map
        // must not wait for whichever runtime asked for the read first.
        self.inner.driver.spawn(async move {
            loop {
                let Some(shared) = inner.upgrade() else {
                    return;
                };
                if !shared.again.swap(false, Ordering::AcqRel) {
                    shared.refreshing.store(false, Ordering::Release);
                    // Asked for between the two lines above: go on reading.
                    if shared.again.load(Ordering::Acquire)
                        && !shared.refreshing.swap(true, Ordering::AcqRel)
                    {
                        continue;
                    }
                    return;
                }
                let started = Instant::now();
                shared.read_map().await;
                drop(shared);
                tokio::time::sleep_until(started + MIN_REFRESH_INTERVAL).await;
            }
        });
    }

    /// The connection of `node` on `lane`, made if there is none (waiting
    /// only for that node). A failed connection is
    /// [`Unavailable`](BackendErrorKind::Unavailable) (nothing was sent),
    /// or a setup error for refused credentials.
    pub(crate) async fn connection(
        &self,
        node: &Node,
        lane: Lane,
    ) -> Result<(u64, MultiplexedConnection), BackendError> {
        let made = self.inner.connection(node, lane).await;
        if made.is_err() {
            // The node may be gone, its slots served elsewhere.
            self.refresh();
        }
        made
    }

    /// Forgets the connection of `generation` to `node` on `lane` after
    /// `error`, if it may mean the connection is broken; and then reads the
    /// slot map again (the node may have failed over).
    pub(crate) fn after_error(&self, node: &Node, lane: Lane, generation: u64, error: &RedisError) {
        if is_broken(error) {
            self.forget(node, lane, generation);
        }
    }

    /// Forgets the connection of `generation` to `node` on `lane`, and reads
    /// the slot map again.
    pub(crate) fn forget(&self, node: &Node, lane: Lane, generation: u64) {
        if let Some(links) = self.inner.lock_links().get(node) {
            links.slot(lane).forget(generation);
        }
        self.refresh();
    }

    /// The first `count` commands of `pipe` on the master of `slot`, their
    /// answers in order (an error reply is a [`Value::ServerError`]). When
    /// the first answer is `NOSCRIPT`, `script` is loaded on that node and
    /// the pipeline sent again; when it is `MOVED` or `ASK`, the pipeline
    /// goes to the node named (after `ASKING`), and the slot map is read
    /// again. Neither answer means the first command ran; the pipelines
    /// sent here hold one script call, and perhaps a `WAIT` after it.
    pub(crate) async fn run(
        &self,
        lane: Lane,
        slot: u16,
        pipe: &redis::Pipeline,
        count: usize,
        script: Option<&Lua>,
    ) -> Result<Vec<Value>, BackendError> {
        let map = self.map().await?;
        let Some(master) = map.master_of(slot).cloned() else {
            self.refresh();
            return Err(BackendError::message(
                BackendErrorKind::Unavailable,
                format!("the cluster announces no master for slot {slot}"),
            ));
        };
        let mut node = master;
        let mut asking = false;
        let mut loaded = false;
        let mut redirects = 0;
        loop {
            let values = if asking {
                let mut asked = redis::pipe();
                asked.cmd("ASKING");
                for cmd in pipe.cmd_iter().take(count) {
                    asked.add_command(cmd.clone());
                }
                let mut values = self.send(&node, lane, &asked, 0, count + 1).await?;
                values.remove(0);
                values
            } else {
                self.send(&node, lane, pipe, 0, count).await?
            };
            let Some(Value::ServerError(first)) = values.first() else {
                return Ok(values);
            };
            let error = RedisError::from(first.clone());
            match (error.kind(), script) {
                (ErrorKind::NoScriptError, Some(script)) if !loaded => {
                    loaded = true;
                    let mut one = redis::pipe();
                    one.add_command(script.load_cmd());
                    if let Some(Value::ServerError(e)) =
                        self.send(&node, lane, &one, 0, 1).await?.first()
                    {
                        return Err(map_redis_error(RedisError::from(e.clone())));
                    }
                }
                (ErrorKind::Moved | ErrorKind::Ask, _) if redirects < MAX_REDIRECTS => {
                    redirects += 1;
                    let Some(to) = error.redirect_node().and_then(|(addr, _)| split(addr)) else {
                        return Ok(values);
                    };
                    asking = error.kind() == ErrorKind::Ask;
                    if !asking {
                        self.refresh();
                    }
                    node = to;
                }
                _ => return Ok(values),
            }
        }
    }

    /// The first `count` commands of `pipe` after `offset` on `node`'s
    /// connection of `lane`, as one write: their answers, an error reply
    /// as a [`Value::ServerError`]. A failed send drops the connection if
    /// it may be broken.
    pub(crate) async fn send(
        &self,
        node: &Node,
        lane: Lane,
        pipe: &redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> Result<Vec<Value>, BackendError> {
        let (generation, mut conn) = self.connection(node, lane).await?;
        match conn.send_packed_commands(pipe, offset, count).await {
            Ok(values) if values.len() == count => Ok(values),
            Ok(values) => Err(BackendError::message(
                BackendErrorKind::Protocol,
                format!("{} answers to {count} commands", values.len()),
            )),
            Err(error) => {
                self.after_error(node, lane, generation, &error);
                Err(map_node_error(error))
            }
        }
    }
}

impl Shared {
    fn lock_links(&self) -> std::sync::MutexGuard<'_, HashMap<Node, Arc<NodeLinks>>> {
        self.links.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn links(&self, node: &Node) -> Arc<NodeLinks> {
        let mut links = self.lock_links();
        // Looked up before it is made: no key is copied on every step.
        match links.get(node) {
            Some(of_node) => Arc::clone(of_node),
            None => Arc::clone(links.entry(node.clone()).or_default()),
        }
    }

    fn info(&self, (host, port): &Node) -> ConnectionInfo {
        let addr = match &self.template.addr {
            ConnectionAddr::TcpTls {
                insecure,
                tls_params,
                ..
            } => ConnectionAddr::TcpTls {
                host: host.clone(),
                port: *port,
                insecure: *insecure,
                tls_params: tls_params.clone(),
            },
            _ => ConnectionAddr::Tcp(host.clone(), *port),
        };
        ConnectionInfo {
            addr,
            redis: self.template.redis.clone(),
        }
    }

    async fn connection(
        &self,
        node: &Node,
        lane: Lane,
    ) -> Result<(u64, MultiplexedConnection), BackendError> {
        let links = self.links(node);
        // Made on the backend's runtime, which then drives it, whichever
        // runtime the step that needed it runs on.
        links
            .slot(lane)
            .get_or_make(self.driver.making(open(
                "connecting",
                self.info(node),
                self.timeout,
                AsyncConnectionConfig::new(),
            )))
            .await
    }

    /// One read of the slot map: every known node (and every node given)
    /// asked at once, the first answer taken.
    async fn read_map(&self) {
        let mut candidates: Vec<Node> = Vec::new();
        if let Some(map) = self.map.borrow().map.clone() {
            for node in map.nodes() {
                if !candidates.contains(node) {
                    candidates.push(node.clone());
                }
            }
        }
        for node in &self.seeds {
            if !candidates.contains(node) {
                candidates.push(node.clone());
            }
        }
        let mut asked: FuturesUnordered<_> = candidates
            .iter()
            .map(|node| async move {
                let answer = tokio::time::timeout(self.timeout, async {
                    let (generation, mut conn) = self.connection(node, Lane::Steps).await?;
                    match redis::cmd("CLUSTER")
                        .arg("SLOTS")
                        .query_async::<Value>(&mut conn)
                        .await
                    {
                        Ok(answer) => SlotMap::parse(&answer),
                        Err(error) => {
                            if is_broken(&error) {
                                if let Some(links) = self.lock_links().get(node) {
                                    links.steps.forget(generation);
                                }
                            }
                            Err(map_node_error(error))
                        }
                    }
                })
                .await;
                answer.unwrap_or_else(|_| {
                    Err(BackendError::timeout("reading the slot map", self.timeout))
                })
            })
            .collect();
        let mut last_error = None;
        let mut found = None;
        while let Some(answer) = asked.next().await {
            match answer {
                Ok(map) if !map.ranges.is_empty() => {
                    found = Some(map);
                    break;
                }
                Ok(_) => {
                    last_error = Some(BackendError::message(
                        BackendErrorKind::Unavailable,
                        "a cluster node serves no slot yet",
                    ));
                }
                Err(error) => last_error = Some(error),
            }
        }
        drop(asked);
        self.map.send_modify(|state| {
            state.reads += 1;
            match found {
                Some(map) => {
                    if state.map.as_deref() != Some(&map) {
                        tracing::debug!(?map, "cluster slot map read");
                        state.map = Some(Arc::new(map));
                    }
                    state.failed = None;
                }
                None => {
                    state.failed = Some(last_error.unwrap_or_else(|| {
                        BackendError::message(
                            BackendErrorKind::Unavailable,
                            "no cluster node given",
                        )
                    }));
                }
            }
        });
        // Connections to nodes that left the map and were not given.
        let known: Vec<Node> = self
            .map
            .borrow()
            .map
            .iter()
            .flat_map(|m| m.nodes().cloned().collect::<Vec<_>>())
            .collect();
        self.lock_links()
            .retain(|node, _| known.contains(node) || self.seeds.contains(node));
    }
}

/// The `(host, port)` of a TCP address.
pub(crate) fn address(addr: &ConnectionAddr) -> Option<Node> {
    match addr {
        ConnectionAddr::Tcp(host, port) | ConnectionAddr::TcpTls { host, port, .. } => {
            Some((host.clone(), *port))
        }
        _ => None,
    }
}

/// `host:port` as a [`Node`].
pub(crate) fn split(addr: &str) -> Option<Node> {
    let (host, port) = addr.rsplit_once(':')?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    Some((host.to_owned(), port.parse().ok()?))
}

/// A request that failed on its node: refused (nothing was sent) is
/// `Unavailable`; anything else as [`map_redis_error`] maps it.
pub(crate) fn map_node_error(error: RedisError) -> BackendError {
    if error.is_connection_refusal() {
        crate::config::connection_error(error)
    } else {
        map_redis_error(error)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(port: i64) -> Value {
        Value::Array(vec![
            Value::BulkString(b"127.0.0.1".to_vec()),
            Value::Int(port),
        ])
    }

    fn range(first: i64, last: i64, nodes: &[i64]) -> Value {
        let mut fields = vec![Value::Int(first), Value::Int(last)];
        fields.extend(nodes.iter().map(|p| node(*p)));
        Value::Array(fields)
    }

    #[test]
    fn the_slot_map_names_each_slot_s_master_and_counts_replicas() {
        let answer = Value::Array(vec![
            range(5461, 10922, &[7001, 7004]),
            range(0, 5460, &[7000, 7003]),
            range(10923, 16383, &[7002]),
        ]);
        let map = SlotMap::parse(&answer).unwrap();
        assert_eq!(map.master_of(0), Some(&("127.0.0.1".to_owned(), 7000)));
        assert_eq!(map.master_of(5461), Some(&("127.0.0.1".to_owned(), 7001)));
        assert_eq!(map.master_of(16383), Some(&("127.0.0.1".to_owned(), 7002)));
        assert_eq!(map.fewest_replicas(), Some(0));
        assert_eq!(map.masters().len(), 3);
        let partial = SlotMap::parse(&Value::Array(vec![range(0, 100, &[7000])])).unwrap();
        assert_eq!(partial.master_of(101), None);
    }

    #[test]
    fn node_addresses_parse() {
        assert_eq!(
            split("127.0.0.1:7000"),
            Some(("127.0.0.1".to_owned(), 7000))
        );
        assert_eq!(split("[::1]:7000"), Some(("::1".to_owned(), 7000)));
        assert_eq!(split("nope"), None);
    }
}

//! The sharded release subscription of a [`RedisClusterBackend`](crate::RedisClusterBackend):
//! one RESP3 connection per master that serves a slot a waiter needs, whose
//! push messages one background task reads and hands to a [`ReleaseHub`].
//!
//! Releases are published with `SPUBLISH` on one shard channel per hash
//! slot, which only the node serving the slot delivers. A waiter's watch
//! is returned once its slot's channel is subscribed there (the server's
//! `ssubscribe` confirmation). The task keeps, for each slot a waiter
//! needs, where its channel is subscribed, and sets that right whenever
//! something changes (a waiter comes, goes, a node connection is lost or
//! made, the slot map changes), sending each node **one** request: a
//! pipeline of one `SSUBSCRIBE` / `SUNSUBSCRIBE` per channel (a command of
//! several shard channels must keep to one slot). So:
//!
//! - a channel is unsubscribed (`SUNSUBSCRIBE`) once no waiter needs it,
//!   at the next check (every second, or sooner);
//! - after a node connection is lost (the client reports the
//!   disconnection, or a health-check `PING` fails) the task connects
//!   again, with backoff, and re-subscribes every channel that node serves
//!   in one request; then it wakes every watch, since releases may have
//!   been missed meanwhile, and so it does after the server dropped a
//!   channel itself (it pushes `sunsubscribe` when a slot moves);
//! - waiters poll on their retry timer in the meantime, so a missed
//!   release costs at most `retry_delay`.
//!
//! The `redis` crate takes a subscription push (`ssubscribe`,
//! `sunsubscribe`) for the reply to the request in flight, also one the
//! server sends on its own; so the task never trusts a reply's place, only
//! the pushes (every one reaches it, a reply or not), and what a node
//! connection answers a `PING` within the timeout.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use lock_core::{BackendError, BackendErrorKind, ReleaseHub, ReleaseWatch};
use redis::aio::MultiplexedConnection;
use redis::{AsyncConnectionConfig, PushInfo, PushKind, Value};
use tokio::sync::{mpsc, watch, Notify};
use tokio::time::Instant;

use crate::cluster::slot_channel;
use crate::cluster_nodes::{ClusterNodes, Node};
use crate::plumbing::connection::open;
use crate::plumbing::task::{deliver, ticker, OnFirstUse, FIRST_RECONNECT_DELAY};
use crate::plumbing::timeout::within;
use crate::slot::key_slot;

/// How often the task checks for channels no waiter needs any more (and
/// for reconnections due), at most.
const SWEEP_INTERVAL: Duration = Duration::from_secs(1);

/// What the sharded release subscription of a
/// [`RedisClusterBackend`](crate::RedisClusterBackend) sent, from
/// [`subscription_stats`](crate::RedisClusterBackend::subscription_stats).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct SubscriptionStats {
    /// Subscription requests sent: each one write to one node, carrying
    /// one `SSUBSCRIBE` per channel it subscribes there.
    pub subscribe_requests: u64,
    /// Shard channels unsubscribed with `SUNSUBSCRIBE` because no waiter
    /// needed them any more.
    pub unsubscribed_channels: u64,
    /// Shard channels subscribed now.
    pub subscribed_channels: usize,
}

pub(crate) struct ShardedSubscription {
    shared: Arc<Shared>,
    /// Started by the first watch, with the events its connections send;
    /// ends with the backend.
    task: OnFirstUse<(Arc<Shared>, mpsc::UnboundedReceiver<Event>)>,
}

struct Shared {
    nodes: ClusterNodes,
    prefix: String,
    hub: ReleaseHub,
    /// One entry per slot some watch needs (keyed by the slot's number):
    /// each watch holds one on its slot, so a slot is needed while it lives.
    needed: ReleaseHub,
    timeout: Duration,
    health_check_interval: Duration,
    max_reconnect_delay: Duration,
    state: Mutex<State>,
    /// Bumped whenever a channel's state changes, for waiting watches.
    changed: watch::Sender<u64>,
    kick: Notify,
    events: mpsc::UnboundedSender<Event>,
    subscribe_requests: AtomicU64,
    unsubscribed: AtomicU64,
}

#[derive(Default)]
struct State {
    channels: HashMap<u16, Channel>,
    links: HashMap<Node, Link>,
    /// Counts connections made, so that the events of an old one are told
    /// from those of its successor.
    generations: u64,
}

/// A slot whose channel is wanted or subscribed.
#[derive(Default)]
struct Channel {
    /// The node the channel is subscribed on (confirmed), if any.
    on: Option<Node>,
    /// A request on its way: `SSUBSCRIBE` (true) or `SUNSUBSCRIBE` (false),
    /// to the node named, on the connection of that generation.
    pending: Option<(Node, u64, bool)>,
    /// The channel was lost (its node's connection, or the server dropped
    /// it): once it is back, every watch is woken.
    lost: bool,
    /// A node refused to subscribe it (a stale slot map): not again before.
    not_before: Option<Instant>,
}

/// The subscription connection to one node.
struct Link {
    generation: u64,
    conn: Option<MultiplexedConnection>,
    connecting: bool,
    retry_at: Instant,
    delay: Duration,
}

enum Event {
    Push(Node, u64, PushInfo),
    Connected(Node, u64, MultiplexedConnection),
    Failed(Node, u64, BackendError),
    /// A request's answers: the slots whose command was refused (a
    /// redirection, a refusal), or the connection broke.
    Sent(Node, u64, Result<Vec<(u16, bool)>, BackendError>),
}

impl ShardedSubscription {
    pub(crate) fn new(nodes: ClusterNodes, config: &crate::RedisConfig) -> Self {
        let (events, received) = mpsc::unbounded_channel();
        let (changed, _) = watch::channel(0);
        let shared = Arc::new(Shared {
            nodes,
            prefix: config.prefix.clone(),
            hub: ReleaseHub::new(),
            needed: ReleaseHub::new(),
            timeout: config.step_timeout,
            health_check_interval: config.health_check_interval,
            max_reconnect_delay: config.max_reconnect_delay,
            state: Mutex::new(State::default()),
            changed,
            kick: Notify::new(),
            events,
            subscribe_requests: AtomicU64::new(0),
            unsubscribed: AtomicU64::new(0),
        });
        Self {
            task: OnFirstUse::new((Arc::clone(&shared), received)),
            shared,
        }
    }

    /// The per-key structures: see
    /// [`RedisClusterBackend::state_counts`](crate::RedisClusterBackend::state_counts).
    pub(crate) fn state_counts(&self) -> [(&'static str, usize); 4] {
        let state = self.shared.state();
        [
            ("release_watches", self.shared.hub.watched_keys()),
            ("slots_watched", self.shared.needed.watched_keys()),
            ("shard_channels", state.channels.len()),
            ("subscription_links", state.links.len()),
        ]
    }

    pub(crate) fn is_subscribed(&self) -> bool {
        self.shared
            .state()
            .channels
            .values()
            .any(|c| c.on.is_some())
    }

    pub(crate) fn stats(&self) -> SubscriptionStats {
        SubscriptionStats {
            subscribe_requests: self.shared.subscribe_requests.load(Ordering::Relaxed),
            unsubscribed_channels: self.shared.unsubscribed.load(Ordering::Relaxed),
            subscribed_channels: self
                .shared
                .state()
                .channels
                .values()
                .filter(|c| c.on.is_some())
                .count(),
        }
    }

    /// A watch on `key` (without prefix) whose lock key is in `slot`,
    /// returned once the slot's channel is subscribed.
    pub(crate) async fn watch(
        &self,
        nodes: &ClusterNodes,
        key: &str,
        slot: u16,
    ) -> Result<ReleaseWatch, BackendError> {
        let deadline = Instant::now() + self.shared.timeout;
        let timed_out = || BackendError::timeout("subscribing", self.shared.timeout);
        // The slot map first, so that the task knows where to subscribe.
        tokio::time::timeout_at(deadline, nodes.map())
            .await
            .map_err(|_| timed_out())??;
        // The watch first: a release from now on either reaches it, or is
        // covered by the wake-up of every watch after a resubscription.
        let watch = self.shared.hub.watch(key);
        let (needed, ready) = {
            let mut state = self.shared.state();
            let needed = self.shared.needed.watch(&slot.to_string());
            let channel = state.channels.entry(slot).or_default();
            (needed, channel.is_ready())
        };
        let watch = ReleaseWatch::either(watch, needed);
        if ready {
            return Ok(watch);
        }
        self.start_task();
        let mut changed = self.shared.changed.subscribe();
        self.shared.kick.notify_one();
        tokio::time::timeout_at(deadline, async {
            loop {
                if self
                    .shared
                    .state()
                    .channels
                    .get(&slot)
                    .is_some_and(Channel::is_ready)
                {
                    return Ok(());
                }
                if changed.changed().await.is_err() {
                    return Err(BackendError::message(
                        BackendErrorKind::Request,
                        "the subscription task has ended",
                    ));
                }
            }
        })
        .await
        .map_err(|_| timed_out())??;
        Ok(watch)
    }

    fn start_task(&self) {
        self.task
            .start(self.shared.nodes.driver(), |(shared, events)| {
                (async move { run(&shared, events).await }, || {
                    tracing::debug!("sharded release subscription ended");
                })
            });
    }
}

impl Channel {
    fn is_ready(&self) -> bool {
        self.on.is_some() && self.pending.is_none()
    }
}

impl Shared {
    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn bump(&self) {
        self.changed.send_modify(|n| *n = n.wrapping_add(1));
    }

    /// Sets every channel right: what to send to which node, sent (one
    /// request per node), connections made where missing. Gives when it
    /// must run again at the latest (a reconnection due).
    fn reconcile(self: &Arc<Self>) -> Option<Instant> {
        let map = self.nodes.cached_map();
        let now = Instant::now();
        let mut next: Option<Instant> = None;
        let mut requests: HashMap<Node, (u64, Vec<(u16, bool)>)> = HashMap::new();
        let mut connect: Vec<(Node, u64)> = Vec::new();
        let mut state = self.state();
        let State {
            channels,
            links,
            generations,
        } = &mut *state;
        channels.retain(|slot, channel| {
            let wanted = self.needed.is_watched(&slot.to_string());
            if channel.pending.is_some() {
                return true;
            }
            if let Some(at) = channel.not_before.filter(|at| *at > now) {
                next = Some(next.map_or(at, |n| n.min(at)));
                return true;
            }
            let target = map.as_ref().and_then(|m| m.master_of(*slot)).cloned();
            let (node, subscribe) = match (&channel.on, wanted) {
                (Some(on), true) if Some(on) == target.as_ref() => return true,
                // Subscribed where the slot no longer is (moved, failed
                // over): subscribed where it is now, the old one left to
                // the server, which drops it, or to its lost connection.
                (_, true) => match target {
                    Some(target) => (target, true),
                    None => return true,
                },
                (Some(on), false) => (on.clone(), false),
                (None, false) => return false,
            };
            let link = links.entry(node.clone()).or_insert_with(|| Link {
                generation: 0,
                conn: None,
                connecting: false,
                retry_at: now,
                delay: FIRST_RECONNECT_DELAY,
            });
            if link.conn.is_some() {
                channel.pending = Some((node.clone(), link.generation, subscribe));
                requests
                    .entry(node)
                    .or_insert_with(|| (link.generation, Vec::new()))
                    .1
                    .push((*slot, subscribe));
            } else if !subscribe {
                // Its connection is gone, and its subscriptions with it.
                channel.on = None;
            } else if !link.connecting {
                if link.retry_at <= now {
                    link.connecting = true;
                    *generations += 1;
                    link.generation = *generations;
                    connect.push((node, link.generation));
                } else {
                    next = Some(next.map_or(link.retry_at, |n| n.min(link.retry_at)));
                }
            }
            true
        });
        let conns: Vec<_> = requests
            .into_iter()
            .filter_map(|(node, (generation, ops))| {
                let conn = links.get(&node)?.conn.clone()?;
                Some((node, generation, conn, ops))
            })
            .collect();
        drop(state);
        for (node, generation) in connect {
            tokio::spawn(Arc::clone(self).connect(node, generation));
        }
        for (node, generation, conn, ops) in conns {
            tokio::spawn(Arc::clone(self).send(node, generation, conn, ops));
        }
        next
    }

    /// A subscription connection to `node`, its pushes sent to the task.
    async fn connect(self: Arc<Self>, node: Node, generation: u64) {
        let events = self.events.clone();
        let from = node.clone();
        let mut info = self.nodes.info(&node);
        info.redis.protocol = redis::ProtocolVersion::RESP3;
        let config = AsyncConnectionConfig::new().set_push_sender(move |push: PushInfo| {
            events.send(Event::Push(from.clone(), generation, push))
        });
        let event = match open("subscribing", info, self.timeout, config).await {
            Ok(conn) => Event::Connected(node, generation, conn),
            Err(error) => Event::Failed(node, generation, error),
        };
        let _ = self.events.send(event);
    }

    /// One request to `node`: `ops` as one pipeline.
    async fn send(
        self: Arc<Self>,
        node: Node,
        generation: u64,
        mut conn: MultiplexedConnection,
        ops: Vec<(u16, bool)>,
    ) {
        let mut pipe = redis::Pipeline::with_capacity(ops.len());
        let mut subscribes = 0;
        for (slot, subscribe) in &ops {
            let channel = slot_channel(*slot, &self.prefix);
            if *subscribe {
                subscribes += 1;
                pipe.cmd("SSUBSCRIBE").arg(channel);
            } else {
                self.unsubscribed.fetch_add(1, Ordering::Relaxed);
                pipe.cmd("SUNSUBSCRIBE").arg(channel);
            }
        }
        if subscribes > 0 {
            self.subscribe_requests.fetch_add(1, Ordering::Relaxed);
        }
        let sent = async {
            conn.send_packed_commands(&pipe, 0, ops.len())
                .await
                .map_err(crate::cluster_nodes::map_node_error)
        };
        let result = within("subscribing", self.timeout, sent)
            .await
            .map(|values| {
                ops.iter()
                    .zip(values)
                    .filter(|(_, value)| matches!(value, Value::ServerError(_)))
                    .map(|(op, _)| *op)
                    .collect()
            });
        let _ = self.events.send(Event::Sent(node, generation, result));
    }

    /// `PING` on every subscription connection; one that does not answer in
    /// time is lost.
    fn ping_all(self: &Arc<Self>) {
        let links: Vec<(Node, u64, MultiplexedConnection)> = self
            .state()
            .links
            .iter()
            .filter_map(|(node, link)| Some((node.clone(), link.generation, link.conn.clone()?)))
            .collect();
        for (node, generation, mut conn) in links {
            let shared = Arc::clone(self);
            tokio::spawn(async move {
                let answer = tokio::time::timeout(
                    shared.timeout,
                    redis::cmd("PING").query_async::<Value>(&mut conn),
                )
                .await;
                if !matches!(answer, Ok(Ok(_))) {
                    let _ = shared.events.send(Event::Failed(
                        node,
                        generation,
                        BackendError::timeout("pinging the subscription", shared.timeout),
                    ));
                }
            });
        }
    }

    /// Handles one event; gives whether every watch must be woken (a
    /// release may have been missed).
    fn handle(&self, event: Event) -> bool {
        let mut wake = false;
        let mut state = self.state();
        let current = |state: &State, node: &Node, generation: u64| {
            state
                .links
                .get(node)
                .is_some_and(|l| l.generation == generation)
        };
        match event {
            Event::Push(node, generation, push) => {
                if !current(&state, &node, generation) {
                    return false;
                }
                match push.kind {
                    PushKind::SMessage => {
                        drop(state);
                        self.deliver(&push.data);
                        return false;
                    }
                    PushKind::SSubscribe => {
                        if let Some(channel) = self.channel_of(&mut state, &push.data) {
                            channel.on = Some(node.clone());
                            if channel
                                .pending
                                .as_ref()
                                .is_some_and(|(n, g, sub)| *n == node && *g == generation && *sub)
                            {
                                channel.pending = None;
                            }
                            wake = std::mem::take(&mut channel.lost);
                        }
                    }
                    PushKind::SUnsubscribe => {
                        if let Some(channel) = self.channel_of(&mut state, &push.data) {
                            let was_on = channel.on.as_ref() == Some(&node);
                            if was_on {
                                channel.on = None;
                            }
                            match &channel.pending {
                                Some((n, g, false)) if *n == node && *g == generation => {
                                    channel.pending = None;
                                }
                                _ if !was_on => {}
                                _ => {
                                    // Dropped by the server: the slot moved.
                                    tracing::debug!("a shard channel was unsubscribed by the server (slot moved)");
                                    channel.lost = true;
                                    wake = true;
                                    self.nodes.refresh();
                                }
                            }
                        }
                    }
                    PushKind::Disconnection => {
                        wake = lose(&mut state, &node, self.max_reconnect_delay);
                    }
                    _ => {}
                }
            }
            Event::Connected(node, generation, conn) => {
                if let Some(link) = state
                    .links
                    .get_mut(&node)
                    .filter(|l| l.generation == generation)
                {
                    link.conn = Some(conn);
                    link.connecting = false;
                    link.delay = FIRST_RECONNECT_DELAY;
                    tracing::debug!(?node, "sharded release subscription connected");
                }
            }
            Event::Failed(node, generation, error) => {
                if current(&state, &node, generation) {
                    tracing::debug!(?node, error = %lock_core::ErrorChain(&error), "sharded release subscription connection lost; reconnecting");
                    wake = lose(&mut state, &node, self.max_reconnect_delay);
                    self.nodes.refresh();
                }
            }
            Event::Sent(node, generation, result) => {
                if !current(&state, &node, generation) {
                    return false;
                }
                match result {
                    Ok(refused) => {
                        let again = Instant::now() + Duration::from_millis(200);
                        for (slot, subscribe) in &refused {
                            if let Some(channel) = state.channels.get_mut(slot) {
                                if channel.pending == Some((node.clone(), generation, *subscribe)) {
                                    channel.pending = None;
                                    // Refused (a stale slot map, mostly):
                                    // not again before the map is read anew.
                                    channel.not_before = Some(again);
                                }
                            }
                        }
                        if !refused.is_empty() {
                            self.nodes.refresh();
                        }
                    }
                    Err(error) => {
                        tracing::debug!(?node, error = %lock_core::ErrorChain(&error), "sharded release subscription request failed; reconnecting");
                        wake = lose(&mut state, &node, self.max_reconnect_delay);
                    }
                }
            }
        }
        drop(state);
        self.bump();
        wake
    }

    fn channel_of<'s>(&self, state: &'s mut State, data: &[Value]) -> Option<&'s mut Channel> {
        let Some(Value::BulkString(channel)) = data.first() else {
            return None;
        };
        let channel = std::str::from_utf8(channel).ok()?;
        state.channels.get_mut(&key_slot(channel))
    }

    /// Hands a published release to the hub.
    fn deliver(&self, data: &[Value]) {
        if let Some(Value::BulkString(payload)) = data.last() {
            deliver(&self.hub, &self.prefix, payload);
        }
    }
}

/// The connection to `node` is gone, and its subscriptions with it: its
/// channels are to be subscribed again, the connection made again after a
/// backoff. Gives whether a channel was lost.
fn lose(state: &mut State, node: &Node, max_delay: Duration) -> bool {
    let mut lost = false;
    for channel in state.channels.values_mut() {
        let here = channel.on.as_ref() == Some(node)
            || channel.pending.as_ref().is_some_and(|(n, ..)| n == node);
        if here {
            lost |= channel.on.is_some();
            channel.lost |= channel.on.is_some();
            channel.on = None;
            channel.pending = None;
        }
    }
    if let Some(link) = state.links.get_mut(node) {
        if link.conn.take().is_some() {
            // Lost after it worked: try again at once, then back off.
            link.retry_at = Instant::now();
        } else {
            link.retry_at = Instant::now() + link.delay;
            link.delay = (link.delay * 2).min(max_delay);
        }
        link.connecting = false;
        // Events of the lost connection are ignored from now on.
        link.generation = 0;
    }
    lost
}

async fn run(shared: &Arc<Shared>, mut events: mpsc::UnboundedReceiver<Event>) {
    let mut sweep = ticker(SWEEP_INTERVAL.min(shared.health_check_interval));
    let mut health = ticker(shared.health_check_interval);
    health.tick().await;
    let mut maps = shared.nodes.map_changes();
    let mut due: Option<Instant> = None;
    loop {
        let wake_at = due.unwrap_or_else(|| Instant::now() + Duration::from_secs(3600));
        let mut wake = false;
        tokio::select! {
            event = events.recv() => {
                let Some(event) = event else { return };
                wake |= shared.handle(event);
                // Everything that arrived meanwhile, then one reconcile.
                while let Ok(event) = events.try_recv() {
                    wake |= shared.handle(event);
                }
            }
            () = shared.kick.notified() => {}
            _ = sweep.tick() => {}
            _ = health.tick() => shared.ping_all(),
            _ = maps.changed() => {}
            () = tokio::time::sleep_until(wake_at), if due.is_some() => {}
        }
        if wake {
            // Releases may have been missed while a channel was lost.
            shared.hub.notify_all();
        }
        due = shared.reconcile();
    }
}

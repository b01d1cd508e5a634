//! The sharded subscription of a [`RedisClusterBackend`](crate::RedisClusterBackend):
//! one RESP3 cluster connection (one multiplexed connection per node) whose
//! push messages a background task hands to a [`ReleaseHub`].
//!
//! Releases are published with `SPUBLISH` on one shard channel per hash
//! slot, which only the node serving the slot delivers. A waiter's watch is
//! returned once its slot's channel is subscribed (`SSUBSCRIBE`, confirmed).
//! The server drops sharded subscriptions on its own: it pushes
//! `SUNSUBSCRIBE` when a slot moves to another node, and a node that dies
//! takes its subscriptions along (the client pushes a disconnection). Then
//! the task wakes every watch (a release may have been missed), subscribes
//! the channel again where the slot now lives (following `MOVED`), and wakes
//! every watch once more when that is confirmed. When that fails, or a
//! health-check `PING` of the masters fails, it makes a new connection
//! (reading the topology afresh), with backoff. Waiters poll on their retry
//! timer in the meantime, so a missed release costs at most `retry_delay`.
//!
//! Requests on this connection go one at a time, one channel each: a
//! `SUNSUBSCRIBE` pushed by the server looks like the reply to a request in
//! flight to the `redis` crate, so every reply is checked, and one that is
//! not the expected answer replaces the connection.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use lock_core::{BackendError, BackendErrorKind, ReleaseHub, ReleaseWatch};
use redis::cluster::{ClusterClient, ClusterConfig};
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{MultipleNodeRoutingInfo, ResponsePolicy, RoutingInfo};
use redis::{PushInfo, PushKind, Value};
use tokio::sync::{mpsc, oneshot, watch, Notify};
use tokio::time::Instant;

use crate::cluster::slot_channel;
use crate::slot::key_slot;
use redis::cluster_routing::{Route, SingleNodeRoutingInfo, SlotAddr};
use redis::{ErrorKind, RedisError};

#[derive(Clone)]
enum State {
    Connecting,
    /// The connection of this generation is up.
    Up(u64, ClusterConnection),
    Down(BackendError),
}

struct Shared {
    client: ClusterClient,
    prefix: String,
    hub: ReleaseHub,
    timeout: Duration,
    health_check_interval: Duration,
    max_reconnect_delay: Duration,
    state: watch::Sender<State>,
    /// The generation of the connection that is up, 0 when none is.
    live: AtomicU64,
    /// Every slot a waiter needed, and whether its channel is subscribed on
    /// the live connection. Slots are never forgotten: at most 16384.
    slots: Mutex<HashMap<u16, bool>>,
    /// One request at a time on the connection.
    commands: tokio::sync::Mutex<()>,
    /// A watch found the connection broken: the generation to replace.
    replace: AtomicU64,
    kick: Notify,
}

pub(crate) struct ShardedSubscription {
    shared: Arc<Shared>,
    /// Taken by the first watch, which starts the task. The task ends when
    /// the sender half (kept here) is dropped with the backend.
    start: Mutex<Option<oneshot::Receiver<()>>>,
    _alive: oneshot::Sender<()>,
}

impl ShardedSubscription {
    pub(crate) fn new(
        infos: &[redis::ConnectionInfo],
        trust: &crate::tls::Trust,
        config: &crate::RedisConfig,
    ) -> Result<Self, crate::SetupError> {
        let builder = redis::cluster::ClusterClientBuilder::new(infos.to_vec())
            .retries(0)
            .use_protocol(redis::ProtocolVersion::RESP3)
            .connection_timeout(config.step_timeout)
            .response_timeout(config.step_timeout);
        #[cfg(feature = "tls")]
        let builder = match trust.certificates() {
            Some(certificates) => builder.certs(certificates.clone()),
            None => builder,
        };
        #[cfg(not(feature = "tls"))]
        let _ = trust;
        let client = builder.build().map_err(crate::SetupError::InvalidUrl)?;
        let (alive, start) = oneshot::channel();
        let (state, _) = watch::channel(State::Connecting);
        Ok(Self {
            shared: Arc::new(Shared {
                client,
                prefix: config.prefix.clone(),
                hub: ReleaseHub::new(),
                timeout: config.step_timeout,
                health_check_interval: config.health_check_interval,
                max_reconnect_delay: config.max_reconnect_delay,
                state,
                live: AtomicU64::new(0),
                slots: Mutex::new(HashMap::new()),
                commands: tokio::sync::Mutex::new(()),
                replace: AtomicU64::new(0),
                kick: Notify::new(),
            }),
            start: Mutex::new(Some(start)),
            _alive: alive,
        })
    }

    pub(crate) fn stats(&self) -> crate::SubscriptionStats {
        crate::SubscriptionStats::default()
    }

    pub(crate) fn is_subscribed(&self) -> bool {
        matches!(*self.shared.state.borrow(), State::Up(..))
    }

    /// A watch on `key` (without prefix) whose lock key is in `slot`,
    /// returned once the slot's channel is subscribed.
    pub(crate) async fn watch(
        &self,
        _nodes: &crate::cluster_nodes::ClusterNodes,
        key: &str,
        slot: u16,
    ) -> Result<ReleaseWatch, BackendError> {
        // The watch first: a release from now on either reaches it, or is
        // covered by the wake-up of every watch after a resubscription.
        let watch = self.shared.hub.watch(key);
        self.shared.want(slot);
        self.start_task();
        let deadline = Instant::now() + self.shared.timeout;
        let timed_out = || BackendError::timeout("subscribing", self.shared.timeout);
        let mut state = self.shared.state.subscribe();
        let (generation, conn) = {
            let settled = tokio::time::timeout_at(
                deadline,
                state.wait_for(|s| !matches!(s, State::Connecting)),
            )
            .await
            .map_err(|_| timed_out())?
            .map_err(|_| {
                BackendError::message(BackendErrorKind::Request, "the subscription task has ended")
            })?;
            match &*settled {
                State::Up(generation, conn) => (*generation, conn.clone()),
                State::Down(error) => return Err(error.clone()),
                State::Connecting => return Err(timed_out()),
            }
        };
        tokio::time::timeout_at(deadline, self.shared.subscribe(generation, conn, slot))
            .await
            .map_err(|_| timed_out())??;
        Ok(watch)
    }

    fn start_task(&self) {
        let start = self
            .start
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(dropped) = start {
            let shared = Arc::clone(&self.shared);
            tokio::spawn(async move {
                tokio::select! {
                    _ = dropped => {}
                    () = run(&shared) => {}
                }
                tracing::debug!("sharded release subscription ended");
            });
        }
    }
}

impl Shared {
    fn slots(&self) -> std::sync::MutexGuard<'_, HashMap<u16, bool>> {
        self.slots.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn want(&self, slot: u16) {
        self.slots().entry(slot).or_insert(false);
    }

    /// Marks every slot as not subscribed.
    fn forget_all(&self) {
        for subscribed in self.slots().values_mut() {
            *subscribed = false;
        }
    }

    /// `SSUBSCRIBE` of `slot`'s channel on the connection of `generation`,
    /// unless it is subscribed already. A broken connection or an answer
    /// that is not the confirmation asks the task to replace the connection.
    async fn subscribe(
        &self,
        generation: u64,
        mut conn: ClusterConnection,
        slot: u16,
    ) -> Result<(), BackendError> {
        let _one_at_a_time = self.commands.lock().await;
        if self.slots().get(&slot) == Some(&true) && self.live.load(Ordering::Acquire) == generation
        {
            return Ok(());
        }
        let channel = slot_channel(slot, &self.prefix);
        let mut cmd = redis::cmd("SSUBSCRIBE");
        cmd.arg(&channel);
        let answer = query_slot(&mut conn, &cmd, slot).await;
        let confirmed = match &answer {
            Ok(Value::Push {
                kind: PushKind::SSubscribe,
                data,
            }) => data
                .first()
                .is_some_and(|c| is_bytes(c, channel.as_bytes())),
            _ => false,
        };
        if confirmed {
            if self.live.load(Ordering::Acquire) == generation {
                self.slots().insert(slot, true);
            }
            return Ok(());
        }
        let error = match answer {
            Err(e) => map_cluster_error(e),
            Ok(other) => BackendError::message(
                BackendErrorKind::Protocol,
                format!("unexpected answer to SSUBSCRIBE {channel}: {other:?}"),
            ),
        };
        if error.kind() == BackendErrorKind::Protocol || is_broken(&error) {
            self.replace.store(generation, Ordering::Release);
            self.kick.notify_one();
        }
        Err(error)
    }

    /// Subscribes every wanted slot that is not subscribed.
    async fn resubscribe(
        &self,
        generation: u64,
        conn: &ClusterConnection,
    ) -> Result<(), BackendError> {
        let pending: Vec<u16> = self
            .slots()
            .iter()
            .filter(|(_, subscribed)| !**subscribed)
            .map(|(slot, _)| *slot)
            .collect();
        for slot in pending {
            tokio::time::timeout(self.timeout, self.subscribe(generation, conn.clone(), slot))
                .await
                .map_err(|_| BackendError::timeout("subscribing", self.timeout))??;
        }
        Ok(())
    }

    /// `PING` to every master, one request at a time.
    async fn ping(&self, conn: &mut ClusterConnection) -> Result<(), BackendError> {
        let _one_at_a_time = self.commands.lock().await;
        let routing = RoutingInfo::MultiNode((
            MultipleNodeRoutingInfo::AllMasters,
            Some(ResponsePolicy::AllSucceeded),
        ));
        let answer = tokio::time::timeout(
            self.timeout,
            conn.route_command(&redis::cmd("PING"), routing),
        )
        .await
        .map_err(|_| BackendError::timeout("pinging the subscription", self.timeout))?
        .map_err(map_cluster_error)?;
        match answer {
            Value::SimpleString(pong) if pong == "PONG" => Ok(()),
            other => Err(BackendError::message(
                BackendErrorKind::Protocol,
                format!("unexpected answer to PING on the subscription: {other:?}"),
            )),
        }
    }

    /// Hands a published release to the hub.
    fn deliver(&self, data: &[Value]) {
        let Some(Value::BulkString(payload)) = data.last() else {
            return;
        };
        match std::str::from_utf8(payload) {
            Ok(key) => {
                if let Some(key) = key.strip_prefix(self.prefix.as_str()) {
                    self.hub.notify(key);
                }
            }
            Err(_) => tracing::trace!("release message is not UTF-8; ignored"),
        }
    }

    /// A `SUNSUBSCRIBE` the server pushed: the slot of the channel moved.
    /// Gives whether it was a slot a waiter needs.
    fn dropped(&self, data: &[Value]) -> bool {
        let Some(Value::BulkString(channel)) = data.first() else {
            return false;
        };
        let Ok(channel) = std::str::from_utf8(channel) else {
            return false;
        };
        let slot = key_slot(channel);
        match self.slots().get_mut(&slot) {
            Some(subscribed) => {
                *subscribed = false;
                true
            }
            None => false,
        }
    }
}

fn is_bytes(value: &Value, expected: &[u8]) -> bool {
    match value {
        Value::BulkString(bytes) => bytes == expected,
        Value::SimpleString(text) => text.as_bytes() == expected,
        _ => false,
    }
}

async fn connect(
    shared: &Shared,
) -> Result<(ClusterConnection, mpsc::UnboundedReceiver<PushInfo>), BackendError> {
    let (pushes, received) = mpsc::unbounded_channel();
    let config = ClusterConfig::new()
        .set_connection_timeout(shared.timeout)
        .set_response_timeout(shared.timeout)
        .set_push_sender(pushes);
    let conn = tokio::time::timeout(
        shared.timeout,
        shared.client.get_async_connection_with_config(config),
    )
    .await
    .map_err(|_| BackendError::timeout("subscribing", shared.timeout))?
    .map_err(BackendError::unavailable)?;
    Ok((conn, received))
}

async fn run(shared: &Shared) {
    let first_delay = Duration::from_millis(50);
    let mut delay = first_delay;
    let mut generation = 0;
    let mut first = true;
    loop {
        let attempt = async {
            let (conn, pushes) = connect(shared).await?;
            generation += 1;
            shared.forget_all();
            shared.live.store(generation, Ordering::Release);
            shared
                .state
                .send_replace(State::Up(generation, conn.clone()));
            shared.resubscribe(generation, &conn).await?;
            Ok::<_, BackendError>((conn, pushes))
        };
        match attempt.await {
            Ok((conn, pushes)) => {
                delay = first_delay;
                if !first {
                    // Releases may have been missed while not subscribed.
                    shared.hub.notify_all();
                }
                first = false;
                tracing::debug!(generation, "sharded release subscription in place");
                let why = listen(shared, generation, conn, pushes).await;
                tracing::debug!(error = %why, "sharded release subscription lost; reconnecting");
                shared.live.store(0, Ordering::Release);
                shared.forget_all();
                shared.state.send_replace(State::Down(why));
                shared.hub.notify_all();
            }
            Err(error) => {
                tracing::debug!(%error, ?delay, "sharded release subscription failed; retrying");
                shared.live.store(0, Ordering::Release);
                shared.forget_all();
                shared.state.send_replace(State::Down(error));
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(shared.max_reconnect_delay);
            }
        }
    }
}

/// Dispatches push messages until the connection must be replaced, and
/// says why.
async fn listen(
    shared: &Shared,
    generation: u64,
    mut conn: ClusterConnection,
    mut pushes: mpsc::UnboundedReceiver<PushInfo>,
) -> BackendError {
    let mut health = tokio::time::interval(shared.health_check_interval);
    health.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    health.tick().await;
    // When to subscribe again the slots the server dropped.
    let mut again: Option<Instant> = None;
    loop {
        let resubscribe_at = again.unwrap_or_else(|| Instant::now() + Duration::from_secs(3600));
        tokio::select! {
            push = pushes.recv() => {
                let Some(push) = push else {
                    return BackendError::message(
                        BackendErrorKind::Request,
                        "the subscription connection closed",
                    );
                };
                match push.kind {
                    PushKind::SMessage => shared.deliver(&push.data),
                    PushKind::SUnsubscribe if shared.dropped(&push.data) => {
                        tracing::debug!("a shard channel was unsubscribed by the server (slot moved)");
                        shared.hub.notify_all();
                        again = Some(Instant::now());
                    }
                    PushKind::Disconnection => {
                        // A node connection closed: its subscriptions are gone.
                        shared.forget_all();
                        shared.hub.notify_all();
                        again = Some(Instant::now());
                    }
                    _ => {}
                }
            }
            _ = health.tick() => {
                if let Err(error) = shared.ping(&mut conn).await {
                    return error;
                }
            }
            () = tokio::time::sleep_until(resubscribe_at), if again.is_some() => {
                again = None;
                if let Err(error) = shared.resubscribe(generation, &conn).await {
                    return error;
                }
                // Releases made before the new subscription were missed.
                shared.hub.notify_all();
            }
            () = shared.kick.notified() => {
                if shared.replace.load(Ordering::Acquire) == generation {
                    return BackendError::message(
                        BackendErrorKind::Protocol,
                        "the subscription connection gave an unexpected answer",
                    );
                }
            }
        }
    }
}

/// Where one request goes.
#[derive(Clone)]
enum Target {
    /// The master of a slot, as the connection's slot map says.
    Slot(u16),
    /// A node named by an `ASK` answer: `ASKING` first, on the same connection.
    Asking(SingleNodeRoutingInfo),
}

fn by_address(addr: &str) -> Option<SingleNodeRoutingInfo> {
    let (host, port) = addr.rsplit_once(':')?;
    Some(SingleNodeRoutingInfo::ByAddress {
        host: host.to_owned(),
        port: port.parse().ok()?,
    })
}

async fn send(
    conn: &mut ClusterConnection,
    cmd: &redis::Cmd,
    target: &Target,
) -> redis::RedisResult<Value> {
    match target {
        Target::Slot(slot) => {
            let route = Route::new(*slot, SlotAddr::Master);
            conn.route_command(
                cmd,
                RoutingInfo::SingleNode(SingleNodeRoutingInfo::SpecificNode(route)),
            )
            .await
        }
        Target::Asking(node) => {
            let mut pipe = redis::pipe();
            pipe.cmd("ASKING").add_command(cmd.clone());
            let mut answers = conn.route_pipeline(&pipe, 1, 1, node.clone()).await?;
            answers.pop().ok_or_else(|| {
                RedisError::from((ErrorKind::ResponseError, "no answer after ASKING"))
            })
        }
    }
}

/// `cmd` on the master of `slot`, following `MOVED` / `ASK` answers.
async fn query_slot(
    conn: &mut ClusterConnection,
    cmd: &redis::Cmd,
    slot: u16,
) -> redis::RedisResult<Value> {
    let mut target = Target::Slot(slot);
    let mut redirects = 0;
    loop {
        match send(conn, cmd, &target).await {
            Err(e) if is_redirect(&e) && redirects < MAX_REDIRECTS => {
                redirects += 1;
                target = redirected(e)?;
            }
            answer => return answer,
        }
    }
}

/// Where a `MOVED` or `ASK` answer points. After `MOVED` the connection
/// reads the topology again before it sends anything else, so the request
/// goes by slot once more; after `ASK` (a slot being migrated) it goes to
/// the node named, after `ASKING`.
fn redirected(error: RedisError) -> redis::RedisResult<Target> {
    match error.redirect_node() {
        Some((_, slot)) if error.kind() == ErrorKind::Moved => Ok(Target::Slot(slot)),
        Some((addr, _)) => match by_address(addr) {
            Some(node) => Ok(Target::Asking(node)),
            None => Err(error),
        },
        None => Err(error),
    }
}

fn is_redirect(error: &RedisError) -> bool {
    matches!(error.kind(), ErrorKind::Moved | ErrorKind::Ask)
}

fn map_cluster_error(error: RedisError) -> BackendError {
    if error.is_connection_refusal() || error.kind() == ErrorKind::ClusterConnectionNotFound {
        crate::config::connection_error(error)
    } else {
        crate::backend::map_redis_error(error)
    }
}

fn is_broken(error: &BackendError) -> bool {
    error.is_timeout()
        || error
            .inner()
            .downcast_ref::<RedisError>()
            .is_none_or(crate::cluster_nodes::is_broken)
}

const MAX_REDIRECTS: usize = 3;

/// What the sharded release subscription of a
/// [`RedisClusterBackend`](crate::RedisClusterBackend) sent, from
/// [`subscription_stats`](crate::RedisClusterBackend::subscription_stats).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct SubscriptionStats {
    /// Subscription requests sent: each one write to one node, carrying
    /// one `SSUBSCRIBE` per channel it subscribes.
    pub subscribe_requests: u64,
    /// Shard channels unsubscribed with `SUNSUBSCRIBE` because no waiter
    /// needed them any more.
    pub unsubscribed_channels: u64,
    /// Shard channels subscribed now.
    pub subscribed_channels: usize,
}

//! The one pub/sub connection of a backend, shared by all its waiters.
//!
//! A background task holds the connection, subscribed to the release
//! channel and to the grant channel of each node that queued through the
//! backend, and hands each message (a released Redis key, or a grant) to
//! a [`ReleaseHub`]. When the connection drops or stops answering pings,
//! the task reconnects with backoff, resubscribes and wakes every watch,
//! since it may have missed releases in between. It ends when the backend
//! is dropped.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use futures_util::StreamExt;
use lock_core::{BackendError, BackendErrorKind, ReleaseHub, ReleaseWatch};
use tokio::sync::watch;

use crate::plumbing::driver::Driver;
use crate::plumbing::errors::{is_key_refused, map_redis_error};
use crate::plumbing::task::{deliver, ticker, OnFirstUse, FIRST_RECONNECT_DELAY};
use crate::plumbing::timeout::within;

/// Where the subscription stands.
#[derive(Clone, Debug)]
enum State {
    /// The first connection is being made.
    Connecting,
    /// Subscribed: every release published from now on reaches the hub.
    Subscribed,
    /// Not subscribed; the task is trying again. The error says why.
    Down(BackendError),
}

/// Where the subscription connection goes.
pub(crate) enum PubSubTarget {
    /// One server.
    Client(redis::Client),
    /// The primary the Sentinels name at each (re)connection.
    Sentinel(Arc<crate::sentinel::SentinelSource>),
}

impl PubSubTarget {
    /// For the Sentinel's primary: changes each time a majority of the
    /// Sentinels names another primary, and the subscription must follow.
    fn switches(&self) -> Option<watch::Receiver<u64>> {
        match self {
            Self::Client(_) => None,
            Self::Sentinel(source) => Some(source.switch_changes()),
        }
    }

    async fn pubsub(&self) -> Result<redis::aio::PubSub, BackendError> {
        match self {
            Self::Client(client) => client.get_async_pubsub().await.map_err(map_redis_error),
            Self::Sentinel(source) => source
                .master()
                .await?
                .get_async_pubsub()
                .await
                .map_err(map_redis_error),
        }
    }
}

/// The most nodes whose grant channels one backend listens to: a
/// backend shared by lockers made and dropped in a loop (each with a drawn
/// node id) would otherwise subscribe without end. The grants of a node
/// beyond it come on the release channel, as to a node of an earlier
/// version.
const MAX_GRANT_CHANNELS: usize = 256;

/// The grant channels of the nodes that queue through the backend \[F4\].
struct Grants {
    /// The current connection's sink while it is subscribed: a node that
    /// queues for the first time subscribes its channel on it.
    sink: Option<redis::aio::PubSubSink>,
}

struct Shared {
    client: PubSubTarget,
    channel: String,
    prefix: String,
    /// The start of every grant channel, before the node id.
    grant_prefix: String,
    /// The node ids whose grant channels are subscribed (or refused), each
    /// time the connection is made.
    nodes: Mutex<HashSet<Box<str>>>,
    /// Held while a grant channel is subscribed, so that a node added
    /// while the connection is made is subscribed by one or the other.
    grants: tokio::sync::Mutex<Grants>,
    /// Whether the ACL refused a grant channel (logged once).
    grants_refused: AtomicBool,
    hub: ReleaseHub,
    state: watch::Sender<State>,
    /// How many times the subscription was made: a watch woken meanwhile
    /// may have been woken by a resubscription, not a release.
    made: AtomicU64,
    /// How many times a (re)subscription failed.
    failed: AtomicU64,
    timeout: Duration,
    health_check_interval: Duration,
    max_reconnect_delay: Duration,
}

pub(crate) struct Subscription {
    shared: Arc<Shared>,
    /// Where the task runs, and so where its connection is driven.
    driver: Driver,
    /// Started by the first watch; ends with the backend.
    task: OnFirstUse<Arc<Shared>>,
}

impl Subscription {
    pub(crate) fn new(
        client: PubSubTarget,
        channel: String,
        prefix: String,
        config: &crate::RedisConfig,
    ) -> Self {
        let (state, _) = watch::channel(State::Connecting);
        let shared = Arc::new(Shared {
            client,
            channel,
            grant_prefix: format!("{prefix}{}", crate::GRANT_CHANNEL),
            prefix,
            nodes: Mutex::new(HashSet::new()),
            grants: tokio::sync::Mutex::new(Grants { sink: None }),
            grants_refused: AtomicBool::new(false),
            hub: ReleaseHub::new(),
            state,
            made: AtomicU64::new(0),
            failed: AtomicU64::new(0),
            timeout: config.step_timeout,
            health_check_interval: config.health_check_interval,
            max_reconnect_delay: config.max_reconnect_delay,
        });
        Self {
            task: OnFirstUse::new(Arc::clone(&shared)),
            shared,
            driver: Driver::default(),
        }
    }

    /// How many times the subscription was made so far: when it changes
    /// while a watch waits, the watch may be woken by the resubscription
    /// (which wakes every watch) rather than by a release.
    pub(crate) fn times_made(&self) -> u64 {
        self.shared.made.load(Ordering::Acquire)
    }

    /// How many times a (re)subscription failed so far.
    pub(crate) fn times_failed(&self) -> u64 {
        self.shared.failed.load(Ordering::Acquire)
    }

    /// How many keys somebody watches.
    pub(crate) fn watched_keys(&self) -> usize {
        self.shared.hub.watched_keys()
    }

    /// Whether the subscription is in place now.
    pub(crate) fn is_subscribed(&self) -> bool {
        matches!(*self.shared.state.borrow(), State::Subscribed)
    }

    /// A watch on `key` (without prefix), returned once the subscription is
    /// confirmed, so that no release published after this returns is missed.
    pub(crate) async fn watch(&self, key: &str) -> Result<ReleaseWatch, BackendError> {
        // The watch first: a release between now and the confirmation below
        // either reaches it over the subscription, or is covered by the
        // wake-up of every watch after a resubscription.
        let watch = self.shared.hub.watch(key);
        self.start_task();
        let mut state = self.shared.state.subscribe();
        let settled = tokio::time::timeout(
            self.shared.timeout,
            state.wait_for(|s| !matches!(s, State::Connecting)),
        )
        .await;
        match settled {
            Ok(Ok(s)) => match &*s {
                State::Subscribed => Ok(watch),
                State::Down(error) => Err(error.clone()),
                State::Connecting => Err(BackendError::timeout("subscribing", self.shared.timeout)),
            },
            Ok(Err(_)) => Err(BackendError::message(
                BackendErrorKind::Request,
                "the subscription task has ended",
            )),
            Err(_) => Err(BackendError::timeout("subscribing", self.shared.timeout)),
        }
    }

    /// Subscribes the grant channel of `node` (once per node, and again at
    /// each reconnection), so that a grant to one of its waiters comes to
    /// this backend alone \[F4\]; returns once the server confirmed it, or
    /// at once when the connection is not up (it is subscribed when the
    /// connection is made). Called before a node's queued attempt is
    /// sent. Never fails: where the channel is not subscribed (refused by
    /// the ACL, the connection down, too many nodes) the release script
    /// finds nobody listening on it and publishes the grant on the release
    /// channel, as before.
    pub(crate) async fn hear_grants_of(&self, node: &str) {
        let shared = &self.shared;
        if shared.knows(node) {
            return;
        }
        let mut grants = shared.grants.lock().await;
        {
            let mut nodes = shared.nodes.lock().unwrap_or_else(PoisonError::into_inner);
            if nodes.contains(node) || nodes.len() >= MAX_GRANT_CHANNELS {
                return;
            }
            nodes.insert(node.into());
        }
        if let Some(sink) = &mut grants.sink {
            if let Err(error) = subscribe_grants(shared, sink, node).await {
                // The task finds the connection broken and makes it again,
                // subscribing this node's channel then.
                tracing::debug!(error = %lock_core::ErrorChain(&error), "grant channel not subscribed");
            }
        }
    }

    fn start_task(&self) {
        self.task.start(&self.driver, |shared| {
            let ended = Arc::clone(&shared);
            (async move { run(&shared).await }, move || {
                tracing::debug!(channel = %ended.channel, "release subscription ended");
            })
        });
    }
}

impl Shared {
    fn knows(&self, node: &str) -> bool {
        self.nodes
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .contains(node)
    }
}

/// Subscribes the grant channel of `node` on `sink`. The ACL's refusal is
/// no error: the node's grants then come on the release channel, and the
/// log says so once \[F6\].
async fn subscribe_grants(
    shared: &Shared,
    sink: &mut redis::aio::PubSubSink,
    node: &str,
) -> Result<(), BackendError> {
    let channel = format!("{}{node}", shared.grant_prefix);
    let subscribe = async { sink.subscribe(&channel).await.map_err(map_redis_error) };
    match within("subscribing a grant channel", shared.timeout, subscribe).await {
        Err(error) if is_key_refused(&error) => {
            if !shared.grants_refused.swap(true, Ordering::Relaxed) {
                tracing::warn!(error = %lock_core::ErrorChain(&error), %channel, "the ACL refuses the grant channel; this node's grants come on the release channel, which wakes every node (add `&{}*` to the user: see lock-redis's README)", shared.grant_prefix);
            }
            Ok(())
        }
        answer => answer,
    }
}

/// Subscribes the grant channel of every node known so far on `sink`, and
/// keeps `sink` for the nodes that come later.
async fn subscribe_all_grants(
    shared: &Shared,
    sink: &redis::aio::PubSubSink,
) -> Result<(), BackendError> {
    let mut grants = shared.grants.lock().await;
    let nodes: Vec<Box<str>> = shared
        .nodes
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .iter()
        .cloned()
        .collect();
    let mut own = sink.clone();
    for node in &nodes {
        subscribe_grants(shared, &mut own, node).await?;
    }
    grants.sink = Some(own);
    Ok(())
}

async fn run(shared: &Shared) {
    let mut delay = FIRST_RECONNECT_DELAY;
    let mut first = true;
    loop {
        // Before the connection is made: a switch meanwhile is seen.
        let switches = shared.client.switches();
        let subscribed = match subscribe(shared).await {
            Ok(pubsub) => {
                let (sink, messages) = pubsub.split();
                subscribe_all_grants(shared, &sink)
                    .await
                    .map(|()| (sink, messages))
            }
            Err(error) => Err(error),
        };
        match subscribed {
            Ok(pubsub) => {
                delay = FIRST_RECONNECT_DELAY;
                shared.made.fetch_add(1, Ordering::AcqRel);
                shared.state.send_replace(State::Subscribed);
                if !first {
                    // Releases may have been missed while not subscribed.
                    // (Before the first subscription, no watch has been
                    // handed out yet: each caller tries again on return.)
                    shared.hub.notify_all();
                }
                first = false;
                tracing::debug!(channel = %shared.channel, "release subscription in place");
                let why = listen(shared, pubsub, switches).await;
                shared.grants.lock().await.sink = None;
                tracing::debug!(error = %lock_core::ErrorChain(&why), "release subscription lost; reconnecting");
                shared.state.send_replace(State::Down(why));
            }
            Err(error) => {
                tracing::debug!(error = %lock_core::ErrorChain(&error), ?delay, "release subscription failed; retrying");
                shared.state.send_replace(State::Down(error));
                shared.failed.fetch_add(1, Ordering::AcqRel);
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(shared.max_reconnect_delay);
            }
        }
    }
}

async fn subscribe(shared: &Shared) -> Result<redis::aio::PubSub, BackendError> {
    let connect = async {
        let mut pubsub = shared.client.pubsub().await?;
        pubsub
            .subscribe(&shared.channel)
            .await
            .map_err(map_redis_error)?;
        Ok::<_, BackendError>(pubsub)
    };
    within("subscribing", shared.timeout, connect).await
}

/// Dispatches messages until the connection drops or fails a ping, or
/// `switches` changes (the Sentinels named another primary), and says why
/// it stopped.
async fn listen(
    shared: &Shared,
    (mut sink, mut messages): (redis::aio::PubSubSink, redis::aio::PubSubStream),
    mut switches: Option<watch::Receiver<u64>>,
) -> BackendError {
    let mut health = ticker(shared.health_check_interval);
    health.tick().await;
    loop {
        tokio::select! {
            Some(()) = switched(&mut switches) => {
                return BackendError::message(
                    BackendErrorKind::Request,
                    "a majority of the Sentinels named another primary",
                );
            }
            message = messages.next() => {
                let Some(message) = message else {
                    return BackendError::message(
                        BackendErrorKind::Request,
                        "the release subscription connection closed",
                    );
                };
                deliver(&shared.hub, &shared.prefix, message.get_payload_bytes());
            }
            _ = health.tick() => {
                let ping = async { sink.ping::<redis::Value>().await.map_err(map_redis_error) };
                if let Err(error) = within("pinging the subscription", shared.timeout, ping).await {
                    return error;
                }
            }
        }
    }
}

/// When `switches` changes; never without one (or once its sender is gone).
async fn switched(switches: &mut Option<watch::Receiver<u64>>) -> Option<()> {
    match switches {
        Some(switches) => switches.changed().await.ok(),
        None => std::future::pending().await,
    }
}

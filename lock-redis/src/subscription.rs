//! The one pub/sub connection of a backend, shared by all its waiters.
//!
//! A background task holds the connection, subscribed to the release
//! channel, and hands each message (a released Redis key) to a
//! [`ReleaseHub`]. When the connection drops or stops answering pings, the
//! task reconnects with backoff, resubscribes and wakes every watch, since
//! it may have missed releases in between. It ends when the backend is
//! dropped.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use lock_core::{BackendError, BackendErrorKind, ReleaseHub, ReleaseWatch};
use tokio::sync::watch;

use crate::plumbing::driver::Driver;
use crate::plumbing::errors::map_redis_error;
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

struct Shared {
    client: PubSubTarget,
    channel: String,
    prefix: String,
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
            prefix,
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

    fn start_task(&self) {
        self.task.start(&self.driver, |shared| {
            let ended = Arc::clone(&shared);
            (async move { run(&shared).await }, move || {
                tracing::debug!(channel = %ended.channel, "release subscription ended");
            })
        });
    }
}

async fn run(shared: &Shared) {
    let mut delay = FIRST_RECONNECT_DELAY;
    let mut first = true;
    loop {
        // Before the connection is made: a switch meanwhile is seen.
        let switches = shared.client.switches();
        match subscribe(shared).await {
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
    pubsub: redis::aio::PubSub,
    mut switches: Option<watch::Receiver<u64>>,
) -> BackendError {
    let (mut sink, mut messages) = pubsub.split();
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

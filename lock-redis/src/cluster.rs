//! `RedisClusterBackend`: the lock steps on a Redis Cluster, each script
//! sent to the master of its key's hash slot on that master's own
//! connection (see [`crate::cluster_nodes`]), concurrent steps batched per
//! master (see [`crate::cluster_batch`]), and releases announced by
//! `SPUBLISH` on a shard channel of the key's slot.
//!
//! Every script call of the cluster backend is built in this file, with
//! its keys and arguments (the scripts: [`crate::plumbing::scripts`]).

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use lock_core::{
    async_trait, AcquireOutcome, BackendError, BackendErrorKind, Capabilities, ExtendOutcome,
    ExtendRequest, Hold, Lease, LockBackend, OwnerToken, QueueTerms, ReleaseOutcome, ReleaseWatch,
    MAX_KEY_LEN,
};
use redis::{ErrorKind, RedisError, Value};

use crate::backend::CHANNEL;
use crate::cluster_batch::{Batchers, Kind};
use crate::cluster_nodes::{ClusterNodes, Lane, Node};
use crate::cluster_subscription::ShardedSubscription;
use crate::config::{connect_error, RedisConfig, SetupError};
use crate::plumbing::errors::{is_key_refused, map_redis_error};
use crate::plumbing::queue::{queue_keys, queued_outcome, QueueRights};
use crate::plumbing::redact;
use crate::plumbing::scripts::{acquire_outcome, extend_outcome, release_outcome, ttl_ms};
use crate::plumbing::scripts::{
    Lua, ACQUIRE, ACQUIRE_QUEUED, EXTEND, HOLD, LEAVE_QUEUE, RELEASE, RELEASE_SHARDED,
};
use crate::plumbing::timeout::within;
use crate::slot::{fence_key, kept_key, key_slot, slot_tag};
use crate::tls::Trust;

/// A lock backend on a Redis Cluster: the same keys, values, scripts and
/// fencing counters as [`RedisBackend`](crate::RedisBackend), each step
/// sent to the master of its key's slot on that master's own connection,
/// and release notifications over sharded pub/sub (`SPUBLISH` /
/// `SSUBSCRIBE`, Redis 7.0 or later).
///
/// Cheap to clone; clones share the node connections and the
/// subscription, which ends when the last clone is dropped.
#[derive(Clone)]
pub struct RedisClusterBackend {
    inner: Arc<Inner>,
}

struct Inner {
    nodes: ClusterNodes,
    /// `host:port` of the nodes the backend was given, for `Debug` and errors.
    given: Vec<String>,
    has_password: bool,
    config: RedisConfig,
    /// Acquisitions and releases waiting to go out together, per master.
    batchers: Batchers,
    subscription: Option<ShardedSubscription>,
    /// Whether releases may touch the fair queue's keys \[F6\].
    queue_rights: QueueRights,
}

impl RedisClusterBackend {
    /// A backend on the cluster whose nodes (one or more; the others are
    /// found with `CLUSTER SLOTS`) are `nodes`, with the default
    /// [`RedisConfig`]. Every node is reached with the credentials,
    /// protocol and TLS settings of the first. Nothing connects until the
    /// first call.
    ///
    /// The backend keeps one connection per node rather than taking a
    /// `redis::cluster::ClusterClient`: see the crate docs ("Redis
    /// Cluster") for why.
    ///
    /// # Errors
    ///
    /// [`SetupError::NoClusterNodes`] for an empty list, and
    /// [`SetupError::InvalidUrl`] for a node that is not a TCP address.
    pub fn new(nodes: impl IntoIterator<Item = redis::ConnectionInfo>) -> Result<Self, SetupError> {
        Self::with_config(nodes, RedisConfig::default())
    }

    /// [`new`](Self::new) with `config`.
    ///
    /// # Errors
    ///
    /// As [`new`](Self::new), and [`SetupError::InvalidConfig`] when a
    /// field of `config` is out of range.
    pub fn with_config(
        nodes: impl IntoIterator<Item = redis::ConnectionInfo>,
        config: RedisConfig,
    ) -> Result<Self, SetupError> {
        validate(&config)?;
        let infos: Vec<_> = nodes.into_iter().collect();
        if infos.is_empty() {
            return Err(SetupError::NoClusterNodes);
        }
        Self::from_infos(infos, &Trust::system(), config)
    }

    /// A backend from the URLs of one or more nodes of the cluster
    /// (`redis://:password@host:port`); the others are found with
    /// `CLUSTER SLOTS`.
    ///
    /// # Errors
    ///
    /// [`SetupError::NoClusterNodes`] for an empty list, and
    /// [`SetupError::InvalidUrl`] when a URL does not parse. Nothing
    /// connects yet.
    pub fn from_urls<T: AsRef<str>>(urls: impl IntoIterator<Item = T>) -> Result<Self, SetupError> {
        Self::from_urls_with(urls, RedisConfig::default())
    }

    /// [`from_urls`](Self::from_urls) with `config`.
    ///
    /// # Errors
    ///
    /// As [`from_urls`](Self::from_urls), and [`SetupError::InvalidConfig`].
    pub fn from_urls_with<T: AsRef<str>>(
        urls: impl IntoIterator<Item = T>,
        config: RedisConfig,
    ) -> Result<Self, SetupError> {
        validate(&config)?;
        Self::from_infos(parse_urls(urls)?, &Trust::system(), config)
    }

    /// [`from_urls_with`](Self::from_urls_with) for `rediss://` URLs,
    /// trusting `certificates` instead of the system's roots: a private
    /// CA's certificate in PEM (`root_cert`), and a client certificate for
    /// nodes that ask for one (`client_tls`). Every node, also those found
    /// later, is reached over TLS with them.
    ///
    /// # Errors
    ///
    /// As [`from_urls_with`](Self::from_urls_with), and [`SetupError::Tls`]
    /// for `redis://` URLs or a PEM that does not parse.
    #[cfg(feature = "tls")]
    pub fn from_urls_with_tls<T: AsRef<str>>(
        urls: impl IntoIterator<Item = T>,
        certificates: redis::TlsCertificates,
        config: RedisConfig,
    ) -> Result<Self, SetupError> {
        validate(&config)?;
        let trust = Trust::custom(certificates);
        Self::from_infos(trusted(parse_urls(urls)?, &trust)?, &trust, config)
    }

    fn from_infos(
        infos: Vec<redis::ConnectionInfo>,
        trust: &Trust,
        config: RedisConfig,
    ) -> Result<Self, SetupError> {
        if infos
            .iter()
            .any(|i| matches!(i.addr, redis::ConnectionAddr::Unix(_)))
        {
            return Err(SetupError::InvalidUrl(RedisError::from((
                ErrorKind::InvalidClientConfig,
                "a Redis Cluster node is a TCP address, not a Unix socket",
            ))));
        }
        let given = infos.iter().map(|i| i.addr.to_string()).collect();
        let has_password = infos.iter().any(|i| i.redis.password.is_some());
        let _ = trust; // on the infos already
        let nodes =
            ClusterNodes::new(&infos, config.step_timeout).ok_or(SetupError::NoClusterNodes)?;
        let subscription = config
            .release_notifications
            .then(|| ShardedSubscription::new(nodes.clone(), &config));
        Ok(Self {
            inner: Arc::new(Inner {
                nodes,
                given,
                has_password,
                config,
                batchers: Batchers::default(),
                subscription,
                queue_rights: QueueRights::default(),
            }),
        })
    }

    /// Like [`from_urls`](Self::from_urls), and checks at once that the
    /// nodes answer, agree on their cluster and serve every slot. Touches no
    /// key.
    ///
    /// # Errors
    ///
    /// As [`from_urls`](Self::from_urls), and [`SetupError::Connect`] when no
    /// node answers, [`SetupError::NotACluster`] for a node without cluster
    /// support, [`SetupError::ClusterNodesDisagree`] when two nodes are not
    /// members of one cluster, [`SetupError::ClusterNotReady`] when the
    /// cluster does not serve every slot, and
    /// [`SetupError::NotEnoughReplicas`] when [`RedisConfig::durability`]
    /// waits for more replicas than some master has.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future drops the backend being made; nothing is left.
    pub async fn connect<T: AsRef<str>>(
        urls: impl IntoIterator<Item = T>,
    ) -> Result<Self, SetupError> {
        Self::connect_with(urls, RedisConfig::default()).await
    }

    /// [`connect`](Self::connect) with `config`.
    ///
    /// # Errors
    ///
    /// As [`connect`](Self::connect), and [`SetupError::InvalidConfig`].
    ///
    /// # Cancel safety
    ///
    /// As [`connect`](Self::connect).
    pub async fn connect_with<T: AsRef<str>>(
        urls: impl IntoIterator<Item = T>,
        config: RedisConfig,
    ) -> Result<Self, SetupError> {
        validate(&config)?;
        Self::checked(parse_urls(urls)?, Trust::system(), config).await
    }

    /// [`from_urls_with_tls`](Self::from_urls_with_tls), and the checks of
    /// [`connect`](Self::connect): nodes whose certificates `certificates`
    /// do not trust are [`SetupError::Connect`] with the TLS error as source.
    ///
    /// # Errors
    ///
    /// As [`from_urls_with_tls`](Self::from_urls_with_tls) and
    /// [`connect`](Self::connect).
    ///
    /// # Cancel safety
    ///
    /// As [`connect`](Self::connect).
    #[cfg(feature = "tls")]
    pub async fn connect_with_tls<T: AsRef<str>>(
        urls: impl IntoIterator<Item = T>,
        certificates: redis::TlsCertificates,
        config: RedisConfig,
    ) -> Result<Self, SetupError> {
        validate(&config)?;
        Self::checked(parse_urls(urls)?, Trust::custom(certificates), config).await
    }

    async fn checked(
        infos: Vec<redis::ConnectionInfo>,
        trust: Trust,
        config: RedisConfig,
    ) -> Result<Self, SetupError> {
        let infos = trusted(infos, &trust)?;
        crate::cluster_check::check_nodes(&infos, config.step_timeout)
            .await
            .map_err(|error| match error {
                SetupError::Connect(error) => connect_error(error, "the cluster nodes"),
                other => other,
            })?;
        let backend = Self::from_infos(infos, &trust, config)?;
        let map = backend
            .bounded("connecting", backend.inner.nodes.map())
            .await
            .map_err(|error| connect_error(error, "the cluster nodes"))?;
        if let Some(durability) = backend.inner.config.durability {
            let available = map.fewest_replicas().unwrap_or(0);
            if usize::try_from(durability.replicas).map_or(true, |wanted| wanted > available) {
                return Err(SetupError::NotEnoughReplicas {
                    wanted: durability.replicas,
                    available: u32::try_from(available).unwrap_or(u32::MAX),
                });
            }
        }
        Ok(backend)
    }

    /// The configuration the backend was made with.
    pub fn config(&self) -> &RedisConfig {
        &self.inner.config
    }

    /// The Redis key that holds the lock of `key`: the prefix, then `key`.
    pub fn lock_key(&self, key: &str) -> String {
        let prefix = &self.inner.config.prefix;
        let mut lock_key = String::with_capacity(prefix.len() + key.len());
        lock_key.push_str(prefix);
        lock_key.push_str(key);
        lock_key
    }

    /// The Redis key of the fencing counter of `key`, in the lock key's
    /// hash slot (see [`RedisBackend::fence_key`](crate::RedisBackend::fence_key)).
    pub fn fence_key(&self, key: &str) -> String {
        fence_key(&self.lock_key(key))
    }

    /// The Redis key of the record of `key`'s minimum hold, in the lock
    /// key's hash slot (see [`RedisBackend::kept_key`](crate::RedisBackend::kept_key)).
    pub fn kept_key(&self, key: &str) -> String {
        kept_key(&self.lock_key(key))
    }

    /// The shard channel the release of `key` is published on:
    /// `{N}:<prefix>withlock:released`, where `N` is the smallest integer
    /// in the lock key's slot, so that it is served by the node that serves
    /// the key. One channel per slot; each message is the released Redis key.
    pub fn channel(&self, key: &str) -> String {
        slot_channel(key_slot(&self.lock_key(key)), &self.inner.config.prefix)
    }

    /// Whether the release subscription is up now: some node's shard
    /// channels are subscribed (always false with notifications off, and
    /// before the first wait).
    pub fn is_subscribed(&self) -> bool {
        self.inner
            .subscription
            .as_ref()
            .is_some_and(ShardedSubscription::is_subscribed)
    }

    /// Counts of what the release subscription sent, for tests and
    /// diagnostics: see [`SubscriptionStats`](crate::SubscriptionStats).
    /// All zero with notifications off.
    pub fn subscription_stats(&self) -> crate::SubscriptionStats {
        self.inner
            .subscription
            .as_ref()
            .map(ShardedSubscription::stats)
            .unwrap_or_default()
    }

    /// The per-key structures of the backend and their sizes now, for
    /// \[T2\] tests (not a stable interface). Once no lock call runs:
    ///
    /// - `release_watches` (keys a waiter watches), `slots_watched` (slots
    ///   a watch needs), `queued_steps` (steps waiting to go out in a
    ///   batch): 0;
    /// - `shard_channels`: slots whose shard channel is wanted or
    ///   subscribed; 0 once the subscription task's sweep (every second)
    ///   has unsubscribed those no waiter needs;
    /// - per node, not per key: `subscription_links` (the subscription's
    ///   connections), `node_links` (the steps' connections; nodes that
    ///   left the slot map are dropped at the next read of it), and
    ///   `batched_masters` (the masters steps went to): at most the
    ///   cluster's nodes.
    #[doc(hidden)]
    pub fn state_counts(&self) -> Vec<(&'static str, usize)> {
        let (batched_masters, queued_steps) = self.inner.batchers.counts();
        let mut counts = vec![
            ("queued_steps", queued_steps),
            ("batched_masters", batched_masters),
            ("node_links", self.inner.nodes.linked_nodes()),
        ];
        match &self.inner.subscription {
            Some(subscription) => counts.extend(subscription.state_counts()),
            None => counts.extend([
                ("release_watches", 0),
                ("slots_watched", 0),
                ("shard_channels", 0),
                ("subscription_links", 0),
            ]),
        }
        counts
    }

    pub(crate) fn nodes(&self) -> &ClusterNodes {
        &self.inner.nodes
    }

    /// Runs `work` within the step timeout.
    pub(crate) async fn bounded<T>(
        &self,
        step: &'static str,
        work: impl std::future::Future<Output = Result<T, BackendError>>,
    ) -> Result<T, BackendError> {
        within(step, self.inner.config.step_timeout, work).await
    }

    /// The master of `key`'s lock key's slot, as the slot map last read
    /// says (`None` before the first read).
    fn cached_master(&self, lock_key: &str) -> Option<Node> {
        self.inner
            .nodes
            .cached_map()
            .and_then(|map| map.master_of(key_slot(lock_key)).cloned())
    }

    /// `lua` on the master of `keys[0]`'s slot, on `lane`, within the step
    /// timeout (following redirections, loading the script after
    /// `NOSCRIPT`): its answer, an error reply as an error.
    pub(crate) async fn eval(
        &self,
        step: &'static str,
        lane: Lane,
        lua: &Lua,
        keys: &[&str],
        args: &[&str],
    ) -> Result<Value, BackendError> {
        let pipe = lua.pipe(keys, args);
        let slot = keys.first().map_or(0, |k| key_slot(k));
        let values = self
            .bounded(step, self.inner.nodes.run(lane, slot, &pipe, 1, Some(lua)))
            .await?;
        self.answer(values.into_iter().next())
    }

    /// One answer of a script call: an error reply as an error (reading the
    /// slot map again after one that says the cluster changed).
    pub(crate) fn answer(&self, value: Option<Value>) -> Result<Value, BackendError> {
        match value {
            Some(Value::ServerError(error)) => {
                let error = RedisError::from(error);
                if matches!(
                    error.kind(),
                    ErrorKind::ClusterDown
                        | ErrorKind::MasterDown
                        | ErrorKind::TryAgain
                        | ErrorKind::Moved
                        | ErrorKind::Ask
                        | ErrorKind::ReadOnly
                ) {
                    self.inner.nodes.refresh();
                }
                Err(map_redis_error(error))
            }
            Some(value) => Ok(value),
            None => Err(BackendError::message(
                BackendErrorKind::Protocol,
                "no answer to the script",
            )),
        }
    }

    /// A step of `kind` with `keys` and `args` on the master of `keys[0]`:
    /// alone, or batched with the others of its kind waiting for that
    /// master (see [`crate::cluster_batch`]).
    async fn step(
        &self,
        kind: Kind,
        keys: Vec<String>,
        args: Vec<String>,
    ) -> Result<Value, BackendError> {
        let master = if self.inner.config.batch_steps {
            keys.first().and_then(|k| self.cached_master(k))
        } else {
            None
        };
        let Some(master) = master else {
            let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            return self
                .eval(kind.name(), Lane::Steps, kind.lua(), &keys, &args)
                .await;
        };
        crate::cluster_batch::step(self, &self.inner.batchers, master, kind, keys, args).await
    }

    /// The acquisition script, then `WAIT` on the same connection of the
    /// same master, in one pipeline; when too few replicas acknowledged,
    /// the release script on that connection, and an error.
    async fn acquire_durably(
        &self,
        durability: crate::Durability,
        lock_key: &str,
        fence: &str,
        owner: &OwnerToken,
        ttl: Duration,
    ) -> Result<i64, BackendError> {
        let limit = self.inner.config.step_timeout + durability.timeout;
        let mut pipe = ACQUIRE.pipe(
            &[lock_key, fence],
            &[
                owner.as_str(),
                &ttl_ms(ttl),
                &self.inner.config.fence_ttl_ms(ttl),
            ],
        );
        pipe.cmd("WAIT")
            .arg(durability.replicas)
            .arg(ttl_ms(durability.timeout));
        let slot = key_slot(lock_key);
        let values = within(
            "acquisition",
            limit,
            self.inner
                .nodes
                .run(Lane::Durable, slot, &pipe, 2, Some(&ACQUIRE)),
        )
        .await?;
        let mut values = values.into_iter();
        let acquired = script_number("acquisition", self.answer(values.next())?)?;
        if acquired <= 0 {
            return Ok(acquired);
        }
        let acked = match values.next() {
            Some(Value::Int(n)) => n,
            other => {
                return Err(BackendError::message(
                    BackendErrorKind::Protocol,
                    format!("unexpected answer to WAIT: {other:?}"),
                ))
            }
        };
        if acked >= i64::from(durability.replicas) {
            return Ok(acquired);
        }
        let channel = slot_channel(slot, &self.inner.config.prefix);
        let released = self
            .eval(
                "release",
                Lane::Durable,
                &RELEASE_SHARDED,
                &[lock_key],
                &[owner.as_str(), &channel],
            )
            .await
            .and_then(|v| script_number("release", v));
        Err(crate::durability::shortfall(acked, durability, released))
    }

    /// The leases of one master in one pipeline, one round trip; a lease
    /// whose answer is a redirection (the slot map was stale) or `NOSCRIPT`
    /// is extended again on its own, redirections followed.
    async fn extend_group(
        &self,
        master: Option<Node>,
        group: Vec<(usize, String, &ExtendRequest)>,
    ) -> Vec<(usize, Result<ExtendOutcome, BackendError>)> {
        let extend_one = |lock_key: &str, request: &ExtendRequest| {
            let (lock_key, owner, ttl, fence_ttl, token) = (
                lock_key.to_owned(),
                request.lease.owner().as_str().to_owned(),
                ttl_ms(request.ttl),
                self.inner.config.fence_ttl_ms(request.ttl),
                request.lease.fencing_token().to_string(),
            );
            async move {
                self.eval(
                    "extension",
                    Lane::Steps,
                    &EXTEND,
                    &[&lock_key, &fence_key(&lock_key)],
                    &[&owner, &ttl, &fence_ttl, &token],
                )
                .await
                .and_then(|v| extend_outcome(script_number("extension", v)?))
            }
        };
        let Some(master) = master else {
            let each = group.iter().map(|(i, lock_key, request)| async move {
                (*i, extend_one(lock_key, request).await)
            });
            return futures_util::future::join_all(each).await;
        };
        let mut pipe = redis::pipe();
        for (_, lock_key, request) in &group {
            EXTEND.add_call(
                &mut pipe,
                &[lock_key, &fence_key(lock_key)],
                &[
                    request.lease.owner().as_str(),
                    &ttl_ms(request.ttl),
                    &self.inner.config.fence_ttl_ms(request.ttl),
                    &request.lease.fencing_token().to_string(),
                ],
            );
        }
        let sent = self
            .bounded(
                "extension",
                self.inner
                    .nodes
                    .send(&master, Lane::Steps, &pipe, 0, group.len()),
            )
            .await;
        let values = match sent {
            Ok(values) => values,
            Err(error) => {
                return group
                    .iter()
                    .map(|(i, _, _)| (*i, Err(error.clone())))
                    .collect()
            }
        };
        let mut outcomes = Vec::with_capacity(group.len());
        let mut again = Vec::new();
        for ((i, lock_key, request), value) in group.iter().zip(values) {
            if needs_routing(&value) {
                again.push((*i, lock_key, *request));
            } else {
                let outcome = self
                    .answer(Some(value))
                    .and_then(|v| extend_outcome(script_number("extension", v)?));
                outcomes.push((*i, outcome));
            }
        }
        // Did not run where they were sent: extended again one by one.
        let each = again
            .into_iter()
            .map(|(i, lock_key, request)| async move { (i, extend_one(lock_key, request).await) });
        outcomes.extend(futures_util::future::join_all(each).await);
        outcomes
    }
}

/// `config` checked for a cluster: in range (the durability setting too).
fn validate(config: &RedisConfig) -> Result<(), SetupError> {
    config.validate()?;
    crate::durability::validate(config)
}

/// Whether a script's answer says it did not run where it was sent: a
/// redirection (`MOVED`, `ASK`) or a script the node does not have
/// (`NOSCRIPT`). Sent again on its own, it is routed and loaded.
pub(crate) fn needs_routing(value: &Value) -> bool {
    match value {
        Value::ServerError(error) => matches!(error.code(), "MOVED" | "ASK" | "NOSCRIPT"),
        _ => false,
    }
}

/// A script's answer as a number.
pub(crate) fn script_number(step: &str, value: Value) -> Result<i64, BackendError> {
    redis::from_redis_value::<i64>(&value).map_err(|e| {
        BackendError::message(
            BackendErrorKind::Protocol,
            format!("the {step} script's answer: {e}"),
        )
    })
}

/// The shard channel of `slot`: `{N}:<prefix>withlock:released`.
pub(crate) fn slot_channel(slot: u16, prefix: &str) -> String {
    let tag = slot_tag(slot).to_string();
    let mut channel = String::with_capacity(tag.len() + 3 + prefix.len() + CHANNEL.len());
    channel.push('{');
    channel.push_str(&tag);
    channel.push_str("}:");
    channel.push_str(prefix);
    channel.push_str(CHANNEL);
    channel
}

fn parse_urls<T: AsRef<str>>(
    urls: impl IntoIterator<Item = T>,
) -> Result<Vec<redis::ConnectionInfo>, SetupError> {
    use redis::IntoConnectionInfo;
    let infos = urls
        .into_iter()
        .map(|url| url.as_ref().into_connection_info())
        .collect::<Result<Vec<_>, _>>()
        .map_err(SetupError::InvalidUrl)?;
    if infos.is_empty() {
        return Err(SetupError::NoClusterNodes);
    }
    Ok(infos)
}

/// `infos` with the certificates of `trust` on each.
fn trusted(
    infos: Vec<redis::ConnectionInfo>,
    trust: &Trust,
) -> Result<Vec<redis::ConnectionInfo>, SetupError> {
    infos.into_iter().map(|info| trust.apply(info)).collect()
}

impl fmt::Debug for RedisClusterBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never the connection infos: their Debug would show the password.
        f.debug_struct("RedisClusterBackend")
            .field("nodes", &self.inner.given)
            .field("password", &redact::secret(self.inner.has_password))
            .field("config", &self.inner.config)
            .field("connected", &self.inner.nodes.is_connected())
            .field("subscribed", &self.is_subscribed())
            .finish()
    }
}

#[async_trait]
impl LockBackend for RedisClusterBackend {
    fn capabilities(&self) -> Capabilities {
        Capabilities::default()
            .with_name("redis-cluster")
            .with_release_notifications(self.inner.subscription.is_some())
            .with_max_key_len(MAX_KEY_LEN)
            .with_max_extend_batch(self.inner.config.max_extend_batch)
            .with_fair_queue(self.inner.config.durability.is_none())
    }

    /// The acquisition script of [`RedisBackend`](crate::RedisBackend) on
    /// the master of the key's slot (the counter is in the same slot); with
    /// [`RedisConfig::durability`], `WAIT` after it on the same connection.
    /// Fails with kind [`Unavailable`](BackendErrorKind::Unavailable) when
    /// the key's master could not be reached: nothing was sent.
    ///
    /// # Cancel safety
    ///
    /// A dropped call may have taken the key; a release with the same owner
    /// token frees it.
    async fn try_acquire(
        &self,
        key: &str,
        owner: &OwnerToken,
        ttl: Duration,
    ) -> Result<AcquireOutcome, BackendError> {
        let lock_key = self.lock_key(key);
        let fence = fence_key(&lock_key);
        let answer = match self.inner.config.durability {
            Some(durability) => {
                Box::pin(self.acquire_durably(durability, &lock_key, &fence, owner, ttl)).await?
            }
            None => {
                let value = self
                    .step(
                        Kind::Acquisition,
                        vec![lock_key, fence],
                        vec![
                            owner.as_str().to_owned(),
                            ttl_ms(ttl),
                            self.inner.config.fence_ttl_ms(ttl),
                        ],
                    )
                    .await?;
                script_number("acquisition", value)?
            }
        };
        acquire_outcome(answer)
    }

    /// `PEXPIRE` if the key still holds the owner token, in one script on
    /// the key's master.
    ///
    /// # Cancel safety
    ///
    /// A dropped call may or may not have extended the key.
    async fn extend(&self, lease: &Lease, ttl: Duration) -> Result<ExtendOutcome, BackendError> {
        let lock_key = self.lock_key(lease.key());
        let value = self
            .eval(
                "extension",
                Lane::Steps,
                &EXTEND,
                &[&lock_key, &fence_key(&lock_key)],
                &[
                    lease.owner().as_str(),
                    &ttl_ms(ttl),
                    &self.inner.config.fence_ttl_ms(ttl),
                    &lease.fencing_token().to_string(),
                ],
            )
            .await?;
        extend_outcome(script_number("extension", value)?)
    }

    /// The leases grouped by the master that serves their slot, one
    /// pipeline per master on that master's own connection, the pipelines
    /// sent at once, each under its own deadline: one round trip per node,
    /// and a hung master delays only its own leases \[L4\]. A lease whose
    /// answer is a redirection (a slot moved since the slot map was read)
    /// is extended again on its own; extensions can be repeated.
    ///
    /// # Cancel safety
    ///
    /// A dropped call may have extended some of the leases.
    async fn extend_many(
        &self,
        requests: &[ExtendRequest],
    ) -> Vec<Result<ExtendOutcome, BackendError>> {
        if requests.is_empty() {
            return Vec::new();
        }
        let map = match self.bounded("extension", self.inner.nodes.map()).await {
            Ok(map) => map,
            Err(error) => return vec![Err(error); requests.len()],
        };
        let mut groups: HashMap<Option<Node>, Vec<(usize, String, &ExtendRequest)>> =
            HashMap::new();
        for (i, request) in requests.iter().enumerate() {
            let lock_key = self.lock_key(request.lease.key());
            let master = map.master_of(key_slot(&lock_key)).cloned();
            groups
                .entry(master)
                .or_default()
                .push((i, lock_key, request));
        }
        let batches = groups
            .into_iter()
            .map(|(master, group)| self.extend_group(master, group));
        let mut results: Vec<Option<Result<ExtendOutcome, BackendError>>> =
            vec![None; requests.len()];
        for group in futures_util::future::join_all(batches).await {
            for (i, result) in group {
                results[i] = Some(result);
            }
        }
        results
            .into_iter()
            .map(|result| {
                result.unwrap_or_else(|| {
                    Err(BackendError::message(
                        BackendErrorKind::Protocol,
                        "no answer for the extension",
                    ))
                })
            })
            .collect()
    }

    /// The master that serves the key's slot, as the slot map last read
    /// says; `0` until the map is read.
    fn failure_domain(&self, key: &str) -> u64 {
        use std::hash::{BuildHasher, BuildHasherDefault, DefaultHasher};
        self.cached_master(&self.lock_key(key)).map_or(0, |node| {
            BuildHasherDefault::<DefaultHasher>::default().hash_one(node)
        })
    }

    /// The release script of [`RedisBackend`](crate::RedisBackend) on the
    /// key's master: when waiters are queued, a grant to the first live
    /// one \[F1\], else `DEL` if the key still holds the owner token; then
    /// `SPUBLISH` of the key (or the grant) on its slot's shard channel.
    /// The lock key, its companion, queue and waiters share the key's slot.
    /// A user whose ACL does not reach the queue's keys frees the key
    /// without them \[F6\].
    ///
    /// # Cancel safety
    ///
    /// A dropped call may or may not have released the key; calling again
    /// is safe.
    async fn release(&self, lease: &Lease) -> Result<ReleaseOutcome, BackendError> {
        let lock_key = self.lock_key(lease.key());
        let channel = slot_channel(key_slot(&lock_key), &self.inner.config.prefix);
        let owner = lease.owner().as_str();
        if self.inner.queue_rights.allowed() {
            let args = vec![
                owner.to_owned(),
                channel.clone(),
                self.inner.config.fence_idle_ms(),
                "SPUBLISH".to_owned(),
            ];
            match self
                .step(Kind::Release, queue_keys(&lock_key).into(), args)
                .await
            {
                Err(error) if is_key_refused(&error) => self.inner.queue_rights.refuse(&error),
                value => return release_outcome(script_number("release", value?)?),
            }
        }
        let value = self
            .eval(
                "release",
                Lane::Steps,
                &RELEASE_SHARDED,
                &[&lock_key],
                &[owner, &channel],
            )
            .await?;
        release_outcome(script_number("release", value)?)
    }

    /// One attempt of a waiter in the key's fair queue (the script of
    /// [`RedisBackend`](crate::RedisBackend)) on the key's master: the
    /// queue's keys share the lock key's slot, and a grant is announced on
    /// the slot's shard channel.
    ///
    /// # Cancel safety
    ///
    /// A dropped call may have taken the key or a place; a release or a
    /// leave with the same owner token undoes either.
    async fn try_acquire_queued(
        &self,
        key: &str,
        owner: &OwnerToken,
        ttl: Duration,
        terms: QueueTerms,
    ) -> Result<AcquireOutcome, BackendError> {
        let lock_key = self.lock_key(key);
        let keys = queue_keys(&lock_key);
        let keys = keys.each_ref().map(String::as_str);
        let args = [
            owner.as_str(),
            &ttl_ms(ttl),
            &self.inner.config.fence_ttl_ms(ttl),
            &ttl_ms(terms.ticket_ttl),
            &ttl_ms(terms.claim),
        ];
        let answer = self
            .eval(
                "queued acquisition",
                Lane::Steps,
                &ACQUIRE_QUEUED,
                &keys,
                &args,
            )
            .await?;
        queued_outcome(&answer)
    }

    /// The waiter's place removed, on the key's master; a grant made to it
    /// and not taken up is handed on as a release would.
    ///
    /// # Cancel safety
    ///
    /// A dropped call may or may not have left; calling again is safe.
    async fn leave_queue(&self, key: &str, owner: &OwnerToken) -> Result<(), BackendError> {
        let lock_key = self.lock_key(key);
        let channel = slot_channel(key_slot(&lock_key), &self.inner.config.prefix);
        let keys = queue_keys(&lock_key);
        let keys = keys.each_ref().map(String::as_str);
        let args = [
            owner.as_str(),
            &channel,
            &self.inner.config.fence_idle_ms(),
            "SPUBLISH",
        ];
        let value = self
            .eval("leaving the queue", Lane::Steps, &LEAVE_QUEUE, &keys, &args)
            .await?;
        script_number("leaving the queue", value).map(drop)
    }

    /// The extension script with the time left of the minimum hold \[H7\]
    /// (Redis keeps no record of when a key was set), at least 1 ms, as
    /// `PEXPIRE 0` would delete the key; and the hold's record beside the
    /// lock, in the key's slot ([`crate::slot::kept_key`]), for the admin.
    /// One script on the key's master.
    async fn hold(&self, lease: &Lease, hold: Hold) -> Result<ExtendOutcome, BackendError> {
        let lock_key = self.lock_key(lease.key());
        let (fence, kept) = (fence_key(&lock_key), kept_key(&lock_key));
        let keys = [&*lock_key, &fence, &kept];
        let ttl = hold.from_now.max(Duration::from_millis(1));
        let (ttl, fence_ttl) = (ttl_ms(ttl), self.inner.config.fence_ttl_ms(ttl));
        let token = lease.fencing_token().to_string();
        let args = [lease.owner().as_str(), &ttl, &fence_ttl, &token];
        let value = match self.eval("hold", Lane::Steps, &HOLD, &keys, &args).await {
            // A user whose ACL does not reach the record: the hold
            // without it (the script did not run).
            Err(error) if is_key_refused(&error) => {
                tracing::debug!(key = %lease.key(), "the ACL refuses the minimum hold's record; holding without it");
                self.eval("hold", Lane::Steps, &EXTEND, &keys[..2], &args)
                    .await?
            }
            value => value?,
        };
        extend_outcome(script_number("hold", value)?)
    }

    /// A watch on `key`, returned once the shard channel of the key's slot
    /// is subscribed on the node that serves it (`SSUBSCRIBE`, confirmed).
    /// Fails while that node cannot be reached, and after the step timeout
    /// if the channel cannot be subscribed; the driver then waits on its
    /// retry timer.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: the subscription belongs to the backend, not the call.
    async fn watch_release(&self, key: &str) -> Result<ReleaseWatch, BackendError> {
        let Some(subscription) = &self.inner.subscription else {
            return Ok(ReleaseWatch::never());
        };
        subscription
            .watch(&self.inner.nodes, key, key_slot(&self.lock_key(key)))
            .await
    }
}

impl Kind {
    /// The script of a step of this kind.
    pub(crate) fn lua(self) -> &'static Lua {
        match self {
            Kind::Acquisition => &ACQUIRE,
            Kind::Release => &RELEASE,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn channels_share_the_slot_of_their_keys() {
        for key in ["a", "{tag}x", "x}y", "🔒", "withlock-redis-test:00:key"] {
            for prefix in ["", "p:", "{p}:"] {
                let lock_key = format!("{prefix}{key}");
                let channel = slot_channel(key_slot(&lock_key), prefix);
                assert_eq!(key_slot(&channel), key_slot(&lock_key), "{lock_key:?}");
                assert!(channel.ends_with(&format!("{prefix}{CHANNEL}")));
            }
        }
    }

    #[test]
    fn a_durability_setting_out_of_range_is_refused() {
        let config = RedisConfig::default()
            .durability(crate::Durability::new(0, Duration::from_millis(100)));
        let refused = RedisClusterBackend::from_urls_with(["redis://127.0.0.1:1"], config);
        assert!(
            matches!(
                refused,
                Err(SetupError::InvalidConfig {
                    field: "durability",
                    ..
                })
            ),
            "{refused:?}"
        );
    }

    #[test]
    fn an_empty_node_list_is_refused() {
        assert!(matches!(
            parse_urls(Vec::<String>::new()),
            Err(SetupError::NoClusterNodes)
        ));
        assert!(matches!(
            parse_urls(["not a url"]),
            Err(SetupError::InvalidUrl(_))
        ));
        assert!(matches!(
            RedisClusterBackend::new(Vec::new()),
            Err(SetupError::NoClusterNodes)
        ));
    }

    #[test]
    fn only_redirections_and_missing_scripts_are_routed_again() {
        let reply =
            |text: &str| redis::parse_redis_value(format!("-{text}\r\n").as_bytes()).unwrap();
        for routed in [
            "MOVED 3999 127.0.0.1:7001",
            "ASK 3999 127.0.0.1:7001",
            "NOSCRIPT No matching script",
        ] {
            assert!(needs_routing(&reply(routed)), "{routed}");
        }
        for answered in [
            "ERR the fencing companion x is not a number",
            "CLUSTERDOWN down",
            "WRONGTYPE x",
        ] {
            assert!(!needs_routing(&reply(answered)), "{answered}");
        }
        assert!(!needs_routing(&Value::Int(1)));
    }
}

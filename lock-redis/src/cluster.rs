//! `RedisClusterBackend`: the lock steps on a Redis Cluster, each script
//! routed to the master of its key's hash slot by the `redis` crate's async
//! cluster connection, extensions batched per node, and releases announced
//! by `SPUBLISH` on a shard channel of the key's slot.

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, Mutex, PoisonError};
use std::time::Duration;

use lock_core::{
    async_trait, AcquireOutcome, BackendError, BackendErrorKind, Capabilities, ExtendOutcome,
    ExtendRequest, Hold, Lease, LockBackend, OwnerToken, ReleaseOutcome, ReleaseWatch, MAX_KEY_LEN,
};
use redis::cluster::{ClusterClient, ClusterClientBuilder, ClusterConfig};
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{Route, RoutingInfo, SingleNodeRoutingInfo, SlotAddr};
use redis::{ErrorKind, RedisError, Script, Value};
use tokio::time::Instant;

use crate::backend::{
    acquire_outcome, extend_outcome, map_redis_error, release_outcome, ttl_ms, CHANNEL,
};
use crate::cluster_subscription::ShardedSubscription;
use crate::config::{connect_error, RedisConfig, SetupError};
use crate::slot::{fence_key, key_slot, slot_tag};
use crate::tls::Trust;

const ACQUIRE_LUA: &str = crate::backend::ACQUIRE_LUA;
const EXTEND_LUA: &str = include_str!("../lua/extend.lua");
const RELEASE_LUA: &str = include_str!("../lua/release_sharded.lua");

static ACQUIRE: LazyLock<Script> = LazyLock::new(|| Script::new(ACQUIRE_LUA));
static EXTEND: LazyLock<Script> = LazyLock::new(|| Script::new(EXTEND_LUA));
static RELEASE: LazyLock<Script> = LazyLock::new(|| Script::new(RELEASE_LUA));

/// How many `MOVED` / `ASK` answers one step follows. Such an answer means
/// the script did not run, so following it is routing, not a retry.
const MAX_REDIRECTS: usize = 3;

/// A lock backend on a Redis Cluster: the same keys, values, scripts and
/// fencing counters as [`RedisBackend`](crate::RedisBackend), each step
/// routed to the master of its key's slot, and release notifications over
/// sharded pub/sub (`SPUBLISH` / `SSUBSCRIBE`, Redis 7.0 or later).
///
/// Cheap to clone; clones share the cluster connection and the
/// subscription, which ends when the last clone is dropped.
#[derive(Clone)]
pub struct RedisClusterBackend {
    inner: Arc<Inner>,
}

struct Inner {
    client: ClusterClient,
    /// `host:port` of the nodes the backend was given, for `Debug` and errors.
    nodes: Vec<String>,
    has_password: bool,
    config: RedisConfig,
    link: Link,
    /// Which master serves which slot, as `CLUSTER SLOTS` said last, to
    /// group extensions by node. Dropped after a redirection.
    slots: Mutex<Option<Arc<SlotMap>>>,
    subscription: Option<ShardedSubscription>,
}

impl RedisClusterBackend {
    /// A backend on the user's cluster `client`, with the default
    /// [`RedisConfig`]. Nothing connects until the first call.
    ///
    /// Build the client with `.retries(0)`: a step is one attempt and the
    /// driver retries, where the crate's own retries would run a step again
    /// after a lost answer (an acquisition could then answer busy for a key
    /// it took). Redirections (`MOVED`, `ASK`) are followed by the backend
    /// either way. Release notifications need
    /// `.use_protocol(redis::ProtocolVersion::RESP3)`; on RESP2 the first
    /// wait fails and waiters poll every `retry_delay`.
    pub fn new(client: ClusterClient) -> Self {
        Self::build(client, Vec::new(), false, RedisConfig::default())
    }

    /// A backend on the user's cluster `client` with `config`.
    ///
    /// # Errors
    ///
    /// [`SetupError::InvalidConfig`] when a field of `config` is out of range.
    pub fn with_config(client: ClusterClient, config: RedisConfig) -> Result<Self, SetupError> {
        validate(&config)?;
        Ok(Self::build(client, Vec::new(), false, config))
    }

    /// A backend with a cluster client of its own, from the URLs of one or
    /// more nodes of the cluster (`redis://:password@host:port`); the others
    /// are found with `CLUSTER SLOTS`. The client makes one attempt per step
    /// (`retries(0)`) and speaks RESP3, for sharded pub/sub.
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
        let nodes = infos.iter().map(|i| i.addr.to_string()).collect();
        let has_password = infos.iter().any(|i| i.redis.password.is_some());
        let builder = ClusterClientBuilder::new(infos)
            .retries(0)
            .use_protocol(redis::ProtocolVersion::RESP3)
            .connection_timeout(config.step_timeout)
            .response_timeout(config.step_timeout);
        // The builder puts the certificates on the nodes it finds too.
        #[cfg(feature = "tls")]
        let builder = match trust.certificates() {
            Some(certificates) => builder.certs(certificates.clone()),
            None => builder,
        };
        #[cfg(not(feature = "tls"))]
        let _ = trust;
        let client = builder.build().map_err(SetupError::InvalidUrl)?;
        Ok(Self::build(client, nodes, has_password, config))
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
    /// cluster does not serve every slot.
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
        backend
            .bounded("connecting", |mut conn| async move {
                redis::cmd("PING")
                    .query_async::<String>(&mut conn)
                    .await
                    .map_err(map_redis_error)
            })
            .await
            .map_err(|error| connect_error(error, "the cluster nodes"))?;
        Ok(backend)
    }

    fn build(
        client: ClusterClient,
        nodes: Vec<String>,
        has_password: bool,
        config: RedisConfig,
    ) -> Self {
        let subscription = config
            .release_notifications
            .then(|| ShardedSubscription::new(client.clone(), &config));
        Self {
            inner: Arc::new(Inner {
                client,
                nodes,
                has_password,
                config,
                link: Link::default(),
                slots: Mutex::new(None),
                subscription,
            }),
        }
    }

    /// The configuration the backend was made with.
    pub fn config(&self) -> &RedisConfig {
        &self.inner.config
    }

    /// The Redis key that holds the lock of `key`: the prefix, then `key`.
    pub fn lock_key(&self, key: &str) -> String {
        format!("{}{key}", self.inner.config.prefix)
    }

    /// The Redis key of the fencing counter of `key`, in the lock key's
    /// hash slot (see [`RedisBackend::fence_key`](crate::RedisBackend::fence_key)).
    pub fn fence_key(&self, key: &str) -> String {
        fence_key(&self.lock_key(key))
    }

    /// The shard channel the release of `key` is published on:
    /// `{N}:<prefix>withlock:released`, where `N` is the smallest integer
    /// in the lock key's slot, so that it is served by the node that serves
    /// the key. One channel per slot; each message is the released Redis key.
    pub fn channel(&self, key: &str) -> String {
        slot_channel(key_slot(&self.lock_key(key)), &self.inner.config.prefix)
    }

    /// Whether the sharded subscription connection is up now (always false
    /// with notifications off, and before the first wait).
    pub fn is_subscribed(&self) -> bool {
        self.inner
            .subscription
            .as_ref()
            .is_some_and(ShardedSubscription::is_subscribed)
    }

    /// Runs `work` on the shared cluster connection within the step timeout,
    /// connection included; forgets the connection after an error that may
    /// mean it is broken (a timeout, a lost or refused node connection), so
    /// that the next step connects afresh and reads the topology again.
    pub(crate) async fn bounded<T, F, Fut>(
        &self,
        step: &'static str,
        work: F,
    ) -> Result<T, BackendError>
    where
        F: FnOnce(ClusterConnection) -> Fut,
        Fut: Future<Output = Result<T, BackendError>>,
    {
        let limit = self.inner.config.step_timeout;
        let deadline = Instant::now() + limit;
        let (generation, conn) =
            match tokio::time::timeout_at(deadline, self.inner.link.get(&self.inner.client, limit))
                .await
            {
                Ok(got) => got?,
                Err(_) => return Err(BackendError::timeout(step, limit)),
            };
        let answer = match tokio::time::timeout_at(deadline, work(conn)).await {
            Ok(answer) => answer,
            Err(_) => Err(BackendError::timeout(step, limit)),
        };
        if let Err(error) = &answer {
            if is_broken(error) {
                self.inner.link.forget(generation);
                self.forget_slots();
            }
        }
        answer
    }

    fn forget_slots(&self) {
        *self
            .inner
            .slots
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = None;
    }

    /// The slot map, read with `CLUSTER SLOTS` when there is none.
    pub(crate) async fn slot_map(
        &self,
        conn: &mut ClusterConnection,
    ) -> Result<Arc<SlotMap>, BackendError> {
        if let Some(map) = self
            .inner
            .slots
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
        {
            return Ok(map);
        }
        let answer: Value = redis::cmd("CLUSTER")
            .arg("SLOTS")
            .query_async(conn)
            .await
            .map_err(map_redis_error)?;
        let map = Arc::new(SlotMap::parse(&answer)?);
        *self
            .inner
            .slots
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some(Arc::clone(&map));
        Ok(map)
    }

    async fn run_script(
        &self,
        step: &'static str,
        script: &'static Lua,
        keys: &[&str],
        args: &[&str],
    ) -> Result<i64, BackendError> {
        self.bounded(step, |mut conn| async move {
            let answer = eval(&mut conn, script, keys, args)
                .await
                .map_err(map_cluster_error)?;
            redis::from_redis_value::<i64>(&answer)
                .map_err(|e| BackendError::new(BackendErrorKind::Protocol, e))
        })
        .await
    }

    /// The leases of one node's group in one pipeline, one round trip; when
    /// the pipeline meets a redirection (the slot map was stale) or its node
    /// is unknown, each lease on its own, redirections followed.
    async fn extend_group(
        &self,
        mut conn: ClusterConnection,
        node: Option<(String, u16)>,
        requests: Vec<(usize, String, &ExtendRequest)>,
    ) -> Result<Vec<(usize, Result<ExtendOutcome, BackendError>)>, BackendError> {
        if let Some((host, port)) = node.filter(|_| requests.len() > 1) {
            let mut pipe = redis::pipe();
            for (_, lock_key, request) in &requests {
                pipe.cmd("EVALSHA")
                    .arg(EXTEND_SCRIPT.script.get_hash())
                    .arg(2)
                    .arg(lock_key)
                    .arg(fence_key(lock_key))
                    .arg(request.lease.owner().as_str())
                    .arg(ttl_ms(request.ttl))
                    .arg(self.inner.config.fence_ttl_ms(request.ttl))
                    .arg(request.lease.fencing_token());
            }
            let route = SingleNodeRoutingInfo::ByAddress { host, port };
            let mut answer = conn
                .route_pipeline(&pipe, 0, requests.len(), route.clone())
                .await;
            if matches!(&answer, Err(e) if e.kind() == ErrorKind::NoScriptError) {
                load(&mut conn, &EXTEND_SCRIPT, &Target::Node(route.clone()))
                    .await
                    .map_err(map_cluster_error)?;
                answer = conn.route_pipeline(&pipe, 0, requests.len(), route).await;
            }
            match answer {
                Ok(values) => {
                    if values.len() != requests.len() {
                        return Err(BackendError::message(
                            BackendErrorKind::Protocol,
                            format!("{} answers to {} extensions", values.len(), requests.len()),
                        ));
                    }
                    return Ok(requests
                        .iter()
                        .zip(values)
                        .map(|((i, _, _), value)| {
                            let outcome = redis::from_redis_value::<i64>(&value)
                                .map_err(|e| BackendError::new(BackendErrorKind::Protocol, e))
                                .and_then(extend_outcome);
                            (*i, outcome)
                        })
                        .collect());
                }
                // A stale slot map: a redirection, or a node the
                // connection no longer knows (a master that died).
                Err(e) if is_redirect(&e) || e.kind() == ErrorKind::ClientError => {
                    tracing::debug!(error = %e, "extension batch misrouted; extending one by one");
                    self.forget_slots();
                }
                Err(e) => {
                    self.forget_slots();
                    return Err(map_cluster_error(e));
                }
            }
        }
        let each = requests.iter().map(|(i, lock_key, request)| {
            let mut conn = conn.clone();
            async move {
                let outcome = async {
                    let answer = eval(
                        &mut conn,
                        &EXTEND_SCRIPT,
                        &[lock_key, &fence_key(lock_key)],
                        &[
                            request.lease.owner().as_str(),
                            &ttl_ms(request.ttl),
                            &self.inner.config.fence_ttl_ms(request.ttl),
                            &request.lease.fencing_token().to_string(),
                        ],
                    )
                    .await
                    .map_err(map_cluster_error)?;
                    let n = redis::from_redis_value::<i64>(&answer)
                        .map_err(|e| BackendError::new(BackendErrorKind::Protocol, e))?;
                    extend_outcome(n)
                }
                .await;
                (*i, outcome)
            }
        });
        Ok(futures_util::future::join_all(each).await)
    }
}

/// `config` checked for a cluster: in range, and asking nothing the
/// cluster backend cannot do. `durability` (`WAIT` after each acquisition)
/// is refused rather than ignored: this backend does not send `WAIT` yet.
fn validate(config: &RedisConfig) -> Result<(), SetupError> {
    config.validate()?;
    if config.durability.is_some() {
        return Err(SetupError::InvalidConfig {
            field: "durability",
            reason: "is not supported by RedisClusterBackend yet (it would not send WAIT): refused rather than ignored",
        });
    }
    Ok(())
}

/// The shard channel of `slot`: `{N}:<prefix>withlock:released`.
pub(crate) fn slot_channel(slot: u16, prefix: &str) -> String {
    format!("{{{}}}:{prefix}{CHANNEL}", slot_tag(slot))
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

/// A Lua script with its source, so that it can be loaded on one node.
pub(crate) struct Lua {
    pub(crate) code: &'static str,
    pub(crate) script: &'static LazyLock<Script>,
}

static ACQUIRE_SCRIPT: Lua = Lua {
    code: ACQUIRE_LUA,
    script: &ACQUIRE,
};
static EXTEND_SCRIPT: Lua = Lua {
    code: EXTEND_LUA,
    script: &EXTEND,
};
static RELEASE_SCRIPT: Lua = Lua {
    code: RELEASE_LUA,
    script: &RELEASE,
};

/// Where one request goes.
#[derive(Clone)]
enum Target {
    /// The master of a slot, as the connection's slot map says.
    Slot(u16),
    /// One node, by address.
    Node(SingleNodeRoutingInfo),
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
        Target::Node(node) => {
            conn.route_command(cmd, RoutingInfo::SingleNode(node.clone()))
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

/// `SCRIPT LOAD` of `lua` on the node of `target` only (a cluster
/// connection would send it to every node, and fail while one is down).
async fn load(conn: &mut ClusterConnection, lua: &Lua, target: &Target) -> redis::RedisResult<()> {
    let mut cmd = redis::cmd("SCRIPT");
    cmd.arg("LOAD").arg(lua.code);
    let target = match target {
        Target::Asking(node) => Target::Node(node.clone()),
        other => other.clone(),
    };
    send(conn, &cmd, &target).await.map(drop)
}

/// `EVALSHA` of `lua` on the master of `keys[0]`'s slot: after `NOSCRIPT`
/// the script is loaded there and sent again, after `MOVED` / `ASK` it is
/// sent where the answer points. Neither answer means the script ran.
pub(crate) async fn eval(
    conn: &mut ClusterConnection,
    lua: &Lua,
    keys: &[&str],
    args: &[&str],
) -> redis::RedisResult<Value> {
    let mut cmd = redis::cmd("EVALSHA");
    cmd.arg(lua.script.get_hash()).arg(keys.len());
    for key in keys {
        cmd.arg(*key);
    }
    for arg in args {
        cmd.arg(*arg);
    }
    let mut target = Target::Slot(keys.first().map_or(0, |k| key_slot(k)));
    let mut loaded = false;
    let mut redirects = 0;
    loop {
        match send(conn, &cmd, &target).await {
            Err(e) if e.kind() == ErrorKind::NoScriptError && !loaded => {
                loaded = true;
                load(conn, lua, &target).await?;
            }
            Err(e) if is_redirect(&e) && redirects < MAX_REDIRECTS => {
                redirects += 1;
                target = redirected(e)?;
            }
            answer => return answer,
        }
    }
}

/// `cmd` on the master of `slot`, following `MOVED` / `ASK` answers.
pub(crate) async fn query_slot(
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

/// A request that failed to reach its node (refused, no route): nothing
/// was sent, so it is `Unavailable`; anything else as
/// [`map_redis_error`] maps it.
pub(crate) fn map_cluster_error(error: RedisError) -> BackendError {
    if error.is_connection_refusal() || error.kind() == ErrorKind::ClusterConnectionNotFound {
        crate::config::connection_error(error)
    } else {
        map_redis_error(error)
    }
}

pub(crate) fn is_broken(error: &BackendError) -> bool {
    error.is_timeout()
        || error.inner().downcast_ref::<RedisError>().is_none_or(|e| {
            e.is_io_error()
                || e.is_connection_dropped()
                || e.is_connection_refusal()
                || e.is_unrecoverable_error()
                || e.is_timeout()
                || matches!(
                    e.kind(),
                    ErrorKind::ClusterConnectionNotFound
                        | ErrorKind::ClusterDown
                        | ErrorKind::MasterDown
                )
        })
}

/// The backend's one cluster connection (which holds one multiplexed
/// connection per node), made on first use and after a broken one was
/// forgotten. Each connection has a generation, so that a step that saw an
/// old one failing does not forget a newer one.
#[derive(Default)]
struct Link {
    current: Mutex<Option<(u64, ClusterConnection)>>,
    connecting: tokio::sync::Mutex<()>,
    generation: AtomicU64,
}

impl Link {
    fn current(&self) -> Option<(u64, ClusterConnection)> {
        self.current
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// The connection; a failed connection is
    /// [`Unavailable`](BackendErrorKind::Unavailable): nothing was sent.
    async fn get(
        &self,
        client: &ClusterClient,
        timeout: Duration,
    ) -> Result<(u64, ClusterConnection), BackendError> {
        if let Some(current) = self.current() {
            return Ok(current);
        }
        let _one_at_a_time = self.connecting.lock().await;
        if let Some(current) = self.current() {
            return Ok(current);
        }
        let config = ClusterConfig::new()
            .set_connection_timeout(timeout)
            .set_response_timeout(timeout);
        let conn = client
            .get_async_connection_with_config(config)
            .await
            .map_err(BackendError::unavailable)?;
        let generation = self.generation.fetch_add(1, Ordering::Relaxed) + 1;
        *self.current.lock().unwrap_or_else(PoisonError::into_inner) =
            Some((generation, conn.clone()));
        Ok((generation, conn))
    }

    fn forget(&self, generation: u64) {
        let mut current = self.current.lock().unwrap_or_else(PoisonError::into_inner);
        if current.as_ref().is_some_and(|(g, _)| *g == generation) {
            *current = None;
        }
    }

    fn is_connected(&self) -> bool {
        self.current().is_some()
    }
}

/// A node's `(host, port)`.
pub(crate) type Node = (String, u16);

/// Which master serves each slot, from `CLUSTER SLOTS`.
#[derive(Debug, Default)]
pub(crate) struct SlotMap {
    /// `(first slot, last slot, master)`, the master `None` when the
    /// cluster announces no usable address for it.
    ranges: Vec<(u16, u16, Option<Node>)>,
}

impl SlotMap {
    fn parse(answer: &Value) -> Result<Self, BackendError> {
        let bad = || {
            BackendError::message(
                BackendErrorKind::Protocol,
                "unexpected CLUSTER SLOTS answer",
            )
        };
        let Value::Array(entries) = answer else {
            return Err(bad());
        };
        let mut ranges = Vec::with_capacity(entries.len());
        for entry in entries {
            let Value::Array(fields) = entry else {
                return Err(bad());
            };
            let (Some(first), Some(last), Some(Value::Array(master))) =
                (fields.first(), fields.get(1), fields.get(2))
            else {
                return Err(bad());
            };
            let first: u16 = redis::from_redis_value(first).map_err(|_| bad())?;
            let last: u16 = redis::from_redis_value(last).map_err(|_| bad())?;
            let host = master
                .first()
                .and_then(|h| redis::from_redis_value::<String>(h).ok())
                .filter(|h| !h.is_empty() && h != "?");
            let port = master
                .get(1)
                .and_then(|p| redis::from_redis_value::<u16>(p).ok());
            ranges.push((first, last, host.zip(port)));
        }
        Ok(Self { ranges })
    }

    /// Every master that serves a slot, once each; `None` stands for the
    /// masters of ranges the cluster announces no usable address for.
    pub(crate) fn masters(&self) -> Vec<Option<Node>> {
        let mut masters: Vec<Option<Node>> = Vec::new();
        for (_, _, master) in &self.ranges {
            if !masters.contains(master) {
                masters.push(master.clone());
            }
        }
        masters
    }

    fn master_of(&self, slot: u16) -> Option<(String, u16)> {
        self.ranges
            .iter()
            .find(|(first, last, _)| (*first..=*last).contains(&slot))
            .and_then(|(_, _, master)| master.clone())
    }
}

impl fmt::Debug for RedisClusterBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never the client: its Debug would show the password.
        f.debug_struct("RedisClusterBackend")
            .field("nodes", &self.inner.nodes)
            .field(
                "password",
                &if self.inner.has_password {
                    "<redacted>"
                } else {
                    "<none>"
                },
            )
            .field("config", &self.inner.config)
            .field("connected", &self.inner.link.is_connected())
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
    }

    /// The acquisition script of [`RedisBackend`](crate::RedisBackend) on
    /// the master of the key's slot (the counter is in the same slot).
    /// Fails with kind [`Unavailable`](BackendErrorKind::Unavailable) when
    /// the cluster or the key's node could not be reached: nothing was sent.
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
        let answer = self
            .run_script(
                "acquisition",
                &ACQUIRE_SCRIPT,
                &[&lock_key, &fence],
                &[
                    owner.as_str(),
                    &ttl_ms(ttl),
                    &self.inner.config.fence_ttl_ms(ttl),
                ],
            )
            .await?;
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
        let answer = self
            .run_script(
                "extension",
                &EXTEND_SCRIPT,
                &[&lock_key, &fence_key(&lock_key)],
                &[
                    lease.owner().as_str(),
                    &ttl_ms(ttl),
                    &self.inner.config.fence_ttl_ms(ttl),
                    &lease.fencing_token().to_string(),
                ],
            )
            .await?;
        extend_outcome(answer)
    }

    /// The leases grouped by the master that serves their slot, one
    /// pipeline per master, the pipelines sent at once: one round trip per
    /// node. A group that meets a redirection (a slot moved since the slot
    /// map was read) is extended lease by lease instead; extensions can be
    /// repeated.
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
        let map = self
            .bounded("extension", |mut conn| async move {
                self.slot_map(&mut conn).await
            })
            .await;
        let map = match map {
            Ok(map) => map,
            Err(error) => return vec![Err(error); requests.len()],
        };
        let mut groups: HashMap<Option<(String, u16)>, Vec<(usize, String, &ExtendRequest)>> =
            HashMap::new();
        for (i, request) in requests.iter().enumerate() {
            let lock_key = self.lock_key(request.lease.key());
            let node = map.master_of(key_slot(&lock_key));
            groups.entry(node).or_default().push((i, lock_key, request));
        }
        // [L4] Each node's group under its own deadline, its failure its own.
        let batches = groups.into_iter().map(|(node, group)| {
            let positions: Vec<usize> = group.iter().map(|(i, _, _)| *i).collect();
            async move {
                let answer = self
                    .bounded("extension", move |conn| {
                        self.extend_group(conn, node, group)
                    })
                    .await;
                (positions, answer)
            }
        });
        let mut results: Vec<Option<Result<ExtendOutcome, BackendError>>> =
            vec![None; requests.len()];
        for (positions, answer) in futures_util::future::join_all(batches).await {
            match answer {
                Ok(group) => {
                    for (i, result) in group {
                        results[i] = Some(result);
                    }
                }
                Err(error) => {
                    for i in positions {
                        results[i] = Some(Err(error.clone()));
                    }
                }
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
    /// says; `0` until the map is read (after a redirection too).
    fn failure_domain(&self, key: &str) -> u64 {
        use std::hash::{BuildHasher, BuildHasherDefault, DefaultHasher};
        let map = self
            .inner
            .slots
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        map.and_then(|map| map.master_of(key_slot(&self.lock_key(key))))
            .map_or(0, |node| {
                BuildHasherDefault::<DefaultHasher>::default().hash_one(node)
            })
    }

    /// `DEL` if the key still holds the owner token, then `SPUBLISH` of the
    /// key on its slot's shard channel, in one script on the key's master.
    ///
    /// # Cancel safety
    ///
    /// A dropped call may or may not have released the key; calling again
    /// is safe.
    async fn release(&self, lease: &Lease) -> Result<ReleaseOutcome, BackendError> {
        let lock_key = self.lock_key(lease.key());
        let channel = slot_channel(key_slot(&lock_key), &self.inner.config.prefix);
        let answer = self
            .run_script(
                "release",
                &RELEASE_SCRIPT,
                &[&lock_key, &fence_key(&lock_key)],
                &[
                    lease.owner().as_str(),
                    &channel,
                    &self.inner.config.fence_idle_ms(),
                ],
            )
            .await?;
        release_outcome(answer)
    }

    /// The extension script with the time left of the minimum hold \[H7\]
    /// (Redis keeps no record of when a key was set). At least 1 ms, as
    /// `PEXPIRE 0` would delete the key.
    async fn hold(&self, lease: &Lease, hold: Hold) -> Result<ExtendOutcome, BackendError> {
        self.extend(lease, hold.from_now.max(Duration::from_millis(1)))
            .await
    }

    /// A watch on `key`, returned once the shard channel of the key's slot
    /// is subscribed on the node that serves it (`SSUBSCRIBE`, confirmed).
    /// Fails while the subscription connection is down, and after the step
    /// timeout if the channel cannot be subscribed; the driver then waits on
    /// its retry timer.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: the subscription belongs to the backend, not the call.
    async fn watch_release(&self, key: &str) -> Result<ReleaseWatch, BackendError> {
        let Some(subscription) = &self.inner.subscription else {
            return Ok(ReleaseWatch::never());
        };
        subscription.watch(key, key_slot(&self.lock_key(key))).await
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
    fn a_durability_setting_is_refused_not_ignored() {
        let config = RedisConfig::default()
            .durability(crate::Durability::new(1, Duration::from_millis(100)));
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
    }
}

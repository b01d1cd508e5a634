//! `RedisSentinelBackend`: the single-node backend on the primary that Redis
//! Sentinel names, looked up again whenever a connection breaks or answers
//! `READONLY` (a demoted primary still answers `PING`), and followed to the
//! primary a majority of the Sentinels announces (`+switch-master`, see
//! [`crate::sentinel_watch`]).

use std::fmt;
use std::sync::Arc;

use lock_core::{BackendError, BackendErrorKind};
use redis::aio::MultiplexedConnection;
use redis::sentinel::{SentinelClient, SentinelClientBuilder, SentinelServerType};
use redis::{ConnectionAddr, ConnectionInfo, ErrorKind, RedisConnectionInfo};

#[cfg(doc)]
use crate::backend::RedisBackend;
use crate::cluster_nodes::{address, Node};
use crate::config::{
    connect_error, is_auth_refusal, AuthenticationRefused, RedisConfig, SetupError,
};
use crate::plumbing::driver::Driver;
use crate::plumbing::errors::map_redis_error;
use crate::plumbing::redact;
use crate::plumbing::task::OnFirstUse;
use crate::sentinel_watch::{follow, Announcements, Sentinels};
use crate::single_node::{single_node_lock_backend, SingleNode, Source};
use crate::subscription::PubSubTarget;
use crate::tls::Trust;

/// How to reach a Redis deployment behind Sentinel: the Sentinels and
/// their credentials, the master name, and the credentials, database and
/// TLS of the data nodes (the primary and its replicas), which are not the
/// Sentinels' own.
///
/// ```
/// use lock_redis::SentinelConfig;
///
/// # fn main() -> Result<(), lock_redis::SetupError> {
/// // The Sentinels' password is in their URLs; the data nodes' is set apart.
/// let sentinel = SentinelConfig::new(
///     "mymaster",
///     ["redis://:sentinel-pw@10.0.0.1:26379", "redis://:sentinel-pw@10.0.0.2:26379"],
/// )?
/// .data_node_username("locks")
/// .data_node_password("data-pw")
/// .data_node_db(0);
/// let shown = format!("{sentinel:?}");
/// assert!(!shown.contains("pw@") && shown.contains("<redacted>"));
/// # Ok(()) }
/// ```
///
/// | setting | default |
/// |---|---|
/// | Sentinels' username and password | from their URLs (none) |
/// | [`data_node_username`](Self::data_node_username) | none (the `default` user) |
/// | [`data_node_password`](Self::data_node_password) | none |
/// | [`data_node_db`](Self::data_node_db) | 0 |
/// | `data_node_tls` (feature `tls`) | TLS when the Sentinel URLs are `rediss://` |
/// | `tls_certificates` (feature `tls`) | the system's roots |
///
/// `Debug` shows whether each password is set, never the password.
#[derive(Clone)]
pub struct SentinelConfig {
    master_name: String,
    sentinels: Vec<ConnectionAddr>,
    sentinel_username: Option<String>,
    sentinel_password: Option<String>,
    data_node_username: Option<String>,
    data_node_password: Option<String>,
    data_node_db: i64,
    data_node_tls: bool,
    trust: Trust,
}

impl SentinelConfig {
    /// The Sentinels at `sentinel_urls` (`redis://[[user]:password@]host:26379`,
    /// `rediss://…` with the `tls` feature), asked for the primary of
    /// `master_name`. The username and password in the URLs are the
    /// Sentinels' own (their `requirepass`), so they must be the same in
    /// every URL; a database in them is ignored (Sentinels have none).
    ///
    /// # Errors
    ///
    /// [`SetupError::NoSentinels`] for an empty list,
    /// [`SetupError::InvalidUrl`] when a URL does not parse (or is
    /// `rediss://` without the `tls` feature), and
    /// [`SetupError::SentinelCredentialsDiffer`].
    pub fn new<T: AsRef<str>>(
        master_name: &str,
        sentinel_urls: impl IntoIterator<Item = T>,
    ) -> Result<Self, SetupError> {
        use redis::IntoConnectionInfo;
        let infos = sentinel_urls
            .into_iter()
            .map(|url| url.as_ref().into_connection_info())
            .collect::<Result<Vec<_>, _>>()
            .map_err(SetupError::InvalidUrl)?;
        let first = infos.first().ok_or(SetupError::NoSentinels)?;
        let (sentinel_username, sentinel_password) =
            (first.redis.username.clone(), first.redis.password.clone());
        if infos
            .iter()
            .any(|i| i.redis.username != sentinel_username || i.redis.password != sentinel_password)
        {
            return Err(SetupError::SentinelCredentialsDiffer);
        }
        let data_node_tls = infos
            .iter()
            .any(|i| matches!(i.addr, ConnectionAddr::TcpTls { .. }));
        Ok(Self {
            master_name: master_name.to_owned(),
            sentinels: infos.into_iter().map(|i| i.addr).collect(),
            sentinel_username,
            sentinel_password,
            data_node_username: None,
            data_node_password: None,
            data_node_db: 0,
            data_node_tls,
            trust: Trust::system(),
        })
    }

    /// The username the data nodes are reached with (an ACL user).
    /// Defaults to none: the `default` user.
    #[must_use]
    pub fn data_node_username(mut self, username: impl Into<String>) -> Self {
        self.data_node_username = Some(username.into());
        self
    }

    /// The password the data nodes are reached with: their `requirepass`,
    /// or the ACL user's password. Defaults to none.
    #[must_use]
    pub fn data_node_password(mut self, password: impl Into<String>) -> Self {
        self.data_node_password = Some(password.into());
        self
    }

    /// The database the locks live in on the data nodes. Defaults to 0.
    #[must_use]
    pub fn data_node_db(mut self, db: i64) -> Self {
        self.data_node_db = db;
        self
    }

    /// Whether the data nodes are reached over TLS, at the address the
    /// Sentinels give (its certificate must name that address). Defaults
    /// to TLS when the Sentinel URLs are `rediss://`.
    #[cfg(feature = "tls")]
    #[must_use]
    pub fn data_node_tls(mut self, on: bool) -> Self {
        self.data_node_tls = on;
        self
    }

    /// The certificates trusted for TLS, instead of the system's roots: a
    /// private CA's certificate in PEM (`root_cert`), and a client
    /// certificate for servers that ask for one (`client_tls`). Used for
    /// the data nodes over TLS and for `rediss://` Sentinels. Defaults to
    /// the system's roots.
    #[cfg(feature = "tls")]
    #[must_use]
    pub fn tls_certificates(mut self, certificates: redis::TlsCertificates) -> Self {
        self.trust = Trust::custom(certificates);
        self
    }

    /// The master name the Sentinels are asked about.
    pub fn master_name(&self) -> &str {
        &self.master_name
    }

    /// How each Sentinel is reached: its address, the Sentinels'
    /// credentials, and the certificates for `rediss://` ones.
    fn sentinel_infos(&self) -> Result<Vec<ConnectionInfo>, SetupError> {
        self.sentinels
            .iter()
            .map(|addr| {
                let info = ConnectionInfo {
                    addr: addr.clone(),
                    redis: RedisConnectionInfo {
                        username: self.sentinel_username.clone(),
                        password: self.sentinel_password.clone(),
                        ..RedisConnectionInfo::default()
                    },
                };
                if matches!(addr, ConnectionAddr::TcpTls { .. }) {
                    self.trust.apply(info)
                } else {
                    Ok(info)
                }
            })
            .collect()
    }

    /// How the data node at `node` is reached: its credentials, database
    /// and TLS.
    fn data_node_info(&self, (host, port): &Node) -> Result<ConnectionInfo, SetupError> {
        let addr = if self.data_node_tls {
            ConnectionAddr::TcpTls {
                host: host.clone(),
                port: *port,
                insecure: false,
                tls_params: None,
            }
        } else {
            ConnectionAddr::Tcp(host.clone(), *port)
        };
        let info = ConnectionInfo {
            addr,
            redis: RedisConnectionInfo {
                db: self.data_node_db,
                username: self.data_node_username.clone(),
                password: self.data_node_password.clone(),
                ..RedisConnectionInfo::default()
            },
        };
        if self.data_node_tls {
            self.trust.apply(info)
        } else {
            Ok(info)
        }
    }

    /// The `redis` crate's client for the primary.
    fn client(&self) -> Result<SentinelClient, SetupError> {
        let mut builder = SentinelClientBuilder::new(
            self.sentinels.clone(),
            self.master_name.clone(),
            SentinelServerType::Master,
        )
        .map_err(SetupError::InvalidUrl)?;
        if let Some(username) = &self.sentinel_username {
            builder = builder.set_client_to_sentinel_username(username.clone());
        }
        if let Some(password) = &self.sentinel_password {
            builder = builder.set_client_to_sentinel_password(password.clone());
        }
        if let Some(username) = &self.data_node_username {
            builder = builder.set_client_to_redis_username(username.clone());
        }
        if let Some(password) = &self.data_node_password {
            builder = builder.set_client_to_redis_password(password.clone());
        }
        builder = builder.set_client_to_redis_db(self.data_node_db);
        if self.data_node_tls {
            builder = builder.set_client_to_redis_tls_mode(redis::TlsMode::Secure);
        }
        #[cfg(feature = "tls")]
        if let Some(certificates) = self.trust.certificates() {
            self.trust.validate()?;
            let tls_sentinels = self
                .sentinels
                .iter()
                .any(|a| matches!(a, ConnectionAddr::TcpTls { .. }));
            if !self.data_node_tls && !tls_sentinels {
                return Err(SetupError::Tls(redis::RedisError::from((
                    ErrorKind::InvalidClientConfig,
                    "TLS certificates given, but neither the Sentinels (redis:// URLs) nor the data nodes (data_node_tls off) use TLS",
                ))));
            }
            builder = builder.set_client_to_redis_certificates(certificates.clone());
            if tls_sentinels {
                builder = builder.set_client_to_sentinel_certificates(certificates.clone());
            }
        }
        // What the builder checks is TLS: modes and certificates against
        // the Sentinels' schemes, and the certificates' PEM.
        builder.build().map_err(SetupError::Tls)
    }
}

impl fmt::Debug for SentinelConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Addresses only (`host:port`): a URL could carry the password.
        let sentinels: Vec<String> = self.sentinels.iter().map(ToString::to_string).collect();
        f.debug_struct("SentinelConfig")
            .field("master_name", &self.master_name)
            .field("sentinels", &sentinels)
            .field("sentinel_username", &self.sentinel_username)
            .field(
                "sentinel_password",
                &redact::secret(self.sentinel_password.is_some()),
            )
            .field("data_node_username", &self.data_node_username)
            .field(
                "data_node_password",
                &redact::secret(self.data_node_password.is_some()),
            )
            .field("data_node_db", &self.data_node_db)
            .field("data_node_tls", &self.data_node_tls)
            .field("trust", &self.trust.describe())
            .finish()
    }
}

/// Where a Sentinel backend's connections go: the primary of the master
/// name as the Sentinels say now.
pub(crate) struct SentinelSource {
    config: SentinelConfig,
    client: tokio::sync::Mutex<SentinelClient>,
    /// What the Sentinels announce, followed by a task started at the
    /// first look-up (see [`crate::sentinel_watch`]).
    announcements: Arc<Announcements>,
    follower: OnFirstUse<Sentinels>,
    /// Where the client's connections to the Sentinels (which it keeps
    /// between look-ups) are made and driven, and the follower runs.
    driver: Driver,
}

impl SentinelSource {
    fn new(config: SentinelConfig, redis: &RedisConfig) -> Result<Self, SetupError> {
        let client = config.client()?;
        let sentinels = Sentinels {
            infos: config.sentinel_infos()?,
            timeout: redis.step_timeout,
            health_check_interval: redis.health_check_interval,
            max_reconnect_delay: redis.max_reconnect_delay,
        };
        Ok(Self {
            announcements: Arc::new(Announcements::new(
                &config.master_name,
                config.sentinels.len(),
            )),
            follower: OnFirstUse::new(sentinels),
            config,
            client: tokio::sync::Mutex::new(client),
            driver: Driver::default(),
        })
    }

    /// A client for the primary: the one a majority of the Sentinels names
    /// now, as their announcements and the follower's reads say; else
    /// asked of the Sentinels now, and the `redis` crate checks that the
    /// server it names says it is a master (`ROLE`). Failures are
    /// [`Unavailable`](BackendErrorKind::Unavailable): nothing was sent to
    /// the primary; refused credentials and certificates are
    /// [`Setup`](BackendErrorKind::Setup), and say whose.
    pub(crate) async fn master(&self) -> Result<redis::Client, BackendError> {
        self.follow();
        let client = match self.announcements.agreed() {
            Some(node) => redis::Client::open(
                self.config
                    .data_node_info(&node)
                    .map_err(BackendError::setup)?,
            )
            .map_err(BackendError::unavailable)?,
            None => self.driver.making(self.ask_master()).await?,
        };
        if let Some(node) = address(&client.get_connection_info().addr) {
            self.announcements.following(node);
        }
        Ok(client)
    }

    /// Starts following the Sentinels' announcements, the first time.
    fn follow(&self) {
        let announcements = Arc::clone(&self.announcements);
        let master_name = self.config.master_name.clone();
        self.follower.start(&self.driver, move |sentinels| {
            (follow(announcements, sentinels), move || {
                tracing::debug!(%master_name, "following the Sentinels ended");
            })
        });
    }

    /// Changes each time a majority of the Sentinels names another primary
    /// than the one the connections go to.
    pub(crate) fn switch_changes(&self) -> tokio::sync::watch::Receiver<u64> {
        self.announcements.switch_changes()
    }

    async fn ask_master(&self) -> Result<redis::Client, BackendError> {
        let mut client = self.client.lock().await;
        match client.async_get_client().await {
            Ok(master) => Ok(master),
            Err(error) if is_auth_refusal(&error) => {
                // The crate's error does not say whether a Sentinel or the
                // primary refused: a Sentinel that takes its credentials
                // clears the Sentinels.
                let refused_by = match client.async_get_sentinel_client().await {
                    Err(e) if is_auth_refusal(&e) => "the Sentinels",
                    _ => "the primary named by the Sentinels",
                };
                // [A8] Trying again cannot help.
                Err(BackendError::setup(AuthenticationRefused::new(
                    refused_by, error,
                )))
            }
            Err(error) => Err(crate::config::connection_error(error)),
        }
    }
}

impl Source for SentinelSource {
    /// A new connection to the primary the Sentinels name now.
    async fn connection(&self) -> Result<MultiplexedConnection, BackendError> {
        self.master()
            .await?
            .get_multiplexed_async_connection()
            .await
            .map_err(crate::config::connection_error)
    }

    /// Counts the times a majority of the Sentinels named another primary.
    fn switches(&self) -> u64 {
        self.announcements.switches()
    }

    /// Whether the data nodes are reached with a password.
    fn has_password(&self) -> bool {
        self.config.data_node_password.is_some()
    }
}

impl fmt::Debug for SentinelSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.config.fmt(f)
    }
}

/// A lock backend on a Redis primary behind Sentinel: the steps, keys and
/// scripts of [`RedisBackend`], on the primary that the Sentinels name for
/// a master name. After a failover the backend follows: a connection that
/// breaks, or that answers `READONLY` (its server was demoted to a replica
/// and still answers `PING`), is dropped, and the next step asks the
/// Sentinels again. The release subscription follows the same way.
///
/// Replication is asynchronous: a lock taken just before the primary
/// fails may be missing on the promoted replica, and then another node can
/// take it. [`RedisConfig::durability`] makes each acquisition wait for
/// replicas (`WAIT`) and count as failed when too few acknowledged it.
///
/// Cheap to clone; clones share the connection and the subscription.
#[derive(Clone)]
pub struct RedisSentinelBackend {
    steps: SingleNode<Arc<SentinelSource>>,
}

single_node_lock_backend!(RedisSentinelBackend => steps);

/// The admin functions of [`RedisBackend`] (see its `LockAdmin`), on the
/// primary the Sentinels name.
#[lock_core::async_trait]
impl lock_core::LockAdmin for RedisSentinelBackend {
    async fn list_locks(&self, prefix: &str) -> Result<Vec<lock_core::LockInfo>, BackendError> {
        self.steps.list_locks(prefix).await
    }

    async fn inspect(&self, key: &str) -> Result<lock_core::LockInfo, BackendError> {
        self.steps.inspect(key).await
    }

    async fn force_release(
        &self,
        key: &str,
    ) -> Result<Option<lock_core::LockInfo>, lock_core::AdminError> {
        self.steps.force_release(key).await
    }
}

impl RedisSentinelBackend {
    /// A backend on the primary that the Sentinels at `sentinel_urls`
    /// (`redis://[:password@]host:26379`) name `master_name`, with the
    /// default [`RedisConfig`]. A password in the URLs is the Sentinels'
    /// own; the primary and its replicas are reached without one: for data
    /// nodes with a password, a database or TLS, use
    /// [`with_config`](Self::with_config) and a [`SentinelConfig`].
    /// Nothing connects yet.
    ///
    /// # Errors
    ///
    /// As [`SentinelConfig::new`].
    pub fn from_urls<T: AsRef<str>>(
        master_name: &str,
        sentinel_urls: impl IntoIterator<Item = T>,
    ) -> Result<Self, SetupError> {
        Self::from_urls_with(master_name, sentinel_urls, RedisConfig::default())
    }

    /// [`from_urls`](Self::from_urls) with `config`.
    ///
    /// # Errors
    ///
    /// As [`from_urls`](Self::from_urls), and [`SetupError::InvalidConfig`].
    pub fn from_urls_with<T: AsRef<str>>(
        master_name: &str,
        sentinel_urls: impl IntoIterator<Item = T>,
        config: RedisConfig,
    ) -> Result<Self, SetupError> {
        Self::with_config(SentinelConfig::new(master_name, sentinel_urls)?, config)
    }

    /// A backend on the primary that `sentinel` leads to, with `config`:
    /// the data nodes reached with the credentials, database and TLS of
    /// `sentinel`. Nothing connects yet.
    ///
    /// # Errors
    ///
    /// [`SetupError::InvalidConfig`], and [`SetupError::Tls`] when the TLS
    /// settings cannot be used.
    pub fn with_config(sentinel: SentinelConfig, config: RedisConfig) -> Result<Self, SetupError> {
        config.validate()?;
        crate::durability::validate(&config)?;
        let source = Arc::new(SentinelSource::new(sentinel, &config)?);
        let pubsub = PubSubTarget::Sentinel(Arc::clone(&source));
        Ok(Self {
            steps: SingleNode::new(source, pubsub, false, config),
        })
    }

    /// Like [`from_urls`](Self::from_urls), and checks at once that a
    /// Sentinel answers, knows `master_name`, that its primary answers, and
    /// that it has the replicas [`RedisConfig::durability`] waits for.
    ///
    /// # Errors
    ///
    /// As [`from_urls`](Self::from_urls), and [`SetupError::UnknownSentinelMaster`],
    /// [`SetupError::NotEnoughReplicas`], [`SetupError::AuthenticationRefused`]
    /// when the Sentinels or the primary refuse the credentials,
    /// [`SetupError::Connect`] when no Sentinel or the primary cannot be
    /// reached (or a TLS handshake fails).
    ///
    /// # Cancel safety
    ///
    /// Dropping the future drops the backend being made; nothing is left.
    pub async fn connect<T: AsRef<str>>(
        master_name: &str,
        sentinel_urls: impl IntoIterator<Item = T>,
    ) -> Result<Self, SetupError> {
        Self::connect_with(master_name, sentinel_urls, RedisConfig::default()).await
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
        master_name: &str,
        sentinel_urls: impl IntoIterator<Item = T>,
        config: RedisConfig,
    ) -> Result<Self, SetupError> {
        Self::connect_with_config(SentinelConfig::new(master_name, sentinel_urls)?, config).await
    }

    /// [`with_config`](Self::with_config), and the checks of
    /// [`connect`](Self::connect).
    ///
    /// # Errors
    ///
    /// As [`with_config`](Self::with_config) and [`connect`](Self::connect).
    ///
    /// # Cancel safety
    ///
    /// As [`connect`](Self::connect).
    pub async fn connect_with_config(
        sentinel: SentinelConfig,
        config: RedisConfig,
    ) -> Result<Self, SetupError> {
        let backend = Self::with_config(sentinel, config)?;
        let source = backend.steps.source();
        let timeout = backend.config().step_timeout;
        let looked_up = tokio::time::timeout(timeout, source.master()).await;
        match looked_up {
            Ok(Ok(_)) => {}
            Ok(Err(error)) => {
                let unknown = crate::plumbing::errors::redis_error_of(error.inner())
                    .is_some_and(|e| e.kind() == ErrorKind::MasterNameNotFoundBySentinel);
                return Err(if unknown {
                    SetupError::UnknownSentinelMaster {
                        name: backend.master_name().to_owned(),
                    }
                } else {
                    connect_error(error, "the Sentinels")
                });
            }
            Err(_) => {
                return Err(SetupError::Connect(BackendError::timeout(
                    "asking the Sentinels",
                    timeout,
                )))
            }
        }
        backend.steps.check_primary().await?;
        Ok(backend)
    }

    /// The master name the Sentinels are asked about.
    pub fn master_name(&self) -> &str {
        self.steps.source().config.master_name()
    }

    /// The configuration the backend was made with.
    pub fn config(&self) -> &RedisConfig {
        self.steps.config()
    }

    /// The Redis key that holds the lock of `key` (see
    /// [`RedisBackend::lock_key`]).
    pub fn lock_key<'k>(&self, key: &'k str) -> std::borrow::Cow<'k, str> {
        self.steps.lock_key(key)
    }

    /// The Redis key of the fencing counter of `key` (see
    /// [`RedisBackend::fence_key`]).
    pub fn fence_key(&self, key: &str) -> String {
        crate::slot::fence_key(&self.lock_key(key))
    }

    /// The Redis key of the record of `key`'s minimum hold (see
    /// [`RedisBackend::kept_key`]).
    pub fn kept_key(&self, key: &str) -> String {
        crate::slot::kept_key(&self.lock_key(key))
    }

    /// Whether the release subscription is in place now.
    pub fn is_subscribed(&self) -> bool {
        self.steps.is_subscribed()
    }

    /// The per-key structures and their sizes now, as
    /// [`RedisBackend::state_counts`] (not a stable interface).
    #[doc(hidden)]
    pub fn state_counts(&self) -> Vec<(&'static str, usize)> {
        self.steps.state_counts()
    }
}

impl fmt::Debug for RedisSentinelBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut shown = f.debug_struct("RedisSentinelBackend");
        shown.field("sentinel", self.steps.source());
        self.steps
            .describe(&mut shown)
            .field("subscribed", &self.is_subscribed())
            .finish()
    }
}

/// How many replicas are connected to the primary behind `conn`, from
/// `INFO replication`.
pub(crate) async fn connected_replicas(
    conn: &mut MultiplexedConnection,
) -> Result<u32, BackendError> {
    let info: String = redis::cmd("INFO")
        .arg("replication")
        .query_async(conn)
        .await
        .map_err(map_redis_error)?;
    info.lines()
        .find_map(|line| line.strip_prefix("connected_slaves:"))
        .and_then(|n| n.trim().parse().ok())
        .ok_or_else(|| {
            BackendError::message(
                BackendErrorKind::Protocol,
                "INFO replication has no connected_slaves",
            )
        })
}

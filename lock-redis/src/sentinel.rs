//! `RedisSentinelBackend`: the single-node backend on the primary that Redis
//! Sentinel names, looked up again whenever a connection breaks or answers
//! `READONLY` (a demoted primary still answers `PING`).

use std::fmt;

use lock_core::{BackendError, BackendErrorKind};
use redis::aio::MultiplexedConnection;
use redis::sentinel::{SentinelClient, SentinelServerType};
use redis::{ConnectionInfo, ErrorKind};

use crate::backend::{map_redis_error, RedisBackend};
use crate::config::{RedisConfig, SetupError};

/// Where a Sentinel backend's connections go: the primary of `master_name`
/// as the Sentinels say now.
pub(crate) struct SentinelSource {
    master_name: String,
    sentinels: Vec<String>,
    client: tokio::sync::Mutex<SentinelClient>,
}

impl SentinelSource {
    fn new(master_name: &str, infos: Vec<ConnectionInfo>) -> Result<Self, SetupError> {
        if infos.is_empty() {
            return Err(SetupError::NoSentinels);
        }
        let sentinels = infos.iter().map(|i| i.addr.to_string()).collect();
        let client = SentinelClient::build(
            infos,
            master_name.to_owned(),
            None,
            SentinelServerType::Master,
        )
        .map_err(SetupError::InvalidUrl)?;
        Ok(Self {
            master_name: master_name.to_owned(),
            sentinels,
            client: tokio::sync::Mutex::new(client),
        })
    }

    /// A client for the primary, asked of the Sentinels now; the `redis`
    /// crate checks that the server it names says it is a master (`ROLE`).
    /// Failures are [`Unavailable`](BackendErrorKind::Unavailable): nothing
    /// was sent to the primary.
    pub(crate) async fn master(&self) -> Result<redis::Client, BackendError> {
        self.client
            .lock()
            .await
            .async_get_client()
            .await
            .map_err(BackendError::unavailable)
    }

    /// A new connection to the primary.
    pub(crate) async fn connection(&self) -> Result<MultiplexedConnection, BackendError> {
        self.master()
            .await?
            .get_multiplexed_async_connection()
            .await
            .map_err(BackendError::unavailable)
    }
}

impl fmt::Debug for SentinelSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Sentinel")
            .field("master_name", &self.master_name)
            .field("sentinels", &self.sentinels)
            .finish()
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
    backend: RedisBackend,
}

lock_core::forward_lock_backend!(RedisSentinelBackend => backend);
// The admin functions of the backend it wraps, on the primary the
// Sentinels name (see `impl LockAdmin for RedisBackend`).
lock_core::forward_lock_admin!(RedisSentinelBackend => backend);

impl RedisSentinelBackend {
    /// A backend on the primary that the Sentinels at `sentinel_urls`
    /// (`redis://host:26379`) name `master_name`, with the default
    /// [`RedisConfig`]. The primary and its replicas are reached without a
    /// password. Nothing connects yet.
    ///
    /// # Errors
    ///
    /// [`SetupError::NoSentinels`] for an empty list, and
    /// [`SetupError::InvalidUrl`] when a URL does not parse.
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
        use redis::IntoConnectionInfo;
        config.validate()?;
        let infos = sentinel_urls
            .into_iter()
            .map(|url| url.as_ref().into_connection_info())
            .collect::<Result<Vec<_>, _>>()
            .map_err(SetupError::InvalidUrl)?;
        let source = SentinelSource::new(master_name, infos)?;
        Ok(Self {
            backend: RedisBackend::on_sentinel(source, config)?,
        })
    }

    /// Like [`from_urls`](Self::from_urls), and checks at once that a
    /// Sentinel answers, knows `master_name`, that its primary answers, and
    /// that it has the replicas [`RedisConfig::durability`] waits for.
    ///
    /// # Errors
    ///
    /// As [`from_urls`](Self::from_urls), and [`SetupError::UnknownSentinelMaster`],
    /// [`SetupError::NotEnoughReplicas`], [`SetupError::Connect`] when no
    /// Sentinel or the primary cannot be reached.
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
        let backend = Self::from_urls_with(master_name, sentinel_urls, config)?;
        let source = backend.backend.sentinel().ok_or(SetupError::NoSentinels)?;
        let timeout = backend.config().step_timeout;
        let looked_up = tokio::time::timeout(timeout, source.master()).await;
        match looked_up {
            Ok(Ok(_)) => {}
            Ok(Err(error)) => {
                let unknown = error
                    .inner()
                    .downcast_ref::<redis::RedisError>()
                    .is_some_and(|e| e.kind() == ErrorKind::MasterNameNotFoundBySentinel);
                return Err(if unknown {
                    SetupError::UnknownSentinelMaster {
                        name: master_name.to_owned(),
                    }
                } else {
                    SetupError::Connect(error)
                });
            }
            Err(_) => {
                return Err(SetupError::Connect(BackendError::timeout(
                    "asking the Sentinels",
                    timeout,
                )))
            }
        }
        backend.backend.check_primary().await?;
        Ok(backend)
    }

    /// The master name the Sentinels are asked about.
    pub fn master_name(&self) -> &str {
        self.backend
            .sentinel()
            .map_or("", |source| source.master_name.as_str())
    }

    /// The configuration the backend was made with.
    pub fn config(&self) -> &RedisConfig {
        self.backend.config()
    }

    /// The Redis key that holds the lock of `key` (see
    /// [`RedisBackend::lock_key`]).
    pub fn lock_key<'k>(&self, key: &'k str) -> std::borrow::Cow<'k, str> {
        self.backend.lock_key(key)
    }

    /// The Redis key of the fencing counter of `key` (see
    /// [`RedisBackend::fence_key`]).
    pub fn fence_key(&self, key: &str) -> String {
        self.backend.fence_key(key)
    }

    /// Whether the release subscription is in place now.
    pub fn is_subscribed(&self) -> bool {
        self.backend.is_subscribed()
    }
}

impl fmt::Debug for RedisSentinelBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("RedisSentinelBackend")
            .field(&self.backend)
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

//! The backend's configuration and the errors of setting it up.

use std::time::Duration;

/// How a [`RedisBackend`](crate::RedisBackend) names its keys and bounds its
/// round trips. Plain data; every field has a documented default.
///
/// | field | default |
/// |---|---|
/// | [`prefix`](Self::prefix) | `""` (the lock is the key itself) |
/// | [`step_timeout`](Self::step_timeout) | 2 s |
/// | [`release_notifications`](Self::release_notifications) | `true` |
/// | [`max_extend_batch`](Self::max_extend_batch) | 500 |
/// | [`health_check_interval`](Self::health_check_interval) | 5 s |
/// | [`max_reconnect_delay`](Self::max_reconnect_delay) | 2 s |
/// | [`durability`](Self::durability) | none |
/// | [`batch_steps`](Self::batch_steps) | `true` |
/// | [`fence_idle`](Self::fence_idle) | 7 days |
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
#[cfg_attr(
    feature = "serde",
    derive(serde::Serialize, serde::Deserialize),
    serde(default, deny_unknown_fields)
)]
pub struct RedisConfig {
    /// Put before every lock key, and before the release channel's name.
    /// Nodes that share locks must use the same prefix.
    ///
    /// Default: empty: the lock of key `k` is the Redis key `k`.
    pub prefix: String,
    /// The longest any one Redis round trip may take, taking a pooled
    /// connection included; a step that takes longer fails with a
    /// [`BackendError`](lock_core::BackendError) of kind `Timeout`, so a cut
    /// or hung connection never hangs a step.
    ///
    /// Default: 2 s.
    #[cfg_attr(feature = "serde", serde(with = "humantime_serde"))]
    pub step_timeout: Duration,
    /// Whether waiters learn of releases over pub/sub (one subscription
    /// connection per backend). When off, waiters poll on their retry
    /// timer only; releases are still published for other nodes.
    ///
    /// Default: `true`.
    pub release_notifications: bool,
    /// How many leases one `extend_many` call carries: one pipeline of that
    /// many script calls, one round trip.
    ///
    /// Default: 500.
    pub max_extend_batch: usize,
    /// How often the subscription connection is pinged, so that a hung
    /// connection is noticed and replaced.
    ///
    /// Default: 5 s.
    #[cfg_attr(feature = "serde", serde(with = "humantime_serde"))]
    pub health_check_interval: Duration,
    /// The longest pause between two attempts to re-establish the
    /// subscription; pauses start at 50 ms and double.
    ///
    /// Default: 2 s.
    #[cfg_attr(feature = "serde", serde(with = "humantime_serde"))]
    pub max_reconnect_delay: Duration,
    /// After each acquisition, wait for this many replicas to acknowledge
    /// it (`WAIT`), and count the attempt as failed, releasing the lock,
    /// when fewer did in time: see [`Durability`](crate::Durability). For a
    /// primary with replicas (Sentinel), or a cluster (`WAIT` on the key's
    /// master).
    ///
    /// Default: `None`: no waiting; a failover may lose a lock just taken.
    pub durability: Option<crate::Durability>,
    /// Whether concurrent acquisitions (and releases) beyond the first two
    /// on the wire go out together, as one script run over all their keys.
    /// It changes no answer; under load the server does a fraction of the
    /// work. Turn it off behind a proxy that routes each command by its
    /// keys' hash slot (such a batch spans slots); a cluster needs
    /// [`RedisClusterBackend`](crate::RedisClusterBackend), which batches
    /// per master as a pipeline of one-key script calls.
    ///
    /// Default: `true`.
    pub batch_steps: bool,
    /// How long a key's fencing companion (`{T}:withlock-fence:<key>`, the
    /// counter its tokens are drawn from) outlives the last use of its
    /// lock. Each acquisition and extension sets the companion's expiry to
    /// the lock's ttl plus this, so it never expires while the lock is
    /// held (an extension puts back a companion lost meanwhile); a release
    /// leaves it, so the companion lives at least this long after the
    /// release and at most the ttl longer (a forced release sets it to
    /// this). A companion that expired costs nothing: tokens
    /// are at least the server clock in microseconds, so they keep
    /// increasing, unless the server clock stepped back by more than this
    /// (see the crate docs, "The fencing counter").
    ///
    /// Between 1 ms and 100 years. Default: 7 days.
    #[cfg_attr(feature = "serde", serde(with = "humantime_serde"))]
    pub fence_idle: Duration,
}

/// The default of [`RedisConfig::fence_idle`]: 7 days.
const DEFAULT_FENCE_IDLE: Duration = Duration::from_secs(7 * 24 * 3600);

/// The longest [`RedisConfig::fence_idle`]: 100 years, so that a
/// companion's expiry always fits the server's clock arithmetic.
const MAX_FENCE_IDLE: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

impl Default for RedisConfig {
    fn default() -> Self {
        Self {
            prefix: String::new(),
            step_timeout: Duration::from_secs(2),
            release_notifications: true,
            max_extend_batch: 500,
            health_check_interval: Duration::from_secs(5),
            max_reconnect_delay: Duration::from_secs(2),
            durability: None,
            batch_steps: true,
            fence_idle: DEFAULT_FENCE_IDLE,
        }
    }
}

impl RedisConfig {
    /// Sets [`batch_steps`](Self::batch_steps). Defaults to `true`.
    #[must_use]
    pub fn batch_steps(mut self, on: bool) -> Self {
        self.batch_steps = on;
        self
    }

    /// Sets [`prefix`](Self::prefix). Defaults to none.
    #[must_use]
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// Sets [`step_timeout`](Self::step_timeout). Defaults to 2 s.
    #[must_use]
    pub fn step_timeout(mut self, timeout: Duration) -> Self {
        self.step_timeout = timeout;
        self
    }

    /// Sets [`release_notifications`](Self::release_notifications).
    /// Defaults to `true`.
    #[must_use]
    pub fn release_notifications(mut self, on: bool) -> Self {
        self.release_notifications = on;
        self
    }

    /// Sets [`max_extend_batch`](Self::max_extend_batch). Defaults to 500.
    #[must_use]
    pub fn max_extend_batch(mut self, n: usize) -> Self {
        self.max_extend_batch = n;
        self
    }

    /// Sets [`health_check_interval`](Self::health_check_interval).
    /// Defaults to 5 s.
    #[must_use]
    pub fn health_check_interval(mut self, every: Duration) -> Self {
        self.health_check_interval = every;
        self
    }

    /// Sets [`max_reconnect_delay`](Self::max_reconnect_delay). Defaults to 2 s.
    #[must_use]
    pub fn max_reconnect_delay(mut self, delay: Duration) -> Self {
        self.max_reconnect_delay = delay;
        self
    }

    /// Sets [`durability`](Self::durability). Defaults to none.
    #[must_use]
    pub fn durability(mut self, durability: crate::Durability) -> Self {
        self.durability = Some(durability);
        self
    }

    /// Sets [`fence_idle`](Self::fence_idle). Defaults to 7 days.
    #[must_use]
    pub fn fence_idle(mut self, idle: Duration) -> Self {
        self.fence_idle = idle;
        self
    }

    /// The companion's ttl for a lock taken or extended for `ttl`, in
    /// milliseconds, as the scripts take it.
    pub(crate) fn fence_ttl_ms(&self, ttl: Duration) -> String {
        crate::plumbing::scripts::ttl_ms(ttl.saturating_add(self.fence_idle))
    }

    /// The companion's ttl after a release, in milliseconds.
    pub(crate) fn fence_idle_ms(&self) -> String {
        crate::plumbing::scripts::ttl_ms(self.fence_idle)
    }

    pub(crate) fn validate(&self) -> Result<(), SetupError> {
        let invalid = |field| {
            Err(SetupError::InvalidConfig {
                field,
                reason: "is zero",
            })
        };
        if self.step_timeout.is_zero() {
            return invalid("step_timeout");
        }
        if self.max_extend_batch == 0 {
            return invalid("max_extend_batch");
        }
        if self.health_check_interval.is_zero() {
            return invalid("health_check_interval");
        }
        if self.max_reconnect_delay.is_zero() {
            return invalid("max_reconnect_delay");
        }
        if self.fence_idle < Duration::from_millis(1) {
            return Err(SetupError::InvalidConfig {
                field: "fence_idle",
                reason: "is under 1 ms",
            });
        }
        if self.fence_idle > MAX_FENCE_IDLE {
            return Err(SetupError::InvalidConfig {
                field: "fence_idle",
                reason: "is over 100 years",
            });
        }
        Ok(())
    }
}

/// Why a [`RedisBackend`](crate::RedisBackend) could not be made. Only
/// [`connect`](crate::RedisBackend::connect) connects while making one;
/// otherwise an unreachable server or a wrong password shows at the first
/// lock call. Never shows a URL or password.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SetupError {
    /// The URL is not a Redis URL.
    #[error("invalid Redis URL")]
    InvalidUrl(#[source] redis::RedisError),
    /// The connection pool could not be made.
    #[error("the Redis connection pool could not be made")]
    Pool(#[source] deadpool_redis::CreatePoolError),
    /// A field of [`RedisConfig`] is out of range.
    #[error("invalid lock-redis config: {field} {reason}")]
    InvalidConfig {
        /// The field.
        field: &'static str,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// The server could not be reached, or refused the connection (from
    /// [`connect`](crate::RedisBackend::connect)).
    #[error("could not connect to Redis")]
    Connect(#[source] lock_core::BackendError),
    /// A Redis Cluster backend was given no node URL.
    #[error("no Redis Cluster node URL given")]
    NoClusterNodes,
    /// A node given to a Redis Cluster backend runs without cluster support
    /// (from [`RedisClusterBackend::connect`](crate::RedisClusterBackend::connect)).
    #[error("the Redis server at {node} is not a cluster node (cluster support disabled)")]
    NotACluster {
        /// The node, `host:port`.
        node: String,
    },
    /// Two nodes given to a Redis Cluster backend belong to different
    /// clusters, or one of them is not part of the cluster yet.
    #[error(
        "the Redis Cluster nodes disagree: {node} does not know {other} as a member of its cluster"
    )]
    ClusterNodesDisagree {
        /// The node whose view was read, `host:port`.
        node: String,
        /// The node it does not know, `host:port`.
        other: String,
    },
    /// The cluster answers but does not serve every slot.
    #[error("the Redis Cluster is not ready: {node} reports cluster_state:{state}")]
    ClusterNotReady {
        /// The node that said so, `host:port`.
        node: String,
        /// What it reported.
        state: String,
    },
    /// A Sentinel backend was given no Sentinel URL.
    #[error("no Sentinel URL given")]
    NoSentinels,
    /// The Sentinel URLs carry different usernames or passwords: every
    /// Sentinel of a group is reached with the same credentials.
    #[error("the Sentinel URLs carry different usernames or passwords")]
    SentinelCredentialsDiffer,
    /// The TLS settings cannot be used: a certificate or key that does not
    /// parse as PEM, certificates given for a `redis://` (not TLS) URL, or
    /// `rediss://` and `redis://` Sentinels mixed with certificates.
    #[error("the TLS settings cannot be used")]
    Tls(#[source] redis::RedisError),
    /// The server, the Sentinels or the primary refused the credentials (a
    /// wrong or missing username or password), from `connect`.
    #[error("authentication refused by {refused_by}")]
    AuthenticationRefused {
        /// Who refused: `"the Redis server"`, `"the Sentinels"` or
        /// `"the primary named by the Sentinels"`.
        refused_by: &'static str,
        /// The refusal.
        #[source]
        source: lock_core::BackendError,
    },
    /// No Sentinel knows a master by this name.
    #[error("no Sentinel knows a master named {name:?}")]
    UnknownSentinelMaster {
        /// The master name.
        name: String,
    },
    /// The durability setting asks for more replicas than the primary has.
    #[error("the durability setting waits for {wanted} replica(s), but the primary has {available} connected")]
    NotEnoughReplicas {
        /// Replicas the setting waits for.
        wanted: u32,
        /// Replicas connected to the primary now.
        available: u32,
    },
}

/// Credentials refused, as the source of a [`BackendError`](lock_core::BackendError):
/// says who refused them, which the `redis` crate's error does not.
#[derive(Debug, thiserror::Error)]
#[error("{refused_by} refused the credentials (a wrong or missing username or password)")]
pub(crate) struct AuthenticationRefused {
    refused_by: &'static str,
    #[source]
    source: redis::RedisError,
}

impl AuthenticationRefused {
    pub(crate) fn new(refused_by: &'static str, source: redis::RedisError) -> Self {
        Self { refused_by, source }
    }
}

/// Whether the server refused the credentials: a wrong password or user
/// (`WRONGPASS`, as the `redis` crate reports a failed `AUTH`), or none
/// given where one is required (`NOAUTH`).
pub(crate) fn is_auth_refusal(error: &redis::RedisError) -> bool {
    error.kind() == redis::ErrorKind::AuthenticationFailed
        || matches!(error.code(), Some("NOAUTH" | "WRONGPASS"))
}

/// The error of a connection that could not be made: kind `Setup` when
/// trying again cannot help (credentials refused, a server certificate the
/// given CA did not sign, a database index the server does not have)
/// \[A8\], else `Unavailable` (nothing was sent).
pub(crate) fn connection_error(error: redis::RedisError) -> lock_core::BackendError {
    let text = error.to_string();
    if is_auth_refusal(&error)
        || text.contains("invalid peer certificate")
        || text.contains("DB index is out of range")
    {
        lock_core::BackendError::setup(error)
    } else {
        lock_core::BackendError::unavailable(error)
    }
}

/// The setup error of a connection check that failed with `error`:
/// [`SetupError::AuthenticationRefused`] when credentials were refused (by
/// `refused_by`, unless the error says who), else [`SetupError::Connect`].
pub(crate) fn connect_error(
    error: lock_core::BackendError,
    refused_by: &'static str,
) -> SetupError {
    let inner = error.inner();
    let refused_by = if let Some(refused) = inner.downcast_ref::<AuthenticationRefused>() {
        refused.refused_by
    } else if crate::plumbing::errors::redis_error_of(inner).is_some_and(is_auth_refusal) {
        refused_by
    } else {
        return SetupError::Connect(error);
    };
    SetupError::AuthenticationRefused {
        refused_by,
        source: error,
    }
}

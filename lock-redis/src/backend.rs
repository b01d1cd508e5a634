//! `RedisBackend`: the steps of [`crate::single_node`] on the user's pool.

use std::borrow::Cow;
use std::fmt;

use deadpool_redis::{Pool, PoolError, Runtime};
use lock_core::BackendError;
use redis::aio::MultiplexedConnection;

use crate::config::{RedisConfig, SetupError};
use crate::single_node::{single_node_lock_backend, SingleNode, Source};
use crate::slot::{fence_key, kept_key};
use crate::subscription::PubSubTarget;
use crate::tls::Trust;

/// The name of the release channel, after the prefix.
pub const CHANNEL: &str = "withlock:released";

/// The start of a node's grant channel, after the prefix and before the
/// node id: a grant of the fair queue goes to the grantee's node alone
/// (one server, Sentinel; see the README's "The fair queue").
pub const GRANT_CHANNEL: &str = "withlock:granted:";

/// A lock backend on Redis: `SET NX PX`, a fencing counter per key, and
/// release notifications over one pub/sub connection. Under load, the
/// acquisitions and releases that many tasks make at once go out as one
/// script run (see [`RedisConfig::batch_steps`]).
///
/// Cheap to clone; clones share the pool and the subscription. The
/// subscription task ends when the last clone is dropped.
#[derive(Clone)]
pub struct RedisBackend {
    steps: SingleNode<Pooled>,
}

single_node_lock_backend!(RedisBackend => steps);

/// The connections of a [`RedisBackend`]: taken from the user's pool.
pub(crate) struct Pooled {
    pool: Pool,
    /// The server, as `Debug` shows it (no password).
    server: String,
    has_password: bool,
}

impl Source for Pooled {
    /// A connection taken from the pool, for good. A failed checkout is
    /// [`Unavailable`](lock_core::BackendErrorKind::Unavailable): the step's request
    /// was not sent.
    async fn connection(&self) -> Result<MultiplexedConnection, BackendError> {
        let pooled = self.pool.get().await.map_err(checkout_error)?;
        Ok(deadpool_redis::Connection::take(pooled))
    }

    fn has_password(&self) -> bool {
        self.has_password
    }
}

impl RedisBackend {
    /// A backend on the user's `pool`, with the default [`RedisConfig`].
    ///
    /// `client` opens the one pub/sub connection of the backend; it must
    /// reach the same server as the pool. Nothing connects until the first
    /// call. The waits for a release check that both reach the same server
    /// (a probe published through the pool must reach the client within
    /// the step timeout) until a probe is heard. After 3 probes in a row
    /// not heard, release notifications are off, with an error logged once
    /// (and no error for each wait): waiters poll every `retry_delay`, and
    /// a probe goes out again every 6 health-check intervals (30 s by
    /// default), which turns them back on once heard.
    pub fn new(pool: Pool, client: redis::Client) -> Self {
        Self::build(pool, client, RedisConfig::default(), true)
    }

    /// A backend on the user's `pool` with `config`.
    ///
    /// # Errors
    ///
    /// [`SetupError::InvalidConfig`] when a field of `config` is out of range.
    pub fn with_config(
        pool: Pool,
        client: redis::Client,
        config: RedisConfig,
    ) -> Result<Self, SetupError> {
        config.validate()?;
        crate::durability::validate(&config)?;
        Ok(Self::build(pool, client, config, true))
    }

    /// A backend with a pool of its own, from a URL such as
    /// `redis://:password@host:6379/0`. The pool has deadpool's default size.
    ///
    /// # Errors
    ///
    /// [`SetupError::InvalidUrl`] when `url` does not parse, and
    /// [`SetupError::Pool`] when the pool cannot be made. Nothing connects
    /// yet: an unreachable server or a wrong password shows at the first
    /// lock call, as a [`BackendError`] with the Redis error as source.
    pub fn from_url(url: &str) -> Result<Self, SetupError> {
        Self::from_url_with(url, RedisConfig::default())
    }

    /// [`from_url`](Self::from_url) with `config`.
    ///
    /// # Errors
    ///
    /// As [`from_url`](Self::from_url), and [`SetupError::InvalidConfig`].
    pub fn from_url_with(url: &str, config: RedisConfig) -> Result<Self, SetupError> {
        Self::from_url_trusting(url, &Trust::system(), config)
    }

    /// [`from_url_with`](Self::from_url_with) for a `rediss://` URL,
    /// trusting `certificates` instead of the system's roots: a private
    /// CA's certificate in PEM (`root_cert`), and a client certificate for
    /// a server that asks for one (`client_tls`).
    ///
    /// # Errors
    ///
    /// As [`from_url_with`](Self::from_url_with), and [`SetupError::Tls`]
    /// for a `redis://` URL or a PEM that does not parse. A server whose
    /// certificate the CA did not sign shows at the first call, or at once
    /// with [`connect_with_tls`](Self::connect_with_tls).
    #[cfg(feature = "tls")]
    pub fn from_url_with_tls(
        url: &str,
        certificates: redis::TlsCertificates,
        config: RedisConfig,
    ) -> Result<Self, SetupError> {
        Self::from_url_trusting(url, &Trust::custom(certificates), config)
    }

    fn from_url_trusting(
        url: &str,
        trust: &Trust,
        config: RedisConfig,
    ) -> Result<Self, SetupError> {
        use redis::IntoConnectionInfo;
        config.validate()?;
        crate::durability::validate(&config)?;
        let info = trust.apply(url.into_connection_info().map_err(SetupError::InvalidUrl)?)?;
        let client = redis::Client::open(info.clone()).map_err(SetupError::InvalidUrl)?;
        // The manager takes the connection info whole: deadpool's own
        // `Config` would drop its TLS certificates.
        let manager = deadpool_redis::Manager::new(info).map_err(SetupError::InvalidUrl)?;
        let pool = Pool::builder(manager)
            .runtime(Runtime::Tokio1)
            .build()
            .map_err(|e| SetupError::Pool(deadpool_redis::CreatePoolError::Build(e)))?;
        Ok(Self::build(pool, client, config, false))
    }

    /// Like [`from_url`](Self::from_url), and checks at once that the
    /// server answers (`PING` through the pool).
    ///
    /// # Errors
    ///
    /// As [`from_url`](Self::from_url), and [`SetupError::Connect`] when the
    /// server cannot be reached or refuses the connection, and
    /// [`SetupError::NotEnoughReplicas`] when [`RedisConfig::durability`]
    /// waits for more replicas than the server has connected.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future drops the backend being made; nothing is left.
    pub async fn connect(url: &str) -> Result<Self, SetupError> {
        Self::connect_with(url, RedisConfig::default()).await
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
    pub async fn connect_with(url: &str, config: RedisConfig) -> Result<Self, SetupError> {
        Self::checked(Self::from_url_with(url, config)?).await
    }

    /// [`from_url_with_tls`](Self::from_url_with_tls), and the checks of
    /// [`connect`](Self::connect): a server whose certificate `certificates`
    /// do not trust is [`SetupError::Connect`] with the TLS error as source.
    ///
    /// # Errors
    ///
    /// As [`from_url_with_tls`](Self::from_url_with_tls) and
    /// [`connect`](Self::connect).
    ///
    /// # Cancel safety
    ///
    /// As [`connect`](Self::connect).
    #[cfg(feature = "tls")]
    pub async fn connect_with_tls(
        url: &str,
        certificates: redis::TlsCertificates,
        config: RedisConfig,
    ) -> Result<Self, SetupError> {
        Self::checked(Self::from_url_with_tls(url, certificates, config)?).await
    }

    async fn checked(backend: Self) -> Result<Self, SetupError> {
        // Boxed: keeps the future of `connect` shallow for the compiler.
        Box::pin(backend.steps.check_primary()).await?;
        Ok(backend)
    }

    fn build(pool: Pool, client: redis::Client, config: RedisConfig, separate: bool) -> Self {
        let info = client.get_connection_info();
        let server = match &info.addr {
            redis::ConnectionAddr::Tcp(host, port) => format!("redis://{host}:{port}"),
            redis::ConnectionAddr::TcpTls { host, port, .. } => format!("rediss://{host}:{port}"),
            redis::ConnectionAddr::Unix(path) => format!("unix://{}", path.display()),
            #[allow(unreachable_patterns)]
            _ => "redis://?".to_owned(),
        };
        let source = Pooled {
            pool,
            server: format!("{server}/{}", info.redis.db),
            has_password: info.redis.password.is_some(),
        };
        Self {
            steps: SingleNode::new(source, PubSubTarget::Client(client), separate, config),
        }
    }

    /// The pool the backend takes its connection from.
    pub fn pool(&self) -> &Pool {
        &self.steps.source().pool
    }

    /// The configuration the backend was made with.
    pub fn config(&self) -> &RedisConfig {
        self.steps.config()
    }

    /// The Redis key that holds the lock of `key`: the prefix, then `key`.
    pub fn lock_key<'k>(&self, key: &'k str) -> Cow<'k, str> {
        self.steps.lock_key(key)
    }

    /// The Redis key of the fencing counter of `key`, in the same Redis
    /// Cluster hash slot as [`lock_key`](Self::lock_key): it holds the last
    /// fencing token drawn for `key`. It expires
    /// [`fence_idle`](RedisConfig::fence_idle) after the lock's last use,
    /// never while the lock is held. Losing it does not make tokens go
    /// back, as each token is at least the server clock in microseconds.
    pub fn fence_key(&self, key: &str) -> String {
        fence_key(&self.lock_key(key))
    }

    /// The Redis keys of `key`'s fair queue \[F1\], in the same hash slot
    /// as [`lock_key`](Self::lock_key): a sorted set of the waiting owner
    /// tokens in arrival order, and a hash of their places
    /// (`<alive until ms>:<claim ms>`). Both expire a ticket ttl after the
    /// last waiter's last attempt.
    pub fn queue_keys(&self, key: &str) -> (String, String) {
        let lock_key = self.lock_key(key);
        (
            crate::slot::queue_key(&lock_key),
            crate::slot::waiters_key(&lock_key),
        )
    }

    /// The Redis key of the record of `key`'s minimum hold \[H7\], in the
    /// same hash slot as [`lock_key`](Self::lock_key): the hold step (a
    /// run that ended before its [`hold_at_least`](lock_core::LockConfig::hold_at_least))
    /// writes the owner token there, expiring with the lock, so that the
    /// admin shows the lock as kept after its run ended; a record that
    /// does not hold the lock's own value is not counted.
    pub fn kept_key(&self, key: &str) -> String {
        kept_key(&self.lock_key(key))
    }

    /// The pub/sub channel releases are published on: the prefix, then
    /// `withlock:released`. Each message is the released Redis key.
    pub fn channel(&self) -> &str {
        self.steps.channel()
    }

    /// Whether the release subscription is in place now (always false with
    /// notifications off, and before the first wait).
    pub fn is_subscribed(&self) -> bool {
        self.steps.is_subscribed()
    }

    /// How many times the release subscription failed to be made or
    /// made again, for tests that wait for a failed resubscription (not a
    /// stable interface).
    #[doc(hidden)]
    pub fn subscription_failures(&self) -> u64 {
        self.steps.subscription_failures()
    }

    /// The per-key structures of the backend and their sizes now, for
    /// \[T2\] tests (not a stable interface). Each is 0 once no lock call
    /// runs:
    ///
    /// - `release_watches`: keys a waiter watches (an entry lives while a
    ///   watch on it does);
    /// - `queued_acquisitions`, `queued_releases`: steps waiting to go out
    ///   in the next batch.
    ///
    /// The connections, the scripts (one `SHA1` each, fixed) and the
    /// release subscription are one per backend, not per key.
    #[doc(hidden)]
    pub fn state_counts(&self) -> Vec<(&'static str, usize)> {
        self.steps.state_counts()
    }

    /// The steps, for the admin functions.
    pub(crate) fn steps(&self) -> &SingleNode<Pooled> {
        &self.steps
    }
}

/// A failed pool checkout (a refused connection, a failed handshake, a
/// pool timeout): the step's request was never written, so it changed
/// nothing in the store and the driver need not clean up after it. The
/// Redis error, when there is one, is the source.
fn checkout_error(error: PoolError) -> BackendError {
    match error {
        PoolError::Backend(e) => crate::config::connection_error(e),
        other => BackendError::unavailable(other),
    }
}

impl fmt::Debug for RedisBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never the pool or the client: their Debug shows the password.
        let source = self.steps.source();
        let mut shown = f.debug_struct("RedisBackend");
        shown.field("server", &source.server);
        self.steps
            .describe(&mut shown)
            .field("pool_size", &source.pool.status().size)
            .field("subscribed", &self.is_subscribed())
            .finish()
    }
}

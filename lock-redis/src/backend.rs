//! `RedisBackend`: the lock steps as one Lua script each (concurrent ones
//! in batches, see [`crate::batch`]), on the user's pool.

use std::borrow::Cow;
use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use deadpool_redis::{Pool, PoolError, Runtime};
use futures_util::FutureExt;
use lock_core::{
    async_trait, batch_results, AcquireOutcome, BackendError, BackendErrorKind, Capabilities,
    ExtendOutcome, ExtendRequest, Hold, Lease, LockBackend, OwnerToken, ReleaseOutcome,
    ReleaseWatch, MAX_KEY_LEN,
};
use redis::aio::MultiplexedConnection;
use redis::FromRedisValue;

use crate::batch::{fail_dropped, spawn_or_drop, Batcher, Queued};
use crate::config::{connect_error, RedisConfig, SetupError};
use crate::plumbing::connection::step_broke;
use crate::plumbing::redact;
use crate::plumbing::scripts::{Lua, ACQUIRE, ACQUIRE_BATCH, EXTEND, RELEASE, RELEASE_BATCH};
use crate::plumbing::timeout::within;
use crate::sentinel::{connected_replicas, SentinelSource};
use crate::slot::fence_key;
use crate::subscription::{PubSubTarget, Subscription};
use crate::tls::Trust;

/// The name of the release channel, after the prefix.
pub const CHANNEL: &str = "withlock:released";

/// A lock backend on Redis: `SET NX PX`, a fencing counter per key, and
/// release notifications over one pub/sub connection. Under load, the
/// acquisitions and releases that many tasks make at once go out as one
/// script run (see [`RedisConfig::batch_steps`]).
///
/// Cheap to clone; clones share the pool and the subscription. The
/// subscription task ends when the last clone is dropped.
#[derive(Clone)]
pub struct RedisBackend {
    inner: Arc<Inner>,
}

struct Inner {
    pool: Pool,
    /// One multiplexed connection taken from the pool, shared by every
    /// step: a pool checkout costs a `PING` round trip each time. Dropped
    /// after a connection error or timeout; the next step takes a new one.
    shared: std::sync::Mutex<Option<MultiplexedConnection>>,
    /// The connection of acquisitions that `WAIT` for replicas, so that a
    /// slow `WAIT` never holds up the extensions on `shared`.
    durable: std::sync::Mutex<Option<MultiplexedConnection>>,
    /// In Sentinel mode, where connections go instead of the pool: the
    /// primary the Sentinels name now.
    sentinel: Option<Arc<SentinelSource>>,
    config: RedisConfig,
    channel: String,
    server: String,
    has_password: bool,
    subscription: Option<Subscription>,
    /// The pub/sub client, when the user gave it beside their own pool: it
    /// must reach the same server, which the first watch checks.
    separate_client: Option<redis::Client>,
    same_server: tokio::sync::OnceCell<Result<(), BackendError>>,
    /// Acquisitions and releases on the wire, and those waiting to go out
    /// together.
    acquisitions: Batcher,
    releases: Batcher,
}

impl RedisBackend {
    /// A backend on the user's `pool`, with the default [`RedisConfig`].
    ///
    /// `client` opens the one pub/sub connection of the backend; it must
    /// reach the same server as the pool. Nothing connects until the first
    /// call. The first wait for a release checks that both reach the same
    /// server (a probe published through the pool must reach the client):
    /// if they do not, release notifications stay off
    /// with an error logged once, and waiters poll every `retry_delay`.
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
        Box::pin(backend.check_primary()).await?;
        Ok(backend)
    }

    /// `PING` through the backend's connection, and the replicas the
    /// durability setting waits for: nothing is written.
    pub(crate) async fn check_primary(&self) -> Result<(), SetupError> {
        let durability = self.inner.config.durability;
        let available = self
            .bounded("connecting", async {
                let mut conn = self.connection().await?;
                redis::cmd("PING")
                    .query_async::<String>(&mut conn)
                    .await
                    .map_err(map_redis_error)?;
                if durability.is_none() {
                    return Ok(None);
                }
                // `INFO` is in the `@dangerous` ACL category: a user
                // without it skips this check, and `WAIT` after each
                // acquisition still counts the replicas [D3].
                match connected_replicas(&mut conn).await {
                    Ok(n) => Ok(Some(n)),
                    Err(e) if e.is_permanent() => {
                        tracing::info!(error = %e, "INFO is not allowed for this user: the replicas the durability setting waits for are not checked at connect");
                        Ok(None)
                    }
                    Err(e) => Err(e),
                }
            })
            .await
            .map_err(|error| connect_error(error, "the Redis server"))?;
        match (durability, available) {
            (Some(d), Some(available)) if d.replicas > available => {
                Err(SetupError::NotEnoughReplicas {
                    wanted: d.replicas,
                    available,
                })
            }
            _ => Ok(()),
        }
    }

    /// A backend on the primary that `source` names, for
    /// [`RedisSentinelBackend`](crate::RedisSentinelBackend). Its pool is
    /// never used (nor handed out): every connection comes from `source`.
    pub(crate) fn on_sentinel(
        source: SentinelSource,
        config: RedisConfig,
    ) -> Result<Self, SetupError> {
        crate::durability::validate(&config)?;
        let unused = deadpool_redis::Config::from_url("redis://sentinel-mode.invalid")
            .create_pool(Some(Runtime::Tokio1))
            .map_err(SetupError::Pool)?;
        let has_password = source.has_password();
        let source = Arc::new(source);
        let channel = format!("{}{CHANNEL}", config.prefix);
        let subscription = config.release_notifications.then(|| {
            Subscription::new(
                PubSubTarget::Sentinel(Arc::clone(&source)),
                channel.clone(),
                config.prefix.clone(),
                &config,
            )
        });
        Ok(Self {
            inner: Arc::new(Inner {
                pool: unused,
                shared: std::sync::Mutex::new(None),
                durable: std::sync::Mutex::new(None),
                sentinel: Some(source),
                config,
                channel,
                server: "sentinel".to_owned(),
                has_password,
                subscription,
                separate_client: None,
                same_server: tokio::sync::OnceCell::new(),
                acquisitions: Batcher::default(),
                releases: Batcher::default(),
            }),
        })
    }

    pub(crate) fn sentinel(&self) -> Option<&SentinelSource> {
        self.inner.sentinel.as_deref()
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
        let server = format!("{server}/{}", info.redis.db);
        let has_password = info.redis.password.is_some();
        let channel = format!("{}{CHANNEL}", config.prefix);
        let separate_client = (separate && config.release_notifications).then(|| client.clone());
        let subscription = config.release_notifications.then(|| {
            Subscription::new(
                PubSubTarget::Client(client),
                channel.clone(),
                config.prefix.clone(),
                &config,
            )
        });
        Self {
            inner: Arc::new(Inner {
                pool,
                shared: std::sync::Mutex::new(None),
                durable: std::sync::Mutex::new(None),
                sentinel: None,
                config,
                channel,
                server,
                has_password,
                subscription,
                separate_client,
                same_server: tokio::sync::OnceCell::new(),
                acquisitions: Batcher::default(),
                releases: Batcher::default(),
            }),
        }
    }

    /// The pool the backend takes its connection from.
    pub fn pool(&self) -> &Pool {
        &self.inner.pool
    }

    /// The configuration the backend was made with.
    pub fn config(&self) -> &RedisConfig {
        &self.inner.config
    }

    /// The Redis key that holds the lock of `key`: the prefix, then `key`.
    pub fn lock_key<'k>(&self, key: &'k str) -> Cow<'k, str> {
        if self.inner.config.prefix.is_empty() {
            Cow::Borrowed(key)
        } else {
            Cow::Owned(format!("{}{key}", self.inner.config.prefix))
        }
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

    /// The pub/sub channel releases are published on: the prefix, then
    /// `withlock:released`. Each message is the released Redis key.
    pub fn channel(&self) -> &str {
        &self.inner.channel
    }

    /// Whether the release subscription is in place now (always false with
    /// notifications off, and before the first wait).
    pub fn is_subscribed(&self) -> bool {
        self.inner
            .subscription
            .as_ref()
            .is_some_and(Subscription::is_subscribed)
    }

    /// Runs `work` within the command timeout.
    fn bounded<'a, T: 'a>(
        &'a self,
        step: &'static str,
        work: impl Future<Output = Result<T, BackendError>> + 'a,
    ) -> impl Future<Output = Result<T, BackendError>> + 'a {
        self.bounded_for(step, self.inner.config.step_timeout, work)
    }

    /// Runs `work` within `limit`, and forgets the shared connections
    /// after an error that may mean they are broken.
    fn bounded_for<'a, T: 'a>(
        &'a self,
        step: &'static str,
        limit: Duration,
        work: impl Future<Output = Result<T, BackendError>> + 'a,
    ) -> impl Future<Output = Result<T, BackendError>> + 'a {
        within(step, limit, work).map(move |answer| {
            if let Err(error) = &answer {
                self.forget_connection_after(error);
            }
            answer
        })
    }

    /// The shared connection, taken from the pool if there is none. A
    /// failed checkout is [`Unavailable`](BackendErrorKind::Unavailable):
    /// the step's request was not sent.
    pub(crate) async fn connection(&self) -> Result<MultiplexedConnection, BackendError> {
        if let Some(conn) = lock_slot(&self.inner.shared).as_ref() {
            return Ok(conn.clone());
        }
        // Boxed: making a connection is a large future, which every step's
        // own future would carry (and copy) on every call otherwise.
        Box::pin(self.connection_in(&self.inner.shared)).await
    }

    /// The connection kept in `slot`, made if there is none: taken from
    /// the pool, or in Sentinel mode opened to the primary the Sentinels
    /// name now.
    async fn connection_in(
        &self,
        slot: &std::sync::Mutex<Option<MultiplexedConnection>>,
    ) -> Result<MultiplexedConnection, BackendError> {
        if let Some(conn) = lock_slot(slot).as_ref() {
            return Ok(conn.clone());
        }
        let conn = match &self.inner.sentinel {
            Some(source) => source.connection().await?,
            None => {
                let pooled = self.inner.pool.get().await.map_err(checkout_error)?;
                deadpool_redis::Connection::take(pooled)
            }
        };
        *lock_slot(slot) = Some(conn.clone());
        Ok(conn)
    }

    /// Forgets the shared connections after an error that may mean they
    /// are broken, so the next step takes a fresh one from the pool (or, in
    /// Sentinel mode, asks the Sentinels again). `READONLY` counts: the
    /// server was demoted to a replica, and still answers `PING`.
    fn forget_connection_after(&self, error: &BackendError) {
        if step_broke(error) {
            *lock_slot(&self.inner.shared) = None;
            *lock_slot(&self.inner.durable) = None;
        }
    }

    /// The acquisition script, then `WAIT` on the same connection; when
    /// too few replicas acknowledged, the release script, and an error.
    async fn acquire_durably(
        &self,
        durability: crate::Durability,
        keys: [&str; 2],
        owner: &OwnerToken,
        ttl: Duration,
    ) -> Result<i64, BackendError> {
        let limit = self.inner.config.step_timeout + durability.timeout;
        self.bounded_for("acquisition", limit, async {
            let mut conn = self.connection_in(&self.inner.durable).await?;
            let acquire = ACQUIRE.call(
                &keys,
                &[
                    owner.as_str(),
                    &ttl_ms(ttl),
                    &self.inner.config.fence_ttl_ms(ttl),
                ],
            );
            let answer: i64 = ACQUIRE.run(&mut conn, &acquire).await?;
            if answer <= 0 {
                return Ok(answer);
            }
            let acked: u32 = redis::cmd("WAIT")
                .arg(durability.replicas)
                .arg(ttl_ms(durability.timeout))
                .query_async(&mut conn)
                .await
                .map_err(map_redis_error)?;
            if acked >= durability.replicas {
                return Ok(answer);
            }
            let release = RELEASE.call(
                &keys,
                &[
                    owner.as_str(),
                    &self.inner.channel,
                    &self.inner.config.fence_idle_ms(),
                ],
            );
            let released: i64 = RELEASE.run(&mut conn, &release).await?;
            Err(BackendError::message(
                BackendErrorKind::Request,
                format!(
                    "the acquisition reached {acked} of the {} replica(s) the durability setting waits for within {:?}; {} and the attempt counts as failed",
                    durability.replicas,
                    durability.timeout,
                    if released == 1 { "the lock was released" } else { "the lock was gone already" },
                ),
            ))
        })
        .await
    }

    /// One call of `script` on the shared connection, within the step
    /// timeout (see [`Lua::run`] for `NOSCRIPT`).
    pub(crate) async fn run_script<T: redis::FromRedisValue>(
        &self,
        step: &'static str,
        script: &Lua,
        keys: &[&str],
        args: &[&str],
    ) -> Result<T, BackendError> {
        let call = script.call(keys, args);
        self.bounded(step, async {
            let mut conn = self.connection().await?;
            script.run(&mut conn, &call).await
        })
        .await
    }
}

/// The two kinds of step that go out in batches under load.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Step {
    Acquisition,
    Release,
}

impl Step {
    fn name(self) -> &'static str {
        match self {
            Self::Acquisition => "acquisition",
            Self::Release => "release",
        }
    }
}

/// A step going out alone: counted on the wire until dropped (also when
/// its caller is dropped first), then the next batch goes out. Not counted
/// when batching is off.
struct OnTheWire<'a>(Option<(&'a RedisBackend, Step)>);

impl Drop for OnTheWire<'_> {
    fn drop(&mut self) {
        if let Some((backend, step)) = self.0 {
            if let Some(batch) = backend.batcher(step).finished() {
                backend.send_batch(step, batch);
            }
        }
    }
}

impl RedisBackend {
    /// Whether a step goes out alone now (`None`: it waits to go out in a
    /// batch).
    fn alone(&self, step: Step) -> Option<OnTheWire<'_>> {
        if !self.inner.config.batch_steps {
            Some(OnTheWire(None))
        } else if self.batcher(step).go_alone() {
            Some(OnTheWire(Some((self, step))))
        } else {
            None
        }
    }

    fn batcher(&self, step: Step) -> &Batcher {
        match step {
            Step::Acquisition => &self.inner.acquisitions,
            Step::Release => &self.inner.releases,
        }
    }

    /// Queues a step to go out with the others waiting (see
    /// [`crate::batch`]), and gives its answer within the command timeout.
    async fn queued(
        &self,
        step: Step,
        keys: Vec<String>,
        args: Vec<String>,
    ) -> Result<redis::Value, BackendError> {
        let (answer, answered) = tokio::sync::oneshot::channel();
        if let Some(batch) = self.batcher(step).queue(Queued { keys, args, answer }) {
            self.send_batch(step, batch);
        }
        self.bounded(step.name(), async {
            answered.await.unwrap_or_else(|_| {
                Err(BackendError::message(
                    BackendErrorKind::Request,
                    "the batch this step went out in was dropped before its answer (the runtime is shutting down)",
                ))
            })
        })
        .await
    }

    /// Sends `batch` (counted on the wire) as one script run, in a task of
    /// its own, and hands each step its answer.
    fn send_batch(&self, step: Step, batch: Vec<Queued>) {
        let counted = BatchOnTheWire {
            backend: self.clone(),
            step,
            batch,
        };
        spawn_or_drop(counted.send());
    }
}

/// A batch on the wire. Dropped before its answer (its task cancelled, or
/// no runtime to send it on), its steps get an error and it counts out.
struct BatchOnTheWire {
    backend: RedisBackend,
    step: Step,
    batch: Vec<Queued>,
}

impl BatchOnTheWire {
    async fn send(mut self) {
        let backend = self.backend.clone();
        let answer = {
            let mut keys: Vec<&str> = Vec::with_capacity(self.batch.len() * 2);
            let mut args: Vec<&str> = Vec::with_capacity(self.batch.len() * 3 + 2);
            let idle = backend.inner.config.fence_idle_ms();
            if self.step == Step::Release {
                args.push(&backend.inner.channel);
                args.push(&idle);
            }
            for queued in &self.batch {
                keys.extend(queued.keys.iter().map(String::as_str));
                args.extend(queued.args.iter().map(String::as_str));
            }
            let script = match self.step {
                Step::Acquisition => &ACQUIRE_BATCH,
                Step::Release => &RELEASE_BATCH,
            };
            backend
                .run_script::<Vec<redis::Value>>(self.step.name(), script, &keys, &args)
                .await
        };
        let n = self.batch.len();
        let answers: Vec<Result<redis::Value, BackendError>> = match answer {
            Ok(values) if values.len() == n => values.into_iter().map(Ok).collect(),
            Ok(values) => {
                let error = BackendError::message(
                    BackendErrorKind::Protocol,
                    format!(
                        "the {} batch script answered {} values for {n} steps",
                        self.step.name(),
                        values.len()
                    ),
                );
                vec![Err(error); n]
            }
            Err(error) => vec![Err(error); n],
        };
        for (queued, answer) in std::mem::take(&mut self.batch).into_iter().zip(answers) {
            let _ = queued.answer.send(answer);
        }
    }
}

impl Drop for BatchOnTheWire {
    fn drop(&mut self) {
        fail_dropped(&mut self.batch);
        if let Some(next) = self.backend.batcher(self.step).finished() {
            self.backend.send_batch(self.step, next);
        }
    }
}

/// The error of an acquisition whose fencing companion holds no counter, as
/// the one-key script gives it.
fn corrupt_companion(fence: &str) -> BackendError {
    map_redis_error(redis::RedisError::from((
        redis::ErrorKind::ResponseError,
        "the fencing companion is not a number below 2^53",
        format!("ERR the fencing companion {fence} is not a number below 2^53"),
    )))
}

fn protocol_error(step: &str, error: &redis::RedisError) -> BackendError {
    BackendError::message(
        BackendErrorKind::Protocol,
        format!("the {step} batch script's answer: {error}"),
    )
}

fn lock_slot(
    slot: &std::sync::Mutex<Option<MultiplexedConnection>>,
) -> std::sync::MutexGuard<'_, Option<MultiplexedConnection>> {
    slot.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
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

impl RedisBackend {
    /// The extensions of [`LockBackend::extend_many`] as one pipeline of
    /// `EVALSHA` of the extension script: one round trip.
    async fn extend_pipeline(
        &self,
        requests: &[ExtendRequest],
    ) -> Result<Vec<ExtendOutcome>, BackendError> {
        let mut pipe = redis::pipe();
        for request in requests {
            let lock_key = self.lock_key(request.lease.key());
            EXTEND.add_call(
                &mut pipe,
                &[&lock_key, &fence_key(&lock_key)],
                &[
                    request.lease.owner().as_str(),
                    &ttl_ms(request.ttl),
                    &self.inner.config.fence_ttl_ms(request.ttl),
                    &request.lease.fencing_token().to_string(),
                ],
            );
        }
        let answers: Vec<i64> = self
            .bounded("extension", async {
                let mut conn = self.connection().await?;
                EXTEND.run(&mut conn, &pipe).await
            })
            .await?;
        if answers.len() != requests.len() {
            return Err(BackendError::message(
                BackendErrorKind::Protocol,
                format!("{} answers to {} extensions", answers.len(), requests.len()),
            ));
        }
        answers.into_iter().map(extend_outcome).collect()
    }

    /// Checks that the pub/sub client hears releases published through the
    /// pool: a probe published on the release channel, for a key nobody
    /// locks, must reach the backend's own subscription. Needs only the
    /// rights the lock steps need (`PUBLISH` and `SUBSCRIBE` on the release
    /// channel), not `INFO` \[D3\]. `Err` (not cached): the check itself
    /// failed; `Ok(Err)` (cached): the probe was not heard, and
    /// notifications stay off.
    async fn check_same_server(
        &self,
        subscription: &Subscription,
    ) -> Result<Result<(), BackendError>, BackendError> {
        let probe = format!("withlock-probe:{:032x}", rand::random::<u128>());
        let mut watch = subscription.watch(&probe).await?;
        let lock_key = self.lock_key(&probe).into_owned();
        let _receivers: i64 = self
            .bounded("probing the release channel", async {
                let mut conn = self.connection().await?;
                redis::cmd("PUBLISH")
                    .arg(&self.inner.channel)
                    .arg(&lock_key)
                    .query_async(&mut conn)
                    .await
                    .map_err(map_redis_error)
            })
            .await?;
        let heard = tokio::time::timeout(self.inner.config.step_timeout, watch.released())
            .await
            .is_ok();
        if heard {
            return Ok(Ok(()));
        }
        tracing::error!(
            channel = %self.inner.channel,
            "the pub/sub client given to RedisBackend does not hear releases published through the pool (it reaches another Redis server): release notifications are off, waiters poll every retry_delay"
        );
        Ok(Err(BackendError::message(
            BackendErrorKind::Protocol,
            format!(
                "the pub/sub client does not hear a probe published through the pool on {:?} within {:?}: it reaches another Redis server; release notifications are off",
                self.inner.channel, self.inner.config.step_timeout
            ),
        )))
    }
}

/// Maps a Redis error to a backend error, keeping it as the source.
pub(crate) fn map_redis_error(error: redis::RedisError) -> BackendError {
    let kind = if error.is_timeout() {
        BackendErrorKind::Timeout
    } else if is_setup_error(&error) {
        BackendErrorKind::Setup
    } else {
        BackendErrorKind::Request
    };
    BackendError::new(kind, error)
}

/// An error that trying again cannot mend \[A8\]: authentication refused,
/// an ACL that denies a command, key or channel, a lock key or companion
/// of the wrong type, a fencing companion that holds no counter. Scripts
/// pass on the code of the command that failed in them.
fn is_setup_error(error: &redis::RedisError) -> bool {
    error.kind() == redis::ErrorKind::AuthenticationFailed
        || matches!(
            error.code(),
            Some("NOPERM" | "WRONGPASS" | "NOAUTH" | "WRONGTYPE")
        )
        || {
            let text = error.to_string();
            // A command a script runs that the ACL denies.
            text.contains("the fencing companion")
                || text.contains("can't run this command")
                || text.contains("No permissions to access")
        }
}

pub(crate) fn ttl_ms(ttl: Duration) -> String {
    ttl.as_millis().clamp(1, u128::from(u64::MAX)).to_string()
}

/// The acquire script's answer: 0 busy, else the fencing token.
pub(crate) fn acquire_outcome(answer: i64) -> Result<AcquireOutcome, BackendError> {
    match u64::try_from(answer) {
        Ok(0) => Ok(AcquireOutcome::Busy),
        Ok(fencing_token) => Ok(AcquireOutcome::Acquired { fencing_token }),
        Err(_) => Err(unexpected("acquire", answer)),
    }
}

/// The release script's answer: 1 released, 0 not held.
pub(crate) fn release_outcome(answer: i64) -> Result<ReleaseOutcome, BackendError> {
    match answer {
        1 => Ok(ReleaseOutcome::Released),
        0 => Ok(ReleaseOutcome::NotHeld),
        other => Err(unexpected("release", other)),
    }
}

pub(crate) fn extend_outcome(answer: i64) -> Result<ExtendOutcome, BackendError> {
    match answer {
        1 => Ok(ExtendOutcome::Extended),
        0 => Ok(ExtendOutcome::Expired),
        -1 => Ok(ExtendOutcome::Taken),
        other => Err(unexpected("extend", other)),
    }
}

pub(crate) fn unexpected(step: &str, answer: i64) -> BackendError {
    BackendError::message(
        BackendErrorKind::Protocol,
        format!("the {step} script answered {answer}"),
    )
}

impl fmt::Debug for RedisBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never the pool or the client: their Debug shows the password.
        let status = self.inner.pool.status();
        f.debug_struct("RedisBackend")
            .field("server", &self.inner.server)
            .field("password", &redact::secret(self.inner.has_password))
            .field("channel", &self.inner.channel)
            .field("config", &self.inner.config)
            .field("pool_size", &status.size)
            .field("subscribed", &self.is_subscribed())
            .finish()
    }
}

#[async_trait]
impl LockBackend for RedisBackend {
    fn capabilities(&self) -> Capabilities {
        Capabilities::default()
            .with_name("redis")
            .with_release_notifications(self.inner.subscription.is_some())
            .with_max_key_len(MAX_KEY_LEN)
            .with_max_extend_batch(self.inner.config.max_extend_batch)
    }

    /// `SET key token NX PX ttl`, and if it took the key, the fencing token
    /// `max(companion + 1, server clock in µs)` stored in the companion, in
    /// one script: tokens keep increasing when the companion is lost.
    /// Fails with kind [`Unavailable`](BackendErrorKind::Unavailable) when
    /// no connection could be had: nothing was sent.
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
            // Boxed, so that the common case's future stays small.
            Some(durability) => {
                Box::pin(self.acquire_durably(durability, [&lock_key, &fence], owner, ttl)).await?
            }
            None => match self.alone(Step::Acquisition) {
                Some(_counted) => {
                    self.run_script(
                        "acquisition",
                        &ACQUIRE,
                        &[&lock_key, &fence],
                        &[
                            owner.as_str(),
                            &ttl_ms(ttl),
                            &self.inner.config.fence_ttl_ms(ttl),
                        ],
                    )
                    .await?
                }
                None => {
                    let answer = self
                        .queued(
                            Step::Acquisition,
                            vec![lock_key.into_owned(), fence.clone()],
                            vec![
                                owner.as_str().to_owned(),
                                ttl_ms(ttl),
                                self.inner.config.fence_ttl_ms(ttl),
                            ],
                        )
                        .await?;
                    match i64::from_redis_value(&answer) {
                        Ok(-1) => return Err(corrupt_companion(&fence)),
                        Ok(answer) => answer,
                        Err(e) => return Err(protocol_error("acquisition", &e)),
                    }
                }
            },
        };
        acquire_outcome(answer)
    }

    /// `PEXPIRE` if the key still holds the owner token, and of its fencing
    /// companion to the ttl plus [`fence_idle`](RedisConfig::fence_idle)
    /// (put back if it was lost), in one script.
    ///
    /// # Cancel safety
    ///
    /// A dropped call may or may not have extended the key.
    async fn extend(&self, lease: &Lease, ttl: Duration) -> Result<ExtendOutcome, BackendError> {
        let lock_key = self.lock_key(lease.key());
        let answer = self
            .run_script(
                "extension",
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
        extend_outcome(answer)
    }

    /// One pipeline of `EVALSHA` of the extension script, one per lease: one
    /// round trip. After `NOSCRIPT` (a restarted or flushed server) the
    /// script is loaded and the whole pipeline sent again, which is safe
    /// since an extension can be repeated.
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
        batch_results(requests.len(), self.extend_pipeline(requests).await)
    }

    /// One server.
    fn failure_domain(&self, _key: &str) -> u64 {
        0
    }

    /// `DEL` if the key still holds the owner token, then the fencing
    /// companion set to expire in [`fence_idle`](RedisConfig::fence_idle)
    /// and `PUBLISH` of the key on the release channel, in one script.
    ///
    /// # Cancel safety
    ///
    /// A dropped call may or may not have released the key; calling again
    /// is safe.
    async fn release(&self, lease: &Lease) -> Result<ReleaseOutcome, BackendError> {
        let lock_key = self.lock_key(lease.key());
        let fence = fence_key(&lock_key);
        let answer = if let Some(_counted) = self.alone(Step::Release) {
            self.run_script(
                "release",
                &RELEASE,
                &[&lock_key, &fence],
                &[
                    lease.owner().as_str(),
                    &self.inner.channel,
                    &self.inner.config.fence_idle_ms(),
                ],
            )
            .await?
        } else {
            let answer = self
                .queued(
                    Step::Release,
                    vec![lock_key.into_owned(), fence],
                    vec![lease.owner().as_str().to_owned()],
                )
                .await?;
            i64::from_redis_value(&answer).map_err(|e| protocol_error("release", &e))?
        };
        release_outcome(answer)
    }

    /// The extension script with the time left of the minimum hold \[H7\]
    /// (Redis keeps no record of when a key was set). At least 1 ms, as
    /// `PEXPIRE 0` would delete the key.
    async fn hold(&self, lease: &Lease, hold: Hold) -> Result<ExtendOutcome, BackendError> {
        self.extend(lease, hold.from_now.max(Duration::from_millis(1)))
            .await
    }

    /// A watch on `key`, returned once the backend's one subscription is
    /// confirmed (the first call starts it). Fails at once while the
    /// subscription is down, and after the command timeout if it cannot be
    /// made; the driver then waits on its retry timer.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: the subscription belongs to the backend, not the call.
    async fn watch_release(&self, key: &str) -> Result<ReleaseWatch, BackendError> {
        let Some(subscription) = &self.inner.subscription else {
            return Ok(ReleaseWatch::never());
        };
        if self.inner.separate_client.is_some() {
            self.inner
                .same_server
                .get_or_try_init(|| self.check_same_server(subscription))
                .await?
                .clone()?;
        }
        subscription.watch(key).await
    }
}

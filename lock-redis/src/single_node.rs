//! The lock steps of a single Redis server, wherever its connections come
//! from: [`RedisBackend`](crate::RedisBackend) takes them from the user's
//! pool, [`RedisSentinelBackend`](crate::RedisSentinelBackend) from the
//! primary the Sentinels name now (a [`Source`] each). One Lua script per
//! step (concurrent ones in batches, see [`crate::batch`]), on one shared
//! connection.

use std::borrow::Cow;
use std::fmt;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

#[cfg(doc)]
use lock_core::LockBackend;
use lock_core::{
    batch_results, AcquireOutcome, BackendError, BackendErrorKind, Capabilities, ExtendOutcome,
    ExtendRequest, Hold, Lease, OwnerToken, QueueTerms, ReleaseOutcome, ReleaseWatch, MAX_KEY_LEN,
};
use redis::aio::MultiplexedConnection;
use redis::FromRedisValue;

use crate::backend::{CHANNEL, GRANT_CHANNEL};
use crate::batch::{fail_dropped, spawn_or_drop, Batcher, Queued};
use crate::config::{connect_error, RedisConfig, SetupError};
use crate::plumbing::connection::{step_broke, ConnectionSlot};
use crate::plumbing::driver::Driver;
use crate::plumbing::errors::{is_key_refused, map_redis_error};
use crate::plumbing::queue::{queue_keys, queued_outcome, GrantChannelRights, QueueRights};
use crate::plumbing::redact;
use crate::plumbing::scripts::{acquire_outcome, extend_outcome, release_outcome, ttl_ms};
use crate::plumbing::scripts::{
    Lua, ACQUIRE, ACQUIRE_BATCH, ACQUIRE_QUEUED, EXTEND, HOLD, LEAVE_QUEUE, RELEASE, RELEASE_BATCH,
    RELEASE_BATCH_UNQUEUED, RELEASE_UNQUEUED,
};
use crate::plumbing::timeout::within;
use crate::same_server::{Next, SameServer};
use crate::sentinel::connected_replicas;
use crate::slot::{fence_key, kept_key};
use crate::subscription::{PubSubTarget, Subscription};

/// Where a single-node backend's connections come from.
pub(crate) trait Source: Send + Sync + 'static {
    /// A new connection to the server. A failure is
    /// [`Unavailable`](BackendErrorKind::Unavailable) when nothing was
    /// sent, or a setup error for refused credentials.
    fn connection(
        &self,
    ) -> impl Future<Output = Result<MultiplexedConnection, BackendError>> + Send;

    /// Whether the server is reached with a password.
    fn has_password(&self) -> bool;

    /// Changes each time the connections taken so far must be dropped
    /// (the Sentinels named another primary).
    fn switches(&self) -> u64 {
        0
    }
}

impl<T: Source> Source for Arc<T> {
    fn connection(
        &self,
    ) -> impl Future<Output = Result<MultiplexedConnection, BackendError>> + Send {
        T::connection(self)
    }

    fn has_password(&self) -> bool {
        T::has_password(self)
    }

    fn switches(&self) -> u64 {
        T::switches(self)
    }
}

/// The steps on one server, the connections from `S`. Cheap to clone;
/// clones share the connections, the subscription and the batches.
pub(crate) struct SingleNode<S> {
    inner: Arc<Inner<S>>,
}

impl<S> Clone for SingleNode<S> {
    fn clone(&self) -> Self {
        Self {
            inner: Arc::clone(&self.inner),
        }
    }
}

struct Inner<S> {
    source: S,
    /// One multiplexed connection taken from the source, shared by every
    /// step: a pool checkout costs a `PING` round trip each time. Dropped
    /// after a connection error or timeout; the next step takes a new one.
    shared: ConnectionSlot,
    /// The connection of acquisitions that `WAIT` for replicas, so that a
    /// slow `WAIT` never holds up the extensions on `shared`.
    durable: ConnectionSlot,
    config: RedisConfig,
    channel: String,
    /// The start of each node's grant channel, before the node id \[F4\].
    grant_prefix: String,
    subscription: Option<Subscription>,
    /// The check that the pub/sub client, when the user gave it beside
    /// their own pool, hears the pool's server.
    same_server: Option<SameServer>,
    /// The source's [`switches`](Source::switches) the connections in
    /// `shared` and `durable` were taken at.
    switches: AtomicU64,
    /// Acquisitions and releases on the wire, and those waiting to go out
    /// together.
    acquisitions: Batcher,
    releases: Batcher,
    /// Where the connections taken from the source are made and driven.
    driver: Driver,
    /// Whether releases may touch the fair queue's keys \[F6\].
    queue_rights: QueueRights,
    /// The log of a grant channel the ACL refuses to releases \[F6\].
    grant_rights: GrantChannelRights,
}

impl<S: Source> SingleNode<S> {
    /// The steps on `source` with `config`, release notifications (when on)
    /// over a subscription to `pubsub`. `separate_client`: whether the
    /// pub/sub client is one the user gave beside their own pool, which the
    /// waits check to hear the same server (see [`crate::same_server`]).
    pub(crate) fn new(
        source: S,
        pubsub: PubSubTarget,
        separate_client: bool,
        config: RedisConfig,
    ) -> Self {
        let same_server = (separate_client && config.release_notifications)
            .then(|| SameServer::new(config.health_check_interval));
        let channel = format!("{}{CHANNEL}", config.prefix);
        let grant_prefix = format!("{}{GRANT_CHANNEL}", config.prefix);
        let subscription = config
            .release_notifications
            .then(|| Subscription::new(pubsub, channel.clone(), config.prefix.clone(), &config));
        Self {
            inner: Arc::new(Inner {
                source,
                shared: ConnectionSlot::default(),
                durable: ConnectionSlot::default(),
                config,
                channel,
                grant_prefix,
                subscription,
                same_server,
                switches: AtomicU64::new(0),
                acquisitions: Batcher::default(),
                releases: Batcher::default(),
                driver: Driver::default(),
                queue_rights: QueueRights::default(),
                grant_rights: GrantChannelRights::default(),
            }),
        }
    }
    /// `PING` through the backend's connection, and the replicas the
    /// durability setting waits for: nothing is written.
    pub(crate) async fn check_primary(&self) -> Result<(), SetupError> {
        let durability = self.inner.config.durability;
        let available = self
            .bounded("connecting", |mut conn| async move {
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
                        tracing::info!(error = %lock_core::ErrorChain(&e), "INFO is not allowed for this user: the replicas the durability setting waits for are not checked at connect");
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

    /// The configuration the backend was made with.
    pub(crate) fn config(&self) -> &RedisConfig {
        &self.inner.config
    }

    /// Where the connections come from.
    pub(crate) fn source(&self) -> &S {
        &self.inner.source
    }

    /// The Redis key that holds the lock of `key`: the prefix, then `key`.
    pub(crate) fn lock_key<'k>(&self, key: &'k str) -> Cow<'k, str> {
        if self.inner.config.prefix.is_empty() {
            Cow::Borrowed(key)
        } else {
            Cow::Owned(format!("{}{key}", self.inner.config.prefix))
        }
    }

    /// The release channel: the prefix, then [`CHANNEL`].
    pub(crate) fn channel(&self) -> &str {
        &self.inner.channel
    }

    /// The per-key structures and their sizes, for \[T2\] tests: see
    /// [`RedisBackend::state_counts`](crate::RedisBackend::state_counts).
    pub(crate) fn state_counts(&self) -> Vec<(&'static str, usize)> {
        vec![
            (
                "release_watches",
                self.inner
                    .subscription
                    .as_ref()
                    .map_or(0, Subscription::watched_keys),
            ),
            ("queued_acquisitions", self.inner.acquisitions.queued()),
            ("queued_releases", self.inner.releases.queued()),
        ]
    }

    /// Whether the release subscription is in place now.
    pub(crate) fn is_subscribed(&self) -> bool {
        self.inner
            .subscription
            .as_ref()
            .is_some_and(Subscription::is_subscribed)
    }

    /// How many times a (re)subscription failed so far.
    pub(crate) fn subscription_failures(&self) -> u64 {
        self.inner
            .subscription
            .as_ref()
            .map_or(0, Subscription::times_failed)
    }

    /// The fields of `Debug` that every single-node backend shows: never
    /// a URL or a client, whose `Debug` shows the password.
    pub(crate) fn describe<'s, 'a, 'b>(
        &self,
        f: &'s mut fmt::DebugStruct<'a, 'b>,
    ) -> &'s mut fmt::DebugStruct<'a, 'b> {
        f.field(
            "password",
            &redact::secret(self.inner.source.has_password()),
        )
        .field("channel", &self.inner.channel)
        .field("config", &self.inner.config)
    }

    /// Runs `work` on the shared connection within the command timeout.
    fn bounded<'a, T: 'a, F>(
        &'a self,
        step: &'static str,
        work: impl FnOnce(MultiplexedConnection) -> F + 'a,
    ) -> impl Future<Output = Result<T, BackendError>> + 'a
    where
        F: Future<Output = Result<T, BackendError>> + 'a,
    {
        self.bounded_on(
            &self.inner.shared,
            step,
            self.inner.config.step_timeout,
            work,
        )
    }

    /// Runs `work` on the connection in `slot` (made if there is none)
    /// within `limit`, and forgets that connection after an error that may
    /// mean it is broken, so the next step takes a fresh one from the pool
    /// (or asks the Sentinels again). `READONLY` counts: the server was
    /// demoted to a replica, and still answers `PING`. A connection another
    /// step has made since stays.
    async fn bounded_on<T, F>(
        &self,
        slot: &ConnectionSlot,
        step: &'static str,
        limit: Duration,
        work: impl FnOnce(MultiplexedConnection) -> F,
    ) -> Result<T, BackendError>
    where
        F: Future<Output = Result<T, BackendError>>,
    {
        // The generation of the connection used, 0 before one was had.
        let used = AtomicU64::new(0);
        let answer = within(step, limit, async {
            let (generation, conn) = self.connection_in(slot).await?;
            used.store(generation, Ordering::Relaxed);
            work(conn).await
        })
        .await;
        if let Err(error) = &answer {
            let generation = used.load(Ordering::Relaxed);
            if generation != 0 && step_broke(error) {
                slot.forget(generation);
            }
        }
        answer
    }

    /// The shared connection, taken from the source if there is none. A
    /// failed checkout is [`Unavailable`](BackendErrorKind::Unavailable):
    /// the step's request was not sent.
    pub(crate) async fn connection(&self) -> Result<MultiplexedConnection, BackendError> {
        self.follow_switches();
        if let Some((_, conn)) = self.inner.shared.current() {
            return Ok(conn);
        }
        // Boxed: making a connection is a large future, which every step's
        // own future would carry (and copy) on every call otherwise.
        Box::pin(self.connection_in(&self.inner.shared))
            .await
            .map(|(_, conn)| conn)
    }

    /// The connection kept in `slot` and its generation, made if there is
    /// none: taken from the source (the pool, or the primary the Sentinels
    /// name now).
    async fn connection_in(
        &self,
        slot: &ConnectionSlot,
    ) -> Result<(u64, MultiplexedConnection), BackendError> {
        self.follow_switches();
        if let Some(current) = slot.current() {
            return Ok(current);
        }
        // Made on the backend's runtime, which then drives it (a pool
        // makes its connections where it is asked for one), whichever
        // runtime this step runs on.
        Box::pin(slot.get_or_make(self.inner.driver.making(self.inner.source.connection()))).await
    }

    /// Drops the connections taken so far when the source says they go to
    /// the wrong server now (the Sentinels named another primary).
    fn follow_switches(&self) {
        let switches = self.inner.source.switches();
        if self.inner.switches.swap(switches, Ordering::AcqRel) != switches {
            self.inner.shared.clear();
            self.inner.durable.clear();
        }
    }

    /// The acquisition script, then `WAIT` on the same connection, in one
    /// pipeline; when too few replicas acknowledged, the release script on
    /// that connection, and an error.
    async fn acquire_durably(
        &self,
        durability: crate::Durability,
        keys: [&str; 2],
        owner: &OwnerToken,
        ttl: Duration,
    ) -> Result<i64, BackendError> {
        let limit = self.inner.config.step_timeout + durability.timeout;
        self.bounded_on(
            &self.inner.durable,
            "acquisition",
            limit,
            |mut conn| async move {
                let mut pipe = ACQUIRE.pipe(
                    &keys,
                    &[
                        owner.as_str(),
                        &ttl_ms(ttl),
                        &self.inner.config.fence_ttl_ms(ttl),
                    ],
                );
                pipe.cmd("WAIT")
                    .arg(durability.replicas)
                    .arg(ttl_ms(durability.timeout));
                let (answer, acked): (i64, i64) = ACQUIRE.run(&mut conn, &pipe).await?;
                if answer <= 0 || acked >= i64::from(durability.replicas) {
                    return Ok(answer);
                }
                let release = RELEASE.call(&keys[..1], &[owner.as_str(), &self.inner.channel]);
                let released = RELEASE.run(&mut conn, &release).await;
                Err(crate::durability::shortfall(acked, durability, released))
            },
        )
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
        let call = &call;
        self.bounded(
            step,
            |mut conn| async move { script.run(&mut conn, call).await },
        )
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
struct OnTheWire<'a, S: Source>(Option<(&'a SingleNode<S>, Step)>);

impl<S: Source> Drop for OnTheWire<'_, S> {
    fn drop(&mut self) {
        if let Some((backend, step)) = self.0 {
            if let Some(batch) = backend.batcher(step).finished() {
                backend.send_batch(step, batch);
            }
        }
    }
}

impl<S: Source> SingleNode<S> {
    /// Whether a step goes out alone now (`None`: it waits to go out in a
    /// batch).
    fn alone(&self, step: Step) -> Option<OnTheWire<'_, S>> {
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
        // The batch's own run forgets its connection if it broke.
        within(step.name(), self.inner.config.step_timeout, async {
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
struct BatchOnTheWire<S: Source> {
    backend: SingleNode<S>,
    step: Step,
    batch: Vec<Queued>,
}

impl<S: Source> BatchOnTheWire<S> {
    async fn send(mut self) {
        let backend = self.backend.clone();
        let answer = {
            let fence_idle = backend.inner.config.fence_idle_ms();
            let send = |queue: bool| {
                let mut keys: Vec<&str> = Vec::with_capacity(self.batch.len() * 4);
                let mut args: Vec<&str> = Vec::with_capacity(self.batch.len() * 3 + 2);
                if self.step == Step::Release {
                    args.push(&backend.inner.channel);
                    if queue {
                        args.push(&fence_idle);
                        args.push(&backend.inner.grant_prefix);
                    }
                }
                for queued in &self.batch {
                    // A release's keys are the lock's and, for the queue,
                    // its companion, queue and waiters [F1].
                    let own = if self.step == Step::Release && !queue {
                        &queued.keys[..1]
                    } else {
                        &queued.keys[..]
                    };
                    keys.extend(own.iter().map(String::as_str));
                    args.extend(queued.args.iter().map(String::as_str));
                }
                let script = match (self.step, queue) {
                    (Step::Acquisition, _) => &ACQUIRE_BATCH,
                    (Step::Release, true) => &RELEASE_BATCH,
                    (Step::Release, false) => &RELEASE_BATCH_UNQUEUED,
                };
                let backend = &backend;
                async move {
                    backend
                        .run_script::<Vec<redis::Value>>(self.step.name(), script, &keys, &args)
                        .await
                }
            };
            let queue = self.step == Step::Release && backend.inner.queue_rights.allowed();
            match send(queue).await {
                Err(error) if queue && is_key_refused(&error) => {
                    backend.inner.queue_rights.refuse(&error);
                    send(false).await
                }
                answer => answer,
            }
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

impl<S: Source> Drop for BatchOnTheWire<S> {
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

impl<S: Source> SingleNode<S> {
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
        let pipe = &pipe;
        let answers: Vec<i64> = self
            .bounded("extension", |mut conn| async move {
                EXTEND.run(&mut conn, pipe).await
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

    /// Whether the pub/sub client hears a release published through the
    /// pool: a probe published on the release channel, for a key nobody
    /// locks, must reach the backend's own subscription within the step
    /// timeout. Needs only the rights the lock steps need (`PUBLISH` and
    /// `SUBSCRIBE` on the release channel), not `INFO` \[D3\]. `Err`: the
    /// probe could not be sent. A watch woken by a resubscription (which
    /// wakes every watch) counts as not heard.
    async fn probe(&self, subscription: &Subscription) -> Result<bool, BackendError> {
        let probe = format!("withlock-probe:{:032x}", rand::random::<u128>());
        let mut watch = subscription.watch(&probe).await?;
        let made = subscription.times_made();
        let lock_key = self.lock_key(&probe).into_owned();
        let lock_key = &lock_key;
        let _receivers: i64 = self
            .bounded("probing the release channel", |mut conn| async move {
                redis::cmd("PUBLISH")
                    .arg(&self.inner.channel)
                    .arg(lock_key)
                    .query_async(&mut conn)
                    .await
                    .map_err(map_redis_error)
            })
            .await?;
        let heard = tokio::time::timeout(self.inner.config.step_timeout, watch.released())
            .await
            .is_ok();
        // Woken by a resubscription, which wakes every watch, the probe was
        // not heard for sure.
        Ok(heard && subscription.times_made() == made)
    }

    /// Probes and reports to `check`; whether the wait watches now.
    async fn probe_for(
        &self,
        check: &SameServer,
        subscription: &Subscription,
    ) -> Result<bool, BackendError> {
        match self.probe(subscription).await {
            Ok(heard) => {
                Ok(check.probed(heard, &self.inner.channel, self.inner.config.step_timeout))
            }
            Err(error) => {
                check.failed(&error);
                Err(error)
            }
        }
    }

    /// A watch on `key` over `subscription`, unless the pub/sub client was
    /// found not to hear the pool's server (see [`crate::same_server`]):
    /// then a watch that never fires, and the wait polls.
    async fn checked_watch(
        &self,
        subscription: &Subscription,
        key: &str,
    ) -> Result<ReleaseWatch, BackendError> {
        if let Some(check) = &self.inner.same_server {
            match check.next() {
                Next::Watch => {}
                Next::Poll => return Ok(ReleaseWatch::never()),
                Next::Probe => {
                    if !self.probe_for(check, subscription).await? {
                        return Ok(ReleaseWatch::never());
                    }
                }
                Next::PollAndProbe => {
                    let backend = self.clone();
                    self.inner.driver.spawn(async move {
                        if let (Some(check), Some(subscription)) =
                            (&backend.inner.same_server, &backend.inner.subscription)
                        {
                            // A failure is logged by the check, at debug.
                            let _ = backend.probe_for(check, subscription).await;
                        }
                    });
                    return Ok(ReleaseWatch::never());
                }
            }
        }
        subscription.watch(key).await
    }
}

/// The lock steps, as [`single_node_lock_backend!`] hands them to
/// [`LockBackend`].
impl<S: Source> SingleNode<S> {
    /// The step of [`LockBackend::capabilities`].
    pub(crate) fn capabilities(&self) -> Capabilities {
        Capabilities::default()
            .with_name("redis")
            .with_release_notifications(self.inner.subscription.is_some())
            .with_max_key_len(MAX_KEY_LEN)
            .with_max_extend_batch(self.inner.config.max_extend_batch)
            .with_fair_queue(self.inner.config.durability.is_none())
    }

    /// The step of [`LockBackend::try_acquire`].
    pub(crate) async fn try_acquire(
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

    /// The step of [`LockBackend::extend`].
    pub(crate) async fn extend(
        &self,
        lease: &Lease,
        ttl: Duration,
    ) -> Result<ExtendOutcome, BackendError> {
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

    /// The step of [`LockBackend::extend_many`].
    pub(crate) async fn extend_many(
        &self,
        requests: &[ExtendRequest],
    ) -> Vec<Result<ExtendOutcome, BackendError>> {
        if requests.is_empty() {
            return Vec::new();
        }
        batch_results(requests.len(), self.extend_pipeline(requests).await)
    }

    /// The step of [`LockBackend::failure_domain`].
    pub(crate) fn failure_domain(&self, _key: &str) -> u64 {
        0
    }

    /// The step of [`LockBackend::release`]: a grant to the fair queue's
    /// head when waiters are queued \[F1\], else the key freed.
    pub(crate) async fn release(&self, lease: &Lease) -> Result<ReleaseOutcome, BackendError> {
        let lock_key = self.lock_key(lease.key());
        let answer = if let Some(_counted) = self.alone(Step::Release) {
            let owner = lease.owner().as_str();
            if self.inner.queue_rights.allowed() {
                let keys = queue_keys(&lock_key);
                let keys = keys.each_ref().map(String::as_str);
                let args = [
                    owner,
                    &self.inner.channel,
                    &self.inner.config.fence_idle_ms(),
                    "PUBLISH",
                    &self.inner.grant_prefix,
                ];
                match self.run_script("release", &RELEASE, &keys, &args).await {
                    Err(error) if is_key_refused(&error) => self.inner.queue_rights.refuse(&error),
                    answer => return release_outcome(self.inner.grant_rights.read(answer?)),
                }
            }
            let args = [owner, &self.inner.channel];
            self.run_script("release", &RELEASE_UNQUEUED, &[&lock_key], &args)
                .await?
        } else {
            let answer = self
                .queued(
                    Step::Release,
                    queue_keys(&lock_key).into(),
                    vec![lease.owner().as_str().to_owned()],
                )
                .await?;
            let answer =
                i64::from_redis_value(&answer).map_err(|e| protocol_error("release", &e))?;
            self.inner.grant_rights.read(answer)
        };
        release_outcome(answer)
    }

    /// The step of [`LockBackend::try_acquire_queued`].
    pub(crate) async fn try_acquire_queued(
        &self,
        key: &str,
        owner: &OwnerToken,
        ttl: Duration,
        terms: QueueTerms,
    ) -> Result<AcquireOutcome, BackendError> {
        // Before the attempt that may make the node's place: a grant to it
        // then comes on its own channel [F4].
        if let Some(subscription) = &self.inner.subscription {
            Box::pin(subscription.hear_grants_of(owner.node_id())).await;
        }
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
        let answer: redis::Value = self
            .run_script("queued acquisition", &ACQUIRE_QUEUED, &keys, &args)
            .await?;
        queued_outcome(&answer)
    }

    /// The step of [`LockBackend::leave_queue`].
    pub(crate) async fn leave_queue(
        &self,
        key: &str,
        owner: &OwnerToken,
    ) -> Result<(), BackendError> {
        let lock_key = self.lock_key(key);
        let keys = queue_keys(&lock_key);
        let keys = keys.each_ref().map(String::as_str);
        let args = [
            owner.as_str(),
            &self.inner.channel,
            &self.inner.config.fence_idle_ms(),
            "PUBLISH",
            &self.inner.grant_prefix,
        ];
        let handed_on: i64 = self
            .run_script("leaving the queue", &LEAVE_QUEUE, &keys, &args)
            .await?;
        self.inner.grant_rights.read(handed_on);
        Ok(())
    }

    /// The step of [`LockBackend::hold`]: the extension with the time left
    /// of the hold (at least 1 ms, as `PEXPIRE 0` would delete the key),
    /// and the hold's record beside the lock for the admin
    /// ([`kept_key`]), in one script run.
    pub(crate) async fn hold(
        &self,
        lease: &Lease,
        hold: Hold,
    ) -> Result<ExtendOutcome, BackendError> {
        let lock_key = self.lock_key(lease.key());
        let (fence, kept) = (fence_key(&lock_key), kept_key(&lock_key));
        let keys = [&*lock_key, &fence, &kept];
        let ttl = hold.from_now.max(Duration::from_millis(1));
        let (ttl, fence_ttl) = (ttl_ms(ttl), self.inner.config.fence_ttl_ms(ttl));
        let token = lease.fencing_token().to_string();
        let args = [lease.owner().as_str(), &ttl, &fence_ttl, &token];
        let answer = match self.run_script("hold", &HOLD, &keys, &args).await {
            // A user whose ACL does not reach the record: the hold
            // without it (the script did not run).
            Err(error) if is_key_refused(&error) => {
                tracing::debug!(key = %lease.key(), "the ACL refuses the minimum hold's record; holding without it");
                self.run_script("hold", &EXTEND, &keys[..2], &args).await?
            }
            answer => answer?,
        };
        extend_outcome(answer)
    }

    /// The step of [`LockBackend::watch_release`].
    pub(crate) async fn watch_release(&self, key: &str) -> Result<ReleaseWatch, BackendError> {
        let Some(subscription) = &self.inner.subscription else {
            return Ok(ReleaseWatch::never());
        };
        self.checked_watch(subscription, key).await
    }
}

/// `LockBackend` for a type whose field `$field` is a [`SingleNode`]: the
/// trait's calls go to its steps directly (one boxed future per call, as
/// for any `async_trait` method, not two).
macro_rules! single_node_lock_backend {
    ($ty:ty => $field:ident) => {
        #[lock_core::async_trait]
        impl lock_core::LockBackend for $ty {
            fn capabilities(&self) -> lock_core::Capabilities {
                self.$field.capabilities()
            }

            /// `SET key token NX PX ttl`, and if it took the key, the fencing token
            /// `max(companion + 1, server clock in µs)` stored in the companion, in
            /// one script: tokens keep increasing when the companion is lost.
            /// Fails with kind [`Unavailable`](lock_core::BackendErrorKind::Unavailable) when
            /// no connection could be had: nothing was sent.
            ///
            /// # Cancel safety
            ///
            /// A dropped call may have taken the key; a release with the same owner
            /// token frees it.
            async fn try_acquire(
                &self,
                key: &str,
                owner: &lock_core::OwnerToken,
                ttl: std::time::Duration,
            ) -> Result<lock_core::AcquireOutcome, lock_core::BackendError> {
                self.$field.try_acquire(key, owner, ttl).await
            }

            /// `PEXPIRE` if the key still holds the owner token, and of its fencing
            /// companion to the ttl plus [`fence_idle`](crate::RedisConfig::fence_idle)
            /// (put back if it was lost), in one script.
            ///
            /// # Cancel safety
            ///
            /// A dropped call may or may not have extended the key.
            async fn extend(
                &self,
                lease: &lock_core::Lease,
                ttl: std::time::Duration,
            ) -> Result<lock_core::ExtendOutcome, lock_core::BackendError> {
                self.$field.extend(lease, ttl).await
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
                requests: &[lock_core::ExtendRequest],
            ) -> Vec<Result<lock_core::ExtendOutcome, lock_core::BackendError>> {
                self.$field.extend_many(requests).await
            }

            /// One server.
            fn failure_domain(&self, key: &str) -> u64 {
                self.$field.failure_domain(key)
            }

            /// `DEL` if the key still holds the owner token, then `PUBLISH` of the
            /// key on the release channel, in one script; with waiters queued, the
            /// grant to the head instead, published on its node's grant channel
            /// \[F4\]. The fencing companion keeps the expiry the last acquisition
            /// or extension gave it: at least
            /// [`fence_idle`](crate::RedisConfig::fence_idle) after the release.
            ///
            /// # Cancel safety
            ///
            /// A dropped call may or may not have released the key; calling again
            /// is safe.
            async fn release(
                &self,
                lease: &lock_core::Lease,
            ) -> Result<lock_core::ReleaseOutcome, lock_core::BackendError> {
                self.$field.release(lease).await
            }

            /// The extension script with the time left of the minimum hold \[H7\]
            /// (Redis keeps no record of when a key was set). At least 1 ms, as
            /// `PEXPIRE 0` would delete the key.
            async fn hold(
                &self,
                lease: &lock_core::Lease,
                hold: lock_core::Hold,
            ) -> Result<lock_core::ExtendOutcome, lock_core::BackendError> {
                self.$field.hold(lease, hold).await
            }

            /// A watch on `key`, returned once the backend's one subscription is
            /// confirmed (the first call starts it). Fails at once while the
            /// subscription is down, and after the command timeout if it cannot be
            /// made; the driver then waits on its retry timer.
            ///
            /// # Cancel safety
            ///
            /// Cancel safe: the subscription belongs to the backend, not the call.
            async fn watch_release(
                &self,
                key: &str,
            ) -> Result<lock_core::ReleaseWatch, lock_core::BackendError> {
                self.$field.watch_release(key).await
            }

            /// One script: takes up a grant, takes a free key when no live
            /// place is ahead, else keeps the owner's place in the key's
            /// queue alive for the ticket ttl \[F1, F2\] (`lua/queue.lua`).
            /// A user whose ACL does not reach the queue's keys gets the
            /// server's `NOPERM`, a setup error: the driver then waits
            /// unqueued \[F6\].
            ///
            /// # Cancel safety
            ///
            /// A dropped call may have made a place or taken the key.
            async fn try_acquire_queued(
                &self,
                key: &str,
                owner: &lock_core::OwnerToken,
                ttl: std::time::Duration,
                terms: lock_core::QueueTerms,
            ) -> Result<lock_core::AcquireOutcome, lock_core::BackendError> {
                self.$field.try_acquire_queued(key, owner, ttl, terms).await
            }

            /// One script: the place removed, a grant not taken up handed on.
            ///
            /// # Cancel safety
            ///
            /// A dropped call may or may not have been applied.
            async fn leave_queue(
                &self,
                key: &str,
                owner: &lock_core::OwnerToken,
            ) -> Result<(), lock_core::BackendError> {
                self.$field.leave_queue(key, owner).await
            }
        }
    };
}
pub(crate) use single_node_lock_backend;

//! `EtcdBackend`: the lock steps as etcd requests, one lease per
//! acquisition.

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, GetOptions, PutOptions, SortOrder, SortTarget, Txn,
    TxnOp, TxnOpResponse, TxnResponse,
};
use lock_core::{
    async_trait, AcquireOutcome, BackendError, BackendErrorKind, Background, Capabilities,
    ExtendOutcome, ExtendRequest, Hold, Lease, LockBackend, OwnerToken, QueueTerms, ReleaseHub,
    ReleaseOutcome, ReleaseWatch, MAX_KEY_LEN,
};

use crate::config::EtcdConfig;
use crate::endpoints::{is_endpoint_failure, Again, Endpoints};
use crate::error::{is_no_leader, is_refusal, protocol, SetupError};
use crate::keepalive::KeepAlives;
use crate::layout::{contender_key, contender_range, is_contender, record_key};
use crate::queue::Places;
use crate::watch::Watches;

/// How many leases one [`LockBackend::extend_many`] call carries: its
/// keys are read in one transaction, and etcd's default `--max-txn-ops`
/// is 128.
pub const MAX_EXTEND_BATCH: usize = 128;

/// A lock backend on etcd, in the key layout of etcd's own
/// `concurrency.Mutex` (see the crate docs).
///
/// Cheap to clone; clones share the endpoint in use (see
/// [`EtcdConfig::failover_timeout`]), the keep-alive stream and the
/// watch stream, whose tasks stop when the last clone is dropped. The
/// connections and those tasks live on withlock's background runtime
/// ([`lock_core::Background`]), not on the runtime the backend was made
/// on \[T1\]: a backend made on one runtime works on another after the
/// first has ended.
#[derive(Clone)]
pub struct EtcdBackend {
    pub(crate) inner: Arc<Inner>,
}

pub(crate) struct Inner {
    /// The endpoint in use, and the failover to the next.
    pub(crate) endpoints: Arc<Endpoints>,
    config: EtcdConfig,
    /// The shortest lease granted, in whole seconds.
    min_ttl_secs: i64,
    /// The lease of each lock this backend acquired, by name and owner
    /// token, while it may still hold it: a step finds its key by it.
    /// Forgotten at every end of the lock (released, moved to its minimum
    /// hold, found expired or taken, a release or hold that failed) \[T2\];
    /// a miss (another process's lease, a forgotten entry) is looked up
    /// by value.
    leases: Mutex<HashMap<(String, String), i64>>,
    /// Whether releases still write the fencing token's record for the
    /// admin: off once etcd refused it (a user with rights on the lock
    /// names alone \[D3\]).
    records: AtomicBool,
    pub(crate) keep_alives: KeepAlives,
    hub: ReleaseHub,
    pub(crate) watches: Option<Watches>,
    /// The places of this backend's waiters in the fair queue \[F1\].
    pub(crate) places: Arc<Places>,
}

impl EtcdBackend {
    /// Connects to the cluster `config` names and checks it: a lease is
    /// granted and revoked at once, which also measures etcd's lease floor
    /// ([`EtcdConfig::min_ttl`]).
    ///
    /// # Errors
    ///
    /// - [`SetupError::InvalidConfig`] for a config that does not validate;
    /// - [`SetupError::NoLeader`] when members answered within
    ///   [`EtcdConfig::connect_timeout`] but none had a leader (an election
    ///   under way: the check is tried again until the connect timeout, so
    ///   a timeout above the election's 1 to 2 s rides it out);
    /// - [`SetupError::Connect`] when no endpoint answers within
    ///   [`EtcdConfig::connect_timeout`], or the connection fails (a TLS
    ///   client against a plain server, or the other way round);
    /// - [`SetupError::Refused`] for wrong credentials or a user without
    ///   the rights to grant leases.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future drops the client being made; the check's lease,
    /// if granted, expires with its 1 s ttl.
    pub async fn connect(config: EtcdConfig) -> Result<Self, SetupError> {
        config.validate()?;
        let mut options = ConnectOptions::new()
            .with_connect_timeout(config.connect_timeout)
            // A member cut off from its leader refuses requests and ends
            // its streams instead of serving stale reads or holding a
            // watch that never fires.
            .with_require_leader(true)
            // A stopped or unreachable member is found out by HTTP/2 pings.
            .with_keep_alive(
                config.step_timeout.min(Duration::from_secs(1)) / 2,
                config.step_timeout / 2,
            )
            .with_keep_alive_while_idle(true);
        if let Some((name, password)) = &config.user {
            options = options.with_user(name.clone(), password.clone());
        }
        #[cfg(feature = "tls")]
        if let Some(tls) = &config.tls {
            options = options.with_tls(tls.clone());
        }
        let background = Background::default();
        let last = Mutex::new(None);
        let connect_error = |error: etcd_client::Error| {
            if is_refusal(&error) {
                SetupError::Refused(error)
            } else {
                SetupError::Connect {
                    endpoints: config.endpoints.clone(),
                    source: Some(error),
                }
            }
        };
        let failover_after = config.failover_timeout.min(config.step_timeout);
        // Whether a member said there is no leader: the timeout then says
        // so, rather than the last endpoint's error (often the stopped
        // leader's refused connection).
        let leaderless = AtomicBool::new(false);
        let note = |error: etcd_client::Error| {
            tracing::debug!(error = %lock_core::ErrorChain(&error), "etcd did not grant the check's lease yet");
            if is_no_leader(&error) {
                leaderless.store(true, Ordering::Relaxed);
            }
            *last.lock().unwrap_or_else(PoisonError::into_inner) = Some(error);
        };
        // The check is tried again until the connect timeout while the
        // cluster answers with a passing error (no leader yet, an endpoint
        // down, passed over to the next): only a refusal or a malformed
        // endpoint ends it at once.
        let check = async {
            let endpoints = loop {
                match Endpoints::connect(
                    config.endpoints.clone(),
                    options.clone(),
                    failover_after,
                    background.clone(),
                )
                .await
                {
                    Ok(endpoints) => break endpoints,
                    // An endpoint that is no URI stays one.
                    Err(
                        error @ (etcd_client::Error::InvalidUri(_)
                        | etcd_client::Error::InvalidArgs(_)),
                    ) => return Err(connect_error(error)),
                    Err(error) if is_refusal(&error) => return Err(connect_error(error)),
                    Err(error) => note(error),
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            };
            loop {
                let pin = match endpoints.pin().await {
                    Ok(pin) => pin,
                    Err(error) if is_refusal(&error) => return Err(connect_error(error)),
                    Err(error) => {
                        note(error);
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    }
                };
                let mut client = pin.client;
                match tokio::time::timeout(failover_after, client.lease_grant(1, None)).await {
                    Ok(Ok(granted)) => {
                        let _ = client.lease_revoke(granted.id()).await;
                        return Ok::<_, SetupError>((endpoints, granted.ttl()));
                    }
                    Ok(Err(error)) if is_refusal(&error) => return Err(SetupError::Refused(error)),
                    Ok(Err(error)) => {
                        if is_endpoint_failure(&error) {
                            endpoints.failed(pin.generation, &error);
                        }
                        note(error);
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                    Err(_) => endpoints.failed(
                        pin.generation,
                        &format_args!("no answer within {failover_after:?}"),
                    ),
                }
            }
        };
        let (endpoints, floor) = match tokio::time::timeout(config.connect_timeout, check).await {
            Ok(checked) => checked?,
            Err(_) => {
                let endpoints = config.endpoints.clone();
                let source = last.lock().unwrap_or_else(PoisonError::into_inner).take();
                return Err(if leaderless.load(Ordering::Relaxed) {
                    SetupError::NoLeader { endpoints, source }
                } else {
                    SetupError::Connect { endpoints, source }
                });
            }
        };
        let endpoints = Arc::new(endpoints);
        let configured = config.min_ttl.map_or(1, whole_seconds);
        let min_ttl_secs = floor.max(configured).max(1);
        let hub = ReleaseHub::new();
        let places = Arc::new(Places::default());
        let watches = config.release_notifications.then(|| {
            Watches::start(
                &endpoints,
                hub.clone(),
                Arc::clone(&places),
                config.step_timeout,
            )
        });
        Ok(Self {
            inner: Arc::new(Inner {
                keep_alives: KeepAlives::start(&endpoints),
                endpoints,
                config,
                min_ttl_secs,
                leases: Mutex::new(HashMap::new()),
                records: AtomicBool::new(true),
                hub,
                watches,
                places,
            }),
        })
    }

    /// [`connect`](Self::connect) on a URL of the form
    /// `etcd://[user:password@]host:2379[,host2:2379…]` (`etcds://` for
    /// TLS), with the other fields of [`EtcdConfig`] at their defaults.
    ///
    /// # Errors
    ///
    /// [`SetupError::InvalidUrl`], or those of [`connect`](Self::connect).
    ///
    /// # Cancel safety
    ///
    /// As [`connect`](Self::connect).
    pub async fn from_url(url: &str) -> Result<Self, SetupError> {
        Self::connect(EtcdConfig::from_url(url)?).await
    }

    /// The client of the endpoint the steps use now, for anything else
    /// you do with etcd. It stays on that endpoint: it does not follow a
    /// later failover (ask again after one).
    pub fn client(&self) -> Client {
        self.inner.endpoints.last_client()
    }

    /// The endpoint the steps use now (see
    /// [`EtcdConfig::failover_timeout`] for when it changes).
    pub fn endpoint(&self) -> String {
        self.inner.endpoints.pinned_url()
    }

    /// Sends one request on the endpoint in use, failing over as
    /// [`Endpoints::call`] says.
    pub(crate) async fn call<T, F, Fut>(&self, again: Again, send: F) -> Result<T, BackendError>
    where
        F: FnMut(Client) -> Fut,
        Fut: Future<Output = Result<T, etcd_client::Error>>,
    {
        self.inner.endpoints.call(again, send).await
    }

    /// The config the backend was made with.
    pub fn config(&self) -> &EtcdConfig {
        &self.inner.config
    }

    /// The shortest lease this backend grants: etcd's floor as measured
    /// at connect, or [`EtcdConfig::min_ttl`] when longer.
    pub fn min_ttl(&self) -> Duration {
        Duration::from_secs(u64::try_from(self.inner.min_ttl_secs).unwrap_or(1))
    }

    /// The ttl a lease asked for with `ttl` is granted: whole seconds,
    /// rounded up, and at least [`min_ttl`](Self::min_ttl).
    pub fn effective_ttl(&self, ttl: Duration) -> Duration {
        Duration::from_secs(u64::try_from(self.lease_secs(ttl)).unwrap_or(u64::MAX))
    }

    pub(crate) fn lease_secs(&self, ttl: Duration) -> i64 {
        whole_seconds(ttl).max(self.inner.min_ttl_secs)
    }

    /// Runs one step within the step timeout.
    pub(crate) async fn step<T>(
        &self,
        name: &'static str,
        work: impl Future<Output = Result<T, BackendError>>,
    ) -> Result<T, BackendError> {
        let after = self.inner.config.step_timeout;
        match tokio::time::timeout(after, work).await {
            Ok(result) => result,
            Err(_) => Err(BackendError::timeout(name, after)),
        }
    }

    fn leases(&self) -> std::sync::MutexGuard<'_, HashMap<(String, String), i64>> {
        self.inner
            .leases
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    pub(crate) fn remember(&self, name: &str, owner: &OwnerToken, lease: i64) {
        self.leases()
            .insert((name.to_owned(), owner.as_str().to_owned()), lease);
    }

    fn forget(&self, name: &str, owner: &OwnerToken) {
        self.leases()
            .remove(&(name.to_owned(), owner.as_str().to_owned()));
    }

    /// The contender key of `owner` on `name` and its lease: remembered
    /// (the key is named after its lease), or else read: the contender
    /// whose value is the owner token, wherever its lease.
    async fn lease_of(
        &self,
        name: &str,
        owner: &OwnerToken,
    ) -> Result<Option<(String, i64)>, BackendError> {
        let remembered = self
            .leases()
            .get(&(name.to_owned(), owner.as_str().to_owned()))
            .copied();
        if let Some(lease) = remembered {
            return Ok(Some((contender_key(name, lease), lease)));
        }
        let (start, end) = contender_range(name);
        let options = GetOptions::new().with_range(end);
        let read = self
            .call(Again::Yes, |mut client| {
                let (start, options) = (start.clone(), options.clone());
                async move { client.get(start, Some(options)).await }
            })
            .await?;
        Ok(read
            .kvs()
            .iter()
            .find(|kv| is_contender(name, kv.key()) && kv.value() == owner.as_str().as_bytes())
            .map(|kv| (String::from_utf8_lossy(kv.key()).into_owned(), kv.lease())))
    }

    /// Revokes `lease` from the background runtime, within the step
    /// timeout; a failure leaves it to expire with its ttl.
    pub(crate) fn revoke_in_background(&self, lease: i64) {
        let endpoints = Arc::clone(&self.inner.endpoints);
        let after = self.inner.config.step_timeout;
        self.inner.endpoints.background().spawn(async move {
            let revoked = tokio::time::timeout(after, revoke(&endpoints, lease)).await;
            let error = match revoked {
                Ok(Ok(())) => return,
                Ok(Err(error)) => error,
                Err(_) => BackendError::timeout("lease revoke", after),
            };
            tracing::debug!(error = %lock_core::ErrorChain(&error), lease, "a lease was not revoked; it expires with its ttl");
        });
    }

    /// Revokes a lease whose key is gone or never held the name; a lease
    /// already gone is fine, and any other failure only leaves it to
    /// expire with its ttl.
    pub(crate) async fn revoke_quietly(&self, lease: i64) {
        if let Err(error) = revoke(&self.inner.endpoints, lease).await {
            tracing::debug!(error = %lock_core::ErrorChain(&error), lease, "lease revoke failed; it expires with its ttl");
        }
    }

    /// Deletes the contender key `contender` of `name` in one transaction
    /// under `compares`, with the fencing token's record for the admin's
    /// view of the free name when the token is known (a clean-up after a
    /// lost answer has none). The record is a courtesy: a user whose
    /// rights cover the lock names alone \[D3\] is refused it, and the
    /// delete is then sent again without it (a refused transaction
    /// changed nothing); from then on this backend writes no record, and
    /// says so once in the log.
    pub(crate) async fn delete_contender(
        &self,
        name: &str,
        compares: Vec<Compare>,
        contender: String,
        fencing_token: u64,
    ) -> Result<TxnResponse, BackendError> {
        let send = |txn: Txn| {
            // Sent twice, a delete that went through the first time would
            // find its comparisons failing the second.
            self.call(Again::No, move |mut client| {
                let txn = txn.clone();
                async move { client.txn(txn).await }
            })
        };
        let delete = Txn::new()
            .when(compares.clone())
            .and_then(vec![TxnOp::delete(contender.clone(), None)]);
        if fencing_token == 0 || !self.inner.records.load(Ordering::Relaxed) {
            return send(delete).await;
        }
        let recorded = Txn::new().when(compares).and_then(vec![
            TxnOp::delete(contender, None),
            TxnOp::put(record_key(name), fencing_token.to_string(), None),
        ]);
        match send(recorded).await {
            Err(refused) if refused.kind() == BackendErrorKind::Setup => {
                let answer = send(delete).await?;
                // The names' rights were enough: the record's were not.
                if self.inner.records.swap(false, Ordering::Relaxed) {
                    tracing::warn!(
                        error = %refused,
                        record = %record_key(name).escape_debug(),
                        "etcd refused the fencing token's record of a release; releases go on \
                         without it, and the admin shows no token for a free name (grant \
                         readwrite on the prefix \"\\0withlock/fencing/\" to keep it)"
                    );
                }
                Ok(answer)
            }
            answer => answer,
        }
    }

    /// The sizes of the backend's per-key structures, by name, for tests
    /// of \[T2\]. Each is back to 0 once no lock is held, no attempt or
    /// step is under way and nobody waits; `watches*` within the sweep
    /// period (2 s) of the last wait.
    ///
    /// - `leases`: the lease of each lock held (or whose step is under
    ///   way);
    /// - `keep_alives_waiting`: leases whose keep-alive awaits its answer;
    /// - `watches`: names with a watch on the watch stream, made or being
    ///   made; `watch_ids`: those etcd confirmed; `watches_creating`:
    ///   those asked for and not confirmed yet; `watches_to_rebuild`:
    ///   names to watch again after the stream broke;
    /// - `release_hub_keys`: names somebody waits on;
    /// - `queue_places`: places of this backend's waiters in the fair
    ///   queue.
    #[doc(hidden)]
    pub fn state_counts(&self) -> Vec<(&'static str, usize)> {
        let mut counts = vec![
            ("leases", self.leases().len()),
            ("keep_alives_waiting", self.inner.keep_alives.waiting()),
            ("release_hub_keys", self.inner.hub.watched_keys()),
            ("queue_places", self.inner.places.len()),
        ];
        if let Some(watches) = &self.inner.watches {
            let w = watches.counts();
            counts.extend([
                ("watches", w.names.load(Ordering::Relaxed)),
                ("watch_ids", w.ids.load(Ordering::Relaxed)),
                ("watches_creating", w.creating.load(Ordering::Relaxed)),
                ("watches_to_rebuild", w.rebuild.load(Ordering::Relaxed)),
                ("watches_queued", w.queued.load(Ordering::Relaxed)),
            ]);
        }
        counts
    }

    /// The attempt's transaction for the contender key on `lease`: puts
    /// it only when no key stands in the name's contender range (then it
    /// is the lowest: the lock is taken), else reads the contenders and
    /// answers busy without a key. A range that holds only keys of other
    /// forms (a longer name's `name/A…`) is left to `TryLock`'s
    /// transaction ([`contend_put`](Self::contend_put)).
    async fn contend(
        &self,
        key: &str,
        owner: &OwnerToken,
        lease: i64,
    ) -> Result<Contended, BackendError> {
        let (start, end) = contender_range(key);
        let mine = contender_key(key, lease);
        let read = || {
            TxnOp::get(
                start.clone(),
                Some(
                    GetOptions::new()
                        .with_range(end.clone())
                        .with_keys_only()
                        .with_sort(SortTarget::Create, SortOrder::Ascend),
                ),
            )
        };
        let txn = Txn::new()
            .when(vec![Compare::create_revision(
                start.clone(),
                CompareOp::Equal,
                0,
            )
            .with_range(end.clone())])
            .and_then(vec![
                TxnOp::put(
                    mine.clone(),
                    owner.as_str(),
                    Some(PutOptions::new().with_lease(lease)),
                ),
                read(),
            ])
            .or_else(vec![read()]);
        // Sent again after a failover, the first sending's put (if it went
        // through) makes the range not empty: the read then finds the own
        // key, the lowest, as the first answer did.
        let answer = self
            .call(Again::Yes, |mut client| {
                let txn = txn.clone();
                async move { client.txn(txn).await }
            })
            .await?;
        let Some(TxnOpResponse::Get(read)) = answer.op_responses().pop() else {
            return Err(protocol("the acquisition's read answered no range"));
        };
        let mut contenders = read.kvs().iter().filter(|kv| is_contender(key, kv.key()));
        let lowest = contenders.next();
        let own = read.kvs().iter().find(|kv| kv.key() == mine.as_bytes());
        match (lowest, own) {
            (Some(lowest), Some(own)) if lowest.key() == own.key() => {
                u64::try_from(own.create_revision())
                    .map(Contended::Taken)
                    .map_err(|_| protocol("a negative create revision"))
            }
            // Put behind another contender: cannot be, as the put needs an
            // empty range; withdrawn all the same.
            (_, Some(_)) => Ok(Contended::Busy { put: true }),
            (Some(_), None) => Ok(Contended::Busy { put: false }),
            (None, None) if answer.succeeded() => {
                Err(protocol("the acquisition's read did not find its own key"))
            }
            (None, None) => Ok(match self.contend_put(key, owner, lease).await? {
                Some(fencing_token) => Contended::Taken(fencing_token),
                None => Contended::Busy { put: true },
            }),
        }
    }

    /// `TryLock`'s transaction for the contender key on `lease`: puts it
    /// and reads the name's contenders; gives the fencing token when it
    /// is the lowest (the lock is taken), else `None` (busy).
    async fn contend_put(
        &self,
        key: &str,
        owner: &OwnerToken,
        lease: i64,
    ) -> Result<Option<u64>, BackendError> {
        let (start, end) = contender_range(key);
        let contenders = GetOptions::new()
            .with_range(end)
            .with_keys_only()
            .with_sort(SortTarget::Create, SortOrder::Ascend);
        let txn = Txn::new().and_then(vec![
            TxnOp::put(
                contender_key(key, lease),
                owner.as_str(),
                Some(PutOptions::new().with_lease(lease)),
            ),
            TxnOp::get(start, Some(contenders)),
        ]);
        // Sent again after a failover, the put finds its own key and
        // leaves its create revision as it was: the read compares
        // create revisions, so the second answer is the first's.
        let answer = self
            .call(Again::Yes, |mut client| {
                let txn = txn.clone();
                async move { client.txn(txn).await }
            })
            .await?;
        let mine = contender_key(key, lease);
        let (lowest, own) = match answer.op_responses().get(1) {
            Some(TxnOpResponse::Get(read)) => {
                let mut contenders = read.kvs().iter().filter(|kv| is_contender(key, kv.key()));
                let lowest = contenders.next().map(|kv| kv.create_revision());
                let own = read
                    .kvs()
                    .iter()
                    .find(|kv| kv.key() == mine.as_bytes())
                    .map(|kv| kv.create_revision());
                (lowest, own)
            }
            _ => (None, None),
        };
        let (Some(lowest), Some(own)) = (lowest, own) else {
            return Err(protocol("the acquisition's read did not find its own key"));
        };
        if lowest != own {
            return Ok(None);
        }
        u64::try_from(own)
            .map(Some)
            .map_err(|_| protocol("a negative create revision"))
    }

    async fn extend_batch(
        &self,
        requests: &[ExtendRequest],
    ) -> Result<Vec<Result<ExtendOutcome, BackendError>>, BackendError> {
        let remembered: Vec<Option<i64>> = {
            let leases = self.leases();
            requests
                .iter()
                .map(|r| {
                    let id = (
                        r.lease.key().to_owned(),
                        r.lease.owner().as_str().to_owned(),
                    );
                    leases.get(&id).copied()
                })
                .collect()
        };
        // Every keep-alive first, then one read of every name's
        // contenders: a key found on its lease after the lease's
        // keep-alive was answered was held when the lease got its ttl
        // again.
        let alive = futures_util::future::join_all(remembered.iter().map(|lease| async move {
            match lease {
                Some(lease) => Some(self.inner.keep_alives.keep_alive(*lease).await),
                None => None,
            }
        }))
        .await;
        let reads: Vec<TxnOp> = requests
            .iter()
            .map(|request| {
                let (start, end) = contender_range(request.lease.key());
                TxnOp::get(start, Some(GetOptions::new().with_range(end)))
            })
            .collect();
        let txn = Txn::new().and_then(reads);
        let answer = self
            .call(Again::Yes, |mut client| {
                let txn = txn.clone();
                async move { client.txn(txn).await }
            })
            .await?;
        let found = answer.op_responses();
        if found.len() != requests.len() {
            return Err(protocol(
                "an extension read answered another count of ranges",
            ));
        }
        let mut outcomes = Vec::with_capacity(requests.len());
        for (((request, lease), alive), read) in
            requests.iter().zip(&remembered).zip(alive).zip(found)
        {
            let TxnOpResponse::Get(read) = read else {
                return Err(protocol("an extension read answered no range"));
            };
            let name = request.lease.key();
            let owner = request.lease.owner().as_str().as_bytes();
            let contenders = || read.kvs().iter().filter(|kv| is_contender(name, kv.key()));
            let mine = contenders().find(|kv| kv.value() == owner);
            let outcome = match (mine, lease, alive) {
                // Held on the lease it was granted, kept alive.
                (Some(kv), Some(lease), Some(alive)) if kv.lease() == *lease => match alive {
                    Ok(true) => Ok(ExtendOutcome::Extended),
                    // The lease ran out between its keep-alive and the read.
                    Ok(false) => Ok(ExtendOutcome::Expired),
                    Err(error) => Err(error),
                },
                // Not remembered (an acquisition of another backend, an
                // entry already forgotten): kept alive now.
                (Some(kv), None, _) => match self.inner.keep_alives.keep_alive(kv.lease()).await {
                    Ok(true) => Ok(ExtendOutcome::Extended),
                    Ok(false) => Ok(ExtendOutcome::Expired),
                    Err(error) => Err(error),
                },
                // The owner token on another lease: written by hand.
                (Some(_), Some(_), _) => Ok(ExtendOutcome::Taken),
                // Gone: taken when somebody else stands for the name.
                (None, _, _) if contenders().next().is_some() => Ok(ExtendOutcome::Taken),
                (None, _, _) => Ok(ExtendOutcome::Expired),
            };
            if let Ok(ExtendOutcome::Expired | ExtendOutcome::Taken) = outcome {
                // Lost: no step of this owner's on the name will need it.
                self.forget(name, request.lease.owner());
            }
            outcomes.push(outcome);
        }
        Ok(outcomes)
    }
}

/// What an acquisition's transaction found.
enum Contended {
    /// The own key is the lowest contender: the lock is taken, with this
    /// fencing token.
    Taken(u64),
    /// Another contender holds; `put` when the own key was put all the
    /// same (and must be withdrawn).
    Busy { put: bool },
}

/// Forgets the lease of `owner`'s lock on `name` when a step that ends the
/// lock (release, minimum hold) ends, whatever its answer, or is dropped
/// \[T2\].
struct ForgetOnDrop<'a> {
    backend: &'a EtcdBackend,
    name: &'a str,
    owner: &'a OwnerToken,
}

impl Drop for ForgetOnDrop<'_> {
    fn drop(&mut self) {
        self.backend.forget(self.name, self.owner);
    }
}

/// Revokes `lease` on the endpoint in use; a lease already gone (revoked
/// by a first of two sends, expired) is fine.
pub(crate) async fn revoke(endpoints: &Endpoints, lease: i64) -> Result<(), BackendError> {
    endpoints
        .call(Again::Yes, |mut client| async move {
            match client.lease_revoke(lease).await {
                Err(etcd_client::Error::GRpcStatus(status))
                    if status.code() == tonic::Code::NotFound =>
                {
                    Ok(())
                }
                answer => answer.map(drop),
            }
        })
        .await
}

/// A lease an acquisition attempt granted, until the attempt hands it back
/// as acquired: every other way out revokes it, which deletes the
/// contender key put on it \[S1\]. An attempt dropped midway (its step
/// timed out, its caller went away) revokes it from the background
/// runtime, so its key, if the put went through or goes through later,
/// stands no longer than that revoke takes; only a cluster that cannot be
/// reached leaves both to expire with the ttl.
struct Granted<'a> {
    backend: &'a EtcdBackend,
    lease: Option<i64>,
}

impl Granted<'_> {
    /// The lock was taken: the lease is the lock's now.
    fn keep(mut self) {
        self.lease = None;
    }

    /// Revokes the lease now, on the attempt's own task (a busy answer
    /// then leaves no key behind when it returns).
    async fn withdraw(mut self) -> Result<(), BackendError> {
        let Some(lease) = self.lease else {
            return Ok(());
        };
        // Dropped during the revoke, the guard sends it again from the
        // background.
        let revoked = revoke(&self.backend.inner.endpoints, lease).await;
        self.lease = None;
        revoked
    }
}

impl Drop for Granted<'_> {
    fn drop(&mut self) {
        let Some(lease) = self.lease.take() else {
            return;
        };
        let endpoints = Arc::clone(&self.backend.inner.endpoints);
        let after = self.backend.inner.config.step_timeout;
        self.backend.inner.endpoints.background().spawn(async move {
            let revoked = tokio::time::timeout(after, revoke(&endpoints, lease)).await;
            let error = match revoked {
                Ok(Ok(())) => return,
                Ok(Err(error)) => error,
                Err(_) => BackendError::timeout("lease revoke", after),
            };
            tracing::debug!(error = %lock_core::ErrorChain(&error), lease, "the lease of a dropped attempt was not revoked; it expires with its ttl");
        });
    }
}

/// `ttl` in whole seconds, rounded up, at least 1.
fn whole_seconds(ttl: Duration) -> i64 {
    let secs = ttl.as_secs() + u64::from(ttl.subsec_nanos() > 0);
    i64::try_from(secs.max(1)).unwrap_or(i64::MAX)
}

impl fmt::Debug for EtcdBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EtcdBackend")
            .field("config", &self.inner.config)
            .field("min_ttl", &self.min_ttl())
            .finish()
    }
}

/// # Cancel safety
///
/// A dropped step may or may not have been applied. A dropped acquisition
/// may have granted its lease and put its key: once its grant was
/// answered, it revokes that lease from the background runtime (which
/// deletes the key, put or still on its way) \[S1\]; a grant whose answer
/// never came leaves a lease without a key, expiring with its ttl. A
/// release with the same owner token still finds a key by its value.
#[async_trait]
impl LockBackend for EtcdBackend {
    fn capabilities(&self) -> Capabilities {
        Capabilities::default()
            .with_name("etcd")
            .with_release_notifications(self.inner.watches.is_some())
            .with_max_key_len(MAX_KEY_LEN)
            .with_max_extend_batch(MAX_EXTEND_BATCH)
            .with_min_ttl(self.min_ttl())
            .with_ttl_granularity(Duration::from_secs(1))
            // The queue's grants are announced by the watch.
            .with_fair_queue(self.inner.watches.is_some())
    }

    /// `TryLock`'s attempt, without the key it would withdraw: grants a
    /// lease of the ttl (whole seconds, rounded up, at least
    /// [`min_ttl`](EtcdBackend::min_ttl)), then in one transaction puts
    /// the contender key `<key>/<lease hex>` with the owner token as its
    /// value on that lease if no contender stands for the name, and reads
    /// the name's contenders. The lowest create revision holds: when it is
    /// this key, the lock is taken and its create revision is the fencing
    /// token; else the answer is busy, no key was put, and the unused
    /// lease is revoked from the background.
    async fn try_acquire(
        &self,
        key: &str,
        owner: &OwnerToken,
        ttl: Duration,
    ) -> Result<AcquireOutcome, BackendError> {
        let secs = self.lease_secs(ttl);
        // [A5] A waiter outside the queue is woken when the holder's key
        // goes: its watch follows the name's line, in place before the
        // attempt, so no release after the attempt is missed. Without it
        // the waiter waits on its retry timer.
        if let Some(watches) = &self.inner.watches {
            if self.inner.hub.is_watched(key) {
                if let Err(error) = self.step("watch_release", watches.watch(key)).await {
                    tracing::debug!(error = %lock_core::ErrorChain(&error), "a waiter's release watch was not made; it waits on its retry timer");
                }
            }
        }
        self.step("try_acquire", async {
            // Sent again after a failover, a grant may leave a lease
            // unused: it expires with its ttl.
            let lease = self
                .call(Again::Yes, |mut client| async move {
                    client.lease_grant(secs, None).await
                })
                .await?
                .id();
            // From here on, every way out but "acquired" revokes the
            // lease, a dropped attempt's in the background.
            let granted = Granted {
                backend: self,
                lease: Some(lease),
            };
            match self.contend(key, owner, lease).await {
                Ok(Contended::Taken(fencing_token)) => {
                    granted.keep();
                    self.remember(key, owner, lease);
                    Ok(AcquireOutcome::Acquired { fencing_token })
                }
                // Busy without a key: its lease, unused, is revoked from
                // the background.
                Ok(Contended::Busy { put: false }) => {
                    drop(granted);
                    Ok(AcquireOutcome::BUSY)
                }
                // Busy with a key: withdraw, or the key would stand in
                // line.
                Ok(Contended::Busy { put: true }) => {
                    granted.withdraw().await?;
                    Ok(AcquireOutcome::BUSY)
                }
                // Refused (permission), failed or unanswered: the put may
                // have gone through, or go through later.
                Err(error) => {
                    if let Err(revoke) = granted.withdraw().await {
                        tracing::debug!(error = %revoke, lease, "the lease of a failed attempt was not revoked; it expires with its ttl");
                    }
                    Err(error)
                }
            }
        })
        .await
    }

    /// [`extend_many`](LockBackend::extend_many) of one lease.
    async fn extend(&self, lease: &Lease, ttl: Duration) -> Result<ExtendOutcome, BackendError> {
        let request = ExtendRequest {
            lease: lease.clone(),
            ttl,
        };
        self.extend_many(std::slice::from_ref(&request))
            .await
            .pop()
            .unwrap_or_else(|| Err(protocol("no outcome for one extension")))
    }

    /// One keep-alive per lease on the backend's shared stream, then one
    /// transaction reading every name's contenders: the owner token's key
    /// on its lease is extended; a name whose contenders no longer
    /// include the owner token is taken when another contender stands for
    /// it, else expired (the driver reports that taken too when the lock
    /// was still valid). The lease gets back the ttl it was granted with
    /// (an etcd lease's ttl cannot change); `ttl` is not used.
    ///
    /// The first extension of a lock granted by the fair queue \[F1\]
    /// takes the grant up: the holder's key moves from its ticket lease
    /// to the lease of the lock's ttl its name gives, keeping its create
    /// revision (see the crate docs).
    async fn extend_many(
        &self,
        requests: &[ExtendRequest],
    ) -> Vec<Result<ExtendOutcome, BackendError>> {
        let places: Vec<_> = if self.inner.places.is_empty() {
            Vec::new()
        } else {
            requests
                .iter()
                .map(|r| {
                    self.inner
                        .places
                        .get(r.lease.key(), r.lease.owner().as_str())
                })
                .collect()
        };
        if places.iter().all(Option::is_none) {
            return match self.step("extend", self.extend_batch(requests)).await {
                Ok(outcomes) => outcomes,
                Err(error) => vec![Err(error); requests.len()],
            };
        }
        // Grants taken up, each on its own; the rest in one batch.
        let rest: Vec<ExtendRequest> = requests
            .iter()
            .zip(&places)
            .filter(|(_, place)| place.is_none())
            .map(|(request, _)| request.clone())
            .collect();
        let batch = async {
            if rest.is_empty() {
                return Vec::new();
            }
            match self.step("extend", self.extend_batch(&rest)).await {
                Ok(outcomes) => outcomes,
                Err(error) => vec![Err(error); rest.len()],
            }
        };
        let grants = futures_util::future::join_all(
            requests
                .iter()
                .zip(&places)
                .filter_map(|(request, place)| place.map(|place| (request, place)))
                .map(|(request, place)| {
                    self.step("extend", self.take_up(&request.lease, request.ttl, place))
                }),
        );
        let (batch, grants) = futures_util::future::join(batch, grants).await;
        let (mut batch, mut grants) = (batch.into_iter(), grants.into_iter());
        places
            .iter()
            .map(|place| {
                let next = if place.is_some() {
                    grants.next()
                } else {
                    batch.next()
                };
                next.unwrap_or_else(|| Err(protocol("no outcome for an extension")))
            })
            .collect()
    }

    fn failure_domain(&self, _key: &str) -> u64 {
        // One cluster answers for every key.
        0
    }

    /// A transaction deletes the contender key if it still holds the owner
    /// token on its lease (and records the fencing token for the admin's
    /// view of the free name, where the user may write it \[D3\]); then the
    /// lease is revoked, from the background. Needs rights on the lock
    /// names only.
    async fn release(&self, lease: &Lease) -> Result<ReleaseOutcome, BackendError> {
        let (key, owner) = (lease.key(), lease.owner());
        // A retry after a failure reads the lease by value.
        let _forget = ForgetOnDrop {
            backend: self,
            name: key,
            owner,
        };
        if let Some(place) = self.inner.places.get(key, owner.as_str()) {
            return self.step("release", self.release_place(lease, place)).await;
        }
        self.step("release", async {
            let Some((contender, id)) = self.lease_of(key, owner).await? else {
                return Ok(ReleaseOutcome::NotHeld);
            };
            let compares = vec![
                Compare::value(contender.clone(), CompareOp::Equal, owner.as_str()),
                Compare::lease(contender.clone(), CompareOp::Equal, id),
            ];
            let answer = self
                .delete_contender(key, compares, contender, lease.fencing_token())
                .await?;
            // The key is gone (or was not this lease's): the lease serves
            // nothing, and its revoke need not delay the answer (the next
            // call of this node joins the queue sooner).
            self.revoke_in_background(id);
            Ok(if answer.succeeded() {
                ReleaseOutcome::Released
            } else {
                ReleaseOutcome::NotHeld
            })
        })
        .await
    }

    /// The minimum hold \[H7\]: an etcd lease's ttl cannot change, so the
    /// contender key moves, in a transaction that checks its value and
    /// lease, onto a new lease of the time left (whole seconds, rounded
    /// up, at least the floor); the key's create revision, the fencing
    /// token, stays. The old lease is then revoked. The key keeps its name,
    /// whose lease part is the old lease's: etcd's own clients look only at
    /// create revisions.
    async fn hold(&self, lease: &Lease, hold: Hold) -> Result<ExtendOutcome, BackendError> {
        let (key, owner) = (lease.key(), lease.owner());
        let secs = self.lease_secs(hold.from_now);
        // Moved or not, the key's lease is read by value from now on: a
        // retry after a failed move may find it on the new lease.
        let _forget = ForgetOnDrop {
            backend: self,
            name: key,
            owner,
        };
        if let Some(place) = self.inner.places.get(key, owner.as_str()) {
            return self.step("hold", self.hold_place(lease, place, secs)).await;
        }
        self.step("hold", async {
            let Some((contender, id)) = self.lease_of(key, owner).await? else {
                return Ok(ExtendOutcome::Expired);
            };
            let new = self
                .call(Again::Yes, |mut client| async move {
                    client.lease_grant(secs, None).await
                })
                .await?
                .id();
            let txn = Txn::new()
                .when(vec![
                    Compare::value(contender.clone(), CompareOp::Equal, owner.as_str()),
                    Compare::lease(contender.clone(), CompareOp::Equal, id),
                ])
                .and_then(vec![TxnOp::put(
                    contender,
                    owner.as_str(),
                    Some(PutOptions::new().with_lease(new)),
                )]);
            // Sent twice, a move that went through the first time would
            // find the key on the new lease the second. A move that failed
            // may have gone through: the new lease is left to its ttl.
            let answer = self
                .call(Again::No, |mut client| {
                    let txn = txn.clone();
                    async move { client.txn(txn).await }
                })
                .await?;
            if !answer.succeeded() {
                self.revoke_quietly(new).await;
                return Ok(ExtendOutcome::Expired);
            }
            self.revoke_quietly(id).await;
            Ok(ExtendOutcome::Extended)
        })
        .await
    }

    /// One attempt of a waiter in etcd's own queue \[F1–F3\]: the first
    /// grants its ticket lease (the ticket ttl, whole seconds, at least the
    /// floor) and the lease its key moves to when it holds, and puts its
    /// contender key `<key>/<that lease's hex>` on the ticket lease, at
    /// the queue's tail, where it stays while the waiter waits; later ones
    /// keep the ticket lease alive and read the name's contenders. When
    /// the key is the lowest contender, it moves to the lock's lease
    /// (keeping its create revision, the fencing token) and the lock is
    /// taken. Else busy, with the holder's lease's time left (one more
    /// request) when this waiter is next. A waiter whose ticket lease ran
    /// out (it stalled past its ticket ttl) joins again at the tail.
    async fn try_acquire_queued(
        &self,
        key: &str,
        owner: &OwnerToken,
        ttl: Duration,
        terms: QueueTerms,
    ) -> Result<AcquireOutcome, BackendError> {
        self.step(
            "try_acquire_queued",
            self.queued_attempt(key, owner, ttl, terms),
        )
        .await
    }

    /// Revokes the waiter's two leases, which deletes its contender key
    /// (on either); a key it held by a grant not taken up goes with it,
    /// and the next contender holds.
    async fn leave_queue(&self, key: &str, owner: &OwnerToken) -> Result<(), BackendError> {
        if self.inner.places.get(key, owner.as_str()).is_none() {
            return Ok(());
        }
        self.step("leave_queue", self.leave(key, owner)).await
    }

    /// A watch on the name's contenders, on the backend's one watch
    /// stream, in place when this returns; it wakes when the holder's key
    /// is deleted (released, revoked, expired, deleted by hand).
    async fn watch_release(&self, key: &str) -> Result<ReleaseWatch, BackendError> {
        let Some(watches) = &self.inner.watches else {
            return Ok(ReleaseWatch::never());
        };
        let watch = self.inner.hub.watch(key);
        // A holder's watch [L5] follows the name's line from now on; a
        // waiter's is made by its next attempt: an unqueued attempt
        // follows the line, a queued one the key just below its own.
        let held = self.leases().keys().any(|(name, _)| name == key);
        if held {
            self.step("watch_release", watches.watch(key)).await?;
        }
        Ok(watch)
    }
}

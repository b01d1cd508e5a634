//! P9's shape on etcd: one hot name, 64 contenders in lockers of their
//! own, against etcd's own Lock RPC in the same run.
//!
//! 64 contenders (`--tasks`) on one name, each in a loop: wait as long as it takes for
//! the lock, run a 200 µs busy critical section (a spin, not a sleep),
//! release. Each kind runs in rounds of a fixed time, in an order that
//! rotates from round to round (`--rounds 5` x `--seconds 1` per kind by
//! default), each round on a name of its own, after a short warm-up round.
//! At a round's end every task finishes the cycle it is in and starts no
//! other (a wait is not cut short: etcd 3.4's Lock RPC stops serving
//! waiters after many waiting calls are cancelled at once,
//! etcd-io/etcd#13336).
//!
//! - `withlock-queued`: 64 `Locker`s, each on an `EtcdBackend` of its own
//!   (its own client, watch and keep-alive streams, as 64 processes would
//!   have), each backend in a wrapper that counts its acquisition
//!   attempts; `with_lock_config(name, LockConfig::default().wait_forever(),
//!   ..)`, which waits in the fair queue (the default);
//! - `withlock-no-queue`: the same lockers, `.no_queue()`: every release
//!   wakes every node's waiter to try;
//! - `etcd-lock-rpc`: 64 etcd-client `Client`s of their own, each cycle:
//!   grant a lease of the lock's ttl, `Lock` on it (etcd's server-side
//!   `concurrency.Mutex`, which waits in the same line of contender keys),
//!   `Unlock`, revoke the lease: what `etcdctl lock` does, and the same
//!   guarantee as withlock's lease per lock;
//! - `handoff-floor`: a holder and two queued waiters, each on a locker and
//!   backend of its own. The floor (P3's method) is from the holder's
//!   callback returning to the first waiter's running; its median gives
//!   the ceiling of a notified handoff, 1 / (200 µs + floor) cycles/s. The
//!   turn is from the first waiter's (empty) callback running to the
//!   second's: a grantee's whole turn, which every holder of a hot name
//!   makes (taking up its grant, releasing, the next grant).
//!
//! For each kind: cycles/s; wait p50/p99, from the moment a task starts
//! wanting the lock to its critical section starting (a wait that ends
//! after the round's end counts up to it); Jain's fairness index over the
//! 64 tasks' acquisitions, (Σx)² / (n·Σx²), the median of the rounds'; the
//! share of acquisitions, among those made while another task was
//! waiting, taken by the task that made the previous one; acquisition
//! attempts per handoff (withlock only: `try_acquire` and
//! `try_acquire_queued` calls, counted by the wrappers for each call that
//! acquired within the round, each task's first call of a round left out:
//! its locker has not seen the name yet, so its first attempt is
//! unqueued), split into unqueued attempts, queued attempts that join the
//! line, and later queued attempts of the same wait (heartbeats, tries
//! after a wake-up: not counted in the target), with every attempt made
//! in the rounds per acquisition beside; and the etcd requests per cycle,
//! from the server's `grpc_server_msg_received_total` by method on
//! `/metrics`, read before and after each round (a unary call is one
//! message; on the keep-alive and watch streams, each request is one),
//! and the watch responses it sent (`grpc_server_msg_sent_total`).
//!
//! Targets (P9, with etcd's Lock RPC as the peer in rslock's place), for
//! both withlock kinds: wait p99 ≤ 0.25x the peer's, Jain ≥ 0.95, ≤ 5% taken
//! by the last holder, cycles/s ≥ 0.5x the peer's and ≥ 0.8x the handoff
//! ceiling, ≤ 1.1 attempts per handoff.
//!
//! Against `ETCD_ENDPOINT` (an `http://host:2379` URL, whose `/metrics`
//! is read; other clients' requests count too), or else a single-member
//! etcd of its own started by `withlock-test-servers` (Debian's `etcd` on
//! `PATH`, data on `/dev/shm`), stopped at the end. Names are in a random
//! namespace; every lock is released, and the leases of any task aborted
//! after the drain limit expire with their ttl. Run it in release mode;
//! name kinds to run only those:
//!
//! ```text
//! cargo run --release -p lock-etcd --example bench_hot_key -- \
//!     [--seconds 1] [--rounds 5] [--tasks 64] [withlock-queued] [withlock-no-queue] \
//!     [etcd-lock-rpc] [handoff-floor]
//! ```

use std::collections::BTreeMap;
use std::error::Error;
use std::io::{Read, Write};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use bench_support::{median, percentile, round_ratios, Spread};
use lock_etcd::etcd_client::{Client, GetOptions, LockOptions};
use lock_etcd::lock_core::{AcquireOutcome, BackendError, OwnerToken, QueueTerms};
use lock_etcd::{EtcdBackend, EtcdConfig, LockConfig, Locker, LockerOptions};
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use withlock_test_servers::etcd::EtcdCluster;

#[path = "../../bench-support/bench_support.rs"]
mod bench_support;

type BoxError = Box<dyn Error + Send + Sync>;

/// Contenders on the hot name, by default.
const TASKS: usize = 64;
/// The busy critical section.
const CRITICAL: Duration = Duration::from_micros(200);
/// The warm-up round of each kind (connections, watches, leases).
const WARM_UP: Duration = Duration::from_millis(300);
/// After a round's end, the time the tasks have to end their last cycle
/// before those still running are aborted.
const DRAIN: Duration = Duration::from_secs(10);
/// After the drain, the time the last revokes (sent in the background)
/// have to land before the next round's counts.
const SETTLE: Duration = Duration::from_millis(200);
/// The longest one handoff of the floor may take.
const HANDOFF_TIMEOUT: Duration = Duration::from_secs(2);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Queued,
    NoQueue,
    LockRpc,
    Floor,
}

impl Kind {
    const ALL: [Self; 4] = [Self::Queued, Self::NoQueue, Self::LockRpc, Self::Floor];

    fn name(self) -> &'static str {
        match self {
            Self::Queued => "withlock-queued",
            Self::NoQueue => "withlock-no-queue",
            Self::LockRpc => "etcd-lock-rpc",
            Self::Floor => "handoff-floor",
        }
    }

    fn parse(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|k| k.name() == name)
    }

    fn is_withlock(self) -> bool {
        matches!(self, Self::Queued | Self::NoQueue)
    }
}

/// Acquisition attempts of one locker's backend.
#[derive(Debug, Default)]
struct Attempts {
    /// `try_acquire` calls.
    unqueued: AtomicU64,
    /// `try_acquire_queued` calls with an owner token new to its backend:
    /// each wait's attempt that joins the line.
    joined: AtomicU64,
    /// Later `try_acquire_queued` calls of the same wait: heartbeats, and
    /// tries after a wake-up.
    repeated: AtomicU64,
    /// Answers of `try_acquire_queued` calls.
    queued_answers: AtomicU64,
    answered: Notify,
}

impl Attempts {
    fn snapshot(&self) -> [u64; 3] {
        [
            self.unqueued.load(Ordering::SeqCst),
            self.joined.load(Ordering::SeqCst),
            self.repeated.load(Ordering::SeqCst),
        ]
    }

    /// Waits until `n` queued attempts were answered.
    async fn until_queued_answers(&self, n: u64) {
        loop {
            let answered = self.answered.notified();
            tokio::pin!(answered);
            answered.as_mut().enable();
            if self.queued_answers.load(Ordering::SeqCst) >= n {
                return;
            }
            answered.await;
        }
    }
}

/// An `EtcdBackend` whose acquisition attempts are counted.
#[derive(Debug)]
struct Counted {
    inner: EtcdBackend,
    attempts: Arc<Attempts>,
    /// The owner token of this backend's last queued attempt (one task per
    /// locker, so one wait at a time).
    last_queued: Mutex<Option<OwnerToken>>,
}

lock_etcd::lock_core::forward_lock_backend!(Counted => inner {
    async fn try_acquire(
        &self,
        key: &str,
        owner: &OwnerToken,
        ttl: Duration,
    ) -> Result<AcquireOutcome, BackendError> {
        self.attempts.unqueued.fetch_add(1, Ordering::SeqCst);
        self.inner.try_acquire(key, owner, ttl).await
    }

    async fn try_acquire_queued(
        &self,
        key: &str,
        owner: &OwnerToken,
        ttl: Duration,
        terms: QueueTerms,
    ) -> Result<AcquireOutcome, BackendError> {
        let repeat = {
            let mut last = self.last_queued.lock().unwrap_or_else(PoisonError::into_inner);
            let repeat = last.as_ref() == Some(owner);
            *last = Some(owner.clone());
            repeat
        };
        let count = if repeat { &self.attempts.repeated } else { &self.attempts.joined };
        count.fetch_add(1, Ordering::SeqCst);
        let answer = self.inner.try_acquire_queued(key, owner, ttl, terms).await;
        self.attempts.queued_answers.fetch_add(1, Ordering::SeqCst);
        self.attempts.answered.notify_waiters();
        answer
    }
});

/// A locker named `name` on a counted backend of its own, and its counts.
async fn node(config: &EtcdConfig, name: &str) -> Result<(Locker, Arc<Attempts>), BoxError> {
    let attempts = Arc::<Attempts>::default();
    let backend = Counted {
        inner: EtcdBackend::connect(config.clone()).await?,
        attempts: Arc::clone(&attempts),
        last_queued: Mutex::new(None),
    };
    let locker = Locker::with_options(backend, LockerOptions::default().node_id(name))?;
    Ok((locker, attempts))
}

fn spin(d: Duration) {
    let t = Instant::now();
    while t.elapsed() < d {
        std::hint::spin_loop();
    }
}

/// Jain's fairness index of `counts`: 1 when all are equal, 1/n when one
/// took everything.
fn jain(counts: &[u64]) -> f64 {
    let sum: f64 = counts.iter().map(|&x| x as f64).sum();
    let squares: f64 = counts.iter().map(|&x| (x as f64) * (x as f64)).sum();
    if squares == 0.0 {
        0.0
    } else {
        sum * sum / (counts.len() as f64 * squares)
    }
}

/// The key of [`grpc_messages`]' count of watch responses sent.
const WATCH_SENT: &str = "watch responses sent";

/// The gRPC messages etcd has received so far, by method, and the watch
/// responses it has sent (under [`WATCH_SENT`]), from its `/metrics`
/// (plain HTTP on the client port).
fn grpc_messages(endpoint: &str) -> Result<BTreeMap<String, u64>, BoxError> {
    let host = endpoint
        .strip_prefix("http://")
        .ok_or("ETCD_ENDPOINT must be an http:// URL to read its /metrics")?
        .trim_end_matches('/');
    let mut stream = std::net::TcpStream::connect(host)?;
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    write!(
        stream,
        "GET /metrics HTTP/1.0\r\nHost: {host}\r\nConnection: close\r\n\r\n"
    )?;
    let mut text = String::new();
    stream.read_to_string(&mut text)?;
    let mut counts = BTreeMap::new();
    for line in text.lines() {
        let (labels, sent) = match (
            line.strip_prefix("grpc_server_msg_received_total{"),
            line.strip_prefix("grpc_server_msg_sent_total{"),
        ) {
            (Some(labels), _) => (labels, false),
            (_, Some(labels)) => (labels, true),
            _ => continue,
        };
        let method = labels
            .split_once("grpc_method=\"")
            .and_then(|(_, rest)| rest.split_once('"'))
            .map(|(method, _)| method)
            .filter(|method| !sent || *method == "Watch")
            .map(|method| if sent { WATCH_SENT } else { method });
        let value = line
            .rsplit_once(' ')
            .and_then(|(_, v)| v.parse::<f64>().ok());
        if let (Some(method), Some(value)) = (method, value) {
            *counts.entry(method.to_owned()).or_default() += value as u64;
        }
    }
    if counts.is_empty() {
        return Err(format!("no grpc_server_msg_received_total on {endpoint}/metrics").into());
    }
    Ok(counts)
}

async fn messages(endpoint: &str) -> Result<BTreeMap<String, u64>, BoxError> {
    let endpoint = endpoint.to_owned();
    tokio::task::spawn_blocking(move || grpc_messages(&endpoint)).await?
}

/// What each kind's contenders run on, made once for all rounds.
struct Setup {
    /// Contenders per round.
    tasks: usize,
    /// The withlock kinds' lockers, one per task, and their attempts.
    lockers: Vec<(Locker, Arc<Attempts>)>,
    /// `etcd-lock-rpc`: a client per task.
    clients: Vec<Client>,
    /// The lease ttl of a Lock RPC cycle: the lock's effective ttl.
    lease_secs: i64,
    /// `handoff-floor`: the holder and two waiters.
    floor: Option<(Locker, FloorWaiter, FloorWaiter)>,
    /// A client for the floor's reads of the line.
    observer: Client,
}

impl Setup {
    async fn new(config: &EtcdConfig, kinds: &[Kind], tasks: usize) -> Result<Self, BoxError> {
        let probe = EtcdBackend::connect(config.clone()).await?;
        let lease_secs =
            i64::try_from(probe.effective_ttl(LockConfig::default().ttl).as_secs()).unwrap_or(30);
        let mut setup = Self {
            tasks,
            lockers: Vec::new(),
            clients: Vec::new(),
            lease_secs,
            floor: None,
            observer: probe.client(),
        };
        if kinds.iter().any(|k| k.is_withlock()) {
            for i in 0..tasks {
                setup.lockers.push(node(config, &format!("hot-{i}")).await?);
            }
        }
        if kinds.contains(&Kind::LockRpc) {
            for _ in 0..tasks {
                // A client of its own each, as a process would have.
                setup
                    .clients
                    .push(Client::connect(config.endpoints.clone(), None).await?);
            }
        }
        if kinds.contains(&Kind::Floor) {
            let (holder, _) = node(config, "floor-holder").await?;
            let first = node(config, "floor-first").await?;
            let second = node(config, "floor-second").await?;
            setup.floor = Some((holder, first, second));
        }
        Ok(setup)
    }

    /// The attempts of every contender's locker so far.
    fn attempts(&self) -> [u64; 3] {
        self.lockers
            .iter()
            .fold([0; 3], |sum, (_, a)| add(sum, a.snapshot()))
    }
}

fn add(a: [u64; 3], b: [u64; 3]) -> [u64; 3] {
    [a[0] + b[0], a[1] + b[1], a[2] + b[2]]
}

fn sub(a: [u64; 3], b: [u64; 3]) -> [u64; 3] {
    [a[0] - b[0], a[1] - b[1], a[2] - b[2]]
}

/// One round's record, shared by its contenders.
struct Round {
    deadline: Instant,
    state: Mutex<RoundState>,
    /// A critical section is running; two at once are an overlap.
    inside: AtomicBool,
    overlaps: AtomicU64,
}

struct RoundState {
    /// When each task started wanting the lock, while it waits.
    wanting: Vec<Option<Instant>>,
    /// Tasks waiting now.
    waiting: usize,
    /// The task that made the last acquisition.
    last: Option<usize>,
    /// Acquisitions per task.
    counts: Vec<u64>,
    waits: Vec<Duration>,
    /// Waits that ended after the deadline (counted up to it).
    late: usize,
    /// Acquisitions made while another task waited, and those of them
    /// taken by the previous holder.
    contended: u64,
    repeats: u64,
    /// The attempts of the calls counted, each task's first of the round
    /// left out (its first attempt on a name new to its locker is
    /// unqueued), and how many calls that is.
    steady: [u64; 3],
    steady_calls: u64,
    /// Per task: whether its first call of the round has ended.
    started: Vec<bool>,
}

impl Round {
    fn new(deadline: Instant, tasks: usize) -> Self {
        Self {
            deadline,
            state: Mutex::new(RoundState {
                wanting: vec![None; tasks],
                waiting: 0,
                last: None,
                counts: vec![0; tasks],
                waits: Vec::new(),
                late: 0,
                contended: 0,
                repeats: 0,
                steady: [0; 3],
                steady_calls: 0,
                started: vec![false; tasks],
            }),
            inside: AtomicBool::new(false),
            overlaps: AtomicU64::new(0),
        }
    }

    /// Task `task`'s critical section, checked for overlaps; whether its
    /// acquisition counts.
    fn section(&self, task: usize) -> bool {
        if self.inside.swap(true, Ordering::SeqCst) {
            self.overlaps.fetch_add(1, Ordering::SeqCst);
        }
        let counted = self.acquired(task);
        spin(CRITICAL);
        self.inside.store(false, Ordering::SeqCst);
        counted
    }

    fn state(&self) -> std::sync::MutexGuard<'_, RoundState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Task `task` starts wanting the lock.
    fn want(&self, task: usize) {
        let now = Instant::now();
        let mut s = self.state();
        s.wanting[task] = Some(now);
        s.waiting += 1;
    }

    /// Task `task`'s critical section starts; whether the acquisition
    /// counts. Acquisitions after the deadline are not counted; their
    /// waits count up to the deadline.
    fn acquired(&self, task: usize) -> bool {
        let now = Instant::now();
        let mut s = self.state();
        let Some(since) = s.wanting[task].take() else {
            return false;
        };
        s.waiting -= 1;
        if now >= self.deadline {
            s.waits.push(self.deadline.saturating_duration_since(since));
            s.late += 1;
            return false;
        }
        s.waits.push(now - since);
        s.counts[task] += 1;
        if s.waiting > 0 {
            s.contended += 1;
            if s.last == Some(task) {
                s.repeats += 1;
            }
        }
        s.last = Some(task);
        true
    }

    /// Task `task`'s call ended, after `attempts`; `counted` when its
    /// acquisition was.
    fn called(&self, task: usize, attempts: [u64; 3], counted: bool) {
        let mut s = self.state();
        let first = !std::mem::replace(&mut s.started[task], true);
        if counted && !first {
            s.steady = add(s.steady, attempts);
            s.steady_calls += 1;
        }
    }
}

/// What one kind measured over all its rounds.
#[derive(Default)]
struct Totals {
    acquisitions: u64,
    /// Cycles/s of each round.
    rates: Vec<f64>,
    waits: Vec<Duration>,
    /// Waits open at a round's end (counted up to it).
    open_waits: usize,
    jains: Vec<f64>,
    /// The fewest acquisitions of one task in a round, over the rounds.
    fewest: Option<u64>,
    contended: u64,
    repeats: u64,
    /// Unqueued, joining and repeated queued attempts, in the rounds.
    attempts: [u64; 3],
    /// The same, of the calls counted after each task's first of a round.
    steady: [u64; 3],
    steady_calls: u64,
    /// Tasks still running at the drain limit, aborted.
    aborted: usize,
    /// Critical sections that began while another ran.
    overlaps: u64,
    messages: BTreeMap<String, u64>,
    errors: u64,
    first_error: Option<String>,
    /// `handoff-floor` only: the floors and the grantees' turns.
    handoffs: Vec<Duration>,
    turns: Vec<Duration>,
}

impl Totals {
    fn error(&mut self, e: impl std::fmt::Display) {
        self.errors += 1;
        self.first_error.get_or_insert_with(|| e.to_string());
    }

    fn rate(&self) -> f64 {
        median(self.rates.clone())
    }

    fn wait(&self, p: f64) -> Duration {
        if self.waits.is_empty() {
            Duration::ZERO
        } else {
            percentile(&self.waits, p)
        }
    }

    fn last_holder_share(&self) -> f64 {
        self.repeats as f64 / self.contended.max(1) as f64
    }

    /// Attempts per handoff in the steady state (each task's calls after
    /// its first of a round), heartbeats and tries after a wake-up (the
    /// repeated queued attempts) not counted.
    fn attempts_per_handoff(&self) -> f64 {
        (self.steady[0] + self.steady[1]) as f64 / self.steady_calls.max(1) as f64
    }

    fn floor(&self) -> Duration {
        median(self.handoffs.clone())
    }
}

/// One contender's loop until the round's deadline.
async fn contender(
    kind: Kind,
    task: usize,
    name: String,
    round: Arc<Round>,
    locker: Option<(Locker, Arc<Attempts>)>,
    client: Option<Client>,
    lease_secs: i64,
) -> Result<(), BoxError> {
    let config = match kind {
        Kind::NoQueue => LockConfig::default().wait_forever().no_queue(),
        _ => LockConfig::default().wait_forever(),
    };
    while Instant::now() < round.deadline {
        round.want(task);
        match kind {
            Kind::Queued | Kind::NoQueue => {
                let (locker, attempts) = locker.as_ref().ok_or("no locker")?;
                let before = attempts.snapshot();
                let r = Arc::clone(&round);
                let counted = locker
                    .with_lock_config(&name, &config, move |_| async move { r.section(task) })
                    .await?;
                round.called(task, sub(attempts.snapshot(), before), counted);
            }
            Kind::LockRpc => {
                let mut client = client.clone().ok_or("no client")?;
                let lease = client.lease_grant(lease_secs, None).await?.id();
                let held = client
                    .lock(name.as_str(), Some(LockOptions::new().with_lease(lease)))
                    .await?;
                round.section(task);
                client.unlock(held.key()).await?;
                client.lease_revoke(lease).await?;
            }
            Kind::Floor => unreachable!("the floor has no contenders"),
        }
    }
    Ok(())
}

/// One round of 64 contenders of `kind` on `name` for `length`, added to
/// `totals`.
async fn contended_round(
    kind: Kind,
    setup: &Setup,
    endpoint: &str,
    name: &str,
    length: Duration,
    totals: &mut Totals,
) -> Result<(), BoxError> {
    let attempts = setup.attempts();
    let before = messages(endpoint).await?;
    let started = Instant::now();
    let round = Arc::new(Round::new(started + length, setup.tasks));
    let tasks: Vec<JoinHandle<Result<(), BoxError>>> = (0..setup.tasks)
        .map(|task| {
            tokio::spawn(contender(
                kind,
                task,
                name.to_owned(),
                Arc::clone(&round),
                setup.lockers.get(task).cloned(),
                setup.clients.get(task).cloned(),
                setup.lease_secs,
            ))
        })
        .collect();
    tokio::time::sleep_until(round.deadline.into()).await;
    let after_attempts = setup.attempts();
    let after = messages(endpoint).await?;
    // Every task ends its cycle and starts no other. A wait is not cut
    // short: etcd 3.4's Lock RPC deadlocks when many of its waiting calls
    // are cancelled at once (etcd-io/etcd#13336, the server's own watch
    // stream stalls, and no Lock call waits successfully after that).
    // Only what is still running after the drain limit is aborted.
    let drained = Instant::now() + DRAIN;
    for mut t in tasks {
        let ended = match tokio::time::timeout_at(drained.into(), &mut t).await {
            Ok(ended) => ended,
            Err(_) => {
                totals.aborted += 1;
                t.abort();
                t.await
            }
        };
        match ended {
            Ok(Ok(())) => {}
            Ok(Err(e)) => totals.error(e),
            Err(e) if e.is_cancelled() => {}
            Err(e) => totals.error(e),
        }
    }
    tokio::time::sleep(SETTLE).await;
    let mut s = round.state();
    let open: Vec<Duration> = s
        .wanting
        .iter()
        .flatten()
        .map(|since| round.deadline.saturating_duration_since(*since))
        .collect();
    totals.open_waits += open.len() + s.late;
    totals.overlaps += round.overlaps.load(Ordering::SeqCst);
    totals.waits.extend(open);
    totals.waits.append(&mut s.waits);
    let acquisitions: u64 = s.counts.iter().sum();
    totals.acquisitions += acquisitions;
    totals
        .rates
        .push(acquisitions as f64 / length.as_secs_f64());
    totals.jains.push(jain(&s.counts));
    let fewest = s.counts.iter().copied().min().unwrap_or(0);
    totals.fewest = Some(totals.fewest.map_or(fewest, |f| f.min(fewest)));
    totals.contended += s.contended;
    totals.repeats += s.repeats;
    totals.attempts = add(totals.attempts, sub(after_attempts, attempts));
    totals.steady = add(totals.steady, s.steady);
    totals.steady_calls += s.steady_calls;
    for (method, calls) in after {
        let delta = calls.saturating_sub(before.get(&method).copied().unwrap_or(0));
        if delta > 0 {
            *totals.messages.entry(method).or_default() += delta;
        }
    }
    Ok(())
}

/// The contender keys of `name` now.
async fn contenders(observer: &Client, name: &str) -> Result<i64, BoxError> {
    let options = GetOptions::new()
        .with_range(format!("{name}/g"))
        .with_count_only();
    let read = observer
        .clone()
        .get(format!("{name}/0"), Some(options))
        .await?;
    Ok(read.count())
}

/// A waiter of the floor: its locker and its attempts.
type FloorWaiter = (Locker, Arc<Attempts>);

/// Starts `waiter` waiting on `name` and returns once its queued attempt
/// (its first, or its second after an unqueued one) has put its key in
/// the line and found the name busy, with `line` contenders: it then
/// waits for its grant. Its callback gives when it ran.
async fn queue_up(
    waiter: &FloorWaiter,
    name: &str,
    line: i64,
    observer: &Client,
) -> Result<JoinHandle<Result<Instant, lock_etcd::LockError>>, BoxError> {
    let (locker, attempts) = waiter;
    let answered = attempts.queued_answers.load(Ordering::SeqCst);
    let (w, n) = (locker.clone(), name.to_owned());
    let config = LockConfig::default().wait_forever();
    let waiting = tokio::spawn(async move {
        w.with_lock_config(&n, &config, |_| async { Instant::now() })
            .await
    });
    attempts.until_queued_answers(answered + 1).await;
    let found = contenders(observer, name).await?;
    if found != line {
        return Err(format!("{found} contenders, not {line}").into());
    }
    Ok(waiting)
}

/// Handoffs on `name` for `length`: a holder and two queued waiters, each
/// on a locker and backend of its own. The floor is from the holder's
/// callback returning to the first waiter's running (P3's method); the
/// turn, from the first waiter's (empty) callback running to the second
/// waiter's: a grantee's whole turn (taking up its grant, releasing),
/// which each holder of a hot name makes.
async fn floor_round(
    setup: &Setup,
    name: &str,
    length: Duration,
    totals: &mut Totals,
) -> Result<(), BoxError> {
    let (holder, first, second) = setup.floor.as_ref().ok_or("no floor lockers")?;
    let deadline = Instant::now() + length;
    while Instant::now() < deadline {
        let handoff = async {
            let (go, wait_go) = tokio::sync::oneshot::channel::<()>();
            let (released_tx, released_rx) = tokio::sync::oneshot::channel::<Instant>();
            let (held_tx, held_rx) = tokio::sync::oneshot::channel::<()>();
            let (h, n) = (holder.clone(), name.to_owned());
            let holding = tokio::spawn(async move {
                h.with_lock(&n, move |_| async move {
                    let _ = held_tx.send(());
                    let _ = wait_go.await;
                    let _ = released_tx.send(Instant::now());
                })
                .await
            });
            held_rx.await?;
            let first = queue_up(first, name, 2, &setup.observer).await?;
            let second = queue_up(second, name, 3, &setup.observer).await?;
            tokio::time::sleep(Duration::from_millis(1)).await;
            let _ = go.send(());
            let released_at = released_rx.await?;
            holding.await??;
            let first_ran = first.await??;
            let second_ran = second.await??;
            Ok::<_, BoxError>((
                first_ran.saturating_duration_since(released_at),
                second_ran.saturating_duration_since(first_ran),
            ))
        };
        match tokio::time::timeout(HANDOFF_TIMEOUT, handoff).await {
            Ok(Ok((floor, turn))) => {
                totals.handoffs.push(floor);
                totals.turns.push(turn);
            }
            Ok(Err(e)) => {
                totals.error(e);
                break;
            }
            Err(_) => {
                totals.error("handoff timed out");
                break;
            }
        }
    }
    Ok(())
}

/// One round of `kind` on a name of its own.
async fn round(
    kind: Kind,
    setup: &Setup,
    endpoint: &str,
    ns: &str,
    label: &str,
    length: Duration,
    totals: &mut Totals,
) -> Result<(), BoxError> {
    let name = format!("{ns}/{}/{label}", kind.name());
    if kind == Kind::Floor {
        floor_round(setup, &name, length, totals).await
    } else {
        contended_round(kind, setup, endpoint, &name, length, totals).await
    }
}

fn verdict(met: bool) -> &'static str {
    if met {
        "met"
    } else {
        "NOT MET"
    }
}

fn print_errors(t: &Totals) {
    if t.errors > 0 {
        println!(
            "      {} errors, the first: {}",
            t.errors,
            t.first_error.as_deref().unwrap_or("")
        );
    }
}

fn print_results(plan: &Plan, totals: &mut [Totals]) {
    let Plan {
        kinds,
        rounds,
        length,
        tasks,
    } = plan;
    for t in totals.iter_mut() {
        t.waits.sort();
    }
    let of = |kind: Kind| kinds.iter().position(|k| *k == kind);
    println!(
        "P9 shape on etcd: one hot name, {tasks} contenders in lockers (clients) of their own, \
         {CRITICAL:?} busy critical section, {rounds} rounds x {length:?} per kind, order \
         rotating; cycles/s and Jain: medians of the rounds"
    );
    println!(
        "  {:<18} {:>9} {:>10} {:>10} {:>6} {:>14} {:>9} {:>9}",
        "kind", "cycles/s", "wait p50", "wait p99", "Jain", "last holder", "att/hand", "reqs/cyc"
    );
    for (kind, t) in kinds.iter().zip(totals.iter()) {
        if *kind == Kind::Floor {
            continue;
        }
        let cycles = t.acquisitions.max(1) as f64;
        let requests: u64 = t
            .messages
            .iter()
            .filter(|(method, _)| *method != WATCH_SENT)
            .map(|(_, n)| n)
            .sum();
        let attempts = if kind.is_withlock() {
            format!("{:.2}", t.attempts_per_handoff())
        } else {
            "-".to_owned()
        };
        println!(
            "  {:<18} {:>9.0} {:>10.2?} {:>10.2?} {:>6.3} {:>5.1}% of {:<6} {:>9} {:>9.2}",
            kind.name(),
            t.rate(),
            t.wait(0.50),
            t.wait(0.99),
            median(t.jains.clone()),
            t.last_holder_share() * 100.0,
            t.contended,
            attempts,
            requests as f64 / cycles,
        );
        let jain_low = t.jains.iter().copied().fold(f64::MAX, f64::min);
        println!(
            "      {} acquisitions, {} waits open at a round's end (counted up to it; {} \
             aborted after the drain), max wait {:.2?}, lowest round's Jain {jain_low:.3}, \
             fewest acquisitions of one task in a round {}",
            t.acquisitions,
            t.open_waits,
            t.aborted,
            t.waits.last().copied().unwrap_or_default(),
            t.fewest.unwrap_or(0),
        );
        if kind.is_withlock() {
            let per = |a: [u64; 3], n: f64| {
                format!(
                    "{:.2} unqueued + {:.2} queued joining the line, {:.2} queued again in \
                     the same wait",
                    a[0] as f64 / n,
                    a[1] as f64 / n,
                    a[2] as f64 / n
                )
            };
            println!(
                "      attempts per call after each task's first of a round, over {} calls: {} \
                 (heartbeats, tries after a wake-up: not counted in att/hand)",
                t.steady_calls,
                per(t.steady, t.steady_calls.max(1) as f64),
            );
            println!(
                "      all attempts in the rounds per acquisition: {}",
                per(t.attempts, cycles),
            );
        }
        let mut by_count: Vec<(&String, &u64)> = t
            .messages
            .iter()
            .filter(|(method, _)| *method != WATCH_SENT)
            .collect();
        by_count.sort_by(|a, b| b.1.cmp(a.1));
        let list: Vec<String> = by_count
            .iter()
            .map(|(method, calls)| format!("{method} {:.2}", **calls as f64 / cycles))
            .collect();
        println!(
            "      etcd requests per cycle: {}; {:.1} watch responses sent per cycle",
            list.join(", "),
            t.messages.get(WATCH_SENT).copied().unwrap_or(0) as f64 / cycles,
        );
        if t.overlaps > 0 {
            println!(
                "      MUTUAL EXCLUSION VIOLATED: {} overlapping sections",
                t.overlaps
            );
        }
        print_errors(t);
    }
    let ceiling = of(Kind::Floor).map(|i| {
        let t = &totals[i];
        if t.handoffs.is_empty() {
            println!("  handoff-floor: no handoff measured");
            print_errors(t);
            return f64::NAN;
        }
        let floor = t.floor();
        let mut sorted = t.handoffs.clone();
        sorted.sort();
        println!(
            "  handoff-floor: median {floor:.2?}, p99 {:.2?} over {} handoffs; ceiling \
             1 / ({CRITICAL:?} + floor) = {:.0} cycles/s",
            percentile(&sorted, 0.99),
            sorted.len(),
            1.0 / (CRITICAL + floor).as_secs_f64(),
        );
        let mut turns = t.turns.clone();
        turns.sort();
        let turn = median(turns.clone());
        println!(
            "  a grantee's whole turn (grant taken up, empty section, release, next grantee \
             running): median {turn:.2?}, p99 {:.2?}; 1 / ({CRITICAL:?} + turn) = {:.0} cycles/s",
            percentile(&turns, 0.99),
            1.0 / (CRITICAL + turn).as_secs_f64(),
        );
        print_errors(t);
        1.0 / (CRITICAL + floor).as_secs_f64()
    });
    let peer = of(Kind::LockRpc).map(|p| &totals[p]);
    println!("P9 targets, etcd's Lock RPC as the peer in rslock's place (same run):");
    for (kind, t) in kinds.iter().zip(totals.iter()) {
        if !kind.is_withlock() {
            continue;
        }
        let check = |what: &str, value: String, met: bool| {
            println!("  {}: {what}: {value}, {}", kind.name(), verdict(met));
        };
        if let Some(p) = peer {
            let p99 = t.wait(0.99).as_secs_f64() / p.wait(0.99).as_secs_f64();
            check(
                "p99 wait <= 0.25x the peer's",
                format!("{p99:.3}x"),
                p99 <= 0.25,
            );
            let rate = t.rate() / p.rate();
            check(
                "cycles/s >= 0.5x the peer's",
                format!("{rate:.3}x"),
                rate >= 0.5,
            );
            Spread::of(&round_ratios(&t.rates, &p.rates))
                .print("    cycles/s vs the peer, rounds' own ratios");
        }
        if let Some(c) = ceiling {
            let x = t.rate() / c;
            check("cycles/s >= 0.8x the ceiling", format!("{x:.3}x"), x >= 0.8);
        }
        let j = median(t.jains.clone());
        check("Jain >= 0.95", format!("{j:.3}"), j >= 0.95);
        let share = t.last_holder_share();
        let last = format!("{:.1}%", share * 100.0);
        check("<= 5% by the last holder", last, share <= 0.05);
        let a = t.attempts_per_handoff();
        check("<= 1.1 attempts per handoff", format!("{a:.2}"), a <= 1.1);
    }
}

/// What to run.
struct Plan {
    kinds: Vec<Kind>,
    rounds: usize,
    length: Duration,
    tasks: usize,
}

async fn run(plan: Plan) -> Result<(), BoxError> {
    let Plan {
        ref kinds,
        rounds,
        length,
        tasks,
    } = plan;
    // The server of its own, if any, lives until the end.
    let (endpoint, _own) = match std::env::var("ETCD_ENDPOINT") {
        Ok(endpoint) => (endpoint, None),
        Err(_) => {
            let own = EtcdCluster::start(1).await?;
            (own.endpoint(0), Some(own))
        }
    };
    let config = EtcdConfig::new([endpoint.clone()]);
    let setup = Setup::new(&config, kinds, tasks).await?;
    println!("lock-etcd hot-key benchmark against {endpoint}");
    let ns = format!("bench-hot-{:08x}", rand::random::<u32>());
    let started = Instant::now();
    let mut warm = Totals::default();
    for kind in kinds {
        round(*kind, &setup, &endpoint, &ns, "warm-up", WARM_UP, &mut warm).await?;
    }
    let mut totals: Vec<Totals> = kinds.iter().map(|_| Totals::default()).collect();
    for r in 0..rounds {
        for step in 0..kinds.len() {
            let i = (r + step) % kinds.len();
            let label = format!("round-{r}");
            round(
                kinds[i],
                &setup,
                &endpoint,
                &ns,
                &label,
                length,
                &mut totals[i],
            )
            .await?;
        }
    }
    print_results(&plan, &mut totals);
    println!("total {:.1?}", started.elapsed());
    Ok(())
}

fn main() -> Result<(), BoxError> {
    const USAGE: &str =
        "usage: bench_hot_key [--seconds S] [--rounds N] [--tasks N] [withlock-queued] \
                         [withlock-no-queue] [etcd-lock-rpc] [handoff-floor]";
    let mut args = std::env::args().skip(1);
    let (mut seconds, mut rounds, mut tasks, mut kinds) = (1.0_f64, 5_usize, TASKS, Vec::new());
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--seconds" => seconds = args.next().ok_or(USAGE)?.parse()?,
            "--rounds" => rounds = args.next().ok_or(USAGE)?.parse()?,
            "--tasks" => tasks = args.next().ok_or(USAGE)?.parse()?,
            name => match Kind::parse(name) {
                Some(kind) if !kinds.contains(&kind) => kinds.push(kind),
                Some(_) => {}
                None => return Err(format!("unknown argument {name:?}; {USAGE}").into()),
            },
        }
    }
    if !(seconds > 0.0 && seconds <= 600.0) || rounds == 0 || tasks < 2 {
        return Err(format!(
            "--seconds must be in (0, 600], --rounds at least 1, --tasks at least 2; {USAGE}"
        )
        .into());
    }
    // In the order of `Kind::ALL`, whatever the command line's.
    let kinds: Vec<Kind> = if kinds.is_empty() {
        Kind::ALL.to_vec()
    } else {
        Kind::ALL
            .into_iter()
            .filter(|k| kinds.contains(k))
            .collect()
    };
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?
        .block_on(run(Plan {
            kinds,
            rounds,
            length: Duration::from_secs_f64(seconds),
            tasks,
        }))
}

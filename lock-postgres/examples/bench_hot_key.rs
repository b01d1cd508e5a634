//! P9 on PostgreSQL: one hot key, 64 contenders in lockers of their own,
//! against Ruby's Locker gem's statements polled in the same run.
//!
//! 64 contenders on one key, each in a loop: wait as long as it takes for
//! the lock, run a 200 µs busy critical section (a spin, not a sleep),
//! release. Each kind runs in rounds of a fixed time, in an order that
//! rotates from round to round (`--rounds 3` x `--seconds 1` per kind by
//! default), each round on a key of its own, after a short warm-up round:
//!
//! - `withlock-queued`: 64 `Locker`s, each on a `PostgresBackend` of its
//!   own (its own pool of 2 connections and its own listening connection,
//!   as 64 processes would have), each backend in a wrapper that counts
//!   its steps; `with_lock_config(key, LockConfig::default().wait_forever(),
//!   ..)`, which waits in the fair queue (the default);
//! - `withlock-no-queue`: the same lockers, `.no_queue()`: every release
//!   wakes every node's waiter to try;
//! - `gem-500ms`: 64 tasks, each on a connection of its own, running Ruby's
//!   Locker gem's own statements: its `get` (`UPDATE … WHERE locked_by IS
//!   NULL OR … locked_until < now`), and the gem's 0.5 s sleep (its
//!   `blocking` mode) when refused; its `release` after;
//! - `gem-10ms`: the same with a 10 ms sleep, a poller as eager as a user
//!   would make one by hand;
//! - `handoff-floor`: two lockers on backends of their own handing one key
//!   over, one queued waiter at a time (P3's method): from the holder's
//!   callback returning to the waiter's callback running. Its median gives
//!   the ceiling of a notified handoff, 1 / (200 µs + floor) cycles/s.
//!
//! For each kind: cycles/s; wait p50/p99, from the moment a task starts
//! wanting the lock to its critical section starting (waits still open at
//! a round's end count with their length so far); Jain's fairness index
//! over the 64 tasks' acquisitions, (Σx)² / (n·Σx²), the median of the
//! rounds'; the share of acquisitions, among those made while another task
//! was waiting, taken by the task that made the previous one; acquisition
//! attempts per handoff, counted at the client (withlock: `try_acquire`
//! and `try_acquire_queued` calls over acquisitions, split into unqueued
//! attempts, queued attempts that join the line, and later queued attempts
//! of the same wait: heartbeats and tries after a wake-up; the gem: its
//! `get`s); and the statements per cycle (each step is one autocommit
//! statement: withlock's attempts, releases, extensions and leaves, the
//! gem's `get`s and releases).
//!
//! Targets (P9, with the gem's polling as the peer in rslock's place), for
//! `withlock-queued`: wait p99 ≤ 0.25x the peer's, Jain ≥ 0.95, ≤ 5% taken
//! by the last holder, cycles/s ≥ 0.5x the peer's and ≥ 0.8x the handoff
//! ceiling, ≤ 1.1 attempts per handoff (heartbeats not counted).
//!
//! The 64 lockers' pools and listeners and the gem's connections need
//! about 270 connections, more than a default server allows (100; the test
//! servers of `withlock-test-servers` 50): the benchmark starts a server of
//! its own (the newest `/usr/lib/postgresql/*/bin`, or `PG_BIN`; through
//! `runuser -u postgres` as root) with `max_connections=400` and otherwise
//! default settings (`fsync` and `synchronous_commit` on), on a free port
//! and a scratch directory, removed at the end. `--database-url URL` runs
//! against another server instead (it needs the connections, and gets a
//! lock table of its own there, dropped at the end). Run it in release
//! mode; name kinds to run only those:
//!
//! ```text
//! cargo run --release -p lock-postgres --example bench_hot_key -- \
//!     [--seconds 1] [--rounds 3] [--database-url URL] [withlock-queued] \
//!     [withlock-no-queue] [gem-500ms] [gem-10ms] [handoff-floor]
//! ```

use std::error::Error;
use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use bench_support::{median, percentile, round_ratios, Spread};
use lock_core::{
    AcquireOutcome, BackendError, ExtendOutcome, ExtendRequest, Lease, LockConfig, Locker,
    LockerOptions, OwnerToken, QueueTerms, ReleaseOutcome,
};
use lock_postgres::sqlx::postgres::{PgPool, PgPoolOptions};
use lock_postgres::{quote_identifier, PostgresBackend, PostgresConfig};
use tokio::sync::Notify;
use tokio::task::JoinHandle;

#[path = "../../bench-support/bench_support.rs"]
mod bench_support;

type BoxError = Box<dyn Error + Send + Sync>;

/// Contenders on the hot key.
const TASKS: usize = 64;
/// The busy critical section.
const CRITICAL: Duration = Duration::from_micros(200);
/// The connections of each locker's pool.
const POOL: u32 = 2;
/// The warm-up round of each kind (connections, listeners, statements).
const WARM_UP: Duration = Duration::from_millis(300);
/// After a round's end, the time the holder has to finish before the
/// tasks still waiting are aborted.
const GRACE: Duration = Duration::from_millis(50);
/// After the aborts, the time the aborted waiters' leaves (sent in the
/// background) have to land before the next round.
const SETTLE: Duration = Duration::from_millis(200);
/// The longest one handoff of the floor may take.
const HANDOFF_TIMEOUT: Duration = Duration::from_secs(2);
/// The server's connection limit when the benchmark starts its own.
const MAX_CONNECTIONS: u32 = 400;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Queued,
    NoQueue,
    Gem,
    GemFast,
    Floor,
}

impl Kind {
    const ALL: [Self; 5] = [
        Self::Queued,
        Self::NoQueue,
        Self::Gem,
        Self::GemFast,
        Self::Floor,
    ];

    fn name(self) -> &'static str {
        match self {
            Self::Queued => "withlock-queued",
            Self::NoQueue => "withlock-no-queue",
            Self::Gem => "gem-500ms",
            Self::GemFast => "gem-10ms",
            Self::Floor => "handoff-floor",
        }
    }

    fn parse(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|k| k.name() == name)
    }

    fn is_withlock(self) -> bool {
        matches!(self, Self::Queued | Self::NoQueue)
    }

    /// The gem's sleep between two refused `get`s.
    fn poll(self) -> Option<Duration> {
        match self {
            Self::Gem => Some(Duration::from_millis(500)),
            Self::GemFast => Some(Duration::from_millis(10)),
            _ => None,
        }
    }
}

/// The names of [`Steps::snapshot`]'s counts: each one statement.
const STEPS: [&str; 6] = [
    "unqueued attempts",
    "queued attempts joining the line",
    "later queued attempts (heartbeats, tries after a wake-up)",
    "releases",
    "extensions",
    "leaves",
];

/// The steps of lockers' backends, counted at the client.
#[derive(Debug, Default)]
struct Steps {
    /// `try_acquire` calls.
    unqueued: AtomicU64,
    /// `try_acquire_queued` calls with an owner token new to its backend:
    /// each wait's attempt that joins the line.
    joined: AtomicU64,
    /// Later `try_acquire_queued` calls of the same wait: heartbeats, and
    /// tries after a wake-up.
    repeated: AtomicU64,
    /// Releases, extensions (statements) and leaves.
    releases: AtomicU64,
    extensions: AtomicU64,
    leaves: AtomicU64,
    /// Answers of `try_acquire_queued` calls.
    queued_answers: AtomicU64,
    answered: Notify,
}

impl Steps {
    /// The counts of the steps, in the order of [`STEPS`].
    fn snapshot(&self) -> [u64; 6] {
        [
            &self.unqueued,
            &self.joined,
            &self.repeated,
            &self.releases,
            &self.extensions,
            &self.leaves,
        ]
        .map(|count| count.load(Ordering::SeqCst))
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

/// A `PostgresBackend` whose steps are counted.
#[derive(Debug)]
struct Counted {
    inner: PostgresBackend,
    steps: Arc<Steps>,
    /// The owner token of this backend's last queued attempt (one task per
    /// locker, so one wait at a time).
    last_queued: Mutex<Option<OwnerToken>>,
}

lock_core::forward_lock_backend!(Counted => inner {
    async fn try_acquire(
        &self,
        key: &str,
        owner: &OwnerToken,
        ttl: Duration,
    ) -> Result<AcquireOutcome, BackendError> {
        self.steps.unqueued.fetch_add(1, Ordering::SeqCst);
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
        let count = if repeat { &self.steps.repeated } else { &self.steps.joined };
        count.fetch_add(1, Ordering::SeqCst);
        let answer = self.inner.try_acquire_queued(key, owner, ttl, terms).await;
        self.steps.queued_answers.fetch_add(1, Ordering::SeqCst);
        self.steps.answered.notify_waiters();
        answer
    }

    async fn release(&self, lease: &Lease) -> Result<ReleaseOutcome, BackendError> {
        self.steps.releases.fetch_add(1, Ordering::SeqCst);
        self.inner.release(lease).await
    }

    async fn extend_many(
        &self,
        requests: &[ExtendRequest],
    ) -> Vec<Result<ExtendOutcome, BackendError>> {
        self.steps.extensions.fetch_add(1, Ordering::SeqCst);
        self.inner.extend_many(requests).await
    }

    async fn extend(&self, lease: &Lease, ttl: Duration) -> Result<ExtendOutcome, BackendError> {
        self.steps.extensions.fetch_add(1, Ordering::SeqCst);
        self.inner.extend(lease, ttl).await
    }

    async fn leave_queue(&self, key: &str, owner: &OwnerToken) -> Result<(), BackendError> {
        self.steps.leaves.fetch_add(1, Ordering::SeqCst);
        self.inner.leave_queue(key, owner).await
    }
});

/// A locker on a backend of its own (its own pool and listener), counted
/// into `steps`.
fn counted_locker(
    url: &str,
    config: &PostgresConfig,
    name: &str,
    steps: &Arc<Steps>,
) -> Result<Locker, BoxError> {
    let pool = PgPoolOptions::new()
        .max_connections(POOL)
        .acquire_timeout(config.step_timeout * 3 / 4)
        .connect_lazy(url)?;
    let backend = Counted {
        inner: PostgresBackend::with_config(pool, config.clone())?,
        steps: Arc::clone(steps),
        last_queued: Mutex::new(None),
    };
    Ok(Locker::with_options(
        backend,
        LockerOptions::default().node_id(name),
    )?)
}

/// Ruby's Locker gem's statements on `table` (`tests/common`'s `Ruby`
/// holds the same): `get` with its 30 s lock, and `release`.
struct Gem {
    get: String,
    release: String,
}

impl Gem {
    fn new(table: &str) -> Self {
        Self {
            get: format!(
                "UPDATE {table} SET locked_by = $2, \
                 locked_at = clock_timestamp() at time zone 'UTC', \
                 locked_until = clock_timestamp() at time zone 'UTC' + interval '30 seconds', \
                 sequence = sequence + 1 \
                 WHERE key = $1 AND (locked_by IS NULL OR locked_by = $2 \
                 OR locked_until < clock_timestamp() at time zone 'UTC')"
            ),
            release: format!(
                "UPDATE {table} SET locked_by = NULL WHERE key = $1 AND locked_by = $2"
            ),
        }
    }
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

/// A PostgreSQL server of the benchmark's own, in a scratch directory, on
/// a free loopback port, stopped and removed when dropped.
struct OwnServer {
    bin: PathBuf,
    dir: PathBuf,
    port: u16,
    as_postgres: bool,
}

impl OwnServer {
    fn start() -> Result<Self, BoxError> {
        let bin = match std::env::var_os("PG_BIN") {
            Some(bin) => PathBuf::from(bin),
            None => std::fs::read_dir("/usr/lib/postgresql")?
                .filter_map(Result::ok)
                .filter_map(|e| {
                    let version: u32 = e.file_name().to_str()?.parse().ok()?;
                    let bin = e.path().join("bin");
                    bin.join("initdb").exists().then_some((version, bin))
                })
                .max()
                .map(|(_, bin)| bin)
                .ok_or("no PostgreSQL under /usr/lib/postgresql (set PG_BIN)")?,
        };
        let uid = Command::new("id").arg("-u").output()?.stdout;
        let as_postgres = String::from_utf8_lossy(&uid).trim() == "0";
        let dir = std::env::temp_dir().join(format!(
            "withlock-bench-pg.{}.{:08x}",
            std::process::id(),
            rand::random::<u32>()
        ));
        std::fs::create_dir_all(&dir)?;
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        let server = Self {
            bin,
            dir,
            port,
            as_postgres,
        };
        if as_postgres {
            check(Command::new("chown").arg("postgres:").arg(&server.dir))?;
        }
        let data = server.dir.join("data").display().to_string();
        let log = server.dir.join("server.log").display().to_string();
        let options = format!(
            "-p {} -k {} -c listen_addresses=127.0.0.1 -c max_connections={MAX_CONNECTIONS}",
            server.port,
            server.dir.display()
        );
        server.pg(
            "initdb",
            &[
                "-D",
                &data,
                "-A",
                "trust",
                "-U",
                "postgres",
                "-E",
                "UTF8",
                "--no-sync",
            ],
        )?;
        server.pg(
            "pg_ctl",
            &[
                "start", "-D", &data, "-l", &log, "-o", &options, "-w", "-t", "30",
            ],
        )?;
        Ok(server)
    }

    fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    fn pg(&self, program: &str, args: &[&str]) -> Result<(), BoxError> {
        let path = self.bin.join(program);
        let mut command = if self.as_postgres {
            let mut c = Command::new("runuser");
            c.args(["-u", "postgres", "--"]).arg(&path);
            c
        } else {
            Command::new(&path)
        };
        check(command.args(args).current_dir(&self.dir))
    }
}

impl Drop for OwnServer {
    fn drop(&mut self) {
        let data = self.dir.join("data").display().to_string();
        let _ = self.pg("pg_ctl", &["stop", "-D", &data, "-m", "immediate"]);
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn check(command: &mut Command) -> Result<(), BoxError> {
    let out = command.output()?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{command:?} failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        )
        .into())
    }
}

/// What each kind's contenders run on, made once for all rounds.
struct Setup {
    config: PostgresConfig,
    /// An admin pool: the gem rounds' rows.
    admin: PgPool,
    /// The withlock kinds' lockers, one per task, and their steps.
    lockers: Vec<Locker>,
    steps: Arc<Steps>,
    /// The gem kinds' connections, one per task.
    gems: Vec<PgPool>,
    gem: Gem,
    /// `handoff-floor`: the holder, the waiter and the waiter's steps.
    floor: Option<(Locker, Locker, Arc<Steps>)>,
}

impl Setup {
    async fn new(url: &str, config: PostgresConfig, kinds: &[Kind]) -> Result<Self, BoxError> {
        let admin = PgPoolOptions::new().max_connections(2).connect(url).await?;
        let table = config.qualified_table()?;
        let steps = Arc::new(Steps::default());
        let mut setup = Self {
            config,
            admin,
            lockers: Vec::new(),
            steps,
            gems: Vec::new(),
            gem: Gem::new(&table),
            floor: None,
        };
        if kinds.iter().any(|k| k.is_withlock()) {
            for i in 0..TASKS {
                let locker = counted_locker(url, &setup.config, &format!("hot-{i}"), &setup.steps)?;
                setup.lockers.push(locker);
            }
        }
        if kinds.iter().any(|k| k.poll().is_some()) {
            for _ in 0..TASKS {
                let pool = PgPoolOptions::new().max_connections(1).connect_lazy(url)?;
                setup.gems.push(pool);
            }
        }
        if kinds.contains(&Kind::Floor) {
            let holder_steps = Arc::new(Steps::default());
            let holder = counted_locker(url, &setup.config, "floor-holder", &holder_steps)?;
            let waiter_steps = Arc::new(Steps::default());
            let waiter = counted_locker(url, &setup.config, "floor-waiter", &waiter_steps)?;
            setup.floor = Some((holder, waiter, waiter_steps));
        }
        Ok(setup)
    }
}

/// One round's record, shared by its contenders.
struct Round {
    deadline: Instant,
    state: Mutex<RoundState>,
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
    /// Acquisitions made while another task waited, and those of them
    /// taken by the previous holder.
    contended: u64,
    repeats: u64,
    /// The gem's `get`s and releases before the deadline.
    polls: u64,
    gem_releases: u64,
}

impl Round {
    fn new(deadline: Instant) -> Self {
        Self {
            deadline,
            state: Mutex::new(RoundState {
                wanting: vec![None; TASKS],
                waiting: 0,
                last: None,
                counts: vec![0; TASKS],
                waits: Vec::new(),
                contended: 0,
                repeats: 0,
                polls: 0,
                gem_releases: 0,
            }),
        }
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

    /// Task `task`'s critical section starts. Acquisitions after the
    /// deadline are not counted; their waits count up to the deadline.
    fn acquired(&self, task: usize) {
        let now = Instant::now();
        let mut s = self.state();
        let Some(since) = s.wanting[task].take() else {
            return;
        };
        s.waiting -= 1;
        if now >= self.deadline {
            s.waits.push(self.deadline.saturating_duration_since(since));
            return;
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
    }

    /// A gem statement sent before the deadline: a `get` or a release.
    fn gem_statement(&self, get: bool) {
        if Instant::now() < self.deadline {
            let mut s = self.state();
            if get {
                s.polls += 1;
            } else {
                s.gem_releases += 1;
            }
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
    open_waits: usize,
    jains: Vec<f64>,
    contended: u64,
    repeats: u64,
    /// The steps (statements) in the order of [`STEPS`] (the gem's `get`s
    /// count as unqueued attempts).
    steps: [u64; 6],
    errors: u64,
    first_error: Option<String>,
    /// `handoff-floor` only.
    handoffs: Vec<Duration>,
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

    fn per_cycle(&self, n: u64) -> f64 {
        n as f64 / self.acquisitions.max(1) as f64
    }

    /// Attempts per handoff, heartbeats and tries after a wake-up included.
    fn attempts_per_handoff(&self) -> f64 {
        self.per_cycle(self.steps[..3].iter().sum())
    }

    /// Attempts per handoff without the repeated queued attempts
    /// (heartbeats, tries after a wake-up).
    fn attempts_without_repeats(&self) -> f64 {
        self.per_cycle(self.steps[0] + self.steps[1])
    }

    fn floor(&self) -> Duration {
        median(self.handoffs.clone())
    }
}

/// One contender's loop until the round's deadline.
async fn contender(
    kind: Kind,
    task: usize,
    key: String,
    round: Arc<Round>,
    locker: Option<Locker>,
    gem: Option<(PgPool, Arc<Gem>)>,
) -> Result<(), BoxError> {
    let config = match kind {
        Kind::NoQueue => LockConfig::default().wait_forever().no_queue(),
        _ => LockConfig::default().wait_forever(),
    };
    let id = format!("host:bench pid:{task} guid:{:032x}", rand::random::<u128>());
    while Instant::now() < round.deadline {
        round.want(task);
        if let (Some(poll), Some((pool, gem))) = (kind.poll(), &gem) {
            loop {
                round.gem_statement(true);
                let got = lock_postgres::sqlx::query(&gem.get)
                    .bind(&key)
                    .bind(&id)
                    .execute(pool)
                    .await?;
                if got.rows_affected() == 1 {
                    break;
                }
                tokio::time::sleep(poll).await;
            }
            round.acquired(task);
            spin(CRITICAL);
            round.gem_statement(false);
            lock_postgres::sqlx::query(&gem.release)
                .bind(&key)
                .bind(&id)
                .execute(pool)
                .await?;
        } else {
            let locker = locker.as_ref().ok_or("no locker")?;
            let r = Arc::clone(&round);
            locker
                .with_lock_config(&key, &config, move |_| async move {
                    r.acquired(task);
                    spin(CRITICAL);
                })
                .await?;
        }
    }
    Ok(())
}

/// One round of 64 contenders of `kind` on `key` for `length`, added to
/// `totals`.
async fn contended_round(
    kind: Kind,
    setup: &Setup,
    key: &str,
    length: Duration,
    totals: &mut Totals,
) -> Result<(), BoxError> {
    if kind.poll().is_some() {
        // The gem updates a row; it does not make one.
        let table = setup.config.qualified_table()?;
        lock_postgres::sqlx::query(&format!(
            "INSERT INTO {table} (key) VALUES ($1) ON CONFLICT (key) DO NOTHING"
        ))
        .bind(key)
        .execute(&setup.admin)
        .await?;
    }
    let before = setup.steps.snapshot();
    let started = Instant::now();
    let round = Arc::new(Round::new(started + length));
    let gem = Arc::new(Gem {
        get: setup.gem.get.clone(),
        release: setup.gem.release.clone(),
    });
    let tasks: Vec<JoinHandle<Result<(), BoxError>>> = (0..TASKS)
        .map(|task| {
            let locker = kind
                .is_withlock()
                .then(|| setup.lockers.get(task).cloned())
                .flatten();
            let gem = kind
                .poll()
                .and(setup.gems.get(task))
                .map(|pool| (pool.clone(), Arc::clone(&gem)));
            tokio::spawn(contender(
                kind,
                task,
                key.to_owned(),
                Arc::clone(&round),
                locker,
                gem,
            ))
        })
        .collect();
    tokio::time::sleep_until(round.deadline.into()).await;
    let after = setup.steps.snapshot();
    // The holder finishes its critical section and releases; whoever still
    // waits is aborted (a key of its own per round, so that a lock taken
    // by an aborted task and left to expire troubles no other round).
    tokio::time::sleep(GRACE).await;
    for t in &tasks {
        t.abort();
    }
    for t in tasks {
        match t.await {
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
    totals.open_waits += open.len();
    totals.waits.extend(open);
    totals.waits.append(&mut s.waits);
    let acquisitions: u64 = s.counts.iter().sum();
    totals.acquisitions += acquisitions;
    totals
        .rates
        .push(acquisitions as f64 / length.as_secs_f64());
    totals.jains.push(jain(&s.counts));
    totals.contended += s.contended;
    totals.repeats += s.repeats;
    if kind.is_withlock() {
        for (total, (after, before)) in totals.steps.iter_mut().zip(after.iter().zip(before)) {
            *total += after - before;
        }
    } else {
        totals.steps[0] += s.polls;
        totals.steps[3] += s.gem_releases;
    }
    Ok(())
}

/// Handoffs between two lockers on `key` for `length`, one queued waiter
/// at a time: from the holder's callback returning to the waiter's
/// running.
async fn floor_round(
    setup: &Setup,
    key: &str,
    length: Duration,
    totals: &mut Totals,
) -> Result<(), BoxError> {
    let (holder, waiter, steps) = setup.floor.as_ref().ok_or("no floor lockers")?;
    let config = LockConfig::default().wait_forever();
    let deadline = Instant::now() + length;
    while Instant::now() < deadline {
        let answered = steps.queued_answers.load(Ordering::SeqCst);
        let handoff = async {
            let (go, wait_go) = tokio::sync::oneshot::channel::<()>();
            let (released_tx, released_rx) = tokio::sync::oneshot::channel::<Instant>();
            let (held_tx, held_rx) = tokio::sync::oneshot::channel::<()>();
            let (h, k) = (holder.clone(), key.to_owned());
            let holding = tokio::spawn(async move {
                h.with_lock(&k, move |_| async move {
                    let _ = held_tx.send(());
                    let _ = wait_go.await;
                    let _ = released_tx.send(Instant::now());
                })
                .await
            });
            held_rx.await?;
            let (w, k) = (waiter.clone(), key.to_owned());
            let waiting = tokio::spawn(async move {
                w.with_lock_config(&k, &config, |_| async { Instant::now() })
                    .await
            });
            // The waiter's queued attempt found the key busy: it waits
            // in the queue for its grant.
            steps.until_queued_answers(answered + 1).await;
            tokio::time::sleep(Duration::from_millis(1)).await;
            let _ = go.send(());
            let released_at = released_rx.await?;
            holding.await??;
            let ran_at = waiting.await??;
            Ok::<_, BoxError>(ran_at.saturating_duration_since(released_at))
        };
        match tokio::time::timeout(HANDOFF_TIMEOUT, handoff).await {
            Ok(Ok(took)) => totals.handoffs.push(took),
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

/// One round of `kind` on a key of its own.
async fn round(
    kind: Kind,
    setup: &Setup,
    name: &str,
    length: Duration,
    totals: &mut Totals,
) -> Result<(), BoxError> {
    let key = format!("hot:{}:{name}:{:08x}", kind.name(), rand::random::<u32>());
    if kind == Kind::Floor {
        floor_round(setup, &key, length, totals).await
    } else {
        contended_round(kind, setup, &key, length, totals).await
    }
}

fn verdict(met: bool) -> &'static str {
    if met {
        "met"
    } else {
        "NOT MET"
    }
}

fn print_results(kinds: &[Kind], totals: &mut [Totals], rounds: usize, length: Duration) {
    for t in totals.iter_mut() {
        t.waits.sort();
    }
    let of = |kind: Kind| kinds.iter().position(|k| *k == kind);
    println!(
        "P9 one hot key, {TASKS} contenders, {CRITICAL:?} busy critical section, \
         {rounds} rounds x {length:?} per kind, order rotating; cycles/s and Jain: \
         medians of the rounds"
    );
    println!(
        "  {:<18} {:>9} {:>10} {:>10} {:>6} {:>15} {:>9} {:>9}",
        "kind", "cycles/s", "wait p50", "wait p99", "Jain", "last holder", "att/hand", "stmt/cyc"
    );
    for (kind, t) in kinds.iter().zip(totals.iter()) {
        if *kind == Kind::Floor {
            continue;
        }
        let jain_low = t.jains.iter().copied().fold(f64::MAX, f64::min);
        println!(
            "  {:<18} {:>9.0} {:>10.2?} {:>10.2?} {:>6.3} {:>5.1}% of {:<6} {:>9.2} {:>9.2}",
            kind.name(),
            t.rate(),
            t.wait(0.50),
            t.wait(0.99),
            median(t.jains.clone()),
            t.last_holder_share() * 100.0,
            t.contended,
            t.attempts_per_handoff(),
            t.per_cycle(t.steps.iter().sum()),
        );
        let split: Vec<String> = STEPS
            .iter()
            .zip(t.steps)
            .filter(|(_, n)| *n > 0)
            .map(|(name, n)| format!("{:.2} {name}", t.per_cycle(n)))
            .collect();
        println!(
            "      {} acquisitions, {} waits still open at a round's end, lowest round's \
             Jain {jain_low:.3}; statements per cycle: {}",
            t.acquisitions,
            t.open_waits,
            split.join(", ")
        );
        if t.errors > 0 {
            println!(
                "      {} errors, the first: {}",
                t.errors,
                t.first_error.as_deref().unwrap_or("")
            );
        }
    }
    let ceiling = of(Kind::Floor).map(|i| {
        let t = &totals[i];
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
        if t.errors > 0 {
            println!(
                "      {} errors, the first: {}",
                t.errors,
                t.first_error.as_deref().unwrap_or("")
            );
        }
        1.0 / (CRITICAL + floor).as_secs_f64()
    });
    let peers = [Kind::Gem, Kind::GemFast];
    println!("Against the gem's polling and the ceiling, same run:");
    for (i, kind) in kinds.iter().enumerate() {
        if !kind.is_withlock() {
            continue;
        }
        let t = &totals[i];
        for peer in peers {
            let Some(p) = of(peer) else { continue };
            let p = &totals[p];
            println!(
                "  {:<18} p99 wait {:.3}x {}'s, cycles/s {:.3}x {}'s",
                kind.name(),
                t.wait(0.99).as_secs_f64() / p.wait(0.99).as_secs_f64(),
                peer.name(),
                t.rate() / p.rate(),
                peer.name(),
            );
            Spread::of(&round_ratios(&t.rates, &p.rates)).print(&format!(
                "    cycles/s vs {}, rounds' own ratios",
                peer.name()
            ));
        }
        if let Some(c) = ceiling {
            println!("  {:<18} {:.3}x the ceiling", kind.name(), t.rate() / c);
        }
    }
    println!("P9 targets (the peer: the gem's own 500 ms polling, and a 10 ms poller):");
    for (i, kind) in kinds.iter().enumerate() {
        if *kind != Kind::Queued {
            continue;
        }
        let t = &totals[i];
        let name = kind.name();
        for peer in peers {
            let Some(p) = of(peer) else {
                println!("  {name}: targets against {}: n/a (not run)", peer.name());
                continue;
            };
            let p = &totals[p];
            let p99 = t.wait(0.99).as_secs_f64() / p.wait(0.99).as_secs_f64();
            let rate = t.rate() / p.rate();
            println!(
                "  {name}: p99 wait <= 0.25x {}'s: {p99:.3}x, {}",
                peer.name(),
                verdict(p99 <= 0.25)
            );
            println!(
                "  {name}: cycles/s >= 0.5x {}'s: {rate:.3}x, {}",
                peer.name(),
                verdict(rate >= 0.5)
            );
        }
        let j = median(t.jains.clone());
        println!("  {name}: Jain >= 0.95: {j:.3}, {}", verdict(j >= 0.95));
        let share = t.last_holder_share();
        println!(
            "  {name}: <= 5% by the last holder: {:.1}%, {}",
            share * 100.0,
            verdict(share <= 0.05)
        );
        match ceiling {
            Some(c) => {
                let x = t.rate() / c;
                println!(
                    "  {name}: cycles/s >= 0.8x the ceiling: {x:.3}x, {}",
                    verdict(x >= 0.8)
                );
            }
            None => println!("  {name}: cycles/s vs the ceiling: n/a (handoff-floor not run)"),
        }
        let a = t.attempts_without_repeats();
        println!(
            "  {name}: <= 1.1 attempts per handoff (heartbeats not counted): {a:.2} \
             ({:.2} with the later queued attempts), {}",
            t.attempts_per_handoff(),
            verdict(a <= 1.1)
        );
    }
}

async fn run(
    kinds: Vec<Kind>,
    rounds: usize,
    length: Duration,
    url: Option<String>,
) -> Result<(), BoxError> {
    let own = match url {
        Some(_) => None,
        None => Some(tokio::task::spawn_blocking(OwnServer::start).await??),
    };
    let url = url.unwrap_or_else(|| own.as_ref().map(OwnServer::url).unwrap_or_default());
    // A table of its own, so that a shared server's `locks` is untouched.
    let table = format!("bench_hot_{:08x}", rand::random::<u32>());
    let config = PostgresConfig::default().table(&table);
    let probe = PostgresBackend::from_url_with(&url, config.clone())?;
    probe.migrate().await?;
    let version: String = lock_postgres::sqlx::query_scalar(
        "SELECT current_setting('server_version') || ', max_connections ' || \
         current_setting('max_connections') || ', fsync ' || current_setting('fsync') || \
         ', synchronous_commit ' || current_setting('synchronous_commit')",
    )
    .fetch_one(probe.pool())
    .await?;
    println!(
        "lock-postgres hot-key benchmark against {probe:?} ({}PostgreSQL {version})",
        if own.is_some() {
            "a server of its own, "
        } else {
            ""
        }
    );
    let setup = Setup::new(&url, config.clone(), &kinds).await?;
    let started = Instant::now();
    let mut warm = Totals::default();
    for kind in &kinds {
        round(*kind, &setup, "warm-up", WARM_UP, &mut warm).await?;
    }
    let mut totals: Vec<Totals> = kinds.iter().map(|_| Totals::default()).collect();
    for r in 0..rounds {
        for step in 0..kinds.len() {
            let i = (r + step) % kinds.len();
            let name = format!("round-{r}");
            round(kinds[i], &setup, &name, length, &mut totals[i]).await?;
        }
    }
    print_results(&kinds, &mut totals, rounds, length);
    println!("total {:.1?}", started.elapsed());
    drop(setup);
    let schema = quote_identifier(&config.schema);
    let drop = [
        config.qualified_table()?,
        config.qualified_waiters_table()?,
        format!("{schema}.{}", quote_identifier(&config.streaks_table())),
    ]
    .join(", ");
    let functions: Vec<String> = ["queue", "release", "leave"]
        .iter()
        .flat_map(|f| {
            ["v1", "v2"]
                .map(|v| format!("{schema}.{}", quote_identifier(&format!("{table}_{f}_{v}"))))
        })
        .collect();
    lock_postgres::sqlx::raw_sql(&format!(
        "DROP TABLE {drop}; DROP FUNCTION {}",
        functions.join(", ")
    ))
    .execute(probe.pool())
    .await?;
    drop_server(own).await
}

async fn drop_server(own: Option<OwnServer>) -> Result<(), BoxError> {
    if let Some(own) = own {
        tokio::task::spawn_blocking(move || drop(own)).await?;
    }
    Ok(())
}

fn main() -> Result<(), BoxError> {
    const USAGE: &str = "usage: bench_hot_key [--seconds S] [--rounds N] [--database-url URL] \
                         [withlock-queued] [withlock-no-queue] [gem-500ms] [gem-10ms] \
                         [handoff-floor]";
    let mut args = std::env::args().skip(1);
    let (mut seconds, mut rounds, mut kinds, mut url) = (1.0_f64, 3_usize, Vec::new(), None);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--seconds" => seconds = args.next().ok_or(USAGE)?.parse()?,
            "--rounds" => rounds = args.next().ok_or(USAGE)?.parse()?,
            "--database-url" => url = Some(args.next().ok_or(USAGE)?),
            name => match Kind::parse(name) {
                Some(kind) if !kinds.contains(&kind) => kinds.push(kind),
                Some(_) => {}
                None => return Err(format!("unknown argument {name:?}; {USAGE}").into()),
            },
        }
    }
    if !(seconds > 0.0 && seconds <= 600.0) || rounds == 0 {
        return Err(
            format!("--seconds must be in (0, 600] and --rounds at least 1; {USAGE}").into(),
        );
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
        .block_on(run(kinds, rounds, Duration::from_secs_f64(seconds), url))
}

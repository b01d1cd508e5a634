//! P9 on Redis: one hot key, 64 contenders, against rslock and a naive
//! poller in the same run.
//!
//! 64 contenders on one key, each in a loop: wait as long as it takes for
//! the lock, run a 200 µs busy critical section (a spin, not a sleep),
//! release. Each kind runs in rounds of a fixed time, in an order that
//! rotates from round to round (`--rounds 3` x `--seconds 1` per kind by
//! default), each round on a key of its own, after a short warm-up round:
//!
//! - `withlock-separate`: 64 `Locker`s, each on a `RedisBackend` of its own
//!   (its own pool and subscription, as 64 processes would have), each
//!   backend in a `CountingBackend` that counts its acquisition attempts;
//!   `with_lock_config(key, LockConfig::default().wait_forever(), ..)`;
//! - `withlock-one-locker`: the same, one `Locker` shared by 64 tasks;
//! - `rslock`: 64 rslock 0.10 `LockManager`s, `acquire` (its own retry
//!   loop), `unlock` after;
//! - `naive-poller`: 64 tasks, each on a multiplexed connection of its own:
//!   `SET key token NX PX 30000`, 10 ms sleep when busy, release by a
//!   compare-and-delete script;
//! - `handoff-floor`: two lockers on backends of their own handing one key
//!   over, one waiter at a time (P3's method): from the holder's callback
//!   returning to the waiter's callback running. Its median gives the
//!   ceiling of a notified handoff, 1 / (200 µs + floor) cycles/s.
//!
//! For each kind: cycles/s; wait p50/p99, from the moment a task starts
//! wanting the lock to its critical section starting (waits still open at a
//! round's end count with their length so far); Jain's fairness index over
//! the 64 tasks' acquisitions, (Σx)² / (n·Σx²), the median of the rounds';
//! the share of acquisitions, among those made while another task was
//! waiting, taken by the task that made the previous one; acquisition
//! attempts per handoff (withlock only: `try_acquire` calls counted by the
//! wrappers over acquisitions); and the server's commands per cycle from
//! `INFO commandstats` before and after each round (commands run inside
//! scripts count too; so do other clients' on a shared server).
//!
//! Targets (P9), for `withlock-separate` and `withlock-one-locker`: wait
//! p99 ≤ 0.25x rslock's, Jain ≥ 0.95, ≤ 5% taken by the last holder,
//! cycles/s ≥ 0.5x rslock's and ≥ 0.8x the handoff ceiling, ≤ 1.1 attempts
//! per handoff.
//!
//! Against `REDIS_URL` (default `redis://127.0.0.1:6379`, or a child
//! `redis-server` when none answers), in a random key namespace deleted at
//! the end. Run it in release mode; name kinds to run only those:
//!
//! ```text
//! cargo run --release -p lock-redis --example bench_hot_key -- \
//!     [--seconds 1] [--rounds 3] [withlock-separate] [withlock-one-locker] \
//!     [rslock] [naive-poller] [handoff-floor]
//! ```

use std::collections::BTreeMap;
use std::error::Error;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use bench_support::{median, percentile, round_ratios, Spread};
use lock_conformance::{CountingBackend, Step};
use lock_core::{LockConfig, Locker, LockerOptions};
use lock_redis::testing::Namespace;
use lock_redis::RedisBackend;
use redis::Script;
use tokio::task::JoinHandle;
use withlock_test_servers::redis::server_url;

#[path = "../../bench-support/bench_support.rs"]
mod bench_support;

type Conn = redis::aio::MultiplexedConnection;
type BoxError = Box<dyn Error + Send + Sync>;

/// Contenders on the hot key.
const TASKS: usize = 64;
/// The busy critical section.
const CRITICAL: Duration = Duration::from_micros(200);
/// The ttl of the rslock and naive locks.
const TTL: Duration = Duration::from_secs(30);
/// The naive poller's sleep when the key is busy.
const POLL: Duration = Duration::from_millis(10);
/// The warm-up round of each kind (connections, subscriptions, scripts).
const WARM_UP: Duration = Duration::from_millis(300);
/// After a round's end, the time the holder has to finish before the
/// tasks still waiting are aborted.
const GRACE: Duration = Duration::from_millis(20);
/// The longest one handoff of the floor may take.
const HANDOFF_TIMEOUT: Duration = Duration::from_secs(2);

const RAW_RELEASE: &str = "if redis.call('GET', KEYS[1]) == ARGV[1] then \
                           return redis.call('DEL', KEYS[1]) end return 0";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Separate,
    OneLocker,
    Rslock,
    Naive,
    Floor,
}

impl Kind {
    const ALL: [Self; 5] = [
        Self::Separate,
        Self::OneLocker,
        Self::Rslock,
        Self::Naive,
        Self::Floor,
    ];

    fn name(self) -> &'static str {
        match self {
            Self::Separate => "withlock-separate",
            Self::OneLocker => "withlock-one-locker",
            Self::Rslock => "rslock",
            Self::Naive => "naive-poller",
            Self::Floor => "handoff-floor",
        }
    }

    fn parse(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|k| k.name() == name)
    }

    fn is_withlock(self) -> bool {
        matches!(self, Self::Separate | Self::OneLocker)
    }
}

fn node(backend: impl lock_core::LockBackend, name: &str) -> Locker {
    Locker::with_options(backend, LockerOptions::default().node_id(name)).expect("node id")
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

/// The calls of each command so far, from `INFO commandstats`.
async fn commandstats(conn: &Conn) -> Result<BTreeMap<String, u64>, BoxError> {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(&mut conn.clone())
        .await?;
    Ok(info
        .lines()
        .filter_map(|l| {
            let (name, rest) = l.strip_prefix("cmdstat_")?.split_once(':')?;
            let calls = rest
                .split(',')
                .find_map(|f| f.strip_prefix("calls="))?
                .parse()
                .ok()?;
            Some((name.to_owned(), calls))
        })
        .collect())
}

/// What each kind's contenders run on, made once for all rounds.
struct Setup {
    /// `withlock-separate`: a locker and its counting backend per task.
    separate: Vec<(Locker, CountingBackend<RedisBackend>)>,
    /// `withlock-one-locker`.
    one: Option<(Locker, CountingBackend<RedisBackend>)>,
    rslock: Vec<rslock::LockManager>,
    naive: Vec<Conn>,
    /// `handoff-floor`: the holder, the waiter and the waiter's counts.
    floor: Option<(Locker, Locker, CountingBackend<RedisBackend>)>,
}

impl Setup {
    async fn new(url: &str, kinds: &[Kind]) -> Result<Self, BoxError> {
        let counted = |name: &str| -> Result<_, BoxError> {
            let counting = CountingBackend::new(RedisBackend::from_url(url)?);
            Ok((node(counting.clone(), name), counting))
        };
        let mut setup = Self {
            separate: Vec::new(),
            one: None,
            rslock: Vec::new(),
            naive: Vec::new(),
            floor: None,
        };
        for kind in kinds {
            match kind {
                Kind::Separate => {
                    for i in 0..TASKS {
                        setup.separate.push(counted(&format!("hot-{i}"))?);
                    }
                }
                Kind::OneLocker => setup.one = Some(counted("hot-one")?),
                Kind::Rslock => {
                    setup.rslock = (0..TASKS)
                        .map(|_| rslock::LockManager::new(vec![url.to_owned()]))
                        .collect();
                }
                Kind::Naive => {
                    let client = redis::Client::open(url)?;
                    for _ in 0..TASKS {
                        setup
                            .naive
                            .push(client.get_multiplexed_async_connection().await?);
                    }
                }
                Kind::Floor => {
                    let (holder, _) = counted("floor-holder")?;
                    let (waiter, counting) = counted("floor-waiter")?;
                    setup.floor = Some((holder, waiter, counting));
                }
            }
        }
        Ok(setup)
    }

    /// `try_acquire` calls so far by the lockers of `kind`.
    fn attempts(&self, kind: Kind) -> u64 {
        match kind {
            Kind::Separate => self
                .separate
                .iter()
                .map(|(_, c)| c.calls(Step::TryAcquire))
                .sum(),
            Kind::OneLocker => self
                .one
                .as_ref()
                .map_or(0, |(_, c)| c.calls(Step::TryAcquire)),
            _ => 0,
        }
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
    attempts: u64,
    commands: BTreeMap<String, u64>,
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

    fn attempts_per_handoff(&self) -> f64 {
        self.attempts as f64 / self.acquisitions.max(1) as f64
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
    manager: Option<rslock::LockManager>,
    conn: Option<Conn>,
) -> Result<(), BoxError> {
    let config = LockConfig::default().wait_forever();
    let release = Script::new(RAW_RELEASE);
    let mut n = 0_u64;
    while Instant::now() < round.deadline {
        round.want(task);
        match kind {
            Kind::Separate | Kind::OneLocker => {
                let locker = locker.as_ref().ok_or("no locker")?;
                let r = Arc::clone(&round);
                locker
                    .with_lock_config(&key, &config, move |_| async move {
                        r.acquired(task);
                        spin(CRITICAL);
                    })
                    .await?;
            }
            Kind::Rslock => {
                let manager = manager.as_ref().ok_or("no lock manager")?;
                let guard = manager.acquire(key.as_bytes(), TTL).await?;
                round.acquired(task);
                spin(CRITICAL);
                guard.release().await;
            }
            Kind::Naive => {
                let mut conn = conn.clone().ok_or("no connection")?;
                n += 1;
                let token = format!("naive/{task}/{n}");
                loop {
                    let ok: Option<String> = redis::cmd("SET")
                        .arg(&key)
                        .arg(&token)
                        .arg("NX")
                        .arg("PX")
                        .arg(TTL.as_millis() as u64)
                        .query_async(&mut conn)
                        .await?;
                    if ok.is_some() {
                        break;
                    }
                    tokio::time::sleep(POLL).await;
                }
                round.acquired(task);
                spin(CRITICAL);
                let _: i64 = release
                    .key(&key)
                    .arg(&token)
                    .invoke_async(&mut conn)
                    .await?;
            }
            Kind::Floor => unreachable!("the floor has no contenders"),
        }
    }
    Ok(())
}

/// One round of 64 contenders of `kind` on `key` for `length`, added to
/// `totals`.
async fn contended_round(
    kind: Kind,
    setup: &Setup,
    stats: &Conn,
    key: &str,
    length: Duration,
    totals: &mut Totals,
) -> Result<(), BoxError> {
    let attempts = setup.attempts(kind);
    let before = commandstats(stats).await?;
    let started = Instant::now();
    let round = Arc::new(Round::new(started + length));
    let tasks: Vec<JoinHandle<Result<(), BoxError>>> = (0..TASKS)
        .map(|task| {
            let locker = match kind {
                Kind::Separate => setup.separate.get(task).map(|(l, _)| l.clone()),
                Kind::OneLocker => setup.one.as_ref().map(|(l, _)| l.clone()),
                _ => None,
            };
            tokio::spawn(contender(
                kind,
                task,
                key.to_owned(),
                Arc::clone(&round),
                locker,
                setup.rslock.get(task).cloned(),
                setup.naive.get(task).cloned(),
            ))
        })
        .collect();
    tokio::time::sleep_until(round.deadline.into()).await;
    let attempts = setup.attempts(kind) - attempts;
    let after = commandstats(stats).await?;
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
    totals.attempts += attempts;
    for (name, calls) in after {
        let delta = calls.saturating_sub(before.get(&name).copied().unwrap_or(0));
        if delta > 0 && name != "info" {
            *totals.commands.entry(name).or_default() += delta;
        }
    }
    Ok(())
}

/// Handoffs between two lockers on `key` for `length`, one waiter at a
/// time: from the holder's callback returning to the waiter's running.
async fn floor_round(
    setup: &Setup,
    key: &str,
    length: Duration,
    totals: &mut Totals,
) -> Result<(), BoxError> {
    let (holder, waiter, counting) = setup.floor.as_ref().ok_or("no floor lockers")?;
    let config = LockConfig::default().wait_forever();
    let deadline = Instant::now() + length;
    while Instant::now() < deadline {
        let attempts = counting.answers(Step::TryAcquire);
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
            // The waiter's first attempt finds the key busy, it watches
            // for the release and tries once more: then it waits.
            counting
                .until_answered(Step::TryAcquire, attempts + 2)
                .await;
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
    stats: &Conn,
    ns: &Namespace,
    name: &str,
    length: Duration,
    totals: &mut Totals,
) -> Result<(), BoxError> {
    let key = ns.key(&format!("hot:{}:{name}", kind.name()));
    if kind == Kind::Floor {
        floor_round(setup, &key, length, totals).await
    } else {
        contended_round(kind, setup, stats, &key, length, totals).await
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
        "  {:<20} {:>9} {:>10} {:>10} {:>6} {:>13} {:>9} {:>9}",
        "kind", "cycles/s", "wait p50", "wait p99", "Jain", "last holder", "att/hand", "cmds/cyc"
    );
    for (kind, t) in kinds.iter().zip(totals.iter()) {
        if *kind == Kind::Floor {
            continue;
        }
        let cycles = t.acquisitions.max(1) as f64;
        let commands: u64 = t.commands.values().sum();
        let attempts = if kind.is_withlock() {
            format!("{:.2}", t.attempts_per_handoff())
        } else {
            "-".to_owned()
        };
        let jain_low = t.jains.iter().copied().fold(f64::MAX, f64::min);
        println!(
            "  {:<20} {:>9.0} {:>10.2?} {:>10.2?} {:>6.3} {:>5.1}% of {:<5} {:>9} {:>9.2}",
            kind.name(),
            t.rate(),
            t.wait(0.50),
            t.wait(0.99),
            median(t.jains.clone()),
            t.last_holder_share() * 100.0,
            t.contended,
            attempts,
            commands as f64 / cycles,
        );
        let mut by_count: Vec<(&String, &u64)> = t.commands.iter().collect();
        by_count.sort_by(|a, b| b.1.cmp(a.1));
        let list: Vec<String> = by_count
            .iter()
            .map(|(name, calls)| format!("{name} {:.2}", **calls as f64 / cycles))
            .collect();
        println!(
            "      {} acquisitions, {} waits still open at a round's end, lowest round's Jain {jain_low:.3}; \
             server commands per cycle: {}",
            t.acquisitions,
            t.open_waits,
            list.join(", ")
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
    let rslock = of(Kind::Rslock);
    println!("Against rslock and the ceiling, same run:");
    for (i, kind) in kinds.iter().enumerate() {
        if matches!(kind, Kind::Floor | Kind::Rslock) {
            continue;
        }
        let t = &totals[i];
        let mut line = format!("  {:<20}", kind.name());
        if let Some(r) = rslock {
            let r = &totals[r];
            line += &format!(
                " p99 wait {:.3}x rslock, cycles/s {:.3}x rslock",
                t.wait(0.99).as_secs_f64() / r.wait(0.99).as_secs_f64(),
                t.rate() / r.rate(),
            );
        }
        if let Some(c) = ceiling {
            line += &format!(", {:.3}x the ceiling", t.rate() / c);
        }
        println!("{line}");
        if let Some(r) = rslock {
            Spread::of(&round_ratios(&t.rates, &totals[r].rates))
                .print("    cycles/s vs rslock, rounds' own ratios");
        }
    }
    println!("P9 targets:");
    for (i, kind) in kinds.iter().enumerate() {
        if !kind.is_withlock() {
            continue;
        }
        let t = &totals[i];
        let name = kind.name();
        match rslock {
            Some(r) => {
                let r = &totals[r];
                let p99 = t.wait(0.99).as_secs_f64() / r.wait(0.99).as_secs_f64();
                let rate = t.rate() / r.rate();
                println!(
                    "  {name}: p99 wait <= 0.25x rslock: {p99:.3}x, {}",
                    verdict(p99 <= 0.25)
                );
                println!(
                    "  {name}: cycles/s >= 0.5x rslock: {rate:.3}x, {}",
                    verdict(rate >= 0.5)
                );
            }
            None => println!("  {name}: targets against rslock: n/a (rslock not run)"),
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
        let a = t.attempts_per_handoff();
        println!(
            "  {name}: <= 1.1 attempts per handoff: {a:.2}, {}",
            verdict(a <= 1.1)
        );
    }
}

async fn run(kinds: Vec<Kind>, rounds: usize, length: Duration) -> Result<(), BoxError> {
    let url = server_url().await;
    let ns = Namespace::new(&url);
    let probe = RedisBackend::from_url(&url)?;
    println!("lock-redis hot-key benchmark against {probe:?}");
    let stats = deadpool_redis::Connection::take(probe.pool().get().await?);
    let setup = Setup::new(&url, &kinds).await?;
    let started = Instant::now();
    let mut warm = Totals::default();
    for kind in &kinds {
        round(*kind, &setup, &stats, &ns, "warm-up", WARM_UP, &mut warm).await?;
    }
    let mut totals: Vec<Totals> = kinds.iter().map(|_| Totals::default()).collect();
    for r in 0..rounds {
        for step in 0..kinds.len() {
            let i = (r + step) % kinds.len();
            let name = format!("round-{r}");
            round(kinds[i], &setup, &stats, &ns, &name, length, &mut totals[i]).await?;
        }
    }
    print_results(&kinds, &mut totals, rounds, length);
    println!("total {:.1?}", started.elapsed());
    drop(setup);
    let deleted = tokio::task::spawn_blocking(move || ns.cleanup()).await??;
    println!("cleaned up {deleted} keys");
    Ok(())
}

fn main() -> Result<(), BoxError> {
    const USAGE: &str = "usage: bench_hot_key [--seconds S] [--rounds N] [withlock-separate] \
                         [withlock-one-locker] [rslock] [naive-poller] [handoff-floor]";
    let mut args = std::env::args().skip(1);
    let (mut seconds, mut rounds, mut kinds) = (1.0_f64, 3_usize, Vec::new());
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--seconds" => seconds = args.next().ok_or(USAGE)?.parse()?,
            "--rounds" => rounds = args.next().ok_or(USAGE)?.parse()?,
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
        .block_on(run(kinds, rounds, Duration::from_secs_f64(seconds)))
}

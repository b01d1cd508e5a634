//! One worker process: tasks looping over `with_lock` with fenced writes,
//! one log line per call, and a graceful `Locker::shutdown` on SIGTERM,
//! SIGINT or the end of stdin (the coordinator gone).

use std::io::{self, Write as _};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use lock_core::{LockConfig, LockContext, LockError, Locker, LockerOptions, QueueTerms};
use lock_postgres::PostgresBackend;
use lock_redis::RedisBackend;
use rand::Rng;
use tokio::sync::{oneshot, watch};
use tokio::task::JoinHandle;

use crate::args::{Backend, WorkerArgs};
use crate::event::{
    now_us, Event, FencedWrite, Held, LeakCheck, LogWriter, Outcome, Section, ShutdownRecord,
};
use crate::fence::{FenceError, FenceStore};
use crate::server::{etcd, held_keys, redis_cluster};
use crate::trace::{Traced, Traces};

/// Attempts after the first while a key is busy; with
/// [`RETRY_DELAY`], a call gives up after about two seconds.
pub const RETRY_ATTEMPTS: u32 = 40;
/// Between two counted attempts.
pub const RETRY_DELAY: Duration = Duration::from_millis(50);
/// The fair queue's terms of every call \[F1–F3\]: the defaults, a
/// ticket ttl of 3 s and a claim deadline of 2 s. The order check reads
/// the ticket ttl from the run's record.
pub const QUEUE_TERMS: QueueTerms = QueueTerms::DEFAULT;
/// A call that has not returned after this is logged as hung and dropped.
pub const WATCHDOG: Duration = Duration::from_secs(60);
/// How long a task whose callback runs may take to finish after shutdown.
pub const FINISH_WAIT: Duration = Duration::from_secs(10);
/// One section in this many holds one to two ttls, so that extensions run.
pub const LONG_HOLD_ONE_IN: u32 = 8;

/// What a worker can fail with before it starts its tasks.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum WorkerError {
    /// The log or stdout failed.
    #[error("worker i/o failed")]
    Io(#[from] io::Error),
    /// The Redis backend could not be made.
    #[error("Redis backend setup failed")]
    Redis(#[from] lock_redis::SetupError),
    /// The PostgreSQL backend could not be made.
    #[error("PostgreSQL backend setup failed")]
    Postgres(#[from] lock_postgres::SetupError),
    /// The etcd backend could not connect.
    #[error("etcd backend setup failed")]
    Etcd(#[from] lock_etcd::SetupError),
    /// The backend took too long to set up.
    #[error("backend setup timed out")]
    Timeout,
    /// The fence store could not be reached.
    #[error("fence store setup failed")]
    Fence(#[from] FenceError),
    /// The locker refused its options.
    #[error("locker setup failed")]
    Locker(#[from] LockError),
}

struct Shared {
    args: WorkerArgs,
    locker: Locker,
    fence: FenceStore,
    log: LogWriter,
    config: LockConfig,
    stopping: AtomicBool,
    traces: Arc<Traces>,
}

/// Runs a worker until it is told to stop, then shuts its locker down and
/// logs how that went.
///
/// # Errors
///
/// [`WorkerError`] when the backend, the fence store or the log cannot be
/// set up.
pub async fn run(args: WorkerArgs) -> Result<(), WorkerError> {
    let log = LogWriter::create(&args.log)?;
    let options = LockerOptions::default().node_id(format!("chaos-w{}", args.worker));
    // Every backend's release tries are recorded for the O6 check.
    let traces = Arc::new(Traces::default());
    let locker = match args.backend {
        Backend::Redis => {
            let backend = RedisBackend::from_url(&args.lock_url)?;
            Locker::with_options(Traced::new(backend, Arc::clone(&traces)), options)?
        }
        Backend::Postgres => {
            let backend = tokio::time::timeout(
                Duration::from_secs(10),
                PostgresBackend::connect(&args.lock_url),
            )
            .await
            .map_err(|_| WorkerError::Timeout)??;
            Locker::with_options(Traced::new(backend, Arc::clone(&traces)), options)?
        }
        Backend::Etcd => {
            let backend =
                tokio::time::timeout(Duration::from_secs(10), etcd::connect(&args.lock_url))
                    .await
                    .map_err(|_| WorkerError::Timeout)??;
            Locker::with_options(Traced::new(backend, Arc::clone(&traces)), options)?
        }
        Backend::RedisCluster => {
            let backend = redis_cluster::backend(&args.lock_url)?;
            Locker::with_options(Traced::new(backend, Arc::clone(&traces)), options)?
        }
    };
    let fence = FenceStore::connect(&args.fence_url, &args.fence_table, args.tasks + 2)?;
    let config = LockConfig::default()
        .ttl(args.ttl)
        .retry_attempts(RETRY_ATTEMPTS)
        .retry_delay(RETRY_DELAY)
        .fair_queue(QUEUE_TERMS);
    let stop = stop_signal()?;
    let shared = Arc::new(Shared {
        args,
        locker,
        fence,
        log,
        config,
        stopping: AtomicBool::new(false),
        traces,
    });
    shared.log.write(&Event::WorkerStart {
        worker: shared.args.worker,
        pid: std::process::id(),
        t: now_us(),
    })?;
    let tasks: Vec<(JoinHandle<()>, Arc<AtomicBool>)> = (0..shared.args.tasks)
        .map(|task| {
            let in_callback = Arc::new(AtomicBool::new(false));
            let handle = tokio::spawn(task_loop(
                Arc::clone(&shared),
                task,
                Arc::clone(&in_callback),
            ));
            (handle, in_callback)
        })
        .collect();
    {
        let mut out = io::stdout().lock();
        writeln!(out, "ready")?;
        out.flush()?;
    }
    let mut stop = stop;
    let _ = stop.wait_for(|stopped| *stopped).await;
    shared.stopping.store(true, Ordering::SeqCst);

    let t_signal = now_us();
    let report = shared.locker.shutdown(shared.args.grace).await;
    let t_done = now_us();
    own_leak_check(&shared).await;
    // Calls still acquiring never settle after shutdown [S2]: end them.
    // Calls whose callback ran log their line once it ends.
    let deadline = tokio::time::Instant::now() + FINISH_WAIT;
    let (mut aborted_tasks, mut abandoned_waits) = (0, 0);
    for (mut handle, in_callback) in tasks {
        if !in_callback.load(Ordering::SeqCst) {
            if !handle.is_finished() {
                abandoned_waits += 1;
            }
            handle.abort();
            continue;
        }
        if tokio::time::timeout_at(deadline, &mut handle)
            .await
            .is_err()
        {
            aborted_tasks += 1;
            handle.abort();
        }
    }
    shared.log.write(&Event::Shutdown(ShutdownRecord {
        worker: shared.args.worker,
        t_signal,
        t_done,
        grace_ms: millis(shared.args.grace),
        release_timeout_ms: millis(LockerOptions::default().release_timeout),
        callbacks_finished: report.callbacks_finished,
        released: report.released,
        release_failures: report.release_failures,
        aborted_tasks,
        abandoned_waits,
    }))?;
    Ok(())
}

/// Right after shutdown returned, nothing may be held by this node \[S1\]:
/// read the store (another node may hold a key by now; that is fine).
async fn own_leak_check(shared: &Shared) {
    let args = &shared.args;
    match held_keys(args.backend, &args.lock_url, &args.keys).await {
        Ok(held) => {
            let node = shared.locker.node_id();
            let event = Event::LeakCheck(LeakCheck {
                by: Some(args.worker),
                t: now_us(),
                keys_checked: args.keys.len(),
                held: held
                    .iter()
                    .filter(|h| h.is_held_by(node))
                    .map(ToString::to_string)
                    .collect(),
            });
            if let Err(error) = shared.log.write(&event) {
                eprintln!("worker {}: log write failed: {error}", args.worker);
            }
        }
        Err(error) => eprintln!("worker {}: leak check failed: {error}", args.worker),
    }
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// Becomes true on SIGTERM, SIGINT, or when stdin ends (the coordinator
/// died: the pipe it holds closes).
fn stop_signal() -> io::Result<watch::Receiver<bool>> {
    use tokio::signal::unix::{signal, SignalKind};
    let (tx, rx) = watch::channel(false);
    let tx = Arc::new(tx);
    for kind in [SignalKind::terminate(), SignalKind::interrupt()] {
        let mut signals = signal(kind)?;
        let tx = Arc::clone(&tx);
        tokio::spawn(async move {
            signals.recv().await;
            tx.send_replace(true);
        });
    }
    // A thread, not a task: a blocked read must not hold up the runtime.
    std::thread::spawn(move || {
        let _ = io::copy(&mut io::stdin().lock(), &mut io::sink());
        tx.send_replace(true);
    });
    Ok(rx)
}

async fn task_loop(shared: Arc<Shared>, task: u32, in_callback: Arc<AtomicBool>) {
    let mut seq = 0;
    while !shared.stopping.load(Ordering::SeqCst) {
        seq += 1;
        in_callback.store(false, Ordering::SeqCst);
        let key = {
            let keys = &shared.args.keys;
            keys[rand::rng().random_range(0..keys.len())].clone()
        };
        let section = one_call(&shared, task, seq, key, &in_callback).await;
        let failed = section.outcome == Outcome::Failed;
        if let Err(error) = shared.log.write(&Event::Section(section)) {
            eprintln!("worker {}: log write failed: {error}", shared.args.worker);
        }
        in_callback.store(false, Ordering::SeqCst);
        if failed {
            tokio::time::sleep(RETRY_DELAY * 4).await;
        }
        // A short pause, so that other nodes get their turn.
        let pause = rand::rng().random_range(0..=shared.args.hold.as_millis() as u64 / 4);
        tokio::time::sleep(Duration::from_millis(pause)).await;
    }
}

/// What the callback reports as soon as it starts.
struct Started {
    token: u64,
    t_start: u64,
    ctx: LockContext,
    told: JoinHandle<u64>,
}

/// What the callback reports when it ends.
struct Ended {
    t_end: u64,
    writes: Vec<FencedWrite>,
}

fn hold_time(args: &WorkerArgs) -> Duration {
    let mut rng = rand::rng();
    if rng.random_range(0..LONG_HOLD_ONE_IN) == 0 {
        args.ttl + args.ttl.mul_f64(rng.random_range(0.0..1.0))
    } else {
        let max = args.hold.as_micros().max(5_000) as u64;
        Duration::from_micros(rng.random_range(1_000..=max))
    }
}

async fn one_call(
    shared: &Arc<Shared>,
    task: u32,
    seq: u64,
    key: String,
    in_callback: &Arc<AtomicBool>,
) -> Section {
    let (started_tx, started_rx) = oneshot::channel::<Started>();
    let (ended_tx, ended_rx) = oneshot::channel::<Ended>();
    let writer = format!("w{}/t{task}/s{seq}", shared.args.worker);
    let hold = hold_time(&shared.args);
    let fence = shared.fence.clone();
    let traces = Arc::clone(&shared.traces);
    let flag = Arc::clone(in_callback);
    let k = key.clone();
    let callback = move |ctx: LockContext| async move {
        let t_start = now_us();
        flag.store(true, Ordering::SeqCst);
        let token = ctx.fencing_token();
        traces.watch(&ctx);
        let watched = ctx.clone();
        let told = tokio::spawn(async move {
            watched.lost().await;
            now_us()
        });
        let _ = started_tx.send(Started {
            token,
            t_start,
            ctx: ctx.clone(),
            told,
        });
        // A write at once, and one after the hold: a holder stalled in
        // between writes late, and the fence store must refuse it if the
        // lock went to someone else meanwhile.
        let first = fenced_write(&fence, &ctx, &k, token, &writer).await;
        tokio::time::sleep(hold).await;
        let second = fenced_write(&fence, &ctx, &k, token, &writer).await;
        let _ = ended_tx.send(Ended {
            t_end: now_us(),
            writes: vec![first, second],
        });
    };
    let t_call = now_us();
    let (result, queued) = shared
        .traces
        .queued(tokio::time::timeout(
            WATCHDOG,
            shared
                .locker
                .with_lock_config(&key, &shared.config, callback),
        ))
        .await;
    let t_return = now_us();
    let (outcome, cause) = match result {
        Err(_) => (Outcome::Hung, None),
        Ok(Ok(())) => (Outcome::Ok, None),
        Ok(Err(error)) => classify(&error),
    };
    // Sent before the callback's first await, so there whenever it ran.
    let mut release = None;
    let held = match started_rx.await {
        Err(_) => None,
        Ok(started) => {
            // What the release did before with_lock returned.
            release = shared.traces.take(&key, started.token);
            // A callback going on after a loss ends within its hold and two
            // bounded writes.
            let ended = match tokio::time::timeout(FINISH_WAIT, ended_rx).await {
                Ok(Ok(ended)) => Some(ended),
                _ => None,
            };
            let ctx_lost = started.ctx.is_lost();
            let told_at = if started.told.is_finished() || ctx_lost {
                tokio::time::timeout(Duration::from_millis(200), started.told)
                    .await
                    .ok()
                    .and_then(Result::ok)
            } else {
                started.told.abort();
                None
            };
            Some(Held {
                token: started.token,
                t_start: started.t_start,
                t_end: ended.as_ref().map(|e| e.t_end),
                writes: ended.map(|e| e.writes).unwrap_or_default(),
                told_at,
                ctx_lost,
            })
        }
    };
    Section {
        key,
        worker: shared.args.worker,
        task,
        seq,
        t_call,
        t_return,
        outcome,
        cause,
        held,
        release,
        queued,
    }
}

async fn fenced_write(
    fence: &FenceStore,
    ctx: &LockContext,
    key: &str,
    token: u64,
    writer: &str,
) -> FencedWrite {
    let lost_before = ctx.is_lost();
    let t_sent = now_us();
    let result = fence.write(key, token, writer).await;
    FencedWrite {
        t_sent,
        t_done: now_us(),
        result,
        lost_before,
    }
}

/// The outcome and the error's text, its sources included.
fn classify(error: &LockError) -> (Outcome, Option<String>) {
    let outcome = if error.is_lost() {
        Outcome::Lost
    } else if error.is_not_acquired() {
        Outcome::NotAcquired
    } else {
        Outcome::Failed
    };
    let text = match error.loss_cause() {
        Some(cause) => chain(cause),
        None => chain(error),
    };
    (outcome, Some(text))
}

fn chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

//! `chaos run`: the fence table, the lock server, the workers, the fault
//! schedule, the graceful stop, the leak check, the analysis.
//!
//! Everything started here is owned by a guard that ends it on every exit
//! path, panics included: the workers (SIGCONT, then SIGKILL, through their
//! child handles, so never another process), the lock server (resumed,
//! then stopped) and the fence table (dropped). Workers also stop by
//! themselves when this process dies: their stdin, a pipe held here, ends.

use std::io;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use nix::sys::signal::Signal;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, ChildStdin, Command};

use crate::analysis::{analyse, Report};
use crate::args::{format_duration, Backend, RunArgs};
use crate::event::{now_us, Event, Fault, FaultKind, LeakCheck, LogWriter, RunInfo, RunLog};
use crate::fence::{FenceError, FenceStore};
use crate::queue::{QueueReadError, QueueReader, Sampler};
use crate::server::{held_keys, signal, Injected, LockServer, ServerError};

/// How long a worker may take to set up.
pub const READY_WAIT: Duration = Duration::from_secs(30);
/// On top of the grace, how long a worker may take to exit after SIGTERM.
pub const EXIT_SLACK: Duration = Duration::from_secs(15);

/// What a run can fail with (as opposed to finding violations).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RunError {
    /// A file or process step failed.
    #[error("run i/o failed: {0}")]
    Io(#[from] io::Error),
    /// The fence store failed.
    #[error("fence store failed")]
    Fence(#[from] FenceError),
    /// The lock server could not be started or faulted.
    #[error("lock server step failed")]
    Server(#[from] ServerError),
    /// A worker did not become ready.
    #[error("worker {worker} did not become ready (see {log})")]
    WorkerNotReady {
        /// Its index.
        worker: u32,
        /// Its stderr file.
        log: String,
    },
    /// The fair queue's reader could not be set up.
    #[error("queue reader setup failed")]
    Queue(#[from] QueueReadError),
    /// The output directory already holds a run.
    #[error("{0} already holds the logs of a run")]
    OutNotEmpty(String),
}

/// A run's output directory and its report.
#[derive(Debug)]
pub struct Finished {
    /// Where the logs and `report.json` are.
    pub dir: PathBuf,
    /// What the analysis found.
    pub report: Report,
}

/// Runs the whole check and analyses it. The logs and `report.json` are
/// left in the output directory.
///
/// # Errors
///
/// [`RunError`] when the run could not be made; what was started is ended.
pub async fn run(args: RunArgs, exe: &Path) -> Result<Finished, RunError> {
    let dir = out_dir(&args)?;
    let log = LogWriter::create(&dir.join("coordinator.jsonl"))?;
    let run_id = format!("{:08x}", rand::random::<u32>());
    let server = LockServer::start(args.backend).await?;
    let keys = server.keys(&format!("chaos-{run_id}-k"), args.keys).await?;

    let fence = FenceGuard::new(
        FenceStore::create(&args.fence_url, &keys).await?,
        &args.fence_url,
    );
    let mut workers = Workers::spawn(&args, exe, &dir, &server, fence.table(), &keys).await?;

    let t_begin = now_us();
    eprintln!(
        "chaos {}: {} workers x {} tasks on {} keys for {} s; logs in {}",
        args.backend.name(),
        args.procs,
        args.tasks,
        args.keys,
        args.seconds,
        dir.display()
    );
    let sampler = match QueueReader::new(args.backend, &server, &keys)? {
        Some(reader) => Some(Sampler::start(reader, &dir, args.shuffle_queue)?),
        None => None,
    };
    let scheduled = schedule(&args, &server, &workers, &keys, &log).await;
    let t_end = now_us();
    if let Some(sampler) = sampler {
        let reads = sampler.stop().await?;
        eprintln!(
            "fair queue read {} times ({} reads failed or timed out)",
            reads.answered, reads.failed
        );
    }
    scheduled?;

    workers.stop(&args, &log).await?;
    match held_keys(args.backend, &server.worker_url(), &keys).await {
        Ok(held) => log.write(&Event::LeakCheck(LeakCheck {
            by: None,
            t: now_us(),
            keys_checked: keys.len(),
            held: held.iter().map(ToString::to_string).collect(),
        }))?,
        Err(error) => eprintln!("leak check failed: {error}"),
    }
    fence.drop_now().await;
    // Stopping a server waits for it (`pg_ctl stop`): not on a runtime thread.
    let _ = tokio::task::spawn_blocking(move || drop(server)).await;
    log.write(&Event::Run(RunInfo {
        backend: args.backend.name().to_owned(),
        t_begin,
        t_end,
        procs: args.procs,
        tasks: args.tasks,
        keys,
        ttl_ms: millis(args.ttl),
        liveness_bound_ms: millis(args.liveness_bound),
        // A Redis Cluster fault touches one master's keys: the others'
        // locks must never be reported lost [L4].
        check_unfaulted_losses: args.backend == Backend::RedisCluster,
        ticket_ttl_ms: millis(crate::worker::QUEUE_TERMS.ticket_ttl),
        claim_ms: millis(crate::worker::QUEUE_TERMS.claim),
    }))?;
    let report = analyse(&RunLog::read_dir(&dir)?);
    let json = serde_json::to_string_pretty(&report).map_err(io::Error::other)?;
    std::fs::write(dir.join("report.json"), json)?;
    Ok(Finished { dir, report })
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

fn out_dir(args: &RunArgs) -> Result<PathBuf, RunError> {
    let dir = match &args.out {
        Some(dir) => dir.clone(),
        None => {
            let secs = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_secs());
            std::env::temp_dir().join(format!(
                "withlock-chaos-{}-{secs}-{:04x}",
                args.backend.name(),
                rand::random::<u16>()
            ))
        }
    };
    std::fs::create_dir_all(&dir)?;
    let used = std::fs::read_dir(&dir)?
        .filter_map(Result::ok)
        .any(|e| e.path().extension().is_some_and(|x| x == "jsonl"));
    if used {
        return Err(RunError::OutNotEmpty(dir.display().to_string()));
    }
    Ok(dir)
}

/// How long a stop lasts: well past the ttl.
fn stop_for(args: &RunArgs) -> Duration {
    (args.ttl * 5 / 2).max(args.ttl + Duration::from_millis(500))
}

/// About how long injecting and healing `kind` takes.
fn expected(kind: FaultKind, args: &RunArgs) -> Duration {
    match kind {
        FaultKind::WorkerStop | FaultKind::ServerStop => stop_for(args),
        FaultKind::ServerKill => Duration::from_millis(500),
        FaultKind::PgRestart => Duration::from_secs(3),
        FaultKind::LeaderKill
        | FaultKind::FollowerKill
        | FaultKind::LeaderStop
        | FaultKind::FollowerStop => stop_for(args) + Duration::from_millis(500),
        // The node timeout (2 s), the election, the cluster whole again.
        FaultKind::MasterStop | FaultKind::MasterKill => Duration::from_secs(6),
        FaultKind::MasterStopShort => {
            crate::server::redis_cluster::short_stop(stop_for(args)) + Duration::from_millis(500)
        }
        _ => Duration::from_millis(200),
    }
}

/// Resolves on SIGINT or SIGTERM to this process.
async fn interrupted() {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut int), Ok(mut term)) = (
        signal(SignalKind::interrupt()),
        signal(SignalKind::terminate()),
    ) else {
        return std::future::pending().await;
    };
    tokio::select! {
        _ = int.recv() => {}
        _ = term.recv() => {}
    }
}

/// Injects the faults of `args` in turn, each followed by the heal time,
/// until the run's time is up or the process is interrupted. The last
/// fault is always followed by the liveness bound of quiet time, so that
/// its recovery can be judged; a second interrupt skips that.
async fn schedule(
    args: &RunArgs,
    server: &LockServer,
    workers: &Workers,
    keys: &[String],
    log: &LogWriter,
) -> Result<(), RunError> {
    let start = tokio::time::Instant::now();
    let end = start + Duration::from_secs(args.seconds);
    let tail = args.heal.max(args.liveness_bound);
    let interrupt = interrupted();
    tokio::pin!(interrupt);
    let quiet = |until: tokio::time::Instant| tokio::time::sleep_until(until);
    // Warm up before the first fault.
    tokio::select! {
        () = quiet(start + args.heal) => {}
        () = &mut interrupt => return Ok(()),
    }
    let mut next_worker = 0;
    let mut last_heal = None;
    for kind in args.faults.iter().copied().cycle() {
        if tokio::time::Instant::now() + expected(kind, args) + tail > end {
            break;
        }
        let t_start = now_us();
        let injected = if kind == FaultKind::WorkerStop {
            let index = next_worker % workers.procs.len();
            next_worker += 1;
            Injected {
                kind: None,
                target: format!("w{index}"),
                detail: workers.stop_one(index, stop_for(args)).await?,
                keys: None,
            }
        } else {
            server.inject(kind, stop_for(args), keys).await?
        };
        let kind = injected.kind.unwrap_or(kind);
        let fault = Fault {
            kind,
            target: injected.target,
            t_start,
            t_end: now_us(),
            detail: injected.detail,
            keys: injected.keys,
        };
        eprintln!(
            "fault {} on {}: {}",
            kind.name(),
            fault.target,
            fault.detail
        );
        log.write(&Event::Fault(fault))?;
        let healed = tokio::time::Instant::now();
        last_heal = Some(healed);
        tokio::select! {
            () = quiet(healed + args.heal) => {}
            () = &mut interrupt => return quiet_tail(last_heal, tail).await,
        }
    }
    tokio::select! {
        () = quiet(end) => Ok(()),
        () = &mut interrupt => quiet_tail(last_heal, tail).await,
    }
}

/// After an interrupt: the quiet time after the last fault, unless
/// interrupted again.
async fn quiet_tail(
    last_heal: Option<tokio::time::Instant>,
    tail: Duration,
) -> Result<(), RunError> {
    if let Some(healed) = last_heal {
        eprintln!(
            "interrupted: letting the last fault heal for {} ms (interrupt again to skip)",
            tail.as_millis()
        );
        tokio::select! {
            () = tokio::time::sleep_until(healed + tail) => {}
            () = interrupted() => {}
        }
    }
    Ok(())
}

/// The worker processes. Dropping this kills those still running.
struct Workers {
    procs: Vec<Proc>,
}

struct Proc {
    index: u32,
    child: Child,
    stdin: Option<ChildStdin>,
}

impl Workers {
    async fn spawn(
        args: &RunArgs,
        exe: &Path,
        dir: &Path,
        server: &LockServer,
        fence_table: &str,
        keys: &[String],
    ) -> Result<Self, RunError> {
        let mut workers = Self { procs: Vec::new() };
        for index in 0..args.procs {
            let stderr = std::fs::File::create(dir.join(format!("worker-{index}.stderr")))?;
            let mut command = Command::new(exe);
            command
                .arg("worker")
                .args(["--backend", args.backend.name()])
                .args(["--lock-url", &server.worker_url()])
                .args(["--fence-url", &args.fence_url])
                .args(["--fence-table", fence_table])
                .args(["--keys", &keys.join(",")])
                .args(["--worker", &index.to_string()])
                .args(["--tasks", &args.tasks.to_string()])
                .args(["--ttl", &format_duration(args.ttl)])
                .args(["--hold", &format_duration(args.hold)])
                .args(["--grace", &format_duration(args.grace)])
                .arg("--log")
                .arg(dir.join(format!("worker-{index}.jsonl")))
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::from(stderr))
                // Its own process group: a Ctrl-C here reaches the
                // coordinator only, which then stops the workers in order.
                .process_group(0)
                .kill_on_drop(true);
            let mut child = command.spawn()?;
            let stdin = child.stdin.take();
            let stdout = child.stdout.take();
            workers.procs.push(Proc {
                index,
                child,
                stdin,
            });
            let ready = async {
                let mut lines = BufReader::new(stdout?).lines();
                let first = lines.next_line().await.ok()??;
                // Keep draining, so that the pipe never fills.
                tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
                (first == "ready").then_some(())
            };
            if tokio::time::timeout(READY_WAIT, ready)
                .await
                .ok()
                .flatten()
                .is_none()
            {
                return Err(RunError::WorkerNotReady {
                    worker: index,
                    log: dir
                        .join(format!("worker-{index}.stderr"))
                        .display()
                        .to_string(),
                });
            }
        }
        Ok(workers)
    }

    /// SIGSTOP of worker `index` for `stop_for`, then SIGCONT.
    async fn stop_one(&self, index: usize, stop_for: Duration) -> Result<String, RunError> {
        let pid = self.procs[index]
            .child
            .id()
            .ok_or_else(|| io::Error::other(format!("worker {index} has exited")))?;
        signal(pid, Signal::SIGSTOP)?;
        tokio::time::sleep(stop_for).await;
        signal(pid, Signal::SIGCONT)?;
        Ok(format!("pid {pid} stopped for {} ms", stop_for.as_millis()))
    }

    /// SIGTERM to every worker; each has the grace plus [`EXIT_SLACK`] to
    /// exit with status 0, else it is killed. Logs how each ended.
    async fn stop(&mut self, args: &RunArgs, log: &LogWriter) -> Result<(), RunError> {
        for proc in &self.procs {
            if let Some(pid) = proc.child.id() {
                let _ = signal(pid, Signal::SIGCONT);
                let _ = signal(pid, Signal::SIGTERM);
            }
        }
        let deadline = tokio::time::Instant::now() + args.grace + EXIT_SLACK;
        for proc in &mut self.procs {
            let (graceful, status) =
                match tokio::time::timeout_at(deadline, proc.child.wait()).await {
                    Ok(Ok(status)) => (status.success(), status.to_string()),
                    Ok(Err(error)) => (false, format!("wait failed: {error}")),
                    Err(_) => {
                        let _ = proc.child.start_kill();
                        let _ = proc.child.wait().await;
                        (
                            false,
                            "killed: did not exit in time after SIGTERM".to_owned(),
                        )
                    }
                };
            proc.stdin = None;
            log.write(&Event::WorkerExit {
                worker: proc.index,
                graceful,
                status,
                t: now_us(),
            })?;
        }
        Ok(())
    }
}

impl Drop for Workers {
    fn drop(&mut self) {
        for proc in &mut self.procs {
            // `id()` is `None` once the child was reaped: only our own
            // running children are signalled, never a reused pid.
            if let Some(pid) = proc.child.id() {
                let _ = signal(pid, Signal::SIGCONT);
                let _ = proc.child.start_kill();
            }
        }
    }
}

/// The fence table, dropped at the end of the run or, on any other exit,
/// when the guard is dropped.
struct FenceGuard {
    store: Option<FenceStore>,
    url: String,
}

impl FenceGuard {
    fn new(store: FenceStore, url: &str) -> Self {
        Self {
            store: Some(store),
            url: url.to_owned(),
        }
    }

    fn table(&self) -> &str {
        self.store.as_ref().map_or("", FenceStore::table)
    }

    async fn drop_now(mut self) {
        if let Some(store) = self.store.take() {
            if let Err(error) = store.drop_table().await {
                eprintln!(
                    "fence table {} left for a later run to drop: {error}",
                    store.table()
                );
            }
        }
    }
}

impl Drop for FenceGuard {
    fn drop(&mut self) {
        let Some(store) = self.store.take() else {
            return;
        };
        let (url, table) = (self.url.clone(), store.table().to_owned());
        drop(store);
        // A runtime of its own on a thread: this may run while the run's
        // runtime unwinds.
        let helper = std::thread::spawn(move || -> Result<(), RunError> {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            runtime.block_on(async {
                FenceStore::connect(&url, &table, 1)?.drop_table().await?;
                Ok(())
            })
        });
        if let Ok(Err(error)) = helper.join() {
            eprintln!("fence table left for a later run to drop: {error}");
        }
    }
}

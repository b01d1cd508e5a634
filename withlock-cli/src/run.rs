//! `withlock run`: take the lock, run the command under it, map what
//! happened to an exit code.

use std::io::IsTerminal;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use lock_core::{LockConfig, LockContext, LockError, LockerOptions, MAX_KEY_LEN};
use nix::sys::signal::Signal;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::args::RunArgs;
use crate::child::{Job, Outcome, Signals, Stopped};
use crate::exit::{self, Failure};
use crate::format::{kept_text, ttl_text, Shown};
use crate::group::Swept;
use crate::record::{self, Record};
use crate::store::{Scheme, Store};
use lock_core::ErrorChain;

/// How long the locker may take to hand back what it holds at exit.
const SHUTDOWN_GRACE: Duration = Duration::from_millis(500);
/// How often the waiting status line is redrawn.
const STATUS_EVERY: Duration = Duration::from_secs(1);

/// Runs `withlock run` and gives the exit code.
pub(crate) async fn run(args: RunArgs) -> Result<u8, Failure> {
    // Everything that can be checked is, before anything is touched: the
    // arguments, and the command (found on PATH, or 127/126).
    Scheme::of(&args.store.url)?;
    if args.key.len() > MAX_KEY_LEN {
        return Err(Failure::usage(format!(
            "--key is {} bytes long; the maximum is {MAX_KEY_LEN}",
            args.key.len()
        )));
    }
    let config = lock_config(&args)?;
    let store_wait = store_wait(&args, &config);
    // Should withlock die, the group is ended before the lock can expire:
    // it was extended at most a third of the ttl before.
    let orphan_grace = args.grace.min(args.ttl / 3);
    let job = Job::find(args.command, args.grace, orphan_grace, args.max_runtime)?;
    let host = hostname();
    let node_id = args.node_id.unwrap_or_else(|| default_node_id(&host));
    let record = Arc::new(Record::new(args.log_format, &args.key, host, &node_id));

    // Signals are ours from here on: forwarded, or the end of the wait.
    let mut signals = Signals::install()
        .map_err(|e| Failure::new(exit::SOFTWARE, format!("cannot handle signals: {e}")))?;
    // The wait counts from here: `--wait` bounds the whole of it, a store
    // waited for (etcd electing a leader) included.
    let waited = Instant::now();
    let store = Store::open_within(&args.store, store_wait)
        .await
        .map_err(did_not_run)?;
    let locker = store
        .locker(LockerOptions::default().node_id(node_id))
        .map_err(|e| Failure::usage(format!("--node-id: {}", ErrorChain(&e))))?;

    let shared = Arc::new(Shared::default());
    let (done_tx, mut done_rx) = oneshot::channel();
    let callback = {
        let shared = Arc::clone(&shared);
        let record = Arc::clone(&record);
        move |ctx: LockContext| {
            // Spawned before the first await, so that a signal handled by
            // the caller always finds the phase up to date; on the main
            // thread (see `Job::spawn`).
            let spawned = {
                let mut state = shared.lock();
                state.clear_line();
                let spawned = job.spawn(&ctx);
                state.phase = match &spawned {
                    Ok(running) => Phase::Running(running.forwarder()),
                    Err(_) => Phase::Finished,
                };
                spawned
            };
            if spawned.is_ok() {
                record.started(ctx.fencing_token(), waited.elapsed());
            }
            async move {
                let outcome = match spawned {
                    Ok(running) => Ok(running.supervise(&ctx, &job).await),
                    Err(error) => Err(error),
                };
                shared.lock().phase = Phase::Finished;
                let _ = done_tx.send(Done {
                    token: ctx.fencing_token(),
                    waited: waited.elapsed(),
                    outcome,
                });
            }
        }
    };

    let status = (!args.quiet && std::io::stderr().is_terminal())
        .then(|| status_line(store.clone(), args.key.clone(), Arc::clone(&shared)));
    // `--wait`: the end of the wait, past which a call still waiting gives
    // up (one that runs the command goes on). None once it passed.
    let mut gives_up_at = args.wait.filter(|w| !w.is_zero()).map(|w| waited + w);
    let mut call = Box::pin(locker.with_lock_config(&args.key, &config, callback));
    let result = loop {
        tokio::select! {
            biased;
            result = &mut call => break Ended::Call(result),
            signal = signals.next() => {
                let phase = shared.lock().phase.clone();
                match phase {
                    Phase::Waiting => break Ended::Signal(signal),
                    Phase::Running(forward) => {
                        let _ = forward.send(signal);
                    }
                    Phase::Finished => {}
                }
            }
            () = tokio::time::sleep_until(gives_up_at.unwrap_or(waited)), if gives_up_at.is_some() => {
                gives_up_at = None;
                if shared.lock().phase == Phase::Waiting {
                    break Ended::WaitOver;
                }
            }
        }
    };
    // Dropping the call while it waits leaves nothing held.
    drop(call);
    if let Some(status) = status {
        status.abort();
    }
    shared.lock().clear_line();

    let busy =
        |holder: Option<&str>| End::busy(&args.key, holder, waited, args.busy_exit, args.quiet);
    let end = match result {
        Ended::WaitOver => match wait_over(&store, &args.key).await {
            Ok(holder) => busy(holder.as_deref()),
            Err(failure) => End::failed(failure, waited, "backend"),
        },
        Ended::Signal(signal) => End {
            code: exit::signalled(signal as i32),
            message: Some(format!(
                "got {signal} while waiting for {:?}; the command did not run",
                args.key
            )),
            cause: Some(format!("{signal} while waiting")),
            ..End::new(waited)
        },
        Ended::Call(Ok(())) => match done_rx.try_recv() {
            Ok(done) => held_throughout(done),
            Err(_) => End::failed(
                Failure::new(exit::SOFTWARE, "the command's outcome was lost"),
                waited,
                "software",
            ),
        },
        Ended::Call(Err(LockError::Lost { key, cause })) => {
            // The callback goes on in the background, terminating the
            // command; signals still reach the command meanwhile.
            let done = loop {
                tokio::select! {
                    biased;
                    done = &mut done_rx => break done.ok(),
                    signal = signals.next() => {
                        if let Phase::Running(forward) = shared.lock().phase.clone() {
                            let _ = forward.send(signal);
                        }
                    }
                }
            };
            lost(&key, &cause, done, waited)
        }
        Ended::Call(Err(LockError::NotAcquired { source: None, .. })) => {
            busy(holder(&store, &args.key).await.as_deref())
        }
        Ended::Call(Err(error)) => {
            End::failed(not_run(&store, &args.key, &error), waited, "backend")
        }
    };
    locker.shutdown(SHUTDOWN_GRACE).await;
    if !end.silent {
        record.ended(&record::Ended {
            token: end.token,
            waited: end.waited,
            ran: end.ran,
            exit: end.code,
            cause: end.cause.as_deref(),
        });
    }
    if let Some(message) = &end.message {
        eprintln!("withlock: {message}");
    }
    Ok(end.code)
}

/// What the callback hands back.
#[derive(Debug)]
struct Done {
    token: u64,
    /// From the start to the lock being taken.
    waited: Duration,
    outcome: std::io::Result<Outcome>,
}

/// How a run that tried the lock ends: its exit code, the line for stderr,
/// and what the record says.
#[derive(Debug)]
struct End {
    code: u8,
    message: Option<String>,
    cause: Option<String>,
    token: Option<u64>,
    waited: Duration,
    ran: Option<Duration>,
    /// Nothing is said of it, not even the `--log-format` record: a busy
    /// lock with `-q`, so that the hosts that lose a cron job's lock
    /// send no mail.
    silent: bool,
}

impl End {
    fn new(waited: Instant) -> Self {
        Self {
            code: 0,
            message: None,
            cause: None,
            token: None,
            waited: waited.elapsed(),
            ran: None,
            silent: false,
        }
    }

    fn failed(failure: Failure, waited: Instant, cause: &str) -> Self {
        Self {
            code: failure.code,
            message: Some(failure.message),
            cause: Some(cause.to_owned()),
            ..Self::new(waited)
        }
    }

    /// The key was found held until the caller gave up after `waited`:
    /// `busy_exit`, said on stderr (and in the `--log-format` record)
    /// unless `quiet`.
    fn busy(key: &str, holder: Option<&str>, waited: Instant, busy_exit: u8, quiet: bool) -> Self {
        let holder = holder
            .map(|node| format!(" (held by {})", Shown(node)))
            .unwrap_or_default();
        Self {
            code: busy_exit,
            message: (!quiet).then(|| {
                format!(
                    "{key:?} is busy{holder}; gave up after {}; the command did not run",
                    ttl_text(waited.elapsed())
                )
            }),
            cause: Some("busy".to_owned()),
            silent: quiet,
            ..Self::new(waited)
        }
    }
}

/// How the wait for the lock ended.
enum Ended {
    /// The call settled.
    Call(Result<(), LockError>),
    /// A signal came while the call waited for the lock.
    Signal(nix::sys::signal::Signal),
    /// `--wait` ran out while the call waited for the lock.
    WaitOver,
}

/// Who holds the key, once `--wait` ran out: Ok with the holder (None if
/// the store names none), or a failure if the store cannot say.
async fn wait_over(store: &Store, key: &str) -> Result<Option<String>, Failure> {
    match tokio::time::timeout(Duration::from_secs(1), store.admin().inspect(key)).await {
        Ok(Ok(view)) => Ok(holder_text(&view)),
        // A lock user that may not read the key as an operator does (on
        // Redis, PTTL and TYPE): busy, holder unknown.
        Ok(Err(error)) if crate::setup::refusal(&error).is_some() => Ok(None),
        Ok(Err(error)) => {
            let failure = Failure::backend(store.name(), &error);
            Err(Failure::new(
                failure.code,
                format!(
                    "could not take the lock on {key:?}: {}; the command did not run",
                    failure.message
                ),
            ))
        }
        Err(_) => Err(Failure::new(
            exit::UNAVAILABLE,
            format!(
                "could not take the lock on {key:?}: {} did not answer; the command did not run",
                store.name()
            ),
        )),
    }
}

/// The holder of a busy key, if the store says so within a second.
async fn holder(store: &Store, key: &str) -> Option<String> {
    match tokio::time::timeout(Duration::from_secs(1), store.admin().inspect(key)).await {
        Ok(Ok(view)) => holder_text(&view),
        _ => None,
    }
}

/// The holder's node id, and for a lock kept by its minimum hold \[H7\]
/// until when: `web-2:41873, kept until 2025-06-01T03:05:00Z (4m 58s left)
/// after its run ended` (a job that ran already, not one running).
fn holder_text(view: &lock_core::LockInfo) -> Option<String> {
    let node = view.node_id()?;
    Some(match kept_text(view, std::time::SystemTime::now()) {
        Some(kept) => format!("{node}, {kept}"),
        None => node.to_owned(),
    })
}

/// A failure before the command could start, saying so.
fn did_not_run(failure: Failure) -> Failure {
    if failure.code == exit::USAGE {
        return failure;
    }
    Failure::new(
        failure.code,
        format!("{}; the command did not run", failure.message),
    )
}

/// The end of a run whose lock held until the callback settled.
fn held_throughout(done: Done) -> End {
    let Done {
        token,
        waited,
        outcome,
    } = done;
    let base = End {
        token: Some(token),
        waited,
        ..End::new(Instant::now())
    };
    let outcome = match outcome {
        Ok(outcome) => outcome,
        Err(error) => {
            return End {
                code: exit::SOFTWARE,
                message: Some(format!("cannot start the command's supervisor: {error}")),
                cause: Some("software".to_owned()),
                ..base
            }
        }
    };
    let swept = match outcome.swept {
        Swept::Empty => None,
        Swept::Terminated => Some("what the command left running was terminated"),
        Swept::Killed => Some("what the command left running was killed"),
    };
    let ran = Some(outcome.ran);
    let status = match outcome.status {
        Ok(status) => status,
        Err(error) => {
            return End {
                code: exit::SOFTWARE,
                message: Some(format!("lost track of the command: {error}")),
                cause: Some("software".to_owned()),
                ran,
                ..base
            }
        }
    };
    match outcome.stopped {
        None => End {
            code: status.exit_code(),
            cause: swept.map(str::to_owned),
            ran,
            ..base
        },
        Some(Stopped::TimedOut(limit)) => End {
            code: exit::TIMED_OUT,
            message: Some(format!(
                "the command ran past --max-runtime {}; it was terminated ({status})",
                humantime::format_duration(limit)
            )),
            cause: Some("max-runtime".to_owned()),
            ran,
            ..base
        },
        // `with_lock` gave Ok, so the lock held; a lost lock cannot come
        // with Ok, and counts as lost if it ever did.
        Some(Stopped::Lost(cause)) => End {
            code: exit::LOST,
            message: Some(format!(
                "lost the lock while the command ran ({}); the command was terminated ({status})",
                ErrorChain(&cause)
            )),
            cause: Some(format!("lost: {cause}")),
            ran,
            ..base
        },
    }
}

/// The end of a run whose lock was lost while the command ran; `done` is
/// what the callback handed back once the command was stopped.
fn lost(key: &str, cause: &lock_core::LossCause, done: Option<Done>, waited: Instant) -> End {
    let (token, waited, command, ran) = match done {
        Some(Done {
            token,
            waited,
            outcome: Ok(outcome),
        }) => {
            let command = match (&outcome.stopped, &outcome.status) {
                (Some(_), Ok(status)) => format!("the command was terminated ({status})"),
                (None, Ok(status)) => format!("the command had exited ({status})"),
                (_, Err(error)) => format!("the command was killed (lost track of it: {error})"),
            };
            (Some(token), waited, command, Some(outcome.ran))
        }
        Some(Done { token, waited, .. }) => (
            Some(token),
            waited,
            "the command did not start".to_owned(),
            None,
        ),
        None => (
            None,
            waited.elapsed(),
            "the command was killed".to_owned(),
            None,
        ),
    };
    End {
        code: exit::LOST,
        message: Some(format!(
            "lost the lock on {key:?} while the command ran ({}); {command}",
            ErrorChain(cause)
        )),
        cause: Some(format!("lost: {cause}")),
        token,
        waited,
        ran,
        silent: false,
    }
}

/// Why the command never ran, as a failure with its exit code: 69 for
/// an outage, 77 or 78 for a refusal trying again cannot mend.
fn not_run(store: &Store, key: &str, error: &LockError) -> Failure {
    match error {
        LockError::NotAcquired {
            attempts,
            source: Some(source),
            ..
        } => {
            let failure = Failure::backend(store.name(), source);
            let tries = if source.is_permanent() {
                String::new()
            } else {
                format!(" ({attempts} attempt(s))")
            };
            Failure::new(
                failure.code,
                format!(
                    "could not take the lock on {key:?}{tries}: {}; the command did not run",
                    failure.message
                ),
            )
        }
        LockError::InvalidInput(invalid) => Failure::usage(invalid.to_string()),
        other => Failure::new(exit::SOFTWARE, ErrorChain(other).to_string()),
    }
}

/// The lock config the arguments ask for, validated.
fn lock_config(args: &RunArgs) -> Result<LockConfig, Failure> {
    let mut config = LockConfig::default().ttl(args.ttl);
    if let Some(minimum) = args.lock_at_least {
        config = config.hold_at_least(minimum);
    }
    if args.no_queue {
        config = config.no_queue();
    }
    if args.no_wait {
        config = config.retry_attempts(0);
    } else if args.wait_forever {
        config = config.wait_forever();
    } else if let Some(wait) = args.wait {
        // Enough retries to last the whole wait however the jitter falls
        // (as many as fit at the shortest jittered delay); `run` gives up
        // at the end of the wait, so that the wait is the one asked for,
        // not the sum of the delays drawn.
        let shortest = config.retry_delay.saturating_sub(config.retry_jitter);
        let retries = wait.as_nanos().div_ceil(shortest.as_nanos().max(1));
        config = config.retry_attempts(u32::try_from(retries).unwrap_or(u32::MAX));
    }
    config.validate().map_err(|e| match e {
        lock_core::InvalidInput::HoldTooLong { .. } => {
            Failure::usage(format!("--lock-at-least: {e}"))
        }
        e => Failure::usage(format!("--ttl: {e}")),
    })?;
    Ok(config)
}

/// How long opening the store may wait for it (etcd's leader): as long
/// as the lock may be waited for, which the lock config already says:
/// `--wait`, none for `--no-wait` (the store's own connect timeout still
/// applies), without end for `--wait-forever`, the library's retries
/// (about 2 s) by default.
fn store_wait(args: &RunArgs, config: &LockConfig) -> Duration {
    args.wait.unwrap_or(match config.retry_attempts {
        lock_core::RetryAttempts::Limited(n) => config.retry_delay.saturating_mul(n),
        // Far enough to be forever, near enough to add to an Instant.
        lock_core::RetryAttempts::Unlimited => Duration::from_secs(u64::from(u32::MAX)),
    })
}

/// This host's name, for the node id and the record.
fn hostname() -> String {
    nix::unistd::gethostname()
        .ok()
        .and_then(|h| h.into_string().ok())
        .filter(|h| !h.is_empty() && !h.chars().any(char::is_control))
        .unwrap_or_else(|| "withlock".to_owned())
}

/// `<hostname>:<pid>`, so that `withlock list` tells which host holds a key.
fn default_node_id(host: &str) -> String {
    format!("{host}:{}", std::process::id())
}

/// Where the command is, shared by the caller (which hands signals on) and
/// the callback (which runs the command).
#[derive(Debug, Default)]
struct Shared {
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    phase: Phase,
    /// A status line is on stderr now.
    line_shown: bool,
}

#[derive(Clone, Debug, Default)]
enum Phase {
    /// Waiting for the lock: a signal ends the wait.
    #[default]
    Waiting,
    /// The command runs: signals go to its supervisor's watch, which
    /// forwards them to its group.
    Running(mpsc::UnboundedSender<Signal>),
    /// The command has exited or never started.
    Finished,
}

impl PartialEq for Phase {
    fn eq(&self, other: &Self) -> bool {
        std::mem::discriminant(self) == std::mem::discriminant(other)
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl State {
    fn clear_line(&mut self) {
        if self.line_shown {
            eprint!("\r\x1b[K");
            self.line_shown = false;
        }
    }
}

/// Redraws a one-line status on stderr every second while waiting: the
/// key, who holds it and how long we have waited.
fn status_line(store: Store, key: String, shared: Arc<Shared>) -> JoinHandle<()> {
    tokio::spawn(async move {
        let started = Instant::now();
        loop {
            tokio::time::sleep(STATUS_EVERY).await;
            let holder = match tokio::time::timeout(STATUS_EVERY, store.admin().inspect(&key)).await
            {
                Ok(Ok(view)) => match (view.node_id(), view.ttl) {
                    (Some(_), _) if view.is_kept() => {
                        format!("held by {}", holder_text(&view).unwrap_or_default())
                    }
                    (Some(node), Some(ttl)) => format!("held by {node}, {} left", ttl_text(ttl)),
                    (Some(node), None) => format!("held by {node}"),
                    (None, _) => "free, taking it".to_owned(),
                },
                Ok(Err(error)) => format!("{} failed: {error}", store.name()),
                Err(_) => format!("{} does not answer", store.name()),
            };
            let mut state = shared.lock();
            if state.phase != Phase::Waiting {
                return;
            }
            eprint!(
                "\r\x1b[Kwithlock: waiting for {}: {holder} (waited {})",
                Shown(&key),
                ttl_text(started.elapsed())
            );
            state.line_shown = true;
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    fn config_of(extra: &[&str]) -> Result<LockConfig, Failure> {
        let mut argv = vec!["withlock", "run", "--url", "redis://x", "--key", "k"];
        argv.extend_from_slice(extra);
        argv.extend_from_slice(&["--", "true"]);
        let cli = crate::args::Cli::try_parse_from(argv).unwrap();
        let crate::args::Command::Run(args) = cli.command else {
            unreachable!()
        };
        lock_config(&args)
    }

    #[test]
    fn waiting_options_map_to_retries() {
        use lock_core::RetryAttempts;
        assert_eq!(config_of(&[]).unwrap(), LockConfig::default());
        assert_eq!(
            config_of(&["--no-wait"]).unwrap().retry_attempts,
            RetryAttempts::Limited(0)
        );
        assert_eq!(
            config_of(&["--wait-forever"]).unwrap().retry_attempts,
            RetryAttempts::Unlimited
        );
        // Enough retries for the whole wait at the shortest jittered
        // delay (200 ms less 100 ms of jitter); `run` ends the wait.
        assert_eq!(
            config_of(&["--wait", "2s"]).unwrap().retry_attempts,
            RetryAttempts::Limited(20)
        );
        assert_eq!(
            config_of(&["--wait", "250ms"]).unwrap().retry_attempts,
            RetryAttempts::Limited(3)
        );
        assert_eq!(
            config_of(&["--wait", "0s"]).unwrap().retry_attempts,
            RetryAttempts::Limited(0)
        );
        // The fair queue by default [F1]; --no-queue opts out.
        assert!(config_of(&["--wait-forever"]).unwrap().fair_queue.is_some());
        assert_eq!(
            config_of(&["--wait-forever", "--no-queue"])
                .unwrap()
                .fair_queue,
            None
        );
    }

    #[test]
    fn a_ttl_too_short_is_a_usage_error() {
        let failure = config_of(&["--ttl", "10ms"]).unwrap_err();
        assert_eq!(failure.code, exit::USAGE);
        assert!(failure.message.contains("--ttl"));
    }

    #[test]
    fn the_default_node_id_names_the_host_and_process() {
        let id = default_node_id(&hostname());
        assert!(id.ends_with(&format!(":{}", std::process::id())));
        assert!(LockerOptions::default().node_id(id).node_id.is_some());
    }
}

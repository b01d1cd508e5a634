//! `withlock run`: take the lock, run the command under it, map what
//! happened to an exit code.

use std::io::IsTerminal;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use lock_core::{LockConfig, LockContext, LockError, LockerOptions, MAX_KEY_LEN};
use nix::unistd::Pid;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::args::RunArgs;
use crate::child::{signal_group, Job, Outcome, Signals};
use crate::exit::{self, Chain, Failure};
use crate::format::{ttl_text, Shown};
use crate::store::{Scheme, Store};

/// How long the locker may take to hand back what it holds at exit.
const SHUTDOWN_GRACE: Duration = Duration::from_millis(500);
/// How often the waiting status line is redrawn.
const STATUS_EVERY: Duration = Duration::from_secs(1);

/// Runs `withlock run` and gives the exit code.
pub(crate) async fn run(args: RunArgs) -> Result<u8, Failure> {
    // Everything that can be checked is, before anything is touched.
    Scheme::of(&args.store.url)?;
    if args.key.len() > MAX_KEY_LEN {
        return Err(Failure::usage(format!(
            "--key is {} bytes long; the maximum is {MAX_KEY_LEN}",
            args.key.len()
        )));
    }
    let config = lock_config(&args)?;
    let mut command = args.command.into_iter();
    let program = command
        .next()
        .ok_or_else(|| Failure::usage("no command after `--`"))?;
    let job = Job {
        program,
        args: command.collect(),
        grace: args.grace,
    };
    let node_id = args.node_id.unwrap_or_else(default_node_id);

    // Signals are ours from here on: forwarded, or the end of the wait.
    let mut signals = Signals::install()
        .map_err(|e| Failure::new(exit::SOFTWARE, format!("cannot handle signals: {e}")))?;
    let store = Store::open(&args.store).await.map_err(did_not_run)?;
    let locker = store
        .locker(LockerOptions::default().node_id(node_id))
        .map_err(|e| Failure::usage(format!("--node-id: {}", Chain(&e))))?;
    store.create_table().await.map_err(did_not_run)?;

    let shared = Arc::new(Shared::default());
    let (done_tx, mut done_rx) = oneshot::channel();
    let callback = {
        let shared = Arc::clone(&shared);
        move |ctx: LockContext| {
            // Spawned before the first await, so that a signal handled by
            // the caller always finds the phase up to date.
            let spawned = {
                let mut state = shared.lock();
                state.clear_line();
                let spawned = job.spawn(&ctx);
                state.phase = match &spawned {
                    Ok(running) => Phase::Running(running.group()),
                    Err(_) => Phase::Finished,
                };
                spawned
            };
            async move {
                let outcome = match spawned {
                    Ok(running) => running.supervise(&ctx, job.grace).await,
                    Err(error) => Outcome::NotStarted(error),
                };
                shared.lock().phase = Phase::Finished;
                let _ = done_tx.send(outcome);
            }
        }
    };

    let status = (!args.quiet && std::io::stderr().is_terminal())
        .then(|| status_line(store.clone(), args.key.clone(), Arc::clone(&shared)));
    let waited = Instant::now();
    // `--wait`: the end of the wait, past which a call still waiting gives
    // up (one that runs the command goes on). None once it passed.
    let mut gives_up_at = args.wait.filter(|w| !w.is_zero()).map(|w| waited + w);
    let mut call = Box::pin(locker.with_lock_config(&args.key, &config, callback));
    let result = loop {
        tokio::select! {
            biased;
            result = &mut call => break Ended::Call(result),
            signal = signals.next() => {
                let phase = shared.lock().phase;
                match phase {
                    Phase::Waiting => break Ended::Signal(signal),
                    Phase::Running(group) => signal_group(group, signal),
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

    let code = match result {
        Ended::WaitOver => Err(wait_over(&store, &args.key, waited).await),
        Ended::Signal(signal) => {
            eprintln!(
                "withlock: got {signal} while waiting for {:?}; the command did not run",
                args.key
            );
            Ok(exit::signalled(signal as i32))
        }
        Ended::Call(Ok(())) => match done_rx.try_recv() {
            Ok(outcome) => Ok(held_throughout(outcome)),
            Err(_) => Err(Failure::new(
                exit::SOFTWARE,
                "the command's outcome was lost",
            )),
        },
        Ended::Call(Err(LockError::Lost { key, cause })) => {
            // The callback goes on in the background, terminating the
            // command; signals still reach the command meanwhile.
            let outcome = loop {
                tokio::select! {
                    biased;
                    outcome = &mut done_rx => break outcome.ok(),
                    signal = signals.next() => {
                        if let Phase::Running(group) = shared.lock().phase {
                            signal_group(group, signal);
                        }
                    }
                }
            };
            let command = match outcome {
                Some(Outcome::Terminated(status)) => {
                    format!("the command was terminated ({status})")
                }
                Some(Outcome::Exited(status)) => format!("the command had exited ({status})"),
                _ => "the command was killed".to_owned(),
            };
            eprintln!(
                "withlock: lost the lock on {key:?} while the command ran ({}); {command}",
                Chain(&cause)
            );
            Ok(exit::LOST)
        }
        Ended::Call(Err(error)) => Err(not_run(&store, &args.key, &error, waited).await),
    };
    locker.shutdown(SHUTDOWN_GRACE).await;
    code
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

/// Why the command never ran when `--wait` ran out: the key is busy, or
/// the store cannot say who holds it.
async fn wait_over(store: &Store, key: &str, waited: Instant) -> Failure {
    match tokio::time::timeout(Duration::from_secs(1), store.admin().inspect(key)).await {
        Ok(Ok(view)) => busy(key, view.node_id(), waited),
        Ok(Err(error)) => Failure::new(
            exit::UNAVAILABLE,
            format!(
                "could not take the lock on {key:?}: {} failed: {}; the command did not run",
                store.name(),
                Chain(&error)
            ),
        ),
        Err(_) => Failure::new(
            exit::UNAVAILABLE,
            format!(
                "could not take the lock on {key:?}: {} did not answer; the command did not run",
                store.name()
            ),
        ),
    }
}

/// The key was found held until the caller gave up after `waited`.
fn busy(key: &str, holder: Option<&str>, waited: Instant) -> Failure {
    let holder = holder
        .map(|node| format!(" (held by {node})"))
        .unwrap_or_default();
    Failure::new(
        exit::BUSY,
        format!(
            "{key:?} is busy{holder}; gave up after {}; the command did not run",
            ttl_text(waited.elapsed())
        ),
    )
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

/// The exit code of a command that ran while the lock was held.
fn held_throughout(outcome: Outcome) -> u8 {
    use std::os::unix::process::ExitStatusExt;
    match outcome {
        // `with_lock` gave Ok, so the lock held; a Terminated outcome
        // cannot come with Ok, and counts as lost if it ever did.
        Outcome::Terminated(_) => exit::LOST,
        Outcome::Exited(status) => match (status.code(), status.signal()) {
            (Some(code), _) => u8::try_from(code & 0xff).unwrap_or(u8::MAX),
            (None, Some(signal)) => exit::signalled(signal),
            (None, None) => exit::SOFTWARE,
        },
        Outcome::NotStarted(error) => {
            eprintln!("withlock: cannot run the command: {error}");
            match error.kind() {
                std::io::ErrorKind::NotFound => exit::NOT_FOUND,
                _ => exit::CANNOT_EXECUTE,
            }
        }
        Outcome::Unknown(error) => {
            eprintln!("withlock: lost track of the command: {error}");
            exit::SOFTWARE
        }
    }
}

/// Why the command never ran, as a failure with its exit code.
async fn not_run(store: &Store, key: &str, error: &LockError, waited: Instant) -> Failure {
    match error {
        LockError::NotAcquired { source: None, .. } => {
            let view = tokio::time::timeout(Duration::from_secs(1), store.admin().inspect(key)).await;
            let holder = match &view {
                Ok(Ok(view)) => view.node_id(),
                _ => None,
            };
            busy(key, holder, waited)
        }
        LockError::NotAcquired {
            attempts,
            source: Some(source),
            ..
        } => Failure::new(
            exit::UNAVAILABLE,
            format!(
                "could not take the lock on {key:?}: {} failed ({attempts} attempt(s)): {}; the command did not run",
                store.name(),
                Chain(source)
            ),
        ),
        LockError::InvalidInput(invalid) => Failure::usage(invalid.to_string()),
        other => Failure::new(exit::SOFTWARE, Chain(other).to_string()),
    }
}

/// The lock config the arguments ask for, validated.
fn lock_config(args: &RunArgs) -> Result<LockConfig, Failure> {
    let mut config = LockConfig::default().ttl(args.ttl);
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
    config
        .validate()
        .map_err(|e| Failure::usage(format!("--ttl: {e}")))?;
    Ok(config)
}

/// `<hostname>:<pid>`, so that `withlock list` tells which host holds a key.
fn default_node_id() -> String {
    let host = nix::unistd::gethostname()
        .ok()
        .and_then(|h| h.into_string().ok())
        .filter(|h| !h.is_empty() && !h.chars().any(char::is_control))
        .unwrap_or_else(|| "withlock".to_owned());
    format!("{host}:{}", std::process::id())
}

/// Where the command is, shared by the caller (which forwards signals) and
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

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
enum Phase {
    /// Waiting for the lock: a signal ends the wait.
    #[default]
    Waiting,
    /// The command runs in this process group: signals go there.
    Running(Pid),
    /// The command has exited or never started.
    Finished,
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
    }

    #[test]
    fn a_ttl_too_short_is_a_usage_error() {
        let failure = config_of(&["--ttl", "10ms"]).unwrap_err();
        assert_eq!(failure.code, exit::USAGE);
        assert!(failure.message.contains("--ttl"));
    }

    #[test]
    fn the_default_node_id_names_the_host_and_process() {
        let id = default_node_id();
        assert!(id.ends_with(&format!(":{}", std::process::id())));
        assert!(LockerOptions::default().node_id(id).node_id.is_some());
    }
}

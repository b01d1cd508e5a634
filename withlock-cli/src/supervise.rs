//! `withlock __supervise`: the process `run` starts the command through,
//! so that the command dies with withlock.
//!
//! `run` starts it (from its main thread) as the leader of a new process
//! group. It then:
//!
//! 1. listens for SIGTERM, SIGINT and SIGHUP, so that none of them ends it;
//! 2. asks the kernel for SIGTERM when its parent dies
//!    (`PR_SET_PDEATHSIG`, Linux only; the signal follows the parent
//!    *thread*, hence the main thread);
//! 3. checks that its parent is still `--parent`: one that died before step
//!    2 sends no signal, and the command is not started;
//! 4. starts the command in its own group, and exits with the command's
//!    code (128 + N when it died of signal N) when it exits.
//!
//! A signal `run` forwards reaches the whole group, this process too,
//! which ignores it while its parent lives. When its parent has died (the
//! death signal, or a look each second), it terminates the group: SIGTERM,
//! then SIGKILL after `--grace`, which ends it too. Needs no `unsafe`:
//! `prctl` and `getppid` through nix.

use std::process::ExitCode;
use std::time::Duration;

use nix::sys::signal::Signal;
use nix::unistd::{getpgrp, getpid, getppid, Pid};
use tokio::signal::unix::{signal, SignalKind};
use tokio::time::Instant;

use crate::args::SuperviseArgs;
use crate::child::check_interpreter;
use crate::exit;
use crate::group;

/// How often the parent is looked for without a signal.
const PARENT_POLL: Duration = Duration::from_secs(1);

/// Runs the supervisor to its end.
pub(crate) fn main(args: SuperviseArgs) -> ExitCode {
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("withlock: cannot start the command's supervisor: {error}");
            return ExitCode::from(exit::SOFTWARE);
        }
    };
    let code = runtime.block_on(supervise(args));
    ExitCode::from(code)
}

async fn supervise(args: SuperviseArgs) -> u8 {
    let parent = Pid::from_raw(args.parent);
    let mut signals = Vec::new();
    for kind in [
        SignalKind::terminate(),
        SignalKind::interrupt(),
        SignalKind::hangup(),
    ] {
        match signal(kind) {
            Ok(stream) => signals.push(stream),
            Err(error) => {
                eprintln!("withlock: the command's supervisor cannot handle signals: {error}");
                return exit::SOFTWARE;
            }
        }
    }
    #[cfg(target_os = "linux")]
    if let Err(error) = nix::sys::prctl::set_pdeathsig(Signal::SIGTERM) {
        eprintln!("withlock: the command's supervisor cannot watch withlock: {error}");
        return exit::SOFTWARE;
    }
    if getppid() != parent {
        // withlock died before the death signal was set: nothing started.
        return exit::signalled(Signal::SIGKILL as i32);
    }

    let mut command = args.command.into_iter();
    let Some(program) = command.next() else {
        return exit::USAGE;
    };
    let mut child = match tokio::process::Command::new(&program)
        .arg0(&args.arg0)
        .args(command)
        .spawn()
    {
        Ok(child) => child,
        Err(error) => {
            let shown = std::path::Path::new(&args.arg0).display();
            // `run` checked the interpreter; one removed since is named
            // here rather than reported as the script's own absence.
            if let Err(bad) = check_interpreter(
                std::path::Path::new(&program),
                std::env::var_os("PATH").as_deref(),
            ) {
                eprintln!("withlock: cannot run {shown}: it {bad}");
                return bad.code();
            }
            eprintln!("withlock: cannot run {shown}: {error}");
            return match error.kind() {
                std::io::ErrorKind::NotFound => exit::NOT_FOUND,
                _ => exit::CANNOT_EXECUTE,
            };
        }
    };

    let [term, int, hup] = &mut signals[..] else {
        return exit::SOFTWARE;
    };
    loop {
        tokio::select! {
            biased;
            status = child.wait() => {
                return match status {
                    Ok(status) => code_of(status),
                    Err(error) => {
                        eprintln!("withlock: lost track of the command: {error}");
                        orphaned(args.grace).await
                    }
                };
            }
            _ = term.recv() => {}
            _ = int.recv() => {}
            _ = hup.recv() => {}
            () = tokio::time::sleep(PARENT_POLL) => {}
        }
        if getppid() != parent {
            return orphaned(args.grace).await;
        }
    }
}

/// withlock is gone, and with it the lock: the group gets SIGTERM, then
/// SIGKILL after `grace` (which ends this process too).
async fn orphaned(grace: Duration) -> u8 {
    // A SIGKILL past the grace goes to the whole group, this process
    // included: nothing of the job is left.
    group::sweep(getpgrp(), Some(getpid()), Instant::now() + grace).await;
    exit::signalled(Signal::SIGTERM as i32)
}

/// The supervisor's exit code for the command's status: its code, or 128
/// + the signal that ended it.
fn code_of(status: std::process::ExitStatus) -> u8 {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(code), _) => u8::try_from(code & 0xff).unwrap_or(u8::MAX),
        (None, Some(signal)) => exit::signalled(signal),
        (None, None) => exit::SOFTWARE,
    }
}

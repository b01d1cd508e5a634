//! The command run under the lock: spawned in a process group of its own,
//! watched until it exits, terminated when the lock is lost; and the
//! signals withlock forwards to it.

use std::ffi::OsString;
use std::io;
use std::process::ExitStatus;
use std::time::Duration;

use lock_core::LockContext;
use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;
use tokio::process::{Child, Command};
use tokio::signal::unix::{signal, SignalKind};
use tokio::sync::mpsc;

/// What became of the command.
#[derive(Debug)]
pub(crate) enum Outcome {
    /// It ran and exited by itself (or of a signal withlock forwarded).
    Exited(ExitStatus),
    /// The lock was lost; it was terminated.
    Terminated(ExitStatus),
    /// It could not be started.
    NotStarted(io::Error),
    /// Waiting for it failed (it may still run; its group was killed).
    Unknown(io::Error),
}

/// The command line to run.
#[derive(Debug)]
pub(crate) struct Job {
    pub(crate) program: OsString,
    pub(crate) args: Vec<OsString>,
    /// How long it has between SIGTERM and SIGKILL after a lost lock.
    pub(crate) grace: Duration,
}

/// A running command: its process, which leads a process group of its own.
#[derive(Debug)]
pub(crate) struct Running {
    child: Child,
    group: Pid,
}

impl Job {
    /// Starts the command with the lock's key and fencing token in its
    /// environment, in a new process group, with withlock's stdin, stdout
    /// and stderr.
    ///
    /// The group lets one signal reach everything the command starts (a
    /// shell script's own children too), so that nothing of it runs on
    /// after a lost lock. The process is killed if withlock drops it.
    pub(crate) fn spawn(&self, ctx: &LockContext) -> io::Result<Running> {
        let child = Command::new(&self.program)
            .args(&self.args)
            .env("WITHLOCK_KEY", ctx.key())
            .env("WITHLOCK_FENCING_TOKEN", ctx.fencing_token().to_string())
            .process_group(0)
            .kill_on_drop(true)
            .spawn()?;
        let id = child
            .id()
            .ok_or_else(|| io::Error::other("the command exited at once"))?;
        let group = Pid::from_raw(
            i32::try_from(id).map_err(|_| io::Error::other("process id out of range"))?,
        );
        Ok(Running { child, group })
    }
}

impl Running {
    /// The command's process group.
    pub(crate) fn group(&self) -> Pid {
        self.group
    }

    /// Waits for the command to exit, or for the lock to be lost; then it
    /// gets SIGTERM, and SIGKILL after `grace`.
    pub(crate) async fn supervise(mut self, ctx: &LockContext, grace: Duration) -> Outcome {
        tokio::select! {
            biased;
            status = self.child.wait() => match status {
                Ok(status) => Outcome::Exited(status),
                Err(error) => {
                    signal_group(self.group, Signal::SIGKILL);
                    Outcome::Unknown(error)
                }
            },
            _ = ctx.lost() => match self.terminate(grace).await {
                Ok(status) => Outcome::Terminated(status),
                Err(error) => Outcome::Unknown(error),
            },
        }
    }

    /// SIGTERM to the group, SIGKILL if the command has not exited after
    /// `grace`, then SIGKILL to whatever it left in its group: the lock is
    /// gone, so nothing of the job may run on.
    async fn terminate(&mut self, grace: Duration) -> io::Result<ExitStatus> {
        signal_group(self.group, Signal::SIGTERM);
        let status = match tokio::time::timeout(grace, self.child.wait()).await {
            Ok(status) => status,
            Err(_) => {
                signal_group(self.group, Signal::SIGKILL);
                self.child.wait().await
            }
        };
        signal_group(self.group, Signal::SIGKILL);
        status
    }
}

/// Sends `signal` to the process group `group`. A group that is gone
/// already (`ESRCH`) is what we wanted; nothing else can fail here for a
/// group this process made.
pub(crate) fn signal_group(group: Pid, signal: Signal) {
    if let Err(error) = killpg(group, signal) {
        if error != nix::errno::Errno::ESRCH {
            eprintln!("withlock: could not send {signal} to the command: {error}");
        }
    }
}

/// SIGTERM, SIGINT and SIGHUP sent to withlock, as they arrive. Once made,
/// these signals no longer end the process: the receiver decides.
#[derive(Debug)]
pub(crate) struct Signals {
    rx: mpsc::UnboundedReceiver<Signal>,
}

impl Signals {
    /// Starts listening. Call it inside the runtime, before anything waits.
    pub(crate) fn install() -> io::Result<Self> {
        let (tx, rx) = mpsc::unbounded_channel();
        for (kind, which) in [
            (SignalKind::terminate(), Signal::SIGTERM),
            (SignalKind::interrupt(), Signal::SIGINT),
            (SignalKind::hangup(), Signal::SIGHUP),
        ] {
            let mut stream = signal(kind)?;
            let tx = tx.clone();
            tokio::spawn(async move {
                while stream.recv().await.is_some() {
                    if tx.send(which).is_err() {
                        return;
                    }
                }
            });
        }
        Ok(Self { rx })
    }

    /// The next signal.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: a signal not yet returned stays queued.
    pub(crate) async fn next(&mut self) -> Signal {
        match self.rx.recv().await {
            Some(signal) => signal,
            None => std::future::pending().await,
        }
    }
}

//! The command run under the lock, as `run` sees it: found on `PATH`
//! before the lock is taken, started through the supervisor (see
//! `supervise.rs`) in a process group of its own, watched until it exits,
//! terminated when the lock is lost or `--max-runtime` passes, and its
//! group swept before the lock is released. Also the signals withlock
//! forwards to it.

use std::ffi::{OsStr, OsString};
use std::fmt;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use lock_core::{LockContext, LossCause};
use nix::errno::Errno;
use nix::sys::signal::Signal;
use nix::sys::wait::{waitid, waitpid, Id, WaitPidFlag, WaitStatus};
use nix::unistd::{access, AccessFlags, Pid};
use tokio::signal::unix::{signal, SignalKind};
use tokio::sync::mpsc;
use tokio::time::Instant;

use crate::exit::{self, Failure};
use crate::group::{self, Swept};

/// How often the supervisor's exit is looked for without a SIGCHLD.
const EXIT_POLL: Duration = Duration::from_secs(1);

/// How the command ended, as its supervisor reported it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Status {
    /// It exited with this code (128 + N when it died of signal N: the
    /// supervisor's code for it).
    Code(i32),
    /// The supervisor itself died of this signal (SIGKILL after the grace).
    Signal(i32),
}

impl Status {
    /// The exit code `run` passes on: the code, or 128 + the signal.
    pub(crate) fn exit_code(self) -> u8 {
        match self {
            Self::Code(code) => u8::try_from(code & 0xff).unwrap_or(u8::MAX),
            Self::Signal(signal) => exit::signalled(signal),
        }
    }
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Self::Code(code) => write!(f, "exit status: {code}"),
            Self::Signal(n) => match Signal::try_from(n) {
                Ok(signal) => write!(f, "signal: {n} ({signal})"),
                Err(_) => write!(f, "signal: {n}"),
            },
        }
    }
}

/// Why the command was stopped before it exited by itself.
#[derive(Clone, Debug)]
pub(crate) enum Stopped {
    /// The lock was lost.
    Lost(LossCause),
    /// It ran past `--max-runtime`.
    TimedOut(Duration),
}

/// What became of the command.
#[derive(Debug)]
pub(crate) struct Outcome {
    /// How it ended, or why it could not be watched.
    pub(crate) status: Result<Status, io::Error>,
    /// Why withlock stopped it, if it did.
    pub(crate) stopped: Option<Stopped>,
    /// What the sweep after it found left in its group.
    pub(crate) swept: Swept,
    /// How long it ran.
    pub(crate) ran: Duration,
}

/// The command line to run, found before the lock is taken.
#[derive(Debug)]
pub(crate) struct Job {
    /// The name it was given, its `argv[0]`.
    pub(crate) name: OsString,
    /// Where it was found.
    program: PathBuf,
    args: Vec<OsString>,
    /// Between SIGTERM (or a forwarded signal) and SIGKILL.
    pub(crate) grace: Duration,
    /// The same, when withlock itself has died: the supervisor's.
    pub(crate) orphan_grace: Duration,
    pub(crate) max_runtime: Option<Duration>,
}

impl Job {
    /// The command `command` names, found as a shell finds it (on `PATH`
    /// unless it holds a `/`). Exit 127 when it is not found, 126 when it
    /// cannot be executed, each naming the command: before anything is
    /// touched.
    pub(crate) fn find(
        command: Vec<OsString>,
        grace: Duration,
        orphan_grace: Duration,
        max_runtime: Option<Duration>,
    ) -> Result<Self, Failure> {
        let mut command = command.into_iter();
        let name = command
            .next()
            .ok_or_else(|| Failure::usage("no command after `--`"))?;
        let program = find_program(&name, std::env::var_os("PATH").as_deref())?;
        Ok(Self {
            name,
            program,
            args: command.collect(),
            grace,
            orphan_grace,
            max_runtime,
        })
    }

    /// Starts the supervisor, which starts the command: in a new process
    /// group that the supervisor leads, with the lock's key and fencing
    /// token in its environment and without `WITHLOCK_URL`, with
    /// withlock's stdin, stdout and stderr.
    ///
    /// Call it on the main thread: the supervisor's parent-death signal
    /// follows the thread that started it. (`run` runs on a current-thread
    /// runtime, so every task runs on the main thread.)
    pub(crate) fn spawn(&self, ctx: &LockContext) -> io::Result<Running> {
        // Listening before the supervisor exists, so that its exit is
        // never missed.
        let sigchld = signal(SignalKind::child())?;
        let supervisor = std::process::Command::new(supervisor_program())
            .arg0("withlock")
            .arg("__supervise")
            .arg("--parent")
            .arg(std::process::id().to_string())
            .arg("--grace")
            .arg(format!("{}ms", self.orphan_grace.as_millis()))
            .arg("--arg0")
            .arg(&self.name)
            .arg("--")
            .arg(&self.program)
            .args(&self.args)
            .env("WITHLOCK_KEY", ctx.key())
            .env("WITHLOCK_FENCING_TOKEN", ctx.fencing_token().to_string())
            .env_remove("WITHLOCK_URL")
            .process_group(0)
            .spawn()?;
        // The `Child` is not kept: `Running` waits for the process itself,
        // without reaping it until its group is swept.
        let pid = Pid::from_raw(
            i32::try_from(supervisor.id())
                .map_err(|_| io::Error::other("process id out of range"))?,
        );
        let (forward, forwarded) = mpsc::unbounded_channel();
        Ok(Running {
            pid,
            sigchld,
            forward,
            forwarded,
            started: Instant::now(),
        })
    }
}

/// This binary, to run as the supervisor: `/proc/self/exe` on Linux, so
/// that a binary replaced or removed on disk since withlock started still
/// runs as the same program.
fn supervisor_program() -> PathBuf {
    let proc_exe = Path::new("/proc/self/exe");
    if proc_exe.exists() {
        return proc_exe.to_path_buf();
    }
    std::env::current_exe().unwrap_or_else(|_| PathBuf::from("withlock"))
}

/// `name` as `execvp` finds it: as a path if it holds a `/`, else in each
/// directory of `path` (an empty entry is the current directory).
fn find_program(name: &OsStr, path: Option<&OsStr>) -> Result<PathBuf, Failure> {
    let shown = Path::new(name).display().to_string();
    if name.is_empty() {
        return Err(Failure::new(exit::NOT_FOUND, "the command is empty"));
    }
    if name.as_bytes().contains(&b'/') {
        let program = PathBuf::from(name);
        return match executable(&program) {
            Ok(()) => Ok(program),
            Err(Unusable::Missing) => Err(Failure::new(
                exit::NOT_FOUND,
                format!("{shown}: no such file; the command did not run"),
            )),
            Err(unusable) => Err(cannot_execute(&shown, &unusable)),
        };
    }
    // As execvp: without PATH, the system's default path.
    let path = path.unwrap_or(OsStr::new("/usr/local/bin:/usr/bin:/bin"));
    let mut refused = None;
    for dir in std::env::split_paths(path) {
        let dir = if dir.as_os_str().is_empty() {
            PathBuf::from(".")
        } else {
            dir
        };
        let candidate = dir.join(name);
        match executable(&candidate) {
            Ok(()) => return Ok(candidate),
            Err(Unusable::Missing) => {}
            // Like a shell: a file found but not executable is reported
            // if nothing executable comes later on PATH.
            Err(unusable) => {
                refused.get_or_insert((candidate, unusable));
            }
        }
    }
    match refused {
        Some((found, unusable)) => Err(cannot_execute(
            &format!("{shown} ({})", found.display()),
            &unusable,
        )),
        None => Err(Failure::new(
            exit::NOT_FOUND,
            format!("{shown}: command not found on PATH; the command did not run"),
        )),
    }
}

/// Why a file cannot be run.
#[derive(Debug)]
enum Unusable {
    Missing,
    Directory,
    NotExecutable(Errno),
}

fn cannot_execute(shown: &str, unusable: &Unusable) -> Failure {
    let why = match unusable {
        Unusable::Directory => "is a directory".to_owned(),
        Unusable::NotExecutable(errno) => format!("cannot be executed: {}", errno.desc()),
        Unusable::Missing => "no such file".to_owned(),
    };
    Failure::new(
        exit::CANNOT_EXECUTE,
        format!("{shown} {why}; the command did not run"),
    )
}

/// Whether `path` is a file this process may execute.
fn executable(path: &Path) -> Result<(), Unusable> {
    let metadata = std::fs::metadata(path).map_err(|_| Unusable::Missing)?;
    if metadata.is_dir() {
        return Err(Unusable::Directory);
    }
    if metadata.permissions().mode() & 0o111 == 0 {
        return Err(Unusable::NotExecutable(Errno::EACCES));
    }
    access(path, AccessFlags::X_OK).map_err(Unusable::NotExecutable)
}

/// A running command: its supervisor, which leads the command's process
/// group and is not reaped before the group is swept.
#[derive(Debug)]
pub(crate) struct Running {
    pid: Pid,
    sigchld: tokio::signal::unix::Signal,
    forward: mpsc::UnboundedSender<Signal>,
    forwarded: mpsc::UnboundedReceiver<Signal>,
    started: Instant,
}

impl Running {
    /// Where to send the signals withlock gets, to forward them to the
    /// command's group.
    pub(crate) fn forwarder(&self) -> mpsc::UnboundedSender<Signal> {
        self.forward.clone()
    }

    /// Waits for the command to exit; meanwhile forwards the signals sent
    /// through [`forwarder`](Self::forwarder), and terminates the group
    /// (SIGTERM, then SIGKILL after the grace) when the lock is lost or
    /// `--max-runtime` passes. A forwarded signal is followed by SIGKILL
    /// after the grace, too, if the command has not exited by then. Once
    /// it has exited, what it left in its group is swept; then the
    /// supervisor is reaped.
    pub(crate) async fn supervise(self, ctx: &LockContext, job: &Job) -> Outcome {
        let Self {
            pid,
            mut sigchld,
            forward: _keep_open,
            mut forwarded,
            started,
        } = self;
        let group = pid;
        let deadline = job.max_runtime.map(|d| started + d);
        let mut stopped = None;
        // When the group gets SIGKILL; None until it is to be stopped.
        let mut kill_at: Option<Instant> = None;
        let mut killed = false;
        let status = loop {
            tokio::select! {
                biased;
                status = exited(pid, &mut sigchld) => break status,
                Some(signal) = forwarded.recv() => {
                    group::signal(group, signal);
                    kill_at.get_or_insert(Instant::now() + job.grace);
                }
                cause = ctx.lost(), if stopped.is_none() => {
                    stopped = Some(Stopped::Lost(cause));
                    group::signal(group, Signal::SIGTERM);
                    kill_at = Some(Instant::now() + job.grace);
                }
                () = tokio::time::sleep_until(deadline.unwrap_or(started)),
                    if deadline.is_some() && stopped.is_none() =>
                {
                    stopped = job.max_runtime.map(Stopped::TimedOut);
                    group::signal(group, Signal::SIGTERM);
                    kill_at = Some(Instant::now() + job.grace);
                }
                () = tokio::time::sleep_until(kill_at.unwrap_or(started)),
                    if kill_at.is_some() && !killed =>
                {
                    killed = true;
                    group::signal(group, Signal::SIGKILL);
                }
            }
        };
        // The supervisor has exited and is not reaped: its process id,
        // which is the group's, stays ours until `reap`.
        let kill_at = if killed {
            Instant::now()
        } else {
            kill_at.unwrap_or_else(|| Instant::now() + job.grace)
        };
        let swept = group::sweep(group, None, kill_at).await;
        let ran = started.elapsed();
        let status = status.and_then(|()| reap(pid));
        Outcome {
            status,
            stopped,
            swept,
            ran,
        }
    }
}

/// Resolves once the supervisor `pid` has exited, leaving it unreaped.
///
/// # Cancel safety
///
/// Cancel safe: it only looks.
async fn exited(pid: Pid, sigchld: &mut tokio::signal::unix::Signal) -> io::Result<()> {
    loop {
        let flags = WaitPidFlag::WEXITED | WaitPidFlag::WNOHANG | WaitPidFlag::WNOWAIT;
        match waitid(Id::Pid(pid), flags) {
            Ok(WaitStatus::StillAlive) => {}
            Ok(_) => return Ok(()),
            Err(Errno::EINTR) => continue,
            Err(error) => return Err(io::Error::from(error)),
        }
        // A SIGCHLD, or a look every second in case one was merged
        // with another child's.
        let _ = tokio::time::timeout(EXIT_POLL, sigchld.recv()).await;
    }
}

/// Reaps the exited supervisor `pid`: how the command ended.
fn reap(pid: Pid) -> io::Result<Status> {
    loop {
        match waitpid(pid, None) {
            Ok(WaitStatus::Exited(_, code)) => return Ok(Status::Code(code)),
            Ok(WaitStatus::Signaled(_, signal, _)) => return Ok(Status::Signal(signal as i32)),
            Ok(other) => {
                return Err(io::Error::other(format!(
                    "unexpected wait status {other:?}"
                )))
            }
            Err(Errno::EINTR) => continue,
            Err(error) => return Err(io::Error::from(error)),
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn programs_are_found_as_a_shell_finds_them() {
        let sh = find_program(
            OsStr::new("sh"),
            Some(OsStr::new("/nonexistent:/bin:/usr/bin")),
        )
        .unwrap();
        assert!(sh.ends_with("sh"), "{}", sh.display());
        let missing =
            find_program(OsStr::new("no-such-withlock-cmd"), Some(OsStr::new("/bin"))).unwrap_err();
        assert_eq!(missing.code, exit::NOT_FOUND);
        assert!(
            missing.message.contains("no-such-withlock-cmd"),
            "{}",
            missing.message
        );
        let dir = find_program(OsStr::new("/tmp"), None).unwrap_err();
        assert_eq!(dir.code, exit::CANNOT_EXECUTE);
        let file = find_program(OsStr::new("/etc/passwd"), None).unwrap_err();
        assert_eq!(file.code, exit::CANNOT_EXECUTE, "{}", file.message);
        assert!(file.message.contains("/etc/passwd"), "{}", file.message);
    }

    #[test]
    fn statuses_read_like_std() {
        assert_eq!(Status::Code(3).to_string(), "exit status: 3");
        assert_eq!(Status::Signal(9).to_string(), "signal: 9 (SIGKILL)");
        assert_eq!(Status::Signal(9).exit_code(), 137);
        assert_eq!(Status::Code(143).exit_code(), 143);
    }
}

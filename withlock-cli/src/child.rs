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
        let path = std::env::var_os("PATH");
        let program = find_program(&name, path.as_deref())?;
        check_interpreter(&program, path.as_deref()).map_err(|bad| {
            Failure::new(
                bad.code(),
                format!(
                    "{} {bad}; the command did not run",
                    Path::new(&name).display()
                ),
            )
        })?;
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
        return Err(Failure::usage("the command after `--` is empty"));
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

/// How many `#!` interpreters deep a script is followed, as Linux does
/// (`BINPRM_MAX_RECURSION`): an interpreter may itself be a script.
const MAX_INTERPRETERS: usize = 4;
/// How much of a script's first line the kernel reads (`BINPRM_BUF_SIZE`).
const SHEBANG_BYTES: usize = 256;

/// Why a script cannot start: its `#!` line names an interpreter that is
/// missing or cannot be executed, or (through `env`) a command not on
/// `PATH`.
#[derive(Debug)]
pub(crate) enum BadInterpreter {
    /// The interpreter its `#!` line names cannot be used.
    Interpreter {
        interpreter: PathBuf,
        unusable: Unusable,
    },
    /// `#!/usr/bin/env NAME`, and `NAME` is not on `PATH`.
    NotOnPath { name: OsString },
}

impl BadInterpreter {
    /// The exit code: 127 for a command `env` would not find (as `env`
    /// exits), else 126 (as a shell exits for a bad interpreter).
    pub(crate) fn code(&self) -> u8 {
        match self {
            Self::NotOnPath { .. } => exit::NOT_FOUND,
            Self::Interpreter { .. } => exit::CANNOT_EXECUTE,
        }
    }
}

impl fmt::Display for BadInterpreter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (name, why) = match self {
            Self::Interpreter {
                interpreter,
                unusable,
            } => (interpreter.as_os_str(), unusable.to_string()),
            Self::NotOnPath { name } => (name.as_os_str(), "not found on PATH".to_owned()),
        };
        let shown = name.to_string_lossy();
        write!(
            f,
            "has a bad interpreter: its #! line names {shown:?}, which {why}"
        )?;
        if name.as_bytes().ends_with(b"\r") {
            f.write_str(
                " (the line ends in \\r: the script has Windows line ends; dos2unix mends it)",
            )?;
        }
        Ok(())
    }
}

/// Checks what the kernel will do with `program`'s `#!` line, if it has
/// one: the interpreter it names exists and may be executed (followed as
/// the kernel follows it, when it is a script too); for `#!/usr/bin/env
/// NAME`, that `NAME` is on `path`. A file that cannot be read (execute
/// permission without read) is left to `exec`.
pub(crate) fn check_interpreter(
    program: &Path,
    path: Option<&OsStr>,
) -> Result<(), BadInterpreter> {
    let mut program = program.to_path_buf();
    for _ in 0..MAX_INTERPRETERS {
        let Some((interpreter, argument)) = shebang(&program) else {
            return Ok(());
        };
        executable(&interpreter).map_err(|unusable| BadInterpreter::Interpreter {
            interpreter: interpreter.clone(),
            unusable,
        })?;
        if interpreter.file_name() == Some(OsStr::new("env")) {
            // `env NAME`: one word, no option (`env -S …` and the like
            // are left to env).
            if let Some(name) = argument.filter(|a| !a.as_bytes().starts_with(b"-")) {
                if find_program(&name, path).is_err() {
                    return Err(BadInterpreter::NotOnPath { name });
                }
            }
            return Ok(());
        }
        program = interpreter;
    }
    Ok(())
}

/// The interpreter and its one optional argument on the `#!` line of the
/// file at `path`, split as Linux splits it: after `#!` and blanks, the
/// interpreter runs to a blank or the end of the line, the rest (blanks
/// trimmed) is one argument. A `\r` is neither a blank nor an end of line.
/// None when the file is not a script or cannot be read.
fn shebang(path: &Path) -> Option<(PathBuf, Option<OsString>)> {
    use std::io::Read;
    let mut head = Vec::with_capacity(SHEBANG_BYTES);
    std::fs::File::open(path)
        .ok()?
        .take(SHEBANG_BYTES as u64)
        .read_to_end(&mut head)
        .ok()?;
    let line = head.strip_prefix(b"#!")?;
    let line = line.split(|&b| b == b'\n' || b == 0).next().unwrap_or(line);
    let blank = |b: &u8| *b == b' ' || *b == b'\t';
    let line = match line.iter().position(|b| !blank(b)) {
        Some(start) => &line[start..],
        None => return None,
    };
    let end = line.iter().position(blank).unwrap_or(line.len());
    let interpreter = PathBuf::from(OsStr::from_bytes(&line[..end]));
    let rest = &line[end..];
    let argument = match (
        rest.iter().position(|b| !blank(b)),
        rest.iter().rposition(|b| !blank(b)),
    ) {
        (Some(start), Some(last)) => Some(OsStr::from_bytes(&rest[start..=last]).to_owned()),
        _ => None,
    };
    Some((interpreter, argument))
}

/// Why a file cannot be run.
#[derive(Debug)]
pub(crate) enum Unusable {
    Missing,
    Directory,
    NotExecutable(Errno),
}

impl fmt::Display for Unusable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Directory => f.write_str("is a directory"),
            Self::NotExecutable(errno) => write!(f, "cannot be executed: {}", errno.desc()),
            Self::Missing => f.write_str("does not exist"),
        }
    }
}

fn cannot_execute(shown: &str, unusable: &Unusable) -> Failure {
    let why = match unusable {
        Unusable::Missing => "no such file".to_owned(),
        other => other.to_string(),
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
    fn shebang_lines_split_as_linux_splits_them() {
        let dir = std::env::temp_dir().join(format!("withlock-shebang-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let line = |text: &[u8]| {
            let path = dir.join("script");
            std::fs::write(&path, text).unwrap();
            shebang(&path)
        };
        let words = |i: &str, a: Option<&str>| Some((PathBuf::from(i), a.map(OsString::from)));
        assert_eq!(line(b"#!/bin/sh\n"), words("/bin/sh", None));
        assert_eq!(line(b"#!/bin/sh\r\n"), words("/bin/sh\r", None));
        assert_eq!(
            line(b"#! /bin/sh -e -u \n"),
            words("/bin/sh", Some("-e -u"))
        );
        assert_eq!(
            line(b"#!/usr/bin/env bash\r\n"),
            words("/usr/bin/env", Some("bash\r"))
        );
        assert_eq!(line(b"#!/bin/sh"), words("/bin/sh", None));
        assert_eq!(line(b"#!  \n"), None);
        assert_eq!(line(b"\x7fELF"), None);
        assert!(check_interpreter(&dir.join("script"), None).is_ok());
        std::fs::write(dir.join("script"), b"#!/bin/sh\r\n").unwrap();
        let bad = check_interpreter(&dir.join("script"), None).unwrap_err();
        assert_eq!(bad.code(), exit::CANNOT_EXECUTE);
        std::fs::write(dir.join("script"), b"#!/usr/bin/env withlock-no-such\n").unwrap();
        let bad = check_interpreter(&dir.join("script"), Some(OsStr::new("/bin"))).unwrap_err();
        assert_eq!(bad.code(), exit::NOT_FOUND);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn statuses_read_like_std() {
        assert_eq!(Status::Code(3).to_string(), "exit status: 3");
        assert_eq!(Status::Signal(9).to_string(), "signal: 9 (SIGKILL)");
        assert_eq!(Status::Signal(9).exit_code(), 137);
        assert_eq!(Status::Code(143).exit_code(), 143);
    }
}

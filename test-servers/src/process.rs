//! What every server here shares: free loopback ports, a scratch
//! directory per server (and the clean-up of those that a killed run left
//! behind), the watchdog that kills a server when the test process dies,
//! and the signals that pause and resume it.
//!
//! Nothing here touches a process or a directory it did not make: a
//! leftover is a scratch directory named after a process that no longer
//! runs, and the only processes killed with it are those working in it.

use std::io;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, MutexGuard, PoisonError};

/// A free port on 127.0.0.1, as the system hands it out.
pub(crate) fn free_port() -> io::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// The system's temporary directory.
pub(crate) fn temp_base() -> PathBuf {
    std::env::temp_dir()
}

/// `/dev/shm` where there is one (data in memory, for servers that sync
/// to disk), else the temporary directory.
#[cfg(feature = "etcd")]
pub(crate) fn shm_base() -> PathBuf {
    let shm = Path::new("/dev/shm");
    if shm.is_dir() {
        shm.to_path_buf()
    } else {
        temp_base()
    }
}

/// The first part of every scratch directory's name.
const DIR_PREFIX: &str = "withlock-";

/// A new directory `withlock-<kind>.<pid>.<16 hex>` under `base`, `<pid>`
/// being this process's. The first one a process makes under `base`
/// removes the leftovers there first: directories of that form whose
/// process no longer runs (a run killed with its watchdogs), after killing
/// the servers still working in them.
pub(crate) fn scratch_dir(base: &Path, kind: &str) -> io::Result<PathBuf> {
    clean_leftovers(base);
    let dir = base.join(format!(
        "{DIR_PREFIX}{kind}.{}.{:016x}",
        std::process::id(),
        rand::random::<u64>()
    ));
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}

/// `result`, with the scratch directory `dir` removed when it is an
/// error: for the steps of a start between making the directory and the
/// server that owns (and removes) it.
pub(crate) fn removing_on_error<T>(dir: &Path, result: io::Result<T>) -> io::Result<T> {
    if result.is_err() {
        let _ = std::fs::remove_dir_all(dir);
    }
    result
}

/// The process id in a scratch directory's name, `withlock-<kind>.<pid>.<16 hex>`.
fn owner_of(name: &str) -> Option<u32> {
    let mut parts = name.strip_prefix(DIR_PREFIX)?.split('.');
    let (kind, pid, random) = (parts.next()?, parts.next()?, parts.next()?);
    let well_formed = parts.next().is_none()
        && !kind.is_empty()
        && random.len() == 16
        && random.bytes().all(|b| b.is_ascii_hexdigit());
    well_formed.then(|| pid.parse().ok()).flatten()
}

/// Whether process `pid` runs (or is a zombie nobody reaped yet).
fn runs(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

/// Removes the scratch directories under `base` whose process no longer
/// runs, once per process and base. Best effort: a directory another run
/// removes at the same time, or one that cannot be read, is skipped.
fn clean_leftovers(base: &Path) {
    static CLEANED: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());
    let mut cleaned = CLEANED.lock().unwrap_or_else(PoisonError::into_inner);
    if cleaned.iter().any(|b| b == base) {
        return;
    }
    cleaned.push(base.to_path_buf());
    // Without /proc nothing can tell a live owner from a dead one.
    if !Path::new("/proc/self").exists() {
        return;
    }
    let Ok(entries) = std::fs::read_dir(base) else {
        return;
    };
    for entry in entries.filter_map(Result::ok) {
        let name = entry.file_name();
        let Some(owner) = name.to_str().and_then(owner_of) else {
            continue;
        };
        if owner == std::process::id() || runs(owner) {
            continue;
        }
        let dir = entry.path();
        for pid in working_in(&dir) {
            let _ = signal(pid, "-CONT");
            let _ = signal(pid, "-KILL");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// The processes whose working directory is in `dir` or whose command
/// line names it: the servers of a leftover scratch directory
/// (`redis-server` and PostgreSQL change into theirs, etcd is given its
/// data directory).
fn working_in(dir: &Path) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let needle = dir.to_string_lossy().into_owned();
    entries
        .filter_map(Result::ok)
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            let cwd = std::fs::read_link(format!("/proc/{pid}/cwd"));
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline"));
            cwd.is_ok_and(|cwd| cwd.starts_with(dir))
                || cmdline.is_ok_and(|c| String::from_utf8_lossy(&c).contains(&needle))
        })
        .collect()
}

/// Sends `signal` (`-STOP`, `-CONT`, `-KILL`) to process `pid`.
///
/// # Errors
///
/// When `kill` cannot run or fails (no such process, not allowed).
pub(crate) fn signal(pid: u32, signal: &str) -> io::Result<()> {
    let status = Command::new("kill")
        .arg(signal)
        .arg(pid.to_string())
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .status()?;
    if status.success() {
        Ok(())
    } else {
        Err(io::Error::other(format!("kill {signal} {pid} failed")))
    }
}

/// The parent pid of `pid`, from `/proc/<pid>/stat`.
#[cfg(any(feature = "postgres", test))]
pub(crate) fn parent_of(pid: u32) -> io::Result<Option<u32>> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    Ok(parse_ppid(&stat))
}

/// The fourth field of a `/proc/<pid>/stat` line; the second (the command
/// name, in parentheses) may hold spaces and parentheses.
#[cfg(any(feature = "postgres", test))]
fn parse_ppid(stat: &str) -> Option<u32> {
    let after = &stat[stat.rfind(')')? + 1..];
    after.split_whitespace().nth(1)?.parse().ok()
}

/// The pids whose parent is `parent`.
#[cfg(any(feature = "postgres", test))]
pub(crate) fn children_of(parent: u32) -> io::Result<Vec<u32>> {
    let mut children = Vec::new();
    for entry in std::fs::read_dir("/proc")? {
        let Some(pid) = entry?
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        // Processes may end while we look.
        if let Ok(Some(ppid)) = parent_of(pid) {
            if ppid == parent {
                children.push(pid);
            }
        }
    }
    Ok(children)
}

/// A server process of this test process and its watchdog: a shell that
/// waits while both run and, if this process dies first (killed, so that
/// nothing was dropped), resumes the server (and whatever a
/// [`pause`](Self::pause) stopped with it), kills it with SIGKILL and
/// removes its scratch directory.
#[derive(Debug)]
pub(crate) struct Watched {
    pid: u32,
    /// The server, when it is a child of this process (to be reaped).
    child: Option<Child>,
    watchdog: Option<Child>,
    /// The pids a pause stopped, one a line, for the watchdog.
    paused: PathBuf,
}

impl Watched {
    /// Spawns `command` (stdin closed; stdout and stderr as the caller
    /// set them) and its watchdog over `dir`.
    ///
    /// # Errors
    ///
    /// When the program cannot be started.
    pub(crate) fn spawn(command: &mut Command, dir: &Path) -> io::Result<Self> {
        let child = command.stdin(Stdio::null()).spawn()?;
        let mut watched = Self::watch(child.id(), dir);
        watched.child = Some(child);
        Ok(watched)
    }

    /// Watches `pid`, a server that is not a child of this process (a
    /// daemon, such as the postmaster `pg_ctl` starts), over `dir`.
    pub(crate) fn watch(pid: u32, dir: &Path) -> Self {
        let paused = dir.join(format!(".paused-{pid}"));
        let watchdog = Command::new("sh")
            .arg("-c")
            .arg(format!(
                "while kill -0 {parent} 2>/dev/null && kill -0 {pid} 2>/dev/null; do sleep 1; done; \
                 for p in $(cat '{paused}' 2>/dev/null) {pid}; do kill -CONT \"$p\" 2>/dev/null; done; \
                 kill -9 {pid} 2>/dev/null; kill -0 {parent} 2>/dev/null || rm -rf '{dir}'",
                parent = std::process::id(),
                paused = paused.display(),
                dir = dir.display(),
            ))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .ok();
        Self {
            pid,
            child: None,
            watchdog,
            paused,
        }
    }

    /// The server's process id.
    pub(crate) fn pid(&self) -> u32 {
        self.pid
    }

    /// Stops the server and then `others` (SIGSTOP), listing them first
    /// for the watchdog, which resumes them if this process dies.
    ///
    /// # Errors
    ///
    /// When the list cannot be written or the server cannot be stopped.
    pub(crate) fn pause(&self, others: &[u32]) -> io::Result<()> {
        let mut list = String::new();
        for pid in others {
            list.push_str(&format!("{pid}\n"));
        }
        std::fs::write(&self.paused, list)?;
        signal(self.pid, "-STOP")?;
        for &pid in others {
            // Processes may end while we stop them.
            let _ = signal(pid, "-STOP");
        }
        Ok(())
    }

    /// Resumes the server (SIGCONT) and whatever [`pause`](Self::pause)
    /// stopped with it.
    ///
    /// # Errors
    ///
    /// When the server cannot be resumed.
    pub(crate) fn resume(&self) -> io::Result<()> {
        let resumed = signal(self.pid, "-CONT");
        if let Ok(list) = std::fs::read_to_string(&self.paused) {
            for pid in list.lines().filter_map(|l| l.parse::<u32>().ok()) {
                let _ = signal(pid, "-CONT");
            }
            let _ = std::fs::remove_file(&self.paused);
        }
        resumed
    }

    /// Kills the server (SIGKILL; a stopped one too), waits for it when
    /// it is a child, and ends the watchdog.
    pub(crate) fn kill(mut self) {
        match self.child.as_mut() {
            Some(child) => {
                let _ = child.kill();
                let _ = child.wait();
            }
            None => {
                let _ = signal(self.pid, "-CONT");
                let _ = signal(self.pid, "-KILL");
            }
        }
        self.unwatch();
    }

    /// Ends the watchdog, for a server stopped another way.
    pub(crate) fn unwatch(mut self) {
        if let Some(mut watchdog) = self.watchdog.take() {
            let _ = watchdog.kill();
            let _ = watchdog.wait();
        }
        let _ = std::fs::remove_file(&self.paused);
    }
}

/// A server that may run or not: the process of its last start, if it
/// still runs.
#[derive(Debug)]
pub(crate) struct Slot {
    /// What to call it in errors: `redis-server on port 6380`, `member 2`.
    label: String,
    running: Mutex<Option<Watched>>,
}

impl Slot {
    /// An empty slot for the server called `label`.
    pub(crate) fn new(label: String) -> Self {
        Self {
            label,
            running: Mutex::new(None),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Option<Watched>> {
        self.running.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Puts the process of a new start in the slot, killing the one there.
    pub(crate) fn set(&self, watched: Watched) {
        if let Some(old) = self.lock().replace(watched) {
            old.kill();
        }
    }

    /// Takes the process out of the slot.
    pub(crate) fn take(&self) -> Option<Watched> {
        self.lock().take()
    }

    /// The server's process id, while it runs.
    pub(crate) fn pid(&self) -> Option<u32> {
        self.lock().as_ref().map(Watched::pid)
    }

    /// Kills the server if it runs (SIGKILL), and waits for it.
    pub(crate) fn kill(&self) {
        if let Some(watched) = self.take() {
            watched.kill();
        }
    }

    fn with<T>(&self, f: impl FnOnce(&Watched) -> io::Result<T>) -> io::Result<T> {
        match self.lock().as_ref() {
            Some(watched) => f(watched),
            None => Err(io::Error::new(
                io::ErrorKind::NotFound,
                format!("{} is not running", self.label),
            )),
        }
    }

    /// Stops the server (SIGSTOP) and `others` with it.
    ///
    /// # Errors
    ///
    /// When the server does not run or the signal cannot be sent.
    pub(crate) fn pause(&self, others: &[u32]) -> io::Result<()> {
        self.with(|w| w.pause(others))
    }

    /// Resumes a paused server (SIGCONT), and what was stopped with it.
    ///
    /// # Errors
    ///
    /// When the server does not run or the signal cannot be sent.
    pub(crate) fn resume(&self) -> io::Result<()> {
        self.with(Watched::resume)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_parent_pid_is_read_past_odd_command_names() {
        assert_eq!(
            parse_ppid("123 (post gres: a) b)) S 77 123 123 0"),
            Some(77)
        );
        assert_eq!(parse_ppid("garbage"), None);
        let me = std::process::id();
        let child = Reap(Command::new("sleep").arg("5").spawn().unwrap());
        assert_eq!(parent_of(child.0.id()).unwrap(), Some(me));
        assert!(children_of(me).unwrap().contains(&child.0.id()));
    }

    struct Reap(Child);

    impl Drop for Reap {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }

    #[test]
    fn only_well_formed_scratch_names_have_an_owner() {
        assert_eq!(owner_of("withlock-redis.123.0123456789abcdef"), Some(123));
        assert_eq!(owner_of("withlock-redis.123.0123456789abcde"), None);
        assert_eq!(owner_of("withlock-redis-6379-01234567"), None);
        assert_eq!(owner_of("withlock-.123.0123456789abcdef"), None);
        assert_eq!(owner_of("other-redis.123.0123456789abcdef"), None);
        assert_eq!(owner_of("withlock-redis.x.0123456789abcdef"), None);
        assert_eq!(owner_of("withlock-a.1.0123456789abcdef.more"), None);
    }

    #[test]
    fn a_dead_runs_leftover_is_removed_and_its_server_killed() {
        let base = std::env::temp_dir().join(format!(
            "withlock-process-test-{:016x}",
            rand::random::<u64>()
        ));
        std::fs::create_dir_all(&base).unwrap();
        // A process that has exited and been reaped: its pid no longer runs.
        let mut gone = Command::new("true").spawn().unwrap();
        let dead = gone.id();
        gone.wait().unwrap();
        let leftover = base.join(format!("{DIR_PREFIX}redis.{dead}.0123456789abcdef"));
        let alive = base.join(format!(
            "{DIR_PREFIX}redis.{}.0123456789abcdef",
            std::process::id()
        ));
        let other = base.join("withlock-pki-0123456789abcdef");
        for dir in [&leftover, &alive, &other] {
            std::fs::create_dir_all(dir).unwrap();
        }
        let server = Reap(
            Command::new("sleep")
                .arg("30")
                .current_dir(&leftover)
                .spawn()
                .unwrap(),
        );
        if runs(dead) {
            // The pid was taken again at once: nothing to test.
            let _ = std::fs::remove_dir_all(&base);
            return;
        }
        clean_leftovers(&base);
        assert!(!leftover.exists(), "the dead run's directory is removed");
        assert!(alive.exists(), "this run's directory stays");
        assert!(other.exists(), "a directory of another form stays");
        let mut server = server;
        let status = server.0.wait().unwrap();
        assert!(!status.success(), "the server working there was killed");
        std::fs::remove_dir_all(&base).unwrap();
    }
}

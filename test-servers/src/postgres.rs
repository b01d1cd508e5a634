//! PostgreSQL to test against: the server of `DATABASE_URL`
//! ([`database_url`]), and servers of a test's own ([`TestServer`]) to
//! stop, start again and pause.
//!
//! The schemas and backends a test works in on a shared server (dropped
//! afterwards) are lock-postgres's `testing` feature.

use std::fmt;
use std::io;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use crate::process::{
    children_of, free_port, removing_on_error, scratch_dir, temp_base, Slot, Watched,
};

/// The server the tests use unless `DATABASE_URL` says otherwise.
pub const DEFAULT_DATABASE_URL: &str = "postgres://postgres@127.0.0.1:5432/test";

/// `DATABASE_URL`, or [`DEFAULT_DATABASE_URL`].
pub fn database_url() -> String {
    std::env::var("DATABASE_URL").unwrap_or_else(|_| DEFAULT_DATABASE_URL.to_owned())
}

/// A PostgreSQL server of its own, in a scratch directory, on a free
/// loopback port, with trust authentication for the user `postgres`.
///
/// Made from the local installation (`PG_BIN`, else the newest
/// `/usr/lib/postgresql/*/bin`). As root, the programs run as the `postgres`
/// system user through `runuser`, since `initdb` refuses root. Dropping it
/// stops the server (immediate mode) and removes the directory; a watchdog
/// kills the server if the test process dies without dropping it. Its
/// methods block: call them from `spawn_blocking` in async code.
pub struct TestServer {
    bin: PathBuf,
    dir: PathBuf,
    port: u16,
    as_postgres: bool,
    /// The postmaster while it runs.
    postmaster: Slot,
}

impl TestServer {
    /// Initialises and starts a server.
    ///
    /// # Errors
    ///
    /// When no PostgreSQL installation is found or a program fails;
    /// whatever was made is removed.
    pub fn start() -> io::Result<Self> {
        let bin = pg_bin()?;
        let as_postgres = is_root();
        let dir = scratch_dir(&temp_base(), "pg")?;
        let port = removing_on_error(&dir, free_port())?;
        let server = Self {
            bin,
            dir,
            port,
            as_postgres,
            postmaster: Slot::new(format!("the PostgreSQL server on port {port}")),
        };
        if as_postgres {
            run(Command::new("chown").arg("postgres:").arg(&server.dir))?;
        }
        let data = server.data_dir();
        server.run_pg(
            "initdb",
            &[
                "-D".as_ref(),
                data.as_os_str(),
                "-A".as_ref(),
                "trust".as_ref(),
                "-U".as_ref(),
                "postgres".as_ref(),
                "-E".as_ref(),
                "UTF8".as_ref(),
                "--no-sync".as_ref(),
            ],
        )?;
        server.start_again()?;
        Ok(server)
    }

    /// The URL of the `postgres` database on this server.
    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    /// The port the server listens on.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The postmaster's process id, while the server runs.
    pub fn pid(&self) -> Option<u32> {
        self.postmaster.pid()
    }

    /// Stops the server at once (`pg_ctl stop -m immediate`), as a crash
    /// would: connections are cut and it is unreachable until
    /// [`start_again`](Self::start_again).
    ///
    /// # Errors
    ///
    /// When `pg_ctl` fails.
    pub fn stop(&self) -> io::Result<()> {
        let data = self.data_dir();
        self.run_pg(
            "pg_ctl",
            &[
                "stop".as_ref(),
                "-D".as_ref(),
                data.as_os_str(),
                "-m".as_ref(),
                "immediate".as_ref(),
                "-w".as_ref(),
                "-t".as_ref(),
                "30".as_ref(),
            ],
        )?;
        if let Some(watched) = self.postmaster.take() {
            watched.unwatch();
        }
        Ok(())
    }

    /// Starts the stopped server again on the same port and data.
    ///
    /// # Errors
    ///
    /// When `pg_ctl` fails or the server is not ready within 30 s.
    pub fn start_again(&self) -> io::Result<()> {
        let data = self.data_dir();
        let log = self.dir.join("server.log");
        let options = format!(
            "-p {} -k {} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=50",
            self.port,
            self.dir.display()
        );
        self.run_pg(
            "pg_ctl",
            &[
                "start".as_ref(),
                "-D".as_ref(),
                data.as_os_str(),
                "-l".as_ref(),
                log.as_os_str(),
                "-o".as_ref(),
                options.as_ref(),
                "-w".as_ref(),
                "-t".as_ref(),
                "30".as_ref(),
            ],
        )?;
        // The postmaster is pg_ctl's, not ours: its pid is the first line
        // of its pid file.
        let pid_file = std::fs::read_to_string(data.join("postmaster.pid"))?;
        let pid = pid_file
            .lines()
            .next()
            .and_then(|l| l.trim().parse().ok())
            .ok_or_else(|| io::Error::other("no pid in postmaster.pid"))?;
        self.postmaster.set(Watched::watch(pid, &self.dir));
        Ok(())
    }

    /// Stops the postmaster and every backend of it (SIGSTOP): connections
    /// stay open and nothing answers, like a hung server. Returns how many
    /// processes were stopped besides the postmaster. If the test process
    /// dies before [`resume`](Self::resume), the watchdog resumes them
    /// and kills the postmaster.
    ///
    /// # Errors
    ///
    /// When the server does not run or the signals cannot be sent.
    pub fn pause(&self) -> io::Result<usize> {
        let pid = self
            .pid()
            .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, "the server is not running"))?;
        let backends = children_of(pid)?;
        self.postmaster.pause(&backends)?;
        Ok(backends.len())
    }

    /// Resumes what [`pause`](Self::pause) stopped (SIGCONT).
    ///
    /// # Errors
    ///
    /// When the server does not run or the signal cannot be sent.
    pub fn resume(&self) -> io::Result<()> {
        self.postmaster.resume()
    }

    fn data_dir(&self) -> PathBuf {
        self.dir.join("data")
    }

    fn run_pg(&self, program: &str, args: &[&std::ffi::OsStr]) -> io::Result<Output> {
        let path = self.bin.join(program);
        let mut command = if self.as_postgres {
            let mut c = Command::new("runuser");
            c.args(["-u", "postgres", "--"]).arg(&path);
            c
        } else {
            Command::new(&path)
        };
        command.args(args).current_dir(&self.dir);
        run(&mut command)
    }
}

impl fmt::Debug for TestServer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TestServer")
            .field("port", &self.port)
            .field("dir", &self.dir)
            .finish()
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        if self.pid().is_some() {
            // A stopped postmaster would make `pg_ctl stop` wait.
            let _ = self.resume();
        }
        let _ = self.stop();
        // Killed if it did not stop (the watchdog's part, done now).
        self.postmaster.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn run(command: &mut Command) -> io::Result<Output> {
    let output = command.output()?;
    if output.status.success() {
        Ok(output)
    } else {
        Err(io::Error::other(format!(
            "{:?} exited with {}: {}",
            command.get_program(),
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        )))
    }
}

fn pg_bin() -> io::Result<PathBuf> {
    if let Some(bin) = std::env::var_os("PG_BIN") {
        return Ok(bin.into());
    }
    let root = Path::new("/usr/lib/postgresql");
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir(root)
        .map_err(|e| io::Error::other(format!("no PostgreSQL under {}: {e}", root.display())))?
        .filter_map(Result::ok)
        .filter_map(|e| {
            let version = e.file_name().to_str()?.parse().ok()?;
            let bin = e.path().join("bin");
            bin.join("initdb").exists().then_some((version, bin))
        })
        .collect();
    versions.sort();
    versions
        .pop()
        .map(|(_, bin)| bin)
        .ok_or_else(|| io::Error::other("no initdb found; set PG_BIN"))
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| o.stdout.trim_ascii() == b"0")
}

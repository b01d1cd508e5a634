//! Redis servers to test against: the server at `REDIS_URL` or one
//! started for the whole test process ([`server_url`]), `redis-server`
//! children to kill, restart, pause and cut ([`RedisServer`], plain or
//! TLS), a local Redis Cluster ([`RedisCluster`], [`shared_cluster`]) and
//! a primary with replicas and three Sentinels ([`SentinelGroup`]).
//!
//! Every server is a child on a free loopback port with no persistence, in
//! a scratch directory of its own; it is killed on drop, and by its
//! watchdog if the test process dies first. Nothing here ever flushes a
//! database or touches keys it did not make (the key namespaces that clean
//! up after themselves are lock-redis's `testing` feature).

use std::io;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::process::{free_port, removing_on_error, scratch_dir, temp_base, Slot, Watched};

mod cluster;
mod sentinel;

pub use cluster::{shared_cluster, RedisCluster};
pub use sentinel::{SentinelAuth, SentinelGroup, MASTER_NAME};

/// The server tests use when `REDIS_URL` is not set.
pub const DEFAULT_URL: &str = "redis://127.0.0.1:6379";

/// `REDIS_URL`, or [`DEFAULT_URL`].
pub fn redis_url() -> String {
    std::env::var("REDIS_URL").unwrap_or_else(|_| DEFAULT_URL.to_owned())
}

/// Whether a Redis server answers `PING` at `url` within a second.
pub async fn answers(url: &str) -> bool {
    let ping = async {
        let client = redis::Client::open(url)?;
        let mut conn = client.get_multiplexed_async_connection().await?;
        redis::cmd("PING").query_async::<String>(&mut conn).await
    };
    matches!(
        tokio::time::timeout(Duration::from_secs(1), ping).await,
        Ok(Ok(_))
    )
}

static FALLBACK: tokio::sync::OnceCell<RedisServer> = tokio::sync::OnceCell::const_new();

/// The URL of a Redis server to test against: `REDIS_URL` (default
/// [`DEFAULT_URL`]) if a server answers there, else a `redis-server` child
/// started once for the whole test process and killed when it exits.
///
/// # Panics
///
/// When no server answers and none can be started.
pub async fn server_url() -> String {
    let url = redis_url();
    if answers(&url).await {
        return url;
    }
    let fallback = FALLBACK
        .get_or_init(|| async {
            match RedisServer::start() {
                Ok(server) => {
                    eprintln!(
                        "no Redis server answers at REDIS_URL; started one at {}",
                        server.url()
                    );
                    server
                }
                Err(error) => panic!(
                    "no Redis server answers at REDIS_URL and `redis-server` could not be \
                     started ({error}); set REDIS_URL (a Redis in Docker will do) or install \
                     redis-server"
                ),
            }
        })
        .await;
    fallback.url()
}

/// A `redis-server` child of this process on a free loopback port, with no
/// persistence, in a scratch directory. Killed on drop.
#[derive(Debug)]
pub struct RedisServer {
    port: u16,
    dir: PathBuf,
    args: Vec<String>,
    /// Its `--requirepass`, for the connections of this helper.
    password: Option<String>,
    /// The CA (PEM) that signed its certificate, when it speaks only TLS.
    tls_ca: Option<Vec<u8>>,
    process: Slot,
}

/// The PEM files of a TLS server: its certificate and key, and the CA
/// that signed the certificate (also the CA it checks replicas, cluster
/// peers and clients that show a certificate against).
#[derive(Clone, Debug)]
pub struct TlsFiles {
    /// The server's certificate.
    pub cert: PathBuf,
    /// The server's private key.
    pub key: PathBuf,
    /// The CA's certificate.
    pub ca: PathBuf,
}

impl TlsFiles {
    /// The `redis-server` arguments of a server on `port` that speaks only
    /// TLS there (`--port 0`) and asks clients for no certificate.
    fn server_args(&self, port: u16) -> Vec<String> {
        let path = |p: &PathBuf| p.to_string_lossy().into_owned();
        [
            "--port".to_owned(),
            "0".to_owned(),
            "--tls-port".to_owned(),
            port.to_string(),
            "--tls-cert-file".to_owned(),
            path(&self.cert),
            "--tls-key-file".to_owned(),
            path(&self.key),
            "--tls-ca-cert-file".to_owned(),
            path(&self.ca),
            "--tls-auth-clients".to_owned(),
            "no".to_owned(),
        ]
        .into()
    }
}

impl RedisServer {
    /// Starts a server and waits until it answers.
    ///
    /// # Errors
    ///
    /// When `redis-server` cannot be started or does not answer within 10 s.
    pub fn start() -> io::Result<Self> {
        Self::start_with(&[])
    }

    /// Starts a server with cluster support on (and no slots assigned), so
    /// that `CLUSTER KEYSLOT` answers.
    ///
    /// # Errors
    ///
    /// As [`start`](Self::start).
    pub fn start_cluster_enabled() -> io::Result<Self> {
        Self::start_with(&["--cluster-enabled", "yes"])
    }

    /// Starts a server with extra `redis-server` arguments, such as
    /// `["--requirepass", "secret"]`.
    ///
    /// # Errors
    ///
    /// As [`start`](Self::start).
    pub fn start_with(extra: &[&str]) -> io::Result<Self> {
        Self::start_inner(extra, None)
    }

    /// Starts a server that speaks only TLS, with the certificate and key
    /// of `tls`, and extra `redis-server` arguments (such as
    /// `["--tls-replication", "yes"]`). Its [`url`](Self::url) is
    /// `rediss://127.0.0.1:<port>`.
    ///
    /// # Errors
    ///
    /// As [`start`](Self::start), and when the CA file cannot be read.
    pub fn start_tls(tls: &TlsFiles, extra: &[&str]) -> io::Result<Self> {
        Self::start_inner(extra, Some(tls))
    }

    fn start_inner(extra: &[&str], tls: Option<&TlsFiles>) -> io::Result<Self> {
        let port = free_port()?;
        let dir = scratch_dir(&temp_base(), "redis")?;
        let mut args: Vec<String> = [
            "--port",
            &port.to_string(),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            &dir.to_string_lossy(),
        ]
        .iter()
        .map(|s| (*s).to_owned())
        .collect();
        // Later arguments win: `--port 0` closes the plain port.
        if let Some(tls) = tls {
            args.extend(tls.server_args(port));
        }
        args.extend(extra.iter().map(|s| (*s).to_owned()));
        let password = extra
            .iter()
            .position(|a| *a == "--requirepass")
            .and_then(|i| extra.get(i + 1))
            .map(|p| (*p).to_owned());
        Self::start_in(port, dir, args, password, tls)
    }

    /// Starts `redis-server` with `args` (which make it listen on `port`)
    /// in the scratch directory `dir`, and waits until it answers.
    fn start_in(
        port: u16,
        dir: PathBuf,
        args: Vec<String>,
        password: Option<String>,
        tls: Option<&TlsFiles>,
    ) -> io::Result<Self> {
        let tls_ca = removing_on_error(&dir, tls.map(|t| std::fs::read(&t.ca)).transpose())?;
        let server = Self {
            port,
            dir,
            args,
            password,
            tls_ca,
            process: Slot::new(format!("redis-server on port {port}")),
        };
        server.spawn()?;
        Ok(server)
    }

    fn spawn(&self) -> io::Result<()> {
        let watched = Watched::spawn(
            Command::new("redis-server")
                .args(&self.args)
                .stdout(Stdio::null())
                .stderr(Stdio::null()),
            &self.dir,
        )?;
        self.process.set(watched);
        self.wait_ready(Duration::from_secs(10))
    }

    fn wait_ready(&self, limit: Duration) -> io::Result<()> {
        let started = Instant::now();
        loop {
            // Any answer, even a refusal such as NOAUTH, means it listens.
            match self.ping() {
                Ok(()) => return Ok(()),
                Err(e) if !e.is_io_error() && !e.is_connection_refusal() => return Ok(()),
                Err(_) => {}
            }
            if started.elapsed() > limit {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("redis-server on port {} did not answer", self.port),
                ));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// A connection to the server with short timeouts, for this crate's
    /// own commands.
    pub(crate) fn connection(&self) -> redis::RedisResult<redis::Connection> {
        let client = self.client()?;
        let conn = client.get_connection_with_timeout(Duration::from_secs(1))?;
        conn.set_read_timeout(Some(Duration::from_secs(2)))?;
        conn.set_write_timeout(Some(Duration::from_secs(2)))?;
        Ok(conn)
    }

    /// A client that reaches the server: with its password, and trusting
    /// its CA.
    ///
    /// # Errors
    ///
    /// When the client cannot be made.
    pub fn client(&self) -> redis::RedisResult<redis::Client> {
        let url = self.url_with_password();
        match &self.tls_ca {
            None => redis::Client::open(url),
            #[cfg(feature = "tls")]
            Some(ca) => redis::Client::build_with_tls(
                url,
                redis::TlsCertificates {
                    client_tls: None,
                    root_cert: Some(ca.clone()),
                },
            ),
            #[cfg(not(feature = "tls"))]
            Some(_) => Err(redis::RedisError::from((
                redis::ErrorKind::InvalidClientConfig,
                "a TLS test server needs the `tls` feature of withlock-test-servers",
            ))),
        }
    }

    fn ping(&self) -> redis::RedisResult<()> {
        redis::cmd("PING").query::<String>(&mut self.connection()?)?;
        Ok(())
    }

    /// The server's URL, `redis://127.0.0.1:<port>` (`rediss://` for a
    /// server started with [`start_tls`](Self::start_tls)), without its
    /// password.
    pub fn url(&self) -> String {
        let scheme = if self.tls_ca.is_some() {
            "rediss"
        } else {
            "redis"
        };
        format!("{scheme}://127.0.0.1:{}", self.port)
    }

    /// [`url`](Self::url) with the password of `--requirepass`, if the
    /// server was started with one.
    pub fn url_with_password(&self) -> String {
        let url = self.url();
        match &self.password {
            Some(password) => url.replacen("://", &format!("://:{password}@"), 1),
            None => url,
        }
    }

    /// The server's port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The server's process id, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.process.pid()
    }

    /// Kills the server (SIGKILL) and waits for it to exit. Its data is
    /// gone: it persists nothing.
    pub fn kill(&self) {
        self.process.kill();
    }

    /// Kills the server if it runs, and starts it again, empty, on the same
    /// port.
    ///
    /// # Errors
    ///
    /// As [`start`](Self::start).
    pub fn restart(&self) -> io::Result<()> {
        self.kill();
        self.spawn()
    }

    /// Stops the server (SIGSTOP): connections stay open and nothing
    /// answers, like a hung server or a cut network.
    ///
    /// # Errors
    ///
    /// When the server does not run or the signal cannot be sent.
    pub fn pause(&self) -> io::Result<()> {
        self.process.pause(&[])
    }

    /// Resumes a paused server (SIGCONT).
    ///
    /// # Errors
    ///
    /// When the server does not run or the signal cannot be sent.
    pub fn resume(&self) -> io::Result<()> {
        self.process.resume()
    }

    /// Closes every client connection of `kind` (`normal`, `pubsub`, …)
    /// with `CLIENT KILL TYPE`, except the one sending it; returns how many
    /// were closed.
    ///
    /// # Errors
    ///
    /// When the server cannot be reached.
    pub fn kill_clients(&self, kind: &str) -> redis::RedisResult<u64> {
        redis::cmd("CLIENT")
            .arg("KILL")
            .arg("TYPE")
            .arg(kind)
            .query(&mut self.connection()?)
    }

    /// The `id=…` fields of the server's client connections of `kind`
    /// (`normal`, `pubsub`, …), as `CLIENT LIST TYPE` gives them.
    ///
    /// # Errors
    ///
    /// When the server cannot be reached.
    pub fn client_ids(&self, kind: &str) -> redis::RedisResult<Vec<String>> {
        let list: String = redis::cmd("CLIENT")
            .arg("LIST")
            .arg("TYPE")
            .arg(kind)
            .query(&mut self.connection()?)?;
        Ok(list
            .lines()
            .filter_map(|l| l.split(' ').next().map(str::to_owned))
            .collect())
    }

    /// Sends `SCRIPT FLUSH`: every cached script is gone.
    ///
    /// # Errors
    ///
    /// When the server cannot be reached.
    pub fn script_flush(&self) -> redis::RedisResult<()> {
        redis::cmd("SCRIPT")
            .arg("FLUSH")
            .query(&mut self.connection()?)
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        if self.pid().is_some() {
            // A paused server must be woken to die promptly on some systems.
            let _ = self.resume();
        }
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

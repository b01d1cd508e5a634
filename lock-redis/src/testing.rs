//! Test support: a Redis server to test against, child servers to kill,
//! restart, pause and cut, and key namespaces that clean up after
//! themselves. Used by this crate's tests; usable by yours.
//!
//! - [`server_url`] gives the server at `REDIS_URL` (default
//!   [`DEFAULT_URL`]) when one answers there, else starts one `redis-server`
//!   child for the whole test process (with the `testcontainers` feature,
//!   a Docker container when `redis-server` cannot be started).
//! - [`RedisServer`] is a dedicated `redis-server` child on a free loopback
//!   port, for tests that break their server. It is killed on drop, and a
//!   watchdog kills it if the test process dies without dropping it.
//! - [`Namespace`] is a random key prefix whose keys (locks and fencing
//!   companions alike) are deleted on drop; [`ScratchBackend`] is a backend
//!   whose every key lives in one.
//!
//! - [`RedisCluster`] is a local Redis Cluster of `redis-server` children (3
//!   masters, 3 replicas by default) to kill masters of and move slots in;
//!   [`shared_cluster`] is one for the whole test process;
//!   [`ScratchClusterBackend`] is a cluster backend in a [`ClusterNamespace`].
//! - [`SentinelGroup`] is a primary, its replicas and three Sentinels, for
//!   failovers.
//!
//! Nothing here ever flushes a database or touches keys it did not make.

use std::io;
use std::net::TcpListener;
use std::ops::Deref;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use crate::{RedisBackend, RedisConfig};

mod cluster;
mod sentinel;

pub use cluster::{shared_cluster, ClusterNamespace, RedisCluster, ScratchClusterBackend};
pub use sentinel::{SentinelAuth, SentinelGroup, MASTER_NAME};

/// The server tests use when `REDIS_URL` is not set.
pub const DEFAULT_URL: &str = "redis://127.0.0.1:6379";

/// The backend's acquisition script, as `EVALSHA` runs it (keys: the lock
/// key and its fencing companion; arguments: the owner token, the ttl and
/// the companion's ttl in milliseconds), for benchmarks and tests that
/// send it by hand.
pub const ACQUIRE_SCRIPT: &str = crate::plumbing::scripts::ACQUIRE_LUA;

/// The backend's release script (keys: the lock key and its fencing
/// companion; arguments: the owner token, the release channel and the
/// companion's idle period in milliseconds).
pub const RELEASE_SCRIPT: &str = include_str!("../lua/release.lua");

/// The cluster backend's release script (as [`RELEASE_SCRIPT`], with
/// `SPUBLISH` on the shard channel of the key's slot, which
/// `RedisClusterBackend::channel` names).
pub const RELEASE_SHARDED_SCRIPT: &str = include_str!("../lua/release_sharded.lua");

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

enum Fallback {
    Child(RedisServer),
    #[cfg(feature = "testcontainers")]
    Docker(Box<DockerRedis>),
}

impl Fallback {
    fn url(&self) -> String {
        match self {
            Self::Child(server) => server.url(),
            #[cfg(feature = "testcontainers")]
            Self::Docker(docker) => docker.url().to_owned(),
        }
    }
}

static FALLBACK: tokio::sync::OnceCell<Fallback> = tokio::sync::OnceCell::const_new();

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
                    Fallback::Child(server)
                }
                Err(error) => no_child(error).await,
            }
        })
        .await;
    fallback.url()
}

#[cfg(not(feature = "testcontainers"))]
async fn no_child(error: io::Error) -> Fallback {
    panic!(
        "no Redis server answers at REDIS_URL and `redis-server` could not be started ({error}); \
         set REDIS_URL, install redis-server, or enable the `testcontainers` feature"
    )
}

#[cfg(feature = "testcontainers")]
async fn no_child(error: io::Error) -> Fallback {
    eprintln!("`redis-server` could not be started ({error}); starting Redis in Docker");
    match DockerRedis::start().await {
        Ok(docker) => Fallback::Docker(Box::new(docker)),
        Err(e) => panic!("no Redis server at REDIS_URL, no redis-server, no Docker: {e}"),
    }
}

/// A Redis server in a Docker container, removed on drop.
#[cfg(feature = "testcontainers")]
pub struct DockerRedis {
    _container: testcontainers::ContainerAsync<testcontainers_modules::redis::Redis>,
    url: String,
}

#[cfg(feature = "testcontainers")]
impl DockerRedis {
    /// Starts the official Redis image and waits until it is ready.
    ///
    /// # Errors
    ///
    /// When Docker is not available or the container does not start.
    pub async fn start() -> Result<Self, testcontainers::TestcontainersError> {
        use testcontainers::runners::AsyncRunner;
        let container = testcontainers_modules::redis::Redis::default()
            .start()
            .await?;
        let host = container.get_host().await?;
        let port = container
            .get_host_port_ipv4(testcontainers_modules::redis::REDIS_PORT)
            .await?;
        Ok(Self {
            _container: container,
            url: format!("redis://{host}:{port}"),
        })
    }

    /// The server's URL.
    pub fn url(&self) -> &str {
        &self.url
    }
}

#[cfg(feature = "testcontainers")]
impl std::fmt::Debug for DockerRedis {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DockerRedis")
            .field("url", &self.url)
            .finish()
    }
}

/// A `redis-server` child of this process on a free loopback port, with no
/// persistence, in a temporary directory. Killed on drop.
#[derive(Debug)]
pub struct RedisServer {
    port: u16,
    dir: PathBuf,
    args: Vec<String>,
    /// Its `--requirepass`, for the connections of this helper.
    password: Option<String>,
    /// The CA (PEM) that signed its certificate, when it speaks only TLS.
    tls_ca: Option<Vec<u8>>,
    running: Mutex<Option<Running>>,
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

#[derive(Debug)]
struct Running {
    server: Child,
    watchdog: Option<Child>,
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
        let port = TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        let dir = std::env::temp_dir().join(format!(
            "withlock-redis-{port}-{:08x}",
            rand::random::<u32>()
        ));
        std::fs::create_dir_all(&dir)?;
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
        let tls_ca = tls.map(|t| std::fs::read(&t.ca)).transpose()?;
        let server = Self {
            port,
            dir,
            args,
            password,
            tls_ca,
            running: Mutex::new(None),
        };
        server.spawn()?;
        Ok(server)
    }

    fn spawn(&self) -> io::Result<()> {
        let child = Command::new("redis-server")
            .args(&self.args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()?;
        // Kills the server if this process dies without dropping `self`.
        let watchdog = Command::new("sh")
            .arg("-c")
            .arg(format!(
                "while kill -0 {parent} 2>/dev/null && kill -0 {child} 2>/dev/null; do sleep 1; done; \
                 kill -9 {child} 2>/dev/null; kill -0 {parent} 2>/dev/null || rm -rf '{dir}'",
                parent = std::process::id(),
                child = child.id(),
                dir = self.dir.display(),
            ))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .ok();
        *self.lock() = Some(Running {
            server: child,
            watchdog,
        });
        self.wait_ready(Duration::from_secs(10))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<Running>> {
        self.running.lock().unwrap_or_else(PoisonError::into_inner)
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

    fn connection(&self) -> redis::RedisResult<redis::Connection> {
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
                "a TLS test server needs the `tls` feature",
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
        self.lock().as_ref().map(|r| r.server.id())
    }

    /// Kills the server (SIGKILL) and waits for it to exit. Its data is
    /// gone: it persists nothing.
    pub fn kill(&self) {
        if let Some(mut running) = self.lock().take() {
            let _ = running.server.kill();
            let _ = running.server.wait();
            if let Some(mut watchdog) = running.watchdog {
                let _ = watchdog.kill();
                let _ = watchdog.wait();
            }
        }
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
        self.signal("-STOP")
    }

    /// Resumes a paused server (SIGCONT).
    ///
    /// # Errors
    ///
    /// When the server does not run or the signal cannot be sent.
    pub fn resume(&self) -> io::Result<()> {
        self.signal("-CONT")
    }

    fn signal(&self, signal: &str) -> io::Result<()> {
        let pid = self
            .pid()
            .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, "the server is not running"))?;
        let status = Command::new("kill")
            .arg(signal)
            .arg(pid.to_string())
            .status()?;
        if status.success() {
            Ok(())
        } else {
            Err(io::Error::other(format!("kill {signal} {pid} failed")))
        }
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

/// A random key prefix on one server, `withlock-redis-test:<16 hex>:`.
/// On drop, every key containing it is deleted: lock keys and their fencing
/// companions (which contain the whole lock key).
#[derive(Debug)]
pub struct Namespace {
    url: String,
    prefix: String,
}

impl Namespace {
    /// A namespace nobody else uses, on the server at `url`.
    ///
    /// Besides the cleanup on drop, the namespace is cleaned up once more
    /// when the test process exits, for namespaces whose owner is leaked on
    /// purpose (a test of a crashed node may `mem::forget` a lock).
    pub fn new(url: &str) -> Self {
        let namespace = Self {
            url: url.to_owned(),
            prefix: format!("withlock-redis-test:{:016x}:", rand::random::<u64>()),
        };
        clean_at_exit(&namespace.url, &namespace.prefix);
        namespace
    }

    /// A key in this namespace.
    pub fn key(&self, name: &str) -> String {
        format!("{}{name}", self.prefix)
    }

    /// The prefix; it contains only characters that a glob matches as
    /// themselves.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The keys on the server that contain the prefix.
    ///
    /// # Errors
    ///
    /// When the server cannot be reached.
    pub fn keys(&self) -> redis::RedisResult<Vec<Vec<u8>>> {
        let client = redis::Client::open(self.url.as_str())?;
        let mut conn = client.get_connection_with_timeout(Duration::from_secs(1))?;
        conn.set_read_timeout(Some(Duration::from_secs(5)))?;
        let pattern = format!("*{}*", self.prefix);
        let mut cursor: u64 = 0;
        let mut keys = Vec::new();
        loop {
            let (next, batch): (u64, Vec<Vec<u8>>) = redis::cmd("SCAN")
                .arg(cursor)
                .arg("MATCH")
                .arg(&pattern)
                .arg("COUNT")
                .arg(1000)
                .query(&mut conn)?;
            keys.extend(batch);
            if next == 0 {
                return Ok(keys);
            }
            cursor = next;
        }
    }

    /// Deletes every key that contains the prefix; returns how many.
    ///
    /// # Errors
    ///
    /// When the server cannot be reached.
    pub fn cleanup(&self) -> redis::RedisResult<usize> {
        let keys = self.keys()?;
        if keys.is_empty() {
            return Ok(0);
        }
        let client = redis::Client::open(self.url.as_str())?;
        let mut conn = client.get_connection_with_timeout(Duration::from_secs(1))?;
        conn.set_read_timeout(Some(Duration::from_secs(5)))?;
        for chunk in keys.chunks(500) {
            redis::cmd("DEL").arg(chunk).query::<u64>(&mut conn)?;
        }
        Ok(keys.len())
    }
}

/// Deletes every key containing the prefix, inside the server.
const CLEANUP_LUA: &str = "local c = '0' repeat \
    local r = redis.call('SCAN', c, 'MATCH', ARGV[1], 'COUNT', 1000) c = r[1] \
    for _, k in ipairs(r[2]) do redis.call('DEL', k) end until c == '0' return 0";

/// Hands `url` and `prefix` to a helper process that waits for this process
/// to exit (its stdin then closes) and deletes the namespace's keys.
fn clean_at_exit(url: &str, prefix: &str) {
    use std::io::Write;
    static HELPER: Mutex<Option<std::process::ChildStdin>> = Mutex::new(None);
    let mut helper = HELPER.lock().unwrap_or_else(PoisonError::into_inner);
    if helper.is_none() {
        let spawned = Command::new("sh")
            .arg("-c")
            .arg(
                "lines=$(cat); printf '%s\\n' \"$lines\" | while read -r url prefix; do \
                 [ -n \"$url\" ] && redis-cli -u \"$url\" EVAL \"$WITHLOCK_CLEANUP_LUA\" 0 \"*$prefix*\" \
                 >/dev/null 2>&1; done",
            )
            .env("WITHLOCK_CLEANUP_LUA", CLEANUP_LUA)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn();
        match spawned {
            Ok(mut child) => *helper = child.stdin.take(),
            Err(e) => eprintln!("no cleanup helper at exit: {e}"),
        }
    }
    if let Some(stdin) = helper.as_mut() {
        let _ = writeln!(stdin, "{url} {prefix}");
    }
}

impl Drop for Namespace {
    fn drop(&mut self) {
        // Not on the background thread that every locker of the process
        // shares (the last lock's clean-up may drop the last reference
        // there): a server that does not answer would block it, and the
        // other tests' locks with it.
        if std::thread::current().name() == Some(lock_core::background::THREAD_NAME) {
            let this = Self {
                url: std::mem::take(&mut self.url),
                prefix: std::mem::take(&mut self.prefix),
            };
            std::thread::spawn(move || drop(this));
            return;
        }
        if let Err(error) = self.cleanup() {
            eprintln!("namespace {} not cleaned up: {error}", self.prefix);
        }
    }
}

/// A [`RedisBackend`] whose every key is in a [`Namespace`] (its prefix),
/// deleted when the backend is dropped. For running the conformance suite
/// on a shared server without leaving fencing counters behind.
#[derive(Debug)]
pub struct ScratchBackend {
    backend: RedisBackend,
    namespace: Namespace,
}

impl ScratchBackend {
    /// A backend on the server at `url`, with `config` and the namespace's
    /// prefix.
    ///
    /// # Panics
    ///
    /// When `url` or `config` is invalid.
    pub fn new(url: &str, config: RedisConfig) -> Self {
        let namespace = Namespace::new(url);
        let config = config.prefix(namespace.prefix());
        let backend = RedisBackend::from_url_with(url, config)
            .unwrap_or_else(|e| panic!("scratch backend: {e}"));
        Self { backend, namespace }
    }

    /// The namespace the backend's keys live in.
    pub fn namespace(&self) -> &Namespace {
        &self.namespace
    }
}

impl Deref for ScratchBackend {
    type Target = RedisBackend;

    fn deref(&self) -> &RedisBackend {
        &self.backend
    }
}

lock_core::forward_lock_backend!(ScratchBackend => backend);
lock_core::forward_lock_admin!(ScratchBackend => backend);

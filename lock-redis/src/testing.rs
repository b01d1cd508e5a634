//! Test support for your own tests on Redis: key namespaces that clean up
//! after themselves, and (with the `testcontainers` feature) a Redis
//! server in Docker.
//!
//! - [`Namespace`] is a random key prefix whose keys (locks and fencing
//!   companions alike) are deleted on drop; [`ScratchBackend`] is a backend
//!   whose every key lives in one.
//! - [`ClusterNamespace`] and [`ScratchClusterBackend`] are the same on a
//!   Redis Cluster, given its nodes' URLs.
//! - `DockerRedis` (feature `testcontainers`) starts the official Redis
//!   image and gives its URL.
//! - [`ACQUIRE_SCRIPT`], [`RELEASE_SCRIPT`] and [`RELEASE_SHARDED_SCRIPT`]
//!   are the backend's scripts, for benchmarks that send them by hand.
//!
//! Nothing here ever flushes a database or touches keys it did not make.
//! (The servers the workspace's own tests start, kill, pause and fail over
//! are in its unpublished `withlock-test-servers` crate.)

use std::ops::Deref;
use std::process::{Command, Stdio};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use crate::{RedisBackend, RedisConfig};

mod cluster;

pub use cluster::{ClusterNamespace, ScratchClusterBackend};

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

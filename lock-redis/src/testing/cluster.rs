//! Key namespaces on a Redis Cluster, and a cluster backend in one.

use std::ops::Deref;
use std::time::Duration;

use crate::{RedisClusterBackend, RedisConfig};

/// A random key prefix on a cluster, `withlock-redis-test:<16 hex>:`. On
/// drop, every key containing it is deleted on every master.
#[derive(Debug)]
pub struct ClusterNamespace {
    urls: Vec<String>,
    prefix: String,
}

impl ClusterNamespace {
    /// A namespace nobody else uses, on the cluster whose nodes are `urls`.
    pub fn new(urls: &[String]) -> Self {
        Self {
            urls: urls.to_vec(),
            prefix: format!("withlock-redis-test:{:016x}:", rand::random::<u64>()),
        }
    }

    /// A key in this namespace.
    pub fn key(&self, name: &str) -> String {
        format!("{}{name}", self.prefix)
    }

    /// The prefix.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// Deletes every key containing the prefix on every node that answers
    /// (replicas refuse the deletion and follow their masters); returns how
    /// many were deleted.
    ///
    /// # Errors
    ///
    /// When no node can be reached.
    pub fn cleanup(&self) -> redis::RedisResult<usize> {
        let mut deleted = 0;
        let mut reached = false;
        let mut last = None;
        for url in &self.urls {
            let conn = redis::Client::open(url.as_str())
                .and_then(|c| c.get_connection_with_timeout(Duration::from_secs(1)));
            let mut conn = match conn {
                Ok(conn) => conn,
                Err(e) => {
                    last = Some(e);
                    continue;
                }
            };
            reached = true;
            let role: Vec<redis::Value> = redis::cmd("ROLE").query(&mut conn)?;
            if !matches!(role.first(), Some(redis::Value::BulkString(r)) if r == b"master") {
                continue;
            }
            let pattern = format!("*{}*", self.prefix);
            let mut cursor: u64 = 0;
            loop {
                let (next, batch): (u64, Vec<Vec<u8>>) = redis::cmd("SCAN")
                    .arg(cursor)
                    .arg("MATCH")
                    .arg(&pattern)
                    .arg("COUNT")
                    .arg(1000)
                    .query(&mut conn)?;
                for key in batch {
                    // One key per DEL: keys of one node may be in many slots.
                    deleted += redis::cmd("DEL").arg(key).query::<usize>(&mut conn)?;
                }
                if next == 0 {
                    break;
                }
                cursor = next;
            }
        }
        match (reached, last) {
            (false, Some(e)) => Err(e),
            _ => Ok(deleted),
        }
    }
}

impl Drop for ClusterNamespace {
    fn drop(&mut self) {
        // Not on the background thread that every locker of the process
        // shares (the last lock's clean-up may drop the last reference
        // there): a server that does not answer would block it, and the
        // other tests' locks with it.
        if std::thread::current().name() == Some(lock_core::background::THREAD_NAME) {
            let this = Self {
                urls: std::mem::take(&mut self.urls),
                prefix: std::mem::take(&mut self.prefix),
            };
            std::thread::spawn(move || drop(this));
            return;
        }
        if let Err(error) = self.cleanup() {
            eprintln!("cluster namespace {} not cleaned up: {error}", self.prefix);
        }
    }
}

/// A [`RedisClusterBackend`] whose every key is in a [`ClusterNamespace`]
/// (its prefix), deleted when the backend is dropped.
#[derive(Debug)]
pub struct ScratchClusterBackend {
    backend: RedisClusterBackend,
    namespace: ClusterNamespace,
}

impl ScratchClusterBackend {
    /// A backend on the cluster whose nodes are `urls`, with `config` and
    /// the namespace's prefix.
    ///
    /// # Panics
    ///
    /// When `urls` or `config` is invalid.
    pub fn new(urls: &[String], config: RedisConfig) -> Self {
        let namespace = ClusterNamespace::new(urls);
        let config = config.prefix(namespace.prefix());
        let backend = RedisClusterBackend::from_urls_with(urls, config)
            .unwrap_or_else(|e| panic!("scratch cluster backend: {e}"));
        Self { backend, namespace }
    }

    /// The namespace the backend's keys live in.
    pub fn namespace(&self) -> &ClusterNamespace {
        &self.namespace
    }
}

impl Deref for ScratchClusterBackend {
    type Target = RedisClusterBackend;

    fn deref(&self) -> &RedisClusterBackend {
        &self.backend
    }
}

lock_core::forward_lock_backend!(ScratchClusterBackend => backend);
lock_core::forward_lock_admin!(ScratchClusterBackend => backend);

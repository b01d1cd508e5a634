//! The operator's functions ([`LockAdmin`]) on a Redis Cluster: the
//! scripts of the single-server backend (see `crate::admin`), each on the
//! master of its key's slot, and a listing that scans every master.

use lock_core::{
    async_trait, AdminError, BackendError, BackendErrorKind, LockAdmin, LockInfo, LockList,
    Unreachable,
};
use redis::Value;

use crate::admin::{
    companion_pattern, forced, info, locks_of_companions, scan, Forced, Read, BATCH,
};
use crate::cluster::RedisClusterBackend;
use crate::cluster_nodes::{Lane, Node};
use crate::plumbing::scripts::{Lua, ADMIN_FORCE_RELEASE, ADMIN_READ};
use crate::slot::{fence_key, kept_key};

/// Lists, inspects and force-releases locks on the cluster, with the
/// keys, scripts and answers of [`RedisBackend`](crate::RedisBackend)'s
/// admin.
///
/// - `list_locks_partial` runs `SCAN … MATCH` for fencing companions on
///   every master of the slot map (`CLUSTER SLOTS`) at once, since each
///   master holds only its own slots' keys, then reads each lock found on
///   the master of its slot. A master that fails or does not answer (each
///   request bounded by the step timeout, [`RedisConfig::step_timeout`](crate::RedisConfig::step_timeout)),
///   and the slots the cluster names no master address for, are named in
///   [`LockList::unreachable`] (`host:port`, or `slots F-L`) with their
///   error, and the locks of the other masters listed; it fails as a whole
///   only when the slot map cannot be read or no master answered. As with
///   any `SCAN`, a key taken, freed or moved during the listing may or may
///   not appear.
/// - `list_locks` is the same listing, whole or failed: any master that
///   did not answer fails it, with an error naming that master.
/// - `inspect` and `force_release` run one script on the master of the
///   key's slot (the lock key and its companion share it), following
///   `MOVED` / `ASK`. `force_release` frees only a lock of withlock's format
///   (refusing anything else with [`AdminError::NotALock`], key untouched)
///   and announces the release with `SPUBLISH` on the shard channel of the
///   key's slot ([`RedisClusterBackend::channel`]), in the same script run.
#[async_trait]
impl LockAdmin for RedisClusterBackend {
    async fn list_locks(&self, prefix: &str) -> Result<Vec<LockInfo>, BackendError> {
        let list = self.list_locks_partial(prefix).await?;
        match list.unreachable.into_iter().next() {
            None => Ok(list.locks),
            Some(unreachable) => Err(not_listed(unreachable)),
        }
    }

    async fn list_locks_partial(&self, prefix: &str) -> Result<LockList, BackendError> {
        let redis_prefix = self.lock_key(prefix);
        let pattern = companion_pattern(&redis_prefix);
        let map = self.bounded("scan", self.nodes().map()).await?;
        let masters: Vec<Node> = map.masters().into_iter().flatten().collect();
        let listings = masters
            .iter()
            .map(|master| self.locks_of_master(master, &pattern, &redis_prefix));
        let mut locks = Vec::new();
        let mut unreachable = Vec::new();
        let mut answered = false;
        for (master, listing) in masters
            .iter()
            .zip(futures_util::future::join_all(listings).await)
        {
            match listing {
                Ok(found) => {
                    answered = true;
                    locks.extend(found);
                }
                Err(error) => {
                    let (host, port) = master;
                    unreachable.push(Unreachable::new(format!("{host}:{port}"), error));
                }
            }
        }
        // No master answered: nothing to list.
        if !answered && !unreachable.is_empty() {
            return Err(not_listed(unreachable.swap_remove(0)));
        }
        for (first, last) in map.unaddressed() {
            unreachable.push(Unreachable::new(
                format!("slots {first}-{last}"),
                BackendError::message(
                    BackendErrorKind::Unavailable,
                    "the cluster announces no address for the master of these slots",
                ),
            ));
        }
        // A key seen on two masters (its slot moved during the scan) once.
        locks.sort_by(|a, b| a.key.cmp(&b.key));
        locks.dedup_by(|a, b| a.key == b.key);
        Ok(LockList::partial(locks, unreachable))
    }

    async fn inspect(&self, key: &str) -> Result<LockInfo, BackendError> {
        let lock_key = self.lock_key(key);
        let answer: Read = self
            .admin_script("inspect", &ADMIN_READ, &lock_key, &[])
            .await?;
        info(&self.config().prefix, &lock_key, answer)
    }

    async fn force_release(&self, key: &str) -> Result<Option<LockInfo>, AdminError> {
        let lock_key = self.lock_key(key);
        let channel = self.channel(key);
        let answer: Forced = self
            .admin_script(
                "force release",
                &ADMIN_FORCE_RELEASE,
                &lock_key,
                &["SPUBLISH", &channel, &self.config().fence_idle_ms()],
            )
            .await?;
        forced(&self.config().prefix, &lock_key, answer)
    }
}

impl RedisClusterBackend {
    /// The locks held now among the keys `master` holds whose companions
    /// match `pattern` (Redis keys starting with `redis_prefix`): `SCAN`
    /// on `master`, then a read of each, every request within the step
    /// timeout.
    async fn locks_of_master(
        &self,
        master: &Node,
        pattern: &str,
        redis_prefix: &str,
    ) -> Result<Vec<LockInfo>, BackendError> {
        let mut keys = Vec::new();
        let mut cursor: u64 = 0;
        loop {
            let mut pipe = redis::pipe();
            pipe.add_command(scan(cursor, pattern));
            let answer = self
                .bounded("scan", self.nodes().send(master, Lane::Steps, &pipe, 0, 1))
                .await?;
            let answer = self.answer(answer.into_iter().next())?;
            let (next, found): (u64, Vec<Vec<u8>>) = redis::from_redis_value(&answer)
                .map_err(|e| BackendError::new(BackendErrorKind::Protocol, e))?;
            keys.extend(locks_of_companions(&found, redis_prefix));
            if next == 0 {
                break;
            }
            cursor = next;
        }
        keys.sort();
        keys.dedup();
        let prefix = self.config().prefix.as_str();
        let mut held = Vec::new();
        for chunk in keys.chunks(BATCH) {
            let reads = chunk.iter().map(|key| async move {
                let answer: Read = self.admin_script("read", &ADMIN_READ, key, &[]).await?;
                info(prefix, key, answer)
            });
            for info in futures_util::future::try_join_all(reads).await? {
                if info.is_held() {
                    held.push(info);
                }
            }
        }
        Ok(held)
    }

    /// Runs an admin script on the master of `lock_key`'s slot, with the
    /// lock key, its fencing companion and its hold's record as keys,
    /// within the step timeout.
    async fn admin_script<T: redis::FromRedisValue>(
        &self,
        step: &'static str,
        lua: &'static Lua,
        lock_key: &str,
        args: &[&str],
    ) -> Result<T, BackendError> {
        let (fence, kept) = (fence_key(lock_key), kept_key(lock_key));
        let answer: Value = self
            .eval(step, Lane::Steps, lua, &[lock_key, &fence, &kept], args)
            .await?;
        redis::from_redis_value(&answer)
            .map_err(|e| BackendError::new(BackendErrorKind::Protocol, e))
    }
}

/// A listing that a master did not answer, naming it; its error is the
/// source.
#[derive(Debug, thiserror::Error)]
#[error("the master {node} did not answer the listing; its locks cannot be listed")]
struct NotListed {
    node: String,
    source: BackendError,
}

/// The error of a listing that `unreachable` did not answer.
fn not_listed(unreachable: Unreachable) -> BackendError {
    let Unreachable { node, error, .. } = unreachable;
    BackendError::new(
        error.kind(),
        NotListed {
            node,
            source: error,
        },
    )
}

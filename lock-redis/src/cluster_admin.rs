//! The operator's functions ([`LockAdmin`]) on a Redis Cluster: the
//! scripts of the single-server backend (see `crate::admin`), each on the
//! master of its key's slot, and a listing that scans every master.

use lock_core::{async_trait, AdminError, BackendError, BackendErrorKind, LockAdmin, LockInfo};
use redis::Value;

use crate::admin::{
    companion_pattern, forced, info, locks_of_companions, scan, Forced, Read, BATCH,
};
use crate::cluster::RedisClusterBackend;
use crate::cluster_nodes::Lane;
use crate::plumbing::scripts::{Lua, ADMIN_FORCE_RELEASE, ADMIN_READ};
use crate::slot::{fence_key, kept_key};

/// Lists, inspects and force-releases locks on the cluster, with the
/// keys, scripts and answers of [`RedisBackend`](crate::RedisBackend)'s
/// admin.
///
/// - `list_locks` runs `SCAN … MATCH` for fencing companions on every
///   master of the slot map (`CLUSTER SLOTS`), since each master holds only
///   its own slots' keys, then reads each lock found on the master of its
///   slot. A master the cluster names no address for fails the listing,
///   rather than leaving its locks out. As with any `SCAN`, a key taken,
///   freed or moved during the listing may or may not appear.
/// - `inspect` and `force_release` run one script on the master of the
///   key's slot (the lock key and its companion share it), following
///   `MOVED` / `ASK`. `force_release` frees only a lock of withlock's format
///   (refusing anything else with [`AdminError::NotALock`], key untouched)
///   and announces the release with `SPUBLISH` on the shard channel of the
///   key's slot ([`RedisClusterBackend::channel`]), in the same script run.
#[async_trait]
impl LockAdmin for RedisClusterBackend {
    async fn list_locks(&self, prefix: &str) -> Result<Vec<LockInfo>, BackendError> {
        let redis_prefix = self.lock_key(prefix);
        let pattern = companion_pattern(&redis_prefix);
        let map = self.bounded("scan", self.nodes().map()).await?;
        let mut keys = Vec::new();
        for master in map.masters() {
            let Some(master) = master else {
                return Err(BackendError::message(
                    BackendErrorKind::Unavailable,
                    "the cluster announces no address for the master of some slots: their locks cannot be listed",
                ));
            };
            let mut cursor: u64 = 0;
            loop {
                let mut pipe = redis::pipe();
                pipe.add_command(scan(cursor, &pattern));
                let answer = self
                    .bounded("scan", self.nodes().send(&master, Lane::Steps, &pipe, 0, 1))
                    .await?;
                let answer = self.answer(answer.into_iter().next())?;
                let (next, found): (u64, Vec<Vec<u8>>) = redis::from_redis_value(&answer)
                    .map_err(|e| BackendError::new(BackendErrorKind::Protocol, e))?;
                keys.extend(locks_of_companions(&found, &redis_prefix));
                if next == 0 {
                    break;
                }
                cursor = next;
            }
        }
        // A key seen on two masters (its slot moved during the scan) once.
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

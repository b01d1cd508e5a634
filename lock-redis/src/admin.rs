//! The operator's functions ([`LockAdmin`]) on one Redis server, also
//! behind Sentinel; what the Redis Cluster backend shares with them (the
//! scripts, reading their answers, finding locks by their companions).

use std::time::Duration;

use lock_core::{
    async_trait, AdminError, BackendError, BackendErrorKind, LockAdmin, LockInfo, OwnerToken,
};

use crate::backend::RedisBackend;
use crate::plumbing::errors::map_redis_error;
use crate::plumbing::scripts::{Query, ADMIN_FORCE_RELEASE, ADMIN_READ};
use crate::plumbing::timeout::within;
use crate::single_node::{SingleNode, Source};
use crate::slot::{fence_key, kept_key, FENCE_INFIX};

/// How many keys one `SCAN` step asks for, and how many locks one pipeline
/// of reads carries.
pub(crate) const BATCH: usize = 500;

/// The answer of `admin_read.lua`: the lock key's value (or `<type>`), its
/// `PTTL`, the companion's value, and the hold's record's value.
pub(crate) type Read = (Option<String>, i64, Option<String>, Option<String>);

/// The answer of `admin_force_release.lua`: its verdict, then what it read.
pub(crate) type Forced = (String, Option<String>, i64, Option<String>, Option<String>);

/// Lists, inspects and force-releases locks on the server (in Sentinel
/// mode, on the primary the Sentinels name).
///
/// - `list_locks` finds keys through their fencing companions
///   (`{T}:withlock-fence:<key>`) with `SCAN … MATCH`, never `KEYS`, so
///   the server is not blocked; a lock set by another client of the same
///   wire format that never drew a token is not listed. As with any
///   `SCAN`, a key taken or freed during the listing may or may not
///   appear.
/// - `inspect` reads the key, its ttl, its companion and the record of its
///   minimum hold in one script run (they share a hash slot). A key of
///   another type, as a client that keeps its locks in a hash makes, shows
///   as held by `<hash>`. A lock whose run ended before its minimum hold
///   \[H7\] shows [`LockInfo::minimum_hold_left`] (its `PTTL`) while the
///   record ([`RedisBackend::kept_key`], written by the hold step) holds
///   the lock key's own value.
/// - `force_release` deletes the key only if it is a string holding an
///   owner token (`<node id>/<32 hex>`), with an expiry and a fencing
///   companion, and then publishes the release on [`RedisBackend::channel`]
///   so that waiters try at once; anything else is refused with
///   [`AdminError::NotALock`] and left as it was. Check, delete and
///   publish are one script run. The fencing counter stays, so tokens keep
///   increasing.
///
/// Each call is one or more round trips, each bounded by the command
/// timeout.
#[async_trait]
impl LockAdmin for RedisBackend {
    async fn list_locks(&self, prefix: &str) -> Result<Vec<LockInfo>, BackendError> {
        self.steps().list_locks(prefix).await
    }

    async fn inspect(&self, key: &str) -> Result<LockInfo, BackendError> {
        self.steps().inspect(key).await
    }

    async fn force_release(&self, key: &str) -> Result<Option<LockInfo>, AdminError> {
        self.steps().force_release(key).await
    }
}

/// The admin functions of every single-node backend (its own, and
/// [`RedisSentinelBackend`](crate::RedisSentinelBackend)'s on the primary
/// the Sentinels name).
impl<S: Source> SingleNode<S> {
    pub(crate) async fn list_locks(&self, prefix: &str) -> Result<Vec<LockInfo>, BackendError> {
        let redis_prefix = self.lock_key(prefix).into_owned();
        let pattern = companion_pattern(&redis_prefix);
        let mut keys = Vec::new();
        let mut cursor: u64 = 0;
        loop {
            let (next, batch): (u64, Vec<Vec<u8>>) =
                self.admin_query("scan", &scan(cursor, &pattern)).await?;
            keys.extend(locks_of_companions(&batch, &redis_prefix));
            if next == 0 {
                break;
            }
            cursor = next;
        }
        keys.sort();
        keys.dedup();
        let mut held = Vec::new();
        if keys.is_empty() {
            return Ok(held);
        }
        // Loaded first: a pipeline cannot load a script it finds missing.
        let hash: String = self
            .admin_query("load script", &ADMIN_READ.load_cmd())
            .await?;
        let prefix = self.config().prefix.as_str();
        for chunk in keys.chunks(BATCH) {
            let mut pipe = redis::pipe();
            for key in chunk {
                pipe.cmd("EVALSHA")
                    .arg(&hash)
                    .arg(3)
                    .arg(key)
                    .arg(fence_key(key))
                    .arg(kept_key(key));
            }
            let answers: Vec<Read> = self.admin_query("read", &pipe).await?;
            for (key, answer) in chunk.iter().zip(answers) {
                let info = info(prefix, key, answer)?;
                if info.is_held() {
                    held.push(info);
                }
            }
        }
        Ok(held)
    }

    pub(crate) async fn inspect(&self, key: &str) -> Result<LockInfo, BackendError> {
        let lock_key = self.lock_key(key);
        let (fence, kept) = (fence_key(&lock_key), kept_key(&lock_key));
        let answer = self
            .run_script("inspect", &ADMIN_READ, &[&lock_key, &fence, &kept], &[])
            .await?;
        info(&self.config().prefix, &lock_key, answer)
    }

    pub(crate) async fn force_release(&self, key: &str) -> Result<Option<LockInfo>, AdminError> {
        let lock_key = self.lock_key(key);
        let (fence, kept) = (fence_key(&lock_key), kept_key(&lock_key));
        let answer = self
            .run_script(
                "force release",
                &ADMIN_FORCE_RELEASE,
                &[&lock_key, &fence, &kept],
                &["PUBLISH", self.channel(), &self.config().fence_idle_ms()],
            )
            .await?;
        forced(&self.config().prefix, &lock_key, answer)
    }
}

impl<S: Source> SingleNode<S> {
    /// Runs one command or pipeline on the backend's connection, bounded
    /// by the command timeout.
    async fn admin_query<T: redis::FromRedisValue>(
        &self,
        step: &'static str,
        query: &(impl Query + Sync),
    ) -> Result<T, BackendError> {
        let limit = self.config().step_timeout;
        within(step, limit, async {
            // The backend's own connection: in Sentinel mode it goes to the
            // primary the Sentinels name, which a pool could not follow.
            let mut conn = self.connection().await?;
            query.run(&mut conn).await.map_err(map_redis_error)
        })
        .await
    }
}

/// `SCAN cursor MATCH pattern COUNT BATCH`.
pub(crate) fn scan(cursor: u64, pattern: &str) -> redis::Cmd {
    let mut cmd = redis::cmd("SCAN");
    cmd.arg(cursor)
        .arg("MATCH")
        .arg(pattern)
        .arg("COUNT")
        .arg(BATCH);
    cmd
}

/// The `SCAN … MATCH` pattern of the companions of the Redis keys starting
/// with `redis_prefix`.
pub(crate) fn companion_pattern(redis_prefix: &str) -> String {
    format!("*{FENCE_INFIX}{}*", glob_escape(redis_prefix))
}

/// The lock keys starting with `redis_prefix` among `found`, the keys a
/// `SCAN` for companions gave.
pub(crate) fn locks_of_companions<'a>(
    found: &'a [Vec<u8>],
    redis_prefix: &'a str,
) -> impl Iterator<Item = String> + 'a {
    found
        .iter()
        .filter_map(|fence| std::str::from_utf8(fence).ok())
        .filter_map(lock_key_of_fence)
        .filter(move |key| key.starts_with(redis_prefix))
        .map(str::to_owned)
}

/// A [`LockInfo`] from `admin_read.lua`'s answer for `lock_key`, a key of a
/// backend whose keys carry `prefix`.
pub(crate) fn info(
    prefix: &str,
    lock_key: &str,
    (value, pttl, fence, kept): Read,
) -> Result<LockInfo, BackendError> {
    let key = lock_key.strip_prefix(prefix).unwrap_or(lock_key);
    let fencing_token = fence
        .map(|v| {
            v.parse::<u64>().map_err(|_| {
                BackendError::message(
                    BackendErrorKind::Protocol,
                    format!("the fencing counter of {key:?} is not a number"),
                )
            })
        })
        .transpose()?;
    // PTTL: -2 the key is gone (it may have expired since GET in a
    // pipeline that is not atomic), -1 no expiry.
    let info = match (value, pttl) {
        (Some(_), -2) | (None, _) => LockInfo::free(key),
        (Some(value), -1) => LockInfo::held(key, OwnerToken::from_value(value), None),
        (Some(value), ms) => {
            let left = Duration::from_millis(u64::try_from(ms).unwrap_or(0));
            // [H7] The hold's record counts only while it names the
            // holder: the lock then expires when the hold ends.
            let kept = kept.as_deref() == Some(value.as_str());
            LockInfo::held(key, OwnerToken::from_value(value), Some(left))
                .with_minimum_hold_left(kept.then_some(left))
        }
    };
    Ok(info.with_fencing_token(fencing_token))
}

/// What `admin_force_release.lua` answered for `lock_key`: what it freed,
/// `None` for a free key, or why it refused.
pub(crate) fn forced(
    prefix: &str,
    lock_key: &str,
    (verdict, value, pttl, fence, kept): Forced,
) -> Result<Option<LockInfo>, AdminError> {
    let read = info(prefix, lock_key, (value, pttl, fence, kept))?;
    let found = match verdict.as_str() {
        "freed" => return Ok(Some(read)),
        "free" => return Ok(None),
        "type" => match read.owner.as_ref().map(OwnerToken::as_str) {
            Some("<list>") => "a list".to_owned(),
            Some("<hash>") => "a hash".to_owned(),
            Some("<set>") => "a set".to_owned(),
            Some("<zset>") => "a sorted set".to_owned(),
            Some("<stream>") => "a stream".to_owned(),
            Some(other) => format!("a key of type {}", other.trim_matches(['<', '>'])),
            None => "a key of another type".to_owned(),
        },
        "no-expiry" => "a string without an expiry".to_owned(),
        "format" => "a value not in withlock's owner-token format".to_owned(),
        "no-fence" => "an owner token without withlock's fencing companion".to_owned(),
        other => {
            return Err(AdminError::Backend(BackendError::message(
                BackendErrorKind::Protocol,
                format!("the force release script answered {other:?}"),
            )))
        }
    };
    Err(AdminError::NotALock {
        key: read.key,
        found,
    })
}

/// The Redis key whose fencing companion is `fence`, if `fence` is one.
///
/// The companion is `{T}:withlock-fence:<key>` where `T` never contains
/// `}`, so the first `}` closes `T`; the answer is checked by building the
/// companion again, which rules out keys that merely look like one.
fn lock_key_of_fence(fence: &str) -> Option<&str> {
    let close = fence.find('}')?;
    let key = fence.get(close + 1..)?.strip_prefix(FENCE_INFIX)?;
    (fence.starts_with('{') && fence_key(key) == fence).then_some(key)
}

/// `text` with the characters that `SCAN … MATCH` treats as a pattern
/// escaped, so that it matches itself only.
fn glob_escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\') {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn companions_lead_back_to_their_key() {
        for key in [
            "a",
            "nightly:import",
            "{user}.job",
            "x}y",
            "}{",
            "a:withlock-fence:b",
            "🔒 *?[]",
            "{}",
        ] {
            assert_eq!(lock_key_of_fence(&fence_key(key)), Some(key), "{key:?}");
        }
    }

    #[test]
    fn keys_that_only_look_like_companions_are_refused() {
        assert_eq!(lock_key_of_fence("{x}:withlock-fence:y"), None);
        assert_eq!(lock_key_of_fence("plain"), None);
        assert_eq!(lock_key_of_fence("{a}:other:a"), None);
        // A lock key shaped like a companion is not taken for one.
        let odd = "{job}:withlock-fence:job2";
        assert_eq!(lock_key_of_fence(odd), None);
        assert_eq!(lock_key_of_fence(&fence_key(odd)), Some(odd));
    }

    #[test]
    fn glob_metacharacters_are_escaped() {
        assert_eq!(glob_escape("a*b?c[d]e\\f"), "a\\*b\\?c\\[d\\]e\\\\f");
        assert_eq!(glob_escape("plain:key"), "plain:key");
    }
}

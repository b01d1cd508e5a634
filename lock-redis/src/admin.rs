//! Operator functions: which locks are held now, one key's state, and a
//! forced release. For tools such as the `withlock` command; the lock steps
//! themselves never use them.

use std::future::Future;
use std::sync::LazyLock;
use std::time::Duration;

use lock_core::{BackendError, BackendErrorKind, OwnerToken};

use crate::backend::{map_redis_error, RedisBackend};
use crate::slot::{fence_key, FENCE_INFIX};

/// Reads a lock key, its ttl and its companion whatever their types, and
/// with a channel as its argument also frees the key (a forced release).
const READ_LUA: &str = include_str!("../lua/admin_read.lua");
static READ: LazyLock<redis::Script> = LazyLock::new(|| redis::Script::new(READ_LUA));

/// How many keys one `SCAN` step asks for, and how many locks one pipeline
/// of reads carries.
const BATCH: usize = 500;

/// What the store says about one key, read in one go.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct LockInfo {
    /// The key, as given to `with_lock` (without the backend's prefix).
    pub key: String,
    /// The value the lock key holds, normally `<node id>/<32 hex>`, or
    /// `<hash>` (the key's type) for a key of another type, as a client that
    /// keeps its locks in a hash makes; `None` when the key is free.
    pub owner: Option<OwnerToken>,
    /// How long the lock lives without an extension; `None` when the key
    /// is free, or when its value was set without an expiry (not by
    /// withlock).
    pub ttl: Option<Duration>,
    /// The last fencing token drawn for the key (its companion counter);
    /// `None` when no token was ever drawn.
    pub fencing_token: Option<u64>,
}

impl LockInfo {
    /// Whether the key is held now.
    pub fn is_held(&self) -> bool {
        self.owner.is_some()
    }

    /// The node id part of the holder's owner token.
    pub fn node_id(&self) -> Option<&str> {
        self.owner.as_ref().map(OwnerToken::node_id)
    }
}

impl RedisBackend {
    /// The locks held now whose key starts with `prefix`, ordered by key,
    /// each with its holder, remaining ttl and last fencing token.
    ///
    /// Keys are found through their fencing companions
    /// (`{T}:withlock-fence:<key>`) with `SCAN … MATCH`, never `KEYS`, so
    /// the server is not blocked; a lock set by another client of the same
    /// wire format that never drew a token is not listed. As with any
    /// `SCAN`, a key taken or freed during the listing may or may not
    /// appear.
    ///
    /// # Errors
    ///
    /// The first failed round trip, each bounded by the command timeout.
    ///
    /// # Cancel safety
    ///
    /// Read only: dropping the future changes nothing.
    pub async fn list_locks(&self, prefix: &str) -> Result<Vec<LockInfo>, BackendError> {
        let redis_prefix = self.lock_key(prefix).into_owned();
        let pattern = format!("*{FENCE_INFIX}{}*", glob_escape(&redis_prefix));
        let mut keys = Vec::new();
        let mut cursor: u64 = 0;
        loop {
            let (next, batch): (u64, Vec<Vec<u8>>) = self
                .admin_query(
                    "scan",
                    redis::cmd("SCAN")
                        .arg(cursor)
                        .arg("MATCH")
                        .arg(&pattern)
                        .arg("COUNT")
                        .arg(BATCH),
                )
                .await?;
            keys.extend(
                batch
                    .iter()
                    .filter_map(|fence| std::str::from_utf8(fence).ok())
                    .filter_map(lock_key_of_fence)
                    .filter(|key| key.starts_with(&redis_prefix))
                    .map(str::to_owned),
            );
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
            .admin_query(
                "load script",
                redis::cmd("SCRIPT").arg("LOAD").arg(READ_LUA),
            )
            .await?;
        for chunk in keys.chunks(BATCH) {
            let mut pipe = redis::pipe();
            for key in chunk {
                pipe.cmd("EVALSHA")
                    .arg(&hash)
                    .arg(2)
                    .arg(key)
                    .arg(fence_key(key));
            }
            let answers: Vec<(Option<String>, i64, Option<String>)> =
                self.admin_query("read", &pipe).await?;
            for (key, answer) in chunk.iter().zip(answers) {
                let info = self.info(key, answer)?;
                if info.is_held() {
                    held.push(info);
                }
            }
        }
        Ok(held)
    }

    /// The state of `key`: its holder and remaining ttl if it is held, and
    /// its last fencing token, read in one script run (the lock key and its
    /// companion share a hash slot). A key of another type, as a client
    /// that keeps its locks in a hash makes, shows as held by `<hash>`.
    ///
    /// # Errors
    ///
    /// The failed round trip, bounded by the command timeout.
    ///
    /// # Cancel safety
    ///
    /// Read only: dropping the future changes nothing.
    pub async fn inspect(&self, key: &str) -> Result<LockInfo, BackendError> {
        let lock_key = self.lock_key(key);
        let fence = fence_key(&lock_key);
        let answer = self
            .run_script("inspect", &READ, &[&lock_key, &fence], &[])
            .await?;
        self.info(&lock_key, answer)
    }

    /// Frees `key` whoever holds it, and publishes the release so that
    /// waiters try at once. Gives what the key held just before, or `None`
    /// when it was free. The fencing counter stays, so tokens keep
    /// increasing.
    ///
    /// The holder is not told: its next extension finds the key gone and
    /// its call ends with a lost lock. Meant for a holder that is known to
    /// be dead, whose lock would otherwise last until its ttl.
    ///
    /// One script run that reads the key as [`inspect`](Self::inspect)
    /// does, then deletes it, whatever its type, and publishes the release
    /// (even when the key was free: waiters then try once more, which is
    /// harmless).
    ///
    /// # Errors
    ///
    /// The failed round trip, bounded by the command timeout; the key may
    /// or may not have been freed then.
    ///
    /// # Cancel safety
    ///
    /// A dropped call may or may not have freed the key.
    pub async fn force_release(&self, key: &str) -> Result<Option<LockInfo>, BackendError> {
        let lock_key = self.lock_key(key);
        let fence = fence_key(&lock_key);
        let answer = self
            .run_script(
                "force release",
                &READ,
                &[&lock_key, &fence],
                &[self.channel()],
            )
            .await?;
        let info = self.info(&lock_key, answer)?;
        Ok(info.is_held().then_some(info))
    }

    /// Runs one command or pipeline on a pooled connection, bounded by the
    /// command timeout.
    async fn admin_query<T: redis::FromRedisValue>(
        &self,
        step: &'static str,
        query: &(impl AdminQuery + Sync),
    ) -> Result<T, BackendError> {
        let limit = self.config().step_timeout;
        bounded(step, limit, async {
            // The backend's own connection: in Sentinel mode it goes to the
            // primary the Sentinels name, which a pool could not follow.
            let mut conn = self.connection().await?;
            query.run(&mut conn).await.map_err(map_redis_error)
        })
        .await
    }

    /// A [`LockInfo`] from `GET key`, `PTTL key` and `GET counter`.
    fn info(
        &self,
        lock_key: &str,
        (value, pttl, fence): (Option<String>, i64, Option<String>),
    ) -> Result<LockInfo, BackendError> {
        let key = lock_key
            .strip_prefix(self.config().prefix.as_str())
            .unwrap_or(lock_key)
            .to_owned();
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
        let (owner, ttl) = match (value, pttl) {
            (Some(_), -2) | (None, _) => (None, None),
            (Some(value), -1) => (Some(OwnerToken::from_value(value)), None),
            (Some(value), ms) => (
                Some(OwnerToken::from_value(value)),
                Some(Duration::from_millis(u64::try_from(ms).unwrap_or(0))),
            ),
        };
        Ok(LockInfo {
            key,
            owner,
            ttl,
            fencing_token,
        })
    }
}

/// A command or a pipeline, sent the same way.
trait AdminQuery {
    fn run<T: redis::FromRedisValue>(
        &self,
        conn: &mut redis::aio::MultiplexedConnection,
    ) -> impl Future<Output = redis::RedisResult<T>> + Send;
}

impl AdminQuery for redis::Cmd {
    fn run<T: redis::FromRedisValue>(
        &self,
        conn: &mut redis::aio::MultiplexedConnection,
    ) -> impl Future<Output = redis::RedisResult<T>> + Send {
        self.query_async(conn)
    }
}

impl AdminQuery for redis::Pipeline {
    fn run<T: redis::FromRedisValue>(
        &self,
        conn: &mut redis::aio::MultiplexedConnection,
    ) -> impl Future<Output = redis::RedisResult<T>> + Send {
        self.query_async(conn)
    }
}

async fn bounded<T>(
    step: &'static str,
    limit: Duration,
    work: impl Future<Output = Result<T, BackendError>>,
) -> Result<T, BackendError> {
    match tokio::time::timeout(limit, work).await {
        Ok(answer) => answer,
        Err(_) => Err(BackendError::timeout(step, limit)),
    }
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

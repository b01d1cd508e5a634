//! Every Lua script of the Redis backends (`lua/*.lua`), each defined
//! once, and how a call of one is sent: one `EVALSHA` with its keys and
//! arguments, and after `NOSCRIPT` (a restarted or flushed server, a
//! cluster node that never saw it) `SCRIPT LOAD` of its source, then the
//! same call again. `NOSCRIPT` means the call did not run, so sending it
//! again is routing, not a retry.

use std::future::Future;
use std::sync::OnceLock;

use std::time::Duration;

use lock_core::{AcquireOutcome, BackendError, BackendErrorKind, ExtendOutcome, ReleaseOutcome};
use redis::aio::MultiplexedConnection;
use redis::{ErrorKind, FromRedisValue, RedisResult, Script};

use crate::plumbing::errors::map_redis_error;

/// The acquisition script: `SET NX PX`, then the fencing token.
pub(crate) const ACQUIRE_LUA: &str = include_str!("../../lua/acquire.lua");

/// The acquisition script, on one server and on a cluster.
pub(crate) static ACQUIRE: Lua = Lua::new(ACQUIRE_LUA);
/// Several acquisitions in one script run (see [`crate::batch`]): the
/// step as a function (`lua/fencing.lua`), and the loop.
pub(crate) static ACQUIRE_BATCH: Lua = Lua::new(concat!(
    include_str!("../../lua/fencing.lua"),
    "\n",
    include_str!("../../lua/acquire_batch.lua")
));
/// The extension script, on one server and on a cluster.
pub(crate) static EXTEND: Lua = Lua::new(include_str!("../../lua/extend.lua"));
/// The minimum hold's script \[H7\]: the extension, and the hold's record
/// beside the lock (`lua/hold_record.lua`, then `lua/extend.lua`).
pub(crate) static HOLD: Lua = Lua::new(concat!(
    include_str!("../../lua/hold_record.lua"),
    "\n",
    include_str!("../../lua/extend.lua")
));
/// The release script of one server: a grant to the fair queue's head
/// \[F1\], `PUBLISH`ed on its node's grant channel \[F4\], or the key
/// freed, `PUBLISH`ed on the release channel.
pub(crate) static RELEASE: Lua = Lua::new(include_str!("../../lua/release.lua"));
/// Several releases in one script run (see [`crate::batch`]), each as
/// [`RELEASE`].
pub(crate) static RELEASE_BATCH: Lua = Lua::new(concat!(
    include_str!("../../lua/fencing.lua"),
    "\n",
    include_str!("../../lua/queue.lua"),
    "\n",
    include_str!("../../lua/release_batch.lua")
));
/// The release of a user whose ACL does not reach the fair queue's keys
/// \[F6\]: the key freed and announced, as before the queue.
pub(crate) static RELEASE_UNQUEUED: Lua = Lua::new(include_str!("../../lua/release_unqueued.lua"));
/// Several releases of such a user in one script run.
pub(crate) static RELEASE_BATCH_UNQUEUED: Lua =
    Lua::new(include_str!("../../lua/release_batch_unqueued.lua"));
/// One attempt of a waiter in the key's fair queue \[F1–F3\].
pub(crate) static ACQUIRE_QUEUED: Lua = Lua::new(concat!(
    include_str!("../../lua/fencing.lua"),
    "\n",
    include_str!("../../lua/queue.lua"),
    "\n",
    include_str!("../../lua/acquire_queued.lua")
));
/// A waiter's place left, an untaken grant handed on \[F2\].
pub(crate) static LEAVE_QUEUE: Lua = Lua::new(concat!(
    include_str!("../../lua/fencing.lua"),
    "\n",
    include_str!("../../lua/queue.lua"),
    "\n",
    include_str!("../../lua/leave_queue.lua")
));
/// The release script of a cluster: `SPUBLISH` on the slot's shard channel.
pub(crate) static RELEASE_SHARDED: Lua = Lua::new(include_str!("../../lua/release_sharded.lua"));
/// Reads a lock key, its ttl and its companion whatever their types.
pub(crate) static ADMIN_READ: Lua = Lua::new(include_str!("../../lua/admin_read.lua"));
/// Frees a lock of withlock's format and announces it, in one script run.
pub(crate) static ADMIN_FORCE_RELEASE: Lua =
    Lua::new(include_str!("../../lua/admin_force_release.lua"));

/// A Lua script: its source, and its SHA1 (worked out on first use).
pub(crate) struct Lua {
    code: &'static str,
    script: OnceLock<Script>,
}

impl Lua {
    const fn new(code: &'static str) -> Self {
        Self {
            code,
            script: OnceLock::new(),
        }
    }

    /// The SHA1 of the script, as `EVALSHA` names it.
    pub(crate) fn hash(&self) -> &str {
        self.script
            .get_or_init(|| Script::new(self.code))
            .get_hash()
    }

    /// `SCRIPT LOAD` of the script's source.
    pub(crate) fn load_cmd(&self) -> redis::Cmd {
        let mut load = redis::cmd("SCRIPT");
        load.arg("LOAD").arg(self.code);
        load
    }

    /// `EVALSHA` of the script with `keys` and `args`, as one command built
    /// in one buffer of the right size (a `redis::Script` invocation copies
    /// every key and argument into a buffer of its own first, and a command
    /// made by name grows its buffer argument by argument).
    pub(crate) fn call(&self, keys: &[&str], args: &[&str]) -> redis::Cmd {
        let size = 64 + keys.iter().chain(args).map(|s| s.len()).sum::<usize>();
        let mut call = redis::Cmd::with_capacity(3 + keys.len() + args.len(), size);
        call.arg("EVALSHA")
            .arg(self.hash())
            .arg(keys.len())
            .arg(keys)
            .arg(args);
        call
    }

    /// `EVALSHA` of the script with `keys` and `args`, added to `pipe`.
    pub(crate) fn add_call(&self, pipe: &mut redis::Pipeline, keys: &[&str], args: &[&str]) {
        pipe.add_command(self.call(keys, args));
    }

    /// One call of the script as a pipeline of one command.
    pub(crate) fn pipe(&self, keys: &[&str], args: &[&str]) -> redis::Pipeline {
        let mut pipe = redis::Pipeline::with_capacity(2);
        self.add_call(&mut pipe, keys, args);
        pipe
    }

    /// Sends `query` (calls of this script: a command, or a pipeline of
    /// them) on `conn`; after `NOSCRIPT`, loads the script on `conn` and
    /// sends `query` again, once.
    pub(crate) async fn run<T: FromRedisValue>(
        &self,
        conn: &mut MultiplexedConnection,
        query: &(impl Query + Sync),
    ) -> Result<T, BackendError> {
        match query.run(conn).await {
            Err(e) if e.kind() == ErrorKind::NoScriptError => {
                let _hash: String = self
                    .load_cmd()
                    .query_async(conn)
                    .await
                    .map_err(map_redis_error)?;
                query.run(conn).await.map_err(map_redis_error)
            }
            answer => answer.map_err(map_redis_error),
        }
    }
}

/// A command or a pipeline, sent the same way.
pub(crate) trait Query {
    fn run<T: FromRedisValue>(
        &self,
        conn: &mut MultiplexedConnection,
    ) -> impl Future<Output = RedisResult<T>> + Send;
}

impl Query for redis::Cmd {
    fn run<T: FromRedisValue>(
        &self,
        conn: &mut MultiplexedConnection,
    ) -> impl Future<Output = RedisResult<T>> + Send {
        self.query_async(conn)
    }
}

impl Query for redis::Pipeline {
    fn run<T: FromRedisValue>(
        &self,
        conn: &mut MultiplexedConnection,
    ) -> impl Future<Output = RedisResult<T>> + Send {
        self.query_async(conn)
    }
}

/// A duration in whole milliseconds, as the scripts take their ttls (at
/// least 1).
pub(crate) fn ttl_ms(ttl: Duration) -> String {
    ttl.as_millis().clamp(1, u128::from(u64::MAX)).to_string()
}

/// The acquire scripts' answer: the fencing token (>= 1), or busy: 0, or
/// -2 - the holder's PTTL in milliseconds \[A9\].
pub(crate) fn acquire_outcome(answer: i64) -> Result<AcquireOutcome, BackendError> {
    match answer {
        0 => Ok(AcquireOutcome::BUSY),
        1.. => Ok(AcquireOutcome::Acquired {
            fencing_token: answer.unsigned_abs(),
        }),
        ..=-2 => Ok(AcquireOutcome::busy(Some(Duration::from_millis(
            (-2 - answer).unsigned_abs(),
        )))),
        -1 => Err(unexpected("acquire", answer)),
    }
}

/// The release script's answer: 1 released, 0 not held.
pub(crate) fn release_outcome(answer: i64) -> Result<ReleaseOutcome, BackendError> {
    match answer {
        1 => Ok(ReleaseOutcome::Released),
        0 => Ok(ReleaseOutcome::NotHeld),
        other => Err(unexpected("release", other)),
    }
}

pub(crate) fn extend_outcome(answer: i64) -> Result<ExtendOutcome, BackendError> {
    match answer {
        1 => Ok(ExtendOutcome::Extended),
        0 => Ok(ExtendOutcome::Expired),
        -1 => Ok(ExtendOutcome::Taken),
        other => Err(unexpected("extend", other)),
    }
}

pub(crate) fn unexpected(step: &str, answer: i64) -> BackendError {
    BackendError::message(
        BackendErrorKind::Protocol,
        format!("the {step} script answered {answer}"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_call_names_the_script_by_its_sha1() {
        assert_eq!(EXTEND.hash(), Script::new(EXTEND.code).get_hash());
        let call = EXTEND.call(&["k", "f"], &["a", "b"]);
        let mut pipe = redis::pipe();
        EXTEND.add_call(&mut pipe, &["k", "f"], &["a", "b"]);
        assert_eq!(call.get_packed_command(), pipe.get_packed_pipeline());
    }
}

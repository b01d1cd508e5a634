//! What every Redis backend needs, once: the single-node
//! [`RedisBackend`](crate::RedisBackend), the
//! [`RedisSentinelBackend`](crate::RedisSentinelBackend) (the same steps on
//! the primary the Sentinels name) and the
//! [`RedisClusterBackend`](crate::RedisClusterBackend) all stand on it.
//!
//! - [`scripts`]: every Lua script, the `EVALSHA` call of each, the
//!   resend after `NOSCRIPT` (a restarted or flushed server), and how
//!   their answers read;
//! - [`errors`]: how a Redis error reads as a backend error;
//! - [`timeout`]: the step timeout;
//! - [`connection`]: the check of whether an error may mean its connection
//!   is broken, and the connections the Cluster backend opens itself;
//! - [`driver`]: the runtime of the crate's own that drives every
//!   connection and background task, whichever runtime a step runs on;
//! - [`queue`]: the fair queue's keys, a queued attempt's answer, and the
//!   switch that leaves the queue out for a user whose ACL refuses it;
//! - [`redact`]: what `Debug` shows of a password;
//! - [`task`]: the background task a release subscription runs, started by
//!   the first watch and ended with the backend, and the hand-off of a
//!   released key to the waiters.

pub(crate) mod connection;
pub(crate) mod driver;
pub(crate) mod errors;
pub(crate) mod queue;
pub(crate) mod redact;
pub(crate) mod scripts;
pub(crate) mod task;
pub(crate) mod timeout;

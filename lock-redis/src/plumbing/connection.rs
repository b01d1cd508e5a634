//! Connections: when an error means a connection must be dropped (and
//! made again, or asked of the Sentinels again), and the connections the
//! Cluster backend opens to its nodes itself.

use std::time::Duration;

use lock_core::BackendError;
use redis::aio::MultiplexedConnection;
use redis::{AsyncConnectionConfig, ConnectionInfo, RedisError};

use crate::plumbing::timeout::within;

/// Whether `error` may mean the connection that gave it is broken: an I/O
/// error, a dropped or refused connection, a timeout. `READONLY` counts
/// too: its server was demoted to a replica and still answers `PING`. (On
/// a cluster such an answer is a reply read from the pipeline, never the
/// error of the send itself; the slot map is read again instead.)
pub(crate) fn is_broken(error: &RedisError) -> bool {
    error.is_io_error()
        || error.is_connection_dropped()
        || error.is_connection_refusal()
        || error.is_unrecoverable_error()
        || error.is_timeout()
        || error.kind() == redis::ErrorKind::ReadOnly
}

/// Whether a step that failed with `error` may have left its connection
/// broken: it timed out, its Redis error [`is_broken`], or it failed
/// without an answer from Redis at all.
pub(crate) fn step_broke(error: &BackendError) -> bool {
    error.is_timeout()
        || error
            .inner()
            .downcast_ref::<RedisError>()
            .is_none_or(is_broken)
}

/// A new connection with `info`, made and answering within `timeout` (a
/// timeout error for `step` past it). A refused or failed connection is
/// [`Unavailable`](lock_core::BackendErrorKind::Unavailable) (nothing was
/// sent), refused credentials a setup error.
pub(crate) async fn open(
    step: &'static str,
    info: ConnectionInfo,
    timeout: Duration,
    config: AsyncConnectionConfig,
) -> Result<MultiplexedConnection, BackendError> {
    let client = redis::Client::open(info).map_err(BackendError::unavailable)?;
    let config = config
        .set_connection_timeout(timeout)
        .set_response_timeout(timeout);
    within(step, timeout, async {
        client
            .get_multiplexed_async_connection_with_config(&config)
            .await
            .map_err(crate::config::connection_error)
    })
    .await
}

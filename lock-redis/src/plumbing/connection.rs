//! Connections: when an error means a connection must be dropped (and
//! made again, or asked of the Sentinels again), and the connections the
//! Cluster backend opens to its nodes itself.

use std::future::Future;
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
        || crate::plumbing::errors::redis_error_of(error.inner()).is_none_or(is_broken)
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

/// One connection, made on first use (one making at a time) and again
/// after a broken one was forgotten: the single node's shared and durable
/// connections, and each Cluster node's lanes. Each connection made has a
/// generation, so that a step that saw an older connection fail never
/// forgets a newer one that another step has made since.
#[derive(Default)]
pub(crate) struct ConnectionSlot {
    current: std::sync::Mutex<Option<(u64, MultiplexedConnection)>>,
    connecting: tokio::sync::Mutex<()>,
}

/// The generation of the last connection made, in any slot: unique in
/// the process, so a slot made again (a Cluster node that left the map and
/// came back) never hands out a generation an old step still holds.
static MADE: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

impl ConnectionSlot {
    fn lock(&self) -> std::sync::MutexGuard<'_, Option<(u64, MultiplexedConnection)>> {
        self.current
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The connection now, with its generation, if there is one.
    pub(crate) fn current(&self) -> Option<(u64, MultiplexedConnection)> {
        self.lock().clone()
    }

    /// The connection now, or one made by `make` (which the steps that
    /// need one meanwhile wait for, rather than each making their own).
    pub(crate) async fn get_or_make(
        &self,
        make: impl Future<Output = Result<MultiplexedConnection, BackendError>>,
    ) -> Result<(u64, MultiplexedConnection), BackendError> {
        if let Some(current) = self.current() {
            return Ok(current);
        }
        let _one_at_a_time = self.connecting.lock().await;
        if let Some(current) = self.current() {
            return Ok(current);
        }
        let conn = make.await?;
        let generation = MADE.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
        *self.lock() = Some((generation, conn.clone()));
        Ok((generation, conn))
    }

    /// Forgets the connection of `generation`, if it is still the current
    /// one: a step that saw it fail.
    pub(crate) fn forget(&self, generation: u64) {
        let mut current = self.lock();
        if current.as_ref().is_some_and(|(g, _)| *g == generation) {
            *current = None;
        }
    }

    /// Forgets whichever connection there is: its server is no longer the
    /// one to talk to (the Sentinels named another primary).
    pub(crate) fn clear(&self) {
        *self.lock() = None;
    }
}

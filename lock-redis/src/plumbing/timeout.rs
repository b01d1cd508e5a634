//! The step timeout: every request of a Redis backend is bounded, and a
//! request that runs out of time is a timeout error naming its step.

use std::future::Future;
use std::time::Duration;

use futures_util::FutureExt;
use lock_core::BackendError;

/// Runs `work` within `limit`; past it, a timeout error for `step`.
///
/// A combinator, not an `async fn`: the future of an `async fn` keeps its
/// arguments beside the futures it moves them into, so `work` would be
/// stored twice (and every step's future copied whole at each await holds
/// more than a kilobyte).
pub(crate) fn within<T>(
    step: &'static str,
    limit: Duration,
    work: impl Future<Output = Result<T, BackendError>>,
) -> impl Future<Output = Result<T, BackendError>> {
    tokio::time::timeout(limit, work)
        .map(move |answer| answer.unwrap_or_else(|_| Err(BackendError::timeout(step, limit))))
}

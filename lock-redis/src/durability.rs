//! The opt-in durability setting: `WAIT` for replicas after each
//! acquisition.

use std::time::Duration;

/// After each acquisition, `WAIT <replicas> <timeout>` on the connection
/// that ran it, pipelined with it (one round trip); when fewer replicas
/// acknowledged the write in time, the lock is released and the attempt
/// counts as failed: a [`BackendError`](lock_core::BackendError) of kind
/// `Request` saying how many acknowledged and whether the release freed
/// the lock, found it gone, or failed (then the lock expires with its
/// ttl). The single node, Sentinel and Cluster backends do the same.
///
/// Redis replication is asynchronous: without this, a primary that fails
/// right after an acquisition may be replaced by a replica that never got
/// the lock, and a second node can take it. With it, a lock is only handed
/// to the callback once `replicas` replicas have it, so a failover to one
/// of them keeps it. (`WAIT` is not allowed inside scripts before Redis
/// 7.2, hence a command of its own.) Extensions are not waited for: a
/// replica that missed one has the lock with an earlier expiry, which the
/// next extension after a failover corrects or reports as lost.
///
/// Costs each acquisition as long as the slowest of the `replicas` fastest
/// replicas takes to acknowledge.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct Durability {
    /// How many replicas must acknowledge each acquisition; at least 1.
    pub replicas: u32,
    /// How long `WAIT` waits for them; not zero (`WAIT` with 0 waits
    /// forever).
    #[cfg_attr(feature = "serde", serde(with = "humantime_serde"))]
    pub timeout: Duration,
}

impl Durability {
    /// Waits for `replicas` replicas, up to `timeout`, after each
    /// acquisition.
    pub fn new(replicas: u32, timeout: Duration) -> Self {
        Self { replicas, timeout }
    }
}

/// Refuses a durability setting that waits for no replica or forever.
pub(crate) fn validate(config: &crate::RedisConfig) -> Result<(), crate::SetupError> {
    let invalid = |reason| {
        Err(crate::SetupError::InvalidConfig {
            field: "durability",
            reason,
        })
    };
    match config.durability {
        Some(d) if d.replicas == 0 => invalid("waits for zero replicas"),
        Some(d) if d.timeout.is_zero() => invalid("has a zero timeout (WAIT would wait forever)"),
        _ => Ok(()),
    }
}

/// The error of an acquisition that fewer replicas than `durability` asks
/// acknowledged in time; `released` is the answer of the release sent
/// after it (1 freed, else found gone).
pub(crate) fn shortfall(
    acked: i64,
    durability: Durability,
    released: Result<i64, lock_core::BackendError>,
) -> lock_core::BackendError {
    lock_core::BackendError::message(
        lock_core::BackendErrorKind::Request,
        format!(
            "the acquisition reached {acked} of the {} replica(s) the durability setting waits for within {:?}; {} and the attempt counts as failed",
            durability.replicas,
            durability.timeout,
            match released {
                Ok(1) => "the lock was released",
                Ok(_) => "the lock was gone already",
                Err(_) => "its release failed (it expires with its ttl)",
            },
        ),
    )
}

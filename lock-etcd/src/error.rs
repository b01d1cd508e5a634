//! Errors of setting the backend up, and the mapping of etcd's errors to
//! [`BackendError`]s.

use lock_core::{BackendError, BackendErrorKind};
use tonic::Code;

/// What can go wrong while making an [`EtcdBackend`](crate::EtcdBackend).
/// Never shows a password.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SetupError {
    /// A field of [`EtcdConfig`](crate::EtcdConfig) is not acceptable.
    #[error("invalid lock-etcd config: {field} {reason}")]
    InvalidConfig {
        /// The field.
        field: &'static str,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// The URL does not parse.
    #[error("invalid etcd URL: {reason}")]
    InvalidUrl {
        /// What is wrong with it.
        reason: &'static str,
    },
    /// No endpoint answered within the connect timeout, or the connection
    /// failed (a TLS client against a plain server, or the other way round,
    /// fails here).
    #[error("could not reach etcd at {endpoints:?}")]
    Connect {
        /// The endpoints tried.
        endpoints: Vec<String>,
        /// etcd's or the transport's error; `None` for a timeout.
        #[source]
        source: Option<etcd_client::Error>,
    },
    /// Members answered within the connect timeout, but none had a leader
    /// to serve the check: an election under way (a leader stopped or
    /// killed; a new one is normally elected within one or two election
    /// timeouts, about 1 to 2 s), or a cluster that lost its quorum.
    /// Trying again later, or with a longer
    /// [`connect_timeout`](crate::EtcdConfig::connect_timeout), can succeed.
    #[error("etcd at {endpoints:?} has no leader (an election under way, or no quorum)")]
    NoLeader {
        /// The endpoints tried.
        endpoints: Vec<String>,
        /// The last error etcd or the transport gave.
        #[source]
        source: Option<etcd_client::Error>,
    },
    /// etcd refused the user name or password, or the user lacks a right
    /// the lock steps need (read, write and lease rights on the lock
    /// names).
    #[error("etcd refused the credentials or a right the lock steps need")]
    Refused(#[source] etcd_client::Error),
}

/// Whether etcd refused the step for a reason that trying again cannot
/// mend: authentication or permission.
pub(crate) fn is_refusal(error: &etcd_client::Error) -> bool {
    match error {
        etcd_client::Error::GRpcStatus(status) => match status.code() {
            Code::Unauthenticated | Code::PermissionDenied => true,
            // etcd answers a wrong password, and a request without a user
            // while authentication is on, with InvalidArgument.
            Code::InvalidArgument => {
                let message = status.message();
                message.contains("authentication failed") || message.contains("user name is empty")
            }
            _ => false,
        },
        _ => false,
    }
}

/// Whether a member answered that the cluster has no leader now (etcd's
/// `no leader`, `leader changed`, or a proposal that timed out waiting for
/// one), as it does during an election.
pub(crate) fn is_no_leader(error: &etcd_client::Error) -> bool {
    match error {
        etcd_client::Error::GRpcStatus(status) => {
            let message = status.message();
            message.contains("no leader")
                || message.contains("leader changed")
                || message.contains("possibly due to previous leader failure")
        }
        _ => false,
    }
}

/// Maps an etcd error of a lock step to a [`BackendError`], keeping it as
/// the source: refusals are [`Setup`](BackendErrorKind::Setup), a refused
/// connection (nothing sent) is
/// [`Unavailable`](BackendErrorKind::Unavailable), anything else
/// [`Request`](BackendErrorKind::Request).
pub(crate) fn step_error(error: etcd_client::Error) -> BackendError {
    if is_refusal(&error) {
        return BackendError::setup(error);
    }
    let kind = if nothing_sent(&error) {
        BackendErrorKind::Unavailable
    } else {
        BackendErrorKind::Request
    };
    BackendError::new(kind, error)
}

/// Whether the request surely did not leave: its connection was refused.
pub(crate) fn nothing_sent(error: &etcd_client::Error) -> bool {
    matches!(
        error,
        etcd_client::Error::GRpcStatus(status)
            if status.code() == Code::Unavailable && status.message().contains("connect")
    )
}

/// An answer etcd should not give.
pub(crate) fn protocol(message: impl Into<String>) -> BackendError {
    BackendError::message(BackendErrorKind::Protocol, message)
}

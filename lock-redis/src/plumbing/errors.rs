//! How a Redis error reads as a [`BackendError`], the same for every
//! Redis backend: its kind (a timeout, a refusal that trying again cannot
//! mend, or a failed request), the Redis error kept as the source.

use lock_core::{BackendError, BackendErrorKind};

/// An error reply of the server, shown in the server's own words
/// (`CLUSTERDOWN The cluster is down`, as `redis-cli`, the server's log
/// and Redis's documentation write it), where the `redis` crate's text
/// names its own kind instead (`ClusterDown: The cluster is down`): a log
/// line or a `withlock` message then reads what one searches for, once.
/// [`redis_error`](Self::redis_error) gives the `redis` crate's error (its
/// kind, code and detail); it is not given as the
/// [`source`](std::error::Error::source), whose text would say the same
/// words a second time in every error chain.
///
/// A [`BackendError`]'s source is this for such replies (`CLUSTERDOWN`,
/// `TRYAGAIN`, `MASTERDOWN`, `READONLY`, `LOADING`, `MOVED`, `ASK`, `ERR`,
/// …), and the [`redis::RedisError`] itself for every other failure (a
/// connection error, a timeout, a reply whose text already starts with
/// its code, such as `NOPERM` or `WRONGTYPE`).
#[derive(Debug)]
pub struct ServerReply(redis::RedisError);

impl ServerReply {
    /// The `redis` crate's error.
    pub fn redis_error(&self) -> &redis::RedisError {
        &self.0
    }
}

impl std::fmt::Display for ServerReply {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.0.code().unwrap_or("ERR"))?;
        match self.0.detail() {
            Some(detail) => write!(f, " {detail}"),
            None => Ok(()),
        }
    }
}

impl std::error::Error for ServerReply {}

/// The `redis` crate's error of a step that failed, however it is kept
/// (as the source itself, or inside a [`ServerReply`]).
pub(crate) fn redis_error_of<'e>(
    inner: &'e (dyn std::error::Error + Send + Sync + 'static),
) -> Option<&'e redis::RedisError> {
    inner.downcast_ref::<redis::RedisError>().or_else(|| {
        inner
            .downcast_ref::<ServerReply>()
            .map(ServerReply::redis_error)
    })
}

/// Maps a Redis error to a backend error, keeping it as the source (in a
/// [`ServerReply`] for a reply the `redis` crate shows without its code).
pub(crate) fn map_redis_error(error: redis::RedisError) -> BackendError {
    let kind = if error.is_timeout() {
        BackendErrorKind::Timeout
    } else if is_setup_error(&error) {
        BackendErrorKind::Setup
    } else {
        BackendErrorKind::Request
    };
    let words_lack_code = error
        .code()
        .is_some_and(|code| error.detail().is_some() && !error.to_string().contains(code));
    if words_lack_code {
        BackendError::new(kind, ServerReply(error))
    } else {
        BackendError::new(kind, error)
    }
}

/// Whether `error` is the ACL's refusal of a key (`NOPERM`), as a server
/// answers a script call with a declared key the user may not reach,
/// before running it: the hold step's record \[H7\], for a user made by
/// the rules of a release before it, which then holds without it.
pub(crate) fn is_key_refused(error: &BackendError) -> bool {
    error.kind() == BackendErrorKind::Setup
        && error
            .inner()
            .downcast_ref::<redis::RedisError>()
            .is_some_and(|e| e.code() == Some("NOPERM"))
}

/// An error that trying again cannot mend \[A8\]: authentication refused,
/// an ACL that denies a command, key or channel, a lock key or companion
/// of the wrong type, a fencing companion that holds no counter. Scripts
/// pass on the code of the command that failed in them.
fn is_setup_error(error: &redis::RedisError) -> bool {
    error.kind() == redis::ErrorKind::AuthenticationFailed
        || matches!(
            error.code(),
            Some("NOPERM" | "WRONGPASS" | "NOAUTH" | "WRONGTYPE")
        )
        || {
            let text = error.to_string();
            // A command a script runs that the ACL denies.
            text.contains("the fencing companion")
                || text.contains("can't run this command")
                || text.contains("No permissions to access")
        }
}

//! How a Redis error reads as a [`BackendError`], the same for every
//! Redis backend: its kind (a timeout, a refusal that trying again cannot
//! mend, or a failed request), the Redis error kept as the source.

use lock_core::{BackendError, BackendErrorKind};

/// Maps a Redis error to a backend error, keeping it as the source.
pub(crate) fn map_redis_error(error: redis::RedisError) -> BackendError {
    let kind = if error.is_timeout() {
        BackendErrorKind::Timeout
    } else if is_setup_error(&error) {
        BackendErrorKind::Setup
    } else {
        BackendErrorKind::Request
    };
    BackendError::new(kind, error)
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

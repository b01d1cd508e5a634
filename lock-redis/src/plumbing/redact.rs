//! What `Debug` shows of a secret: whether it is set, never the secret.
//! Backends show addresses (`host:port`), never a URL or a
//! `redis::ConnectionInfo`, whose `Debug` would show the password.

/// `<redacted>` for a secret that is set, `<none>` otherwise.
pub(crate) fn secret(is_set: bool) -> &'static str {
    if is_set {
        "<redacted>"
    } else {
        "<none>"
    }
}

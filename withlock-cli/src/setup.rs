//! Errors that trying again cannot mend, told apart by exit code: a
//! refused login or permission (77, `EX_NOPERM`) from a store that is not
//! set up (78, `EX_CONFIG`), both apart from an outage (69) \[A8, D3\].
//! And the first contact with a store, which finds them before anything is
//! locked.

use std::error::Error as StdError;

use lock_postgres::sqlx::postgres::PgConnectOptions;
use lock_postgres::sqlx::{self, ConnectOptions, Connection};
use lock_postgres::PostgresConfig;
use lock_redis::{RedisBackend, RedisConfig};

use crate::exit::{self, Chain, Failure};

/// What a store's refusal says about its setup.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// Credentials or a permission refused: 77.
    Permission,
    /// Not set up as withlock needs: 78.
    Config,
    /// The PostgreSQL lock table does not exist: 78, naming `migrate`.
    MissingTable,
}

impl Refusal {
    /// The exit code.
    pub(crate) fn code(self) -> u8 {
        match self {
            Self::Permission => exit::NO_PERMISSION,
            Self::Config | Self::MissingTable => exit::CONFIG,
        }
    }

    /// What to do about it, if the store's own words do not say.
    pub(crate) fn hint(self) -> Option<&'static str> {
        match self {
            Self::MissingTable => Some(
                "create the lock table once with `withlock migrate` (with the same --url, --schema and --table), as a role that may create it",
            ),
            Self::Permission | Self::Config => None,
        }
    }
}

/// The refusal in `error` or any of its sources, if it is one that trying
/// again cannot mend.
pub(crate) fn refusal(error: &(dyn StdError + 'static)) -> Option<Refusal> {
    let mut permanent = false;
    let mut next = Some(error);
    while let Some(error) = next {
        if let Some(found) = refusal_of(error) {
            return Some(found);
        }
        if let Some(backend) = error.downcast_ref::<lock_core::BackendError>() {
            permanent |= backend.is_permanent();
        }
        next = error.source();
    }
    // A setup error of a kind not named here.
    permanent.then_some(Refusal::Config)
}

/// The refusal `error` itself is, without its sources.
fn refusal_of(error: &(dyn StdError + 'static)) -> Option<Refusal> {
    if let Some(redis) = error.downcast_ref::<lock_redis::SetupError>() {
        return match redis {
            lock_redis::SetupError::AuthenticationRefused { .. } => Some(Refusal::Permission),
            _ => None,
        };
    }
    if let Some(lock_postgres::SetupError::NarrowSequence { .. }) =
        error.downcast_ref::<lock_postgres::SetupError>()
    {
        return Some(Refusal::Config);
    }
    if let Some(sqlx::Error::Database(db)) = error.downcast_ref::<sqlx::Error>() {
        // SQLSTATE classes 28 (authorization) and 42501 (privilege);
        // 3D000, 3F000, 42P01, 42703, 42883, 42804, 22003: a missing
        // database, schema, table, column or function, a wrong type.
        return match db.code().as_deref() {
            Some("28000" | "28P01" | "42501") => Some(Refusal::Permission),
            Some("42P01") => Some(Refusal::MissingTable),
            Some("3D000" | "3F000" | "42703" | "42883" | "42804" | "22003") => {
                Some(Refusal::Config)
            }
            _ => None,
        };
    }
    if let Some(redis) = error.downcast_ref::<lock_redis::redis::RedisError>() {
        let text = redis.to_string();
        if redis.kind() == lock_redis::redis::ErrorKind::AuthenticationFailed
            || matches!(redis.code(), Some("NOPERM" | "WRONGPASS" | "NOAUTH"))
            || text.contains("can't run this command")
            || text.contains("No permissions to access")
        {
            return Some(Refusal::Permission);
        }
        if redis.code() == Some("WRONGTYPE")
            || text.contains("the fencing companion")
            || text.contains("DB index is out of range")
        {
            return Some(Refusal::Config);
        }
    }
    None
}

/// A failure of the store named `what`: 77 or 78 for a refusal that
/// trying again cannot mend, with what to do about it; 69 otherwise.
pub(crate) fn failure(what: &str, error: &(dyn StdError + 'static)) -> Failure {
    let refusal = refusal(error);
    let mut message = match refusal {
        // The store's own words say what: the backend error's kind line
        // ("unreachable", "refused the step") adds nothing, or misleads.
        Some(_) => format!("{what}: {}", Words(error)),
        None => format!("{what}: {}", Chain(error)),
    };
    if let Some(hint) = refusal.and_then(Refusal::hint) {
        message.push_str("; ");
        message.push_str(hint);
    }
    Failure::new(refusal.map_or(exit::UNAVAILABLE, Refusal::code), message)
}

/// An error and its sources on one line, as [`Chain`], without the
/// lines of the [`lock_core::BackendError`]s in it, which name only a
/// kind.
struct Words<'a>(&'a (dyn StdError + 'static));

impl std::fmt::Display for Words<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut shown = String::new();
        let mut next = Some(self.0);
        while let Some(error) = next {
            next = error.source();
            if error.is::<lock_core::BackendError>() {
                continue;
            }
            let text = error.to_string();
            if shown.contains(&text) {
                continue;
            }
            if !shown.is_empty() {
                f.write_str(": ")?;
            }
            f.write_str(&text)?;
            shown = text;
        }
        Ok(())
    }
}

/// A backend on the one Redis server `url` names, having asked it for a
/// `PING`: a refused login or a database index out of range ends the
/// command at once (77, 78), before any lock is taken. A server that
/// cannot be reached is left to the lock calls, which try again as long
/// as the wait lets them.
pub(crate) async fn redis_server(url: &str, config: RedisConfig) -> Result<RedisBackend, Failure> {
    match RedisBackend::connect_with(url, config.clone()).await {
        Ok(backend) => Ok(backend),
        Err(error @ lock_redis::SetupError::Connect(_)) if refusal(&error).is_none() => {
            RedisBackend::from_url_with(url, config)
                .map_err(|e| Failure::usage(format!("--url: {}", Chain(&e))))
        }
        Err(error) => match refusal(&error) {
            Some(_) => Err(failure("the Redis server refused", &error)),
            None => Err(Failure::usage(format!("--url: {}", Chain(&error)))),
        },
    }
}

/// Opens one connection to the PostgreSQL server `options` name and
/// closes it, so that a failure is told in the server's or the system's
/// words (a pool would only say it timed out): a refused connection names
/// the address (69), a refused login 77, a missing database 78.
pub(crate) async fn postgres_server(
    options: &PgConnectOptions,
    config: &PostgresConfig,
) -> Result<(), Failure> {
    let address = if options.get_host().starts_with('/') {
        format!(
            "the socket {}/.s.PGSQL.{}",
            options.get_host(),
            options.get_port()
        )
    } else {
        format!("{}:{}", options.get_host(), options.get_port())
    };
    match tokio::time::timeout(config.step_timeout, options.connect()).await {
        Ok(Ok(conn)) => {
            let _ = conn.close().await;
            Ok(())
        }
        Ok(Err(sqlx::Error::Io(error))) => Err(Failure::new(
            exit::UNAVAILABLE,
            format!(
                "could not connect to PostgreSQL at {address}: {}",
                io_text(&error)
            ),
        )),
        Ok(Err(error)) => Err(failure(
            &format!("PostgreSQL at {address} refused the connection"),
            &error,
        )),
        Err(_) => Err(Failure::new(
            exit::UNAVAILABLE,
            format!(
                "could not connect to PostgreSQL at {address}: no answer within {:?}",
                config.step_timeout
            ),
        )),
    }
}

/// An I/O error in the system's words, lower case as in other messages.
fn io_text(error: &std::io::Error) -> String {
    match error.kind() {
        std::io::ErrorKind::ConnectionRefused => "connection refused".to_owned(),
        _ => error.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn setup_errors_of_no_known_kind_are_config() {
        let error = lock_core::BackendError::setup(std::io::Error::other("odd"));
        assert_eq!(refusal(&error), Some(Refusal::Config));
        let outage = lock_core::BackendError::unavailable(std::io::Error::other("down"));
        assert_eq!(refusal(&outage), None);
        assert_eq!(failure("Redis", &outage).code, exit::UNAVAILABLE);
    }

    #[test]
    fn redis_refusals_are_told_apart() {
        use lock_redis::redis::{ErrorKind, RedisError};
        let denied = RedisError::from((ErrorKind::AuthenticationFailed, "WRONGPASS"));
        assert_eq!(refusal(&denied), Some(Refusal::Permission));
        let range = RedisError::from((
            ErrorKind::ResponseError,
            "ERR",
            "DB index is out of range".to_owned(),
        ));
        assert_eq!(refusal(&range), Some(Refusal::Config));
    }
}

//! Errors that trying again cannot mend, told apart by exit code: a
//! refused login or permission (77, `EX_NOPERM`) from a store that is not
//! set up (78, `EX_CONFIG`), both apart from an outage (69) \[A8, D3\].
//! And the first contact with a store, which finds them before anything is
//! locked.

use std::error::Error as StdError;

use lock_etcd::etcd_client;
use lock_etcd::EtcdConfig;
use lock_postgres::sqlx::postgres::PgConnectOptions;
use lock_postgres::sqlx::{self, ConnectOptions, Connection};
use lock_postgres::PostgresConfig;
use lock_redis::{RedisBackend, RedisConfig};

use crate::exit::{self, Failure};
use lock_core::ErrorChain;

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
    if let Some(lock_etcd::SetupError::Refused(_)) = error.downcast_ref::<lock_etcd::SetupError>() {
        return Some(Refusal::Permission);
    }
    if let Some(etcd_client::Error::GRpcStatus(status)) = error.downcast_ref::<etcd_client::Error>()
    {
        // etcd answers a wrong password, and a request without a user
        // while authentication is on, with InvalidArgument.
        return match status.code() {
            tonic::Code::Unauthenticated | tonic::Code::PermissionDenied => {
                Some(Refusal::Permission)
            }
            tonic::Code::InvalidArgument
                if status.message().contains("authentication failed")
                    || status.message().contains("user name is empty") =>
            {
                Some(Refusal::Permission)
            }
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
    let redis = error
        .downcast_ref::<lock_redis::redis::RedisError>()
        .or_else(|| {
            error
                .downcast_ref::<lock_redis::ServerReply>()
                .map(lock_redis::ServerReply::redis_error)
        });
    if let Some(redis) = redis {
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
        None => format!("{what}: {}", ErrorChain(error)),
    };
    if let Some(hint) = refusal.and_then(Refusal::hint) {
        message.push_str("; ");
        message.push_str(hint);
    }
    Failure::new(refusal.map_or(exit::UNAVAILABLE, Refusal::code), message)
}

/// An error and its sources on one line, as [`ErrorChain`], without the
/// [`lock_core::BackendError`]s in it, whose kind adds nothing here (their
/// store's words are their source, printed next).
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
                .map_err(|e| Failure::usage(format!("--url: {}", ErrorChain(&e))))
        }
        Err(error) => match refusal(&error) {
            Some(_) => Err(failure("the Redis server refused", &error)),
            None => Err(Failure::usage(format!("--url: {}", ErrorChain(&error)))),
        },
    }
}

/// The config of an `etcd://` or `etcds://` URL, as lock-etcd reads it
/// (the scheme in any case), every endpoint's port checked: the URI parser
/// would drop a port past 65535 and dial port 80 instead.
pub(crate) fn etcd_config(url: &str) -> Result<EtcdConfig, Failure> {
    let url = match url.split_once("://") {
        Some((scheme, rest)) => format!("{}://{rest}", scheme.to_ascii_lowercase()),
        None => url.to_owned(),
    };
    let config = EtcdConfig::from_url(&url)
        .map_err(|e| Failure::usage(format!("--url: {}", ErrorChain(&e))))?;
    // lock-etcd ends every endpoint with `:PORT`, adding `:2379`.
    let port_ok = |endpoint: &String| {
        endpoint
            .rsplit_once(':')
            .and_then(|(_, port)| port.parse::<u16>().ok())
            .is_some_and(|port| port != 0)
    };
    if !config.endpoints.iter().all(port_ok) {
        return Err(Failure::usage(
            "--url: invalid etcd URL: a port is not a number from 1 to 65535",
        ));
    }
    Ok(config)
}

/// A failure of connecting to etcd: an endpoint that is no URI is a
/// usage failure (64), refused credentials or rights 77, no endpoint
/// answering or no leader 69.
pub(crate) fn etcd_failure(error: &lock_etcd::SetupError) -> Failure {
    use lock_etcd::SetupError;
    match error {
        SetupError::InvalidUrl { .. } | SetupError::InvalidConfig { .. } => {
            Failure::usage(format!("--url: {}", ErrorChain(error)))
        }
        SetupError::Connect {
            source:
                Some(
                    source @ (etcd_client::Error::InvalidUri(_)
                    | etcd_client::Error::InvalidArgs(_)),
                ),
            ..
        } => Failure::usage(format!("--url: invalid etcd URL: {}", etcd_words(source))),
        SetupError::NoLeader { endpoints, source } => Failure::new(
            exit::UNAVAILABLE,
            format!(
                "etcd at {} has no leader (an election under way, or no quorum){}",
                endpoints.join(", "),
                source
                    .as_ref()
                    .map_or_else(String::new, |e| format!(": {}", etcd_words(e)))
            ),
        ),
        SetupError::Refused(source) => Failure::new(
            exit::NO_PERMISSION,
            format!("{error}: {}", etcd_words(source)),
        ),
        _ => match (refusal(error), error) {
            (None, SetupError::Connect { endpoints, source }) => Failure::new(
                exit::UNAVAILABLE,
                format!(
                    "could not reach etcd at {}: {}",
                    endpoints.join(", "),
                    source
                        .as_ref()
                        .map_or_else(|| "no answer in time".to_owned(), etcd_words)
                ),
            ),
            (refusal, _) => Failure::new(
                refusal.map_or(exit::UNAVAILABLE, Refusal::code),
                Words(error).to_string(),
            ),
        },
    }
}

/// An etcd client error in few words: the system's for a connection that
/// failed, etcd's own message for an answer.
fn etcd_words(error: &etcd_client::Error) -> String {
    let etcd_client::Error::GRpcStatus(status) = error else {
        return error.to_string();
    };
    let mut next = StdError::source(status);
    while let Some(cause) = next {
        if let Some(io) = cause.downcast_ref::<std::io::Error>() {
            return io_text(io);
        }
        next = cause.source();
    }
    status.message().to_owned()
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

    #[test]
    fn etcd_refusals_are_permission() {
        let wrong = etcd_client::Error::GRpcStatus(tonic::Status::invalid_argument(
            "etcdserver: authentication failed, invalid user ID or password",
        ));
        assert_eq!(refusal(&wrong), Some(Refusal::Permission));
        let denied = lock_core::BackendError::setup(etcd_client::Error::GRpcStatus(
            tonic::Status::permission_denied("etcdserver: permission denied"),
        ));
        assert_eq!(refusal(&denied), Some(Refusal::Permission));
        let down = etcd_client::Error::GRpcStatus(tonic::Status::unavailable("no leader"));
        assert_eq!(refusal(&down), None);
    }

    #[test]
    fn etcd_urls_are_lock_etcds_with_ports_checked() {
        let config = etcd_config("ETCD://u:p@a:1,b").unwrap();
        assert_eq!(config.endpoints, ["http://a:1", "http://b:2379"]);
        for bad in [
            "etcd://",
            "etcd://a:99999",
            "etcd://a:0",
            "etcd://a,,b",
            "etcd://h/x",
        ] {
            let failure = etcd_config(bad).unwrap_err();
            assert_eq!(failure.code, exit::USAGE, "{bad}");
        }
        let failure = etcd_config("etcd://u:hunter2@a:99999").unwrap_err();
        assert!(!failure.message.contains("hunter2"), "{}", failure.message);
    }
}

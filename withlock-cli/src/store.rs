//! The lock backend a URL names, and its admin functions behind one type.

use std::time::Duration;

use lock_core::{BackendError, LockError, Locker, LockerOptions, OwnerToken};
use lock_postgres::sqlx::postgres::PgConnectOptions;
use lock_postgres::{PostgresBackend, PostgresConfig};
use lock_redis::{RedisBackend, RedisConfig};

use crate::args::StoreArgs;
use crate::exit::{Chain, Failure, UNAVAILABLE};

/// The backends the command knows, by URL scheme.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Scheme {
    Redis,
    Postgres,
}

impl Scheme {
    /// The scheme of `url`, checked before anything is touched. The
    /// message never shows the URL, which may hold a password.
    pub(crate) fn of(url: &str) -> Result<Self, Failure> {
        let Some((scheme, _)) = url.split_once("://") else {
            return Err(Failure::usage(
                "--url is not a URL: expected redis://, rediss://, postgres:// or postgresql://",
            ));
        };
        match scheme.to_ascii_lowercase().as_str() {
            "redis" | "rediss" => Ok(Self::Redis),
            "postgres" | "postgresql" => Ok(Self::Postgres),
            _ => Err(Failure::usage(format!(
                "--url has the unknown scheme {:?}: expected redis://, rediss://, postgres:// or postgresql://",
                scheme.chars().take(32).collect::<String>()
            ))),
        }
    }
}

/// An open lock backend.
#[derive(Clone, Debug)]
pub(crate) enum Store {
    Redis(RedisBackend),
    Postgres(PostgresBackend),
}

/// What the store says about one key, whichever the backend.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct LockView {
    pub(crate) key: String,
    /// `None`: the key is free.
    pub(crate) owner: Option<OwnerToken>,
    /// `None`: free, or (Redis) set without an expiry.
    pub(crate) ttl: Option<Duration>,
    /// The last fencing token drawn for the key, if any was.
    pub(crate) fencing_token: Option<u64>,
}

impl LockView {
    pub(crate) fn node_id(&self) -> Option<&str> {
        self.owner.as_ref().map(OwnerToken::node_id)
    }
}

impl From<lock_redis::LockInfo> for LockView {
    fn from(info: lock_redis::LockInfo) -> Self {
        Self {
            key: info.key,
            owner: info.owner,
            ttl: info.ttl,
            fencing_token: info.fencing_token,
        }
    }
}

impl From<lock_postgres::LockInfo> for LockView {
    fn from(info: lock_postgres::LockInfo) -> Self {
        Self {
            key: info.key,
            owner: info.owner,
            ttl: info.ttl,
            fencing_token: info.fencing_token,
        }
    }
}

impl Store {
    /// Makes the backend `args` names, changing nothing in the store.
    ///
    /// A malformed URL or table name is a usage failure; a server that
    /// cannot be reached is "unavailable". Redis connects at the first
    /// call; PostgreSQL connects here.
    pub(crate) async fn open(args: &StoreArgs) -> Result<Self, Failure> {
        match Scheme::of(&args.url)? {
            Scheme::Redis => {
                let config = RedisConfig::default().prefix(args.redis_prefix.clone());
                RedisBackend::from_url_with(&args.url, config)
                    .map(Self::Redis)
                    .map_err(|e| Failure::usage(format!("--url: {}", Chain(&e))))
            }
            Scheme::Postgres => {
                args.url.parse::<PgConnectOptions>().map_err(|e| {
                    Failure::usage(format!(
                        "--url is not a valid PostgreSQL URL: {}",
                        Chain(&e)
                    ))
                })?;
                let config = PostgresConfig::default()
                    .schema(args.schema.clone())
                    .table(args.table.clone());
                config
                    .validate()
                    .map_err(|e| Failure::usage(Chain(&e).to_string()))?;
                PostgresBackend::connect_with(&args.url, config)
                    .await
                    .map(Self::Postgres)
                    .map_err(|e| Failure::new(UNAVAILABLE, Chain(&e).to_string()))
            }
        }
    }

    /// Creates the PostgreSQL lock table if it is missing (`migrate`,
    /// idempotent); nothing to do for Redis.
    pub(crate) async fn create_table(&self) -> Result<(), Failure> {
        match self {
            Self::Redis(_) => Ok(()),
            Self::Postgres(backend) => backend
                .migrate()
                .await
                .map_err(|e| Failure::unavailable("PostgreSQL", &e)),
        }
    }

    /// A locker (one node) on this backend.
    pub(crate) fn locker(&self, options: LockerOptions) -> Result<Locker, LockError> {
        match self {
            Self::Redis(backend) => Locker::with_options(backend.clone(), options),
            Self::Postgres(backend) => Locker::with_options(backend.clone(), options),
        }
    }

    /// The backend's name in messages.
    pub(crate) fn name(&self) -> &'static str {
        match self {
            Self::Redis(_) => "Redis",
            Self::Postgres(_) => "PostgreSQL",
        }
    }

    pub(crate) async fn list(&self, prefix: &str) -> Result<Vec<LockView>, BackendError> {
        Ok(match self {
            Self::Redis(backend) => into_views(backend.list_locks(prefix).await?),
            Self::Postgres(backend) => into_views(backend.list_locks(prefix).await?),
        })
    }

    pub(crate) async fn inspect(&self, key: &str) -> Result<LockView, BackendError> {
        Ok(match self {
            Self::Redis(backend) => backend.inspect(key).await?.into(),
            Self::Postgres(backend) => backend.inspect(key).await?.into(),
        })
    }

    /// Frees `key` whoever holds it; gives the holder it freed.
    pub(crate) async fn force_release(&self, key: &str) -> Result<Option<LockView>, BackendError> {
        Ok(match self {
            Self::Redis(backend) => backend.force_release(key).await?.map(Into::into),
            Self::Postgres(backend) => backend.force_release(key).await?.map(Into::into),
        })
    }
}

fn into_views<T: Into<LockView>>(infos: Vec<T>) -> Vec<LockView> {
    infos.into_iter().map(Into::into).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schemes_pick_the_backend() {
        assert_eq!(Scheme::of("redis://h:6379").unwrap(), Scheme::Redis);
        assert_eq!(Scheme::of("rediss://h").unwrap(), Scheme::Redis);
        assert_eq!(Scheme::of("postgres://u@h/db").unwrap(), Scheme::Postgres);
        assert_eq!(Scheme::of("PostgreSQL://u@h/db").unwrap(), Scheme::Postgres);
    }

    #[test]
    fn unknown_schemes_are_named_without_the_url() {
        let failure = Scheme::of("mysql://root:secret@h/db").unwrap_err();
        assert_eq!(failure.code, crate::exit::USAGE);
        assert!(failure.message.contains("\"mysql\""));
        assert!(!failure.message.contains("secret"));
        assert!(Scheme::of("127.0.0.1:6379").is_err());
    }
}

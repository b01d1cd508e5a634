//! The lock store a URL names: its backend for `withlock run`, and its
//! admin functions ([`LockAdmin`]) for `list`, `inspect` and `release`,
//! the same on every backend and deployment \[D1\].

use std::sync::Arc;
use std::time::Duration;

use lock_core::{DynLockBackend, LockAdmin, LockError, Locker, LockerOptions};
use lock_etcd::EtcdBackend;
use lock_postgres::sqlx::postgres::PgConnectOptions;
use lock_postgres::{PostgresBackend, PostgresConfig};
use lock_redis::{RedisClusterBackend, RedisConfig, RedisSentinelBackend, SentinelConfig};

use crate::args::StoreArgs;
use crate::exit::Failure;
use crate::setup;
use lock_core::ErrorChain;

/// The schemes `--url` may have, for messages.
const SCHEMES: &str = "redis://, rediss://, redis+cluster://, rediss+cluster://, \
                       redis+sentinel://, postgres://, postgresql://, etcd:// or etcds://";

/// The backends the command knows, by URL scheme.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Scheme {
    Redis,
    /// `redis+cluster://` or `rediss+cluster://`.
    RedisCluster {
        tls: bool,
    },
    /// `redis+sentinel://`.
    RedisSentinel,
    Postgres,
    /// `etcd://` or `etcds://` (TLS).
    Etcd,
}

impl Scheme {
    /// The scheme of `url`, checked before anything is touched. The
    /// message never shows the URL, which may hold a password.
    pub(crate) fn of(url: &str) -> Result<Self, Failure> {
        let Some((scheme, _)) = url.split_once("://") else {
            return Err(Failure::usage(format!(
                "--url is not a URL: expected {SCHEMES}"
            )));
        };
        match scheme.to_ascii_lowercase().as_str() {
            "redis" | "rediss" => Ok(Self::Redis),
            "redis+cluster" => Ok(Self::RedisCluster { tls: false }),
            "rediss+cluster" => Ok(Self::RedisCluster { tls: true }),
            "redis+sentinel" => Ok(Self::RedisSentinel),
            "postgres" | "postgresql" => Ok(Self::Postgres),
            "etcd" | "etcds" => Ok(Self::Etcd),
            _ => Err(Failure::usage(format!(
                "--url has the unknown scheme {:?}: expected {SCHEMES}",
                scheme.chars().take(32).collect::<String>()
            ))),
        }
    }
}

/// The query parameters the redis crate reads from a `redis://` or
/// `rediss://` URL (its `IntoConnectionInfo` docs): any other it ignores.
const REDIS_PARAMETERS: &[&str] = &["protocol"];

/// The query parameters sqlx reads from a `postgres://` URL
/// (`PgConnectOptions`' docs), spellings it accepts included, besides
/// `options[NAME]`: any other it ignores, with a log line nobody sees.
const POSTGRES_PARAMETERS: &[&str] = &[
    "sslmode",
    "ssl-mode",
    "sslrootcert",
    "ssl-root-cert",
    "ssl-ca",
    "sslcert",
    "ssl-cert",
    "sslkey",
    "ssl-key",
    "statement-cache-capacity",
    "host",
    "hostaddr",
    "port",
    "dbname",
    "user",
    "password",
    "application_name",
    "options",
];

/// `url` without its query, and the query (after the first `?` past the
/// user and password), empty if none. A password may hold `?`; the hosts
/// never do.
fn split_query(url: &str) -> (&str, &str) {
    let hosts_at = url.rfind('@').map_or(0, |at| at + 1);
    match url[hosts_at..].find('?') {
        Some(mark) => (&url[..hosts_at + mark], &url[hosts_at + mark + 1..]),
        None => (url, ""),
    }
}

/// The query of `url` up to a `#`, empty if none.
fn query_of(url: &str) -> &str {
    let (_, query) = split_query(url);
    query.split_once('#').map_or(query, |(query, _)| query)
}

/// Refuses a query parameter of `url` that its driver would ignore
/// (`known`, and for PostgreSQL `options[NAME]`), naming it, so that a
/// misspelt `?pasword=` is not silently dropped. The names are decoded as
/// the drivers decode them (`+` a space, `%XX` escapes). A name that does
/// not look like one (it may be part of a password with an unescaped `?`)
/// is not shown.
fn check_query(url: &str, what: &str, known: &[&str]) -> Result<(), Failure> {
    let postgres = known == POSTGRES_PARAMETERS;
    for pair in query_of(url).split('&').filter(|p| !p.is_empty()) {
        let raw = pair.split_once('=').map_or(pair, |(name, _)| name);
        let name = percent_decode(&raw.replace('+', " ")).unwrap_or_else(|_| raw.to_owned());
        let is_known = known.contains(&name.as_str())
            || (postgres && name.starts_with("options[") && name.ends_with(']'));
        if is_known {
            continue;
        }
        let plain = !name.is_empty()
            && name.len() <= 40
            && name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "_-.[]".contains(c));
        let shown = if plain {
            format!("the query parameter {name:?}")
        } else {
            "a query parameter (not shown: it may be part of a password; percent-encode a `?` in one)"
                .to_owned()
        };
        return Err(Failure::usage(format!(
            "--url: {shown} is not one the {what} driver reads, and it would be ignored; it takes {}",
            known.join(", ")
        )));
    }
    Ok(())
}

/// The nodes of a `redis+cluster://` or `redis+sentinel://` URL, each as a
/// `redis://` (or `rediss://`) URL with the URL's user and password, and
/// the path after the hosts (the Sentinel master name), percent-decoded.
fn split_hosts(url: &str, scheme: &str) -> Result<(Vec<String>, String), Failure> {
    let rest = url.split_once("://").map_or("", |(_, rest)| rest);
    let (authority, path) = rest.split_once('/').unwrap_or((rest, ""));
    // The password may hold '@' or ','; the hosts never do.
    let (userinfo, hosts) = match authority.rsplit_once('@') {
        Some((userinfo, hosts)) => (Some(userinfo), hosts),
        None => (None, authority),
    };
    let hosts: Vec<&str> = hosts.split(',').map(str::trim).collect();
    if hosts.iter().any(|h| h.is_empty()) {
        return Err(Failure::usage(
            "--url names no host, or an empty one between commas: expected host:port[,host:port…]",
        ));
    }
    let urls = hosts
        .iter()
        .map(|host| match userinfo {
            Some(userinfo) => format!("{scheme}://{userinfo}@{host}"),
            None => format!("{scheme}://{host}"),
        })
        .collect();
    Ok((urls, percent_decode(path)?))
}

/// The data nodes' credentials and database from the query of a
/// `redis+sentinel://` URL (`data_username`, `data_password`, `db`, each
/// percent-decoded): the URL's own user and password are the Sentinels'.
fn data_node_options(mut sentinel: SentinelConfig, query: &str) -> Result<SentinelConfig, Failure> {
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
        let value = percent_decode(value)?;
        sentinel = match name {
            "data_username" => sentinel.data_node_username(value),
            "data_password" => sentinel.data_node_password(value),
            "db" => sentinel.data_node_db(value.parse().map_err(|_| {
                Failure::usage("--url: db= in a redis+sentinel:// URL is not a database number")
            })?),
            _ => {
                return Err(Failure::usage(format!(
                    "--url: a redis+sentinel:// URL takes data_username=, data_password= and db= \
                     in its query, not {:?}",
                    name.chars().take(32).collect::<String>()
                )))
            }
        };
    }
    Ok(sentinel)
}

/// `text` with its `%XX` escapes decoded.
fn percent_decode(text: &str) -> Result<String, Failure> {
    let bad = || Failure::usage("--url has a bad percent escape");
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = text.get(i + 1..i + 3).ok_or_else(bad)?;
            out.push(u8::from_str_radix(hex, 16).map_err(|_| bad())?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| bad())
}

/// An open lock store: a backend to lock with, and the same store's
/// admin functions.
#[derive(Clone)]
pub(crate) struct Store {
    name: &'static str,
    backend: Arc<DynLockBackend>,
    admin: Arc<dyn LockAdmin>,
    /// The backend whose table `withlock migrate` creates.
    postgres: Option<PostgresBackend>,
}

impl Store {
    fn new<B: lock_core::LockBackend + LockAdmin>(name: &'static str, backend: B) -> Self {
        let backend = Arc::new(backend);
        Self {
            name,
            backend: Arc::clone(&backend) as Arc<DynLockBackend>,
            admin: backend,
            postgres: None,
        }
    }

    /// Makes the backend `args` names, changing nothing in the store.
    ///
    /// A malformed URL or table name is a usage failure; a server that
    /// cannot be reached is "unavailable" (69), one that refuses the login
    /// 77, a missing database or a Redis database index out of range 78.
    /// A single Redis server is asked for a `PING` here, and reached again
    /// at the first call if it did not answer; PostgreSQL and etcd connect
    /// here (etcd also grants and revokes a lease, so a user without the
    /// right to is refused here).
    pub(crate) async fn open(args: &StoreArgs) -> Result<Self, Failure> {
        Self::open_within(args, Duration::ZERO).await
    }

    /// [`open`](Self::open) for a caller that may wait up to `wait` for
    /// its lock: etcd, whose connect waits for a leader (after the leader
    /// stopped or died, an election takes 1 to 2 s), waits for one within
    /// the larger of `wait` and its connect timeout. The other stores
    /// connect as `open` does: a server that does not answer is not
    /// waited for.
    pub(crate) async fn open_within(args: &StoreArgs, wait: Duration) -> Result<Self, Failure> {
        let redis_config = || RedisConfig::default().prefix(args.redis_prefix.clone());
        let bad_url =
            |e: lock_redis::SetupError| Failure::usage(format!("--url: {}", ErrorChain(&e)));
        match Scheme::of(&args.url)? {
            Scheme::Redis => {
                check_query(&args.url, "Redis", REDIS_PARAMETERS)?;
                setup::redis_server(&args.url, redis_config())
                    .await
                    .map(|b| Self::new("Redis", b))
            }
            Scheme::RedisCluster { tls } => {
                check_query(&args.url, "Redis Cluster", REDIS_PARAMETERS)?;
                // The query is every node's, not the last host's.
                let (url, query) = split_query(&args.url);
                let (nodes, path) = split_hosts(url, if tls { "rediss" } else { "redis" })?;
                if !path.is_empty() {
                    return Err(Failure::usage(
                        "--url: a redis+cluster:// URL has no path (no database number on a cluster)",
                    ));
                }
                let nodes: Vec<String> = if query.is_empty() {
                    nodes
                } else {
                    nodes.into_iter().map(|n| format!("{n}/?{query}")).collect()
                };
                RedisClusterBackend::from_urls_with(nodes, redis_config())
                    .map(|b| Self::new("Redis Cluster", b))
                    .map_err(bad_url)
            }
            Scheme::RedisSentinel => {
                let (url, query) = split_query(&args.url);
                let (sentinels, master) = split_hosts(url, "redis")?;
                if master.is_empty() || master.contains('/') {
                    return Err(Failure::usage(
                        "--url: a redis+sentinel:// URL ends with the master name: redis+sentinel://host:port[,host:port…]/NAME",
                    ));
                }
                let sentinel = data_node_options(
                    SentinelConfig::new(&master, sentinels).map_err(bad_url)?,
                    query,
                )?;
                RedisSentinelBackend::with_config(sentinel, redis_config())
                    .map(|b| Self::new("Redis Sentinel", b))
                    .map_err(bad_url)
            }
            Scheme::Postgres => {
                check_query(&args.url, "PostgreSQL", POSTGRES_PARAMETERS)?;
                let options = args.url.parse::<PgConnectOptions>().map_err(|e| {
                    Failure::usage(format!(
                        "--url is not a valid PostgreSQL URL: {}",
                        ErrorChain(&e)
                    ))
                })?;
                let config = PostgresConfig::default()
                    .schema(args.schema.clone())
                    .table(args.table.clone());
                config
                    .validate()
                    .map_err(|e| Failure::usage(ErrorChain(&e).to_string()))?;
                setup::postgres_server(&options, &config).await?;
                let backend = PostgresBackend::connect_with(&args.url, config)
                    .await
                    .map_err(|e| setup::failure("PostgreSQL", &e))?;
                Ok(Self {
                    postgres: Some(backend.clone()),
                    ..Self::new("PostgreSQL", backend)
                })
            }
            Scheme::Etcd => {
                let mut config = setup::etcd_config(&args.url)?;
                config.connect_timeout = config.connect_timeout.max(wait);
                EtcdBackend::connect(config)
                    .await
                    .map(|b| Self::new("etcd", b))
                    .map_err(|e| setup::etcd_failure(&e))
            }
        }
    }

    /// Creates the PostgreSQL lock table if it is missing (`migrate`,
    /// idempotent) and gives its name; None for a store that needs no
    /// setup. Only `withlock migrate` calls it: `run` runs no DDL \[D3\].
    pub(crate) async fn migrate(&self) -> Result<Option<String>, Failure> {
        match &self.postgres {
            None => Ok(None),
            Some(backend) => backend
                .migrate()
                .await
                .map(|()| Some(backend.qualified_table().to_owned()))
                .map_err(|e| setup::failure("PostgreSQL", &e)),
        }
    }

    /// A locker (one node) on this store.
    pub(crate) fn locker(&self, options: LockerOptions) -> Result<Locker, LockError> {
        Locker::with_options(Arc::clone(&self.backend), options)
    }

    /// The store's admin functions.
    pub(crate) fn admin(&self) -> &dyn LockAdmin {
        &*self.admin
    }

    /// The backend's name in messages.
    pub(crate) fn name(&self) -> &'static str {
        self.name
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schemes_pick_the_backend() {
        assert_eq!(Scheme::of("redis://h:6379").unwrap(), Scheme::Redis);
        assert_eq!(Scheme::of("rediss://h").unwrap(), Scheme::Redis);
        assert_eq!(
            Scheme::of("redis+cluster://h:7000,h:7001").unwrap(),
            Scheme::RedisCluster { tls: false }
        );
        assert_eq!(
            Scheme::of("rediss+cluster://h:7000").unwrap(),
            Scheme::RedisCluster { tls: true }
        );
        assert_eq!(
            Scheme::of("redis+sentinel://h:26379/mymaster").unwrap(),
            Scheme::RedisSentinel
        );
        assert_eq!(Scheme::of("postgres://u@h/db").unwrap(), Scheme::Postgres);
        assert_eq!(Scheme::of("PostgreSQL://u@h/db").unwrap(), Scheme::Postgres);
        assert_eq!(Scheme::of("etcd://h:2379,h2").unwrap(), Scheme::Etcd);
        assert_eq!(Scheme::of("etcds://u:p@h").unwrap(), Scheme::Etcd);
    }

    #[test]
    fn unknown_schemes_are_named_without_the_url() {
        let failure = Scheme::of("mysql://root:secret@h/db").unwrap_err();
        assert_eq!(failure.code, crate::exit::USAGE);
        assert!(failure.message.contains("\"mysql\""));
        assert!(!failure.message.contains("secret"));
        assert!(Scheme::of("127.0.0.1:6379").is_err());
    }

    #[test]
    fn query_parameters_the_driver_ignores_are_refused() {
        let redis = |url| check_query(url, "Redis", REDIS_PARAMETERS);
        let postgres = |url| check_query(url, "PostgreSQL", POSTGRES_PARAMETERS);
        assert!(redis("redis://h:1").is_ok());
        assert!(redis("redis://h:1/2?protocol=resp3").is_ok());
        assert!(redis("rediss://h:1/?protocol=3#insecure").is_ok());
        let refused = redis("redis://:secret@h:1/?pasword=x").unwrap_err();
        assert_eq!(refused.code, crate::exit::USAGE);
        assert!(
            refused.message.contains("\"pasword\""),
            "{}",
            refused.message
        );
        assert!(!refused.message.contains("secret"), "{}", refused.message);
        assert!(postgres("postgres://u@h/db?sslmode=require&application_name=x").is_ok());
        assert!(
            postgres("postgres://u@h/db?options[statement_timeout]=5s&ssl-mode=disable").is_ok()
        );
        assert!(postgres("postgres://u@h/db?application%5Fname=x").is_ok());
        assert!(postgres("postgres://u@h/db?sslmode=require&pasword=x").is_err());
        assert!(postgres("postgres://u@h/db?protocol=resp3").is_err());
        // A password with `?` is no query; a name that does not look like
        // one is not shown.
        assert!(redis("redis://:se?cr&et@h:1").is_ok());
        let hidden = redis("redis://h:1?a%20b%21=1").unwrap_err();
        assert!(!hidden.message.contains("a b!"), "{}", hidden.message);
        assert_eq!(
            split_query("redis://:p?w@h:1/?protocol=3"),
            ("redis://:p?w@h:1/", "protocol=3")
        );
    }

    #[test]
    fn cluster_and_sentinel_urls_name_each_node_with_the_credentials() {
        let (nodes, path) = split_hosts("redis+cluster://u:p@ss@a:7000,b:7001", "redis").unwrap();
        assert_eq!(nodes, ["redis://u:p@ss@a:7000", "redis://u:p@ss@b:7001"]);
        assert_eq!(path, "");
        let (nodes, master) =
            split_hosts("redis+sentinel://s1:26379, s2:26379/my%20master", "redis").unwrap();
        assert_eq!(nodes, ["redis://s1:26379", "redis://s2:26379"]);
        assert_eq!(master, "my master");
        assert!(split_hosts("redis+cluster://a:1,,b:2", "redis").is_err());
        assert!(split_hosts("redis+sentinel:///m", "redis").is_err());
        assert!(split_hosts("redis+sentinel://a:1/%zz", "redis").is_err());
    }
}

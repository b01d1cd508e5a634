//! The command line, as clap parses it.

use std::ffi::OsString;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::exit::Failure;
use crate::store::Scheme;

/// The exit codes, as `--help` shows them.
const EXIT_CODES: &str = "\
Exit codes of `withlock run`:
  N      the command's own exit code, when it ran and the lock was held
         the whole time (128 + S when it died of signal S)
  64     bad arguments (EX_USAGE); nothing was touched
  69     the lock backend could not be reached or failed (EX_UNAVAILABLE);
         the command did not run
  75     the lock was busy until the wait ran out (EX_TEMPFAIL; another
         code with --busy-exit); the command did not run
  77     the backend refused the credentials or a permission
         (EX_NOPERM); the command did not run
  78     the backend is not set up: no such database, schema or table
         (create it with `withlock migrate`), a database index out of
         range, a column of the wrong type (EX_CONFIG); it did not run
  79     the lock was lost while the command ran: the command was sent
         SIGTERM, then SIGKILL after --grace, whatever it then returned
  124    the command ran past --max-runtime and was terminated
  126    the command could not be executed (or a script's #! line names
         an interpreter that cannot be); 127: it was not found (or the
         NAME of `#!/usr/bin/env NAME` is not on PATH); all checked
         before the lock is taken
  128+S  withlock got signal S while waiting; the command did not run
A command's own exit code of 75-79 or 124 cannot be told from withlock's.
`status` exits 0 when the key is held and 1 when it is free. Admin
commands exit 0, 64, 69, 77 or 78; `release --force` exits 65
(EX_DATAERR) when the key is not a withlock lock (a list, a hash, a value
without an expiry or of another format): it was left untouched.";

/// Where the locks are: the backend URL and its table or prefix.
const STORE_HELP: &str = "\
Backends, by URL scheme:
  redis://[user:pass@]host:port[/db][?protocol=resp3], rediss://…
      one Redis server: the lock is the Redis key itself
  redis+cluster://[user:pass@]host:port[,host:port…][?protocol=resp3],
  rediss+cluster://…
      a Redis Cluster (7.0 or later), found from any of its nodes; the
      user, password and query are used on every node
  redis+sentinel://[user:pass@]host:port[,host:port…]/MASTER[?data_password=P&data_username=U&db=N]
      the primary that the Sentinels at host:port name MASTER; the user
      and password are the Sentinels' own, the query gives the data nodes'
      (their requirepass or ACL user, percent-encoded) and the database
  postgres://, postgresql://
      one row per key in a table, created once by `withlock migrate`
      (`run` never creates it); see --schema and --table; the query
      takes sqlx's parameters (sslmode, sslrootcert, sslcert, sslkey,
      application_name, options, …)
  etcd://[user:pass@]host[:port][,host[:port]…], etcds://…
      an etcd cluster (3.4 or later), in the key layout of etcd's own lock,
      so that `etcdctl lock KEY` and withlock exclude each other; the port
      defaults to 2379; etcds:// is TLS, checked against the system's roots
A query parameter the URL's driver would ignore is refused (64), and so
are --schema and --table for another backend than PostgreSQL and
--redis-prefix for another than Redis (from the environment: a warning,
none with `run -q`).
The URL may be read from a file (--url-file, WITHLOCK_URL_FILE), so that
no password shows in `ps`. Every backend has the same list, inspect,
status and release commands.";

/// Run a command while holding a lock across every host that shares the
/// lock backend, and administer those locks.
#[derive(Debug, Parser)]
#[command(name = "withlock", version, after_long_help = EXIT_CODES)]
pub(crate) struct Cli {
    #[command(subcommand)]
    pub(crate) command: Command,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub(crate) enum Command {
    /// Take the lock on KEY, run CMD while holding it (extended as long as
    /// CMD runs), release it when CMD exits.
    ///
    /// CMD gets WITHLOCK_KEY and WITHLOCK_FENCING_TOKEN in its environment
    /// (and not WITHLOCK_URL). It runs in a process group of its own:
    /// SIGTERM, SIGINT and SIGHUP sent to withlock are forwarded to that
    /// group, which gets SIGKILL if CMD has not exited --grace later. If the
    /// lock is lost while CMD runs, or CMD runs past --max-runtime, the
    /// group gets SIGTERM at once and SIGKILL after --grace. When CMD
    /// exits, whatever it left in its group gets SIGTERM, then SIGKILL
    /// after --grace; only then is the lock released. On Linux, CMD's
    /// group is terminated too when withlock itself dies (even of
    /// SIGKILL). (Being in a group of its own, CMD cannot read from the
    /// terminal.)
    #[command(after_long_help = format!("{STORE_HELP}\n\n{EXIT_CODES}"))]
    Run(RunArgs),
    /// List the locks held now, with holder, remaining ttl and fencing
    /// token.
    #[command(after_long_help = STORE_HELP)]
    List(ListArgs),
    /// Show one key: its holder, remaining ttl and last fencing token.
    #[command(after_long_help = STORE_HELP)]
    Inspect(InspectArgs),
    /// Free a key whoever holds it (needs --force), printing who held it.
    ///
    /// Only a withlock lock is freed (on Redis: a string holding an owner
    /// token `<node id>/<32 hex>`, with an expiry and a fencing counter; on
    /// PostgreSQL: a held row of withlock or Ruby Locker, with
    /// locked_until; on etcd: a holder whose value is a withlock owner
    /// token, not one of `etcdctl lock`). Anything else is refused with
    /// exit 65 and left as it was. The release is announced as a release
    /// is, so waiters take the key at once, and a live holder's `withlock
    /// run` finds the lock gone within about a second and ends its command
    /// (exit 79): meant for a holder known to be dead or stuck.
    #[command(after_long_help = format!("{STORE_HELP}\n\n{EXIT_CODES}"))]
    Release(ReleaseArgs),
    /// Whether KEY is held: exit 0 when it is, 1 when it is free.
    ///
    /// Prints the holder, fencing token and time left of a held key.
    #[command(after_long_help = STORE_HELP)]
    Status(StatusArgs),
    /// Set the store up: on PostgreSQL, create the lock table if missing.
    ///
    /// The schema must exist, and the role must be allowed to create the
    /// table; `run` then needs only SELECT, INSERT, UPDATE and DELETE on the
    /// table and USAGE on its id sequence. Idempotent. Redis and etcd need
    /// nothing.
    #[command(after_long_help = STORE_HELP)]
    Migrate(MigrateArgs),
    /// Internal: the supervisor `run` starts CMD through.
    #[command(name = "__supervise", hide = true)]
    Supervise(SuperviseArgs),
}

impl Command {
    /// The store arguments of a subcommand that has them.
    pub(crate) fn store_mut(&mut self) -> Option<&mut StoreArgs> {
        match self {
            Self::Run(args) => Some(&mut args.store),
            Self::List(args) => Some(&mut args.store),
            Self::Inspect(args) => Some(&mut args.store),
            Self::Release(args) => Some(&mut args.store),
            Self::Status(args) => Some(&mut args.store),
            Self::Migrate(args) => Some(&mut args.store),
            Self::Supervise(_) => None,
        }
    }
}

/// The lock backend's URL and settings, common to every subcommand.
#[derive(Debug, Args)]
pub(crate) struct StoreArgs {
    /// The lock backend: redis://, rediss://, redis+cluster://,
    /// rediss+cluster://, redis+sentinel://, postgres://, postgresql://,
    /// etcd:// or etcds:// (see below; never printed: it may hold a
    /// password).
    #[arg(
        long = "url",
        env = "WITHLOCK_URL",
        value_name = "URL",
        hide_env_values = true
    )]
    url_arg: Option<String>,
    /// A file holding the URL (one line), so that no password shows in
    /// the process list; instead of --url.
    #[arg(long, env = "WITHLOCK_URL_FILE", value_name = "PATH")]
    url_file: Option<PathBuf>,
    /// The URL, from --url or --url-file (see [`resolve_url`](Self::resolve_url)).
    #[arg(skip)]
    pub(crate) url: String,
    /// PostgreSQL only: the schema of the lock table (it must exist).
    #[arg(
        long,
        env = "WITHLOCK_PG_SCHEMA",
        value_name = "SCHEMA",
        default_value = "public"
    )]
    pub(crate) schema: String,
    /// PostgreSQL only: the lock table (Ruby Locker's columns).
    #[arg(
        long,
        env = "WITHLOCK_PG_TABLE",
        value_name = "TABLE",
        default_value = "locks"
    )]
    pub(crate) table: String,
    /// Redis only: the prefix the lock keys carry, as `RedisConfig::prefix`
    /// of the services sharing the locks.
    #[arg(
        long,
        env = "WITHLOCK_REDIS_PREFIX",
        value_name = "PREFIX",
        default_value = ""
    )]
    pub(crate) redis_prefix: String,
    /// Where `--schema`, `--table` and `--redis-prefix` came from (see
    /// [`backend_options`](Self::backend_options)); set by `main` from
    /// clap's matches.
    #[arg(skip)]
    pub(crate) sources: Sources,
}

/// Where an option's value came from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) enum Source {
    /// Its default: not given.
    #[default]
    Default,
    /// The environment variable.
    Environment,
    /// The command line.
    CommandLine,
}

impl Source {
    /// The source of the argument `id` in `matches`.
    pub(crate) fn of(matches: &clap::ArgMatches, id: &str) -> Self {
        match matches.value_source(id) {
            Some(clap::parser::ValueSource::CommandLine) => Self::CommandLine,
            Some(clap::parser::ValueSource::EnvVariable) => Self::Environment,
            _ => Self::Default,
        }
    }
}

/// Where the options meant for one backend came from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Sources {
    pub(crate) schema: Source,
    pub(crate) table: Source,
    pub(crate) redis_prefix: Source,
}

impl Sources {
    /// The sources of the store options in a subcommand's `matches`.
    pub(crate) fn of(matches: &clap::ArgMatches) -> Self {
        Self {
            schema: Source::of(matches, "schema"),
            table: Source::of(matches, "table"),
            redis_prefix: Source::of(matches, "redis_prefix"),
        }
    }
}

impl StoreArgs {
    /// Sets [`url`](Self::url) from `--url` or the file `--url-file`
    /// names; checks the PostgreSQL table and schema names. The messages
    /// never show the URL.
    pub(crate) fn resolve_url(&mut self) -> Result<(), Failure> {
        self.url = match (self.url_arg.take(), &self.url_file) {
            (Some(_), Some(_)) => {
                return Err(Failure::usage(
                    "both --url (or WITHLOCK_URL) and --url-file (or WITHLOCK_URL_FILE) are set: give one",
                ))
            }
            (Some(url), None) => url,
            (None, Some(path)) => read_url_file(path)?,
            (None, None) => {
                return Err(Failure::usage(
                    "missing --url (or WITHLOCK_URL, --url-file, WITHLOCK_URL_FILE)",
                ))
            }
        };
        if self.url.trim().is_empty() {
            return Err(Failure::usage("--url is empty"));
        }
        for (option, name) in [("--schema", &self.schema), ("--table", &self.table)] {
            if !is_plain_identifier(name) {
                return Err(Failure::usage(format!(
                    "{option} {:?} is not a plain identifier (a letter or _, then letters, digits or _; at most 63 bytes)",
                    name.escape_debug().to_string()
                )));
            }
        }
        Ok(())
    }
}

impl StoreArgs {
    /// Checks that the options meant for one backend (`--schema` and
    /// `--table` for PostgreSQL, `--redis-prefix` for Redis) are not set
    /// for another, which would ignore them: given on the command line,
    /// a usage failure; from the environment (a host may export one set
    /// for jobs on several backends), a warning, given back for the
    /// caller to print.
    pub(crate) fn backend_options(&self) -> Result<Vec<String>, Failure> {
        let scheme = Scheme::of(&self.url)?;
        let postgres = scheme == Scheme::Postgres;
        let redis = matches!(
            scheme,
            Scheme::Redis | Scheme::RedisCluster { .. } | Scheme::RedisSentinel
        );
        let backend = match scheme {
            Scheme::Postgres => "PostgreSQL",
            Scheme::Etcd => "etcd",
            _ => "Redis",
        };
        let mut warnings = Vec::new();
        for (option, variable, source, meant, fits) in [
            (
                "--schema",
                "WITHLOCK_PG_SCHEMA",
                self.sources.schema,
                "PostgreSQL",
                postgres,
            ),
            (
                "--table",
                "WITHLOCK_PG_TABLE",
                self.sources.table,
                "PostgreSQL",
                postgres,
            ),
            (
                "--redis-prefix",
                "WITHLOCK_REDIS_PREFIX",
                self.sources.redis_prefix,
                "Redis",
                redis,
            ),
        ] {
            match source {
                _ if fits => {}
                Source::Default => {}
                Source::CommandLine => {
                    return Err(Failure::usage(format!(
                        "{option} is for {meant} only; the URL is {backend}'s, which would ignore it"
                    )))
                }
                Source::Environment => warnings.push(format!(
                    "warning: {variable} is set but ignored: it is for {meant} only, and the URL is {backend}'s"
                )),
            }
        }
        Ok(warnings)
    }
}

/// The URL in the file at `path`: its first line, without surrounding
/// whitespace.
fn read_url_file(path: &std::path::Path) -> Result<String, Failure> {
    let text = std::fs::read_to_string(path).map_err(|e| {
        Failure::usage(format!(
            "--url-file {}: cannot read it: {e}",
            path.display()
        ))
    })?;
    let url = text.lines().map(str::trim).find(|l| !l.is_empty());
    url.map(str::to_owned).ok_or_else(|| {
        Failure::usage(format!(
            "--url-file {}: the file holds no URL",
            path.display()
        ))
    })
}

/// A name PostgreSQL takes unquoted: a letter or `_`, then letters,
/// digits or `_`, at most 63 bytes (lower or upper case: it is quoted as
/// given).
fn is_plain_identifier(name: &str) -> bool {
    let mut chars = name.chars();
    name.len() <= 63
        && chars
            .next()
            .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// How `run` records what it did on stderr.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum LogFormat {
    /// One line of text when the command starts and one when it ends.
    Text,
    /// The same as one JSON object per line.
    Json,
}

/// `withlock run`.
#[derive(Debug, Args)]
pub(crate) struct RunArgs {
    #[command(flatten)]
    pub(crate) store: StoreArgs,
    /// The lock key, the same on every host running the job.
    #[arg(long, value_name = "KEY", value_parser = non_empty_key)]
    pub(crate) key: String,
    /// How long the lock lives unless extended; it is extended about every
    /// third of it while CMD runs, so this only matters when withlock
    /// itself dies or hangs.
    #[arg(long, value_name = "DURATION", default_value = "30s", value_parser = duration)]
    pub(crate) ttl: Duration,
    /// Wait up to DURATION for a busy lock, then exit 75. Default: the
    /// library's retries (10 more attempts 200 ms apart, about 2 s). The
    /// wait counts from the start: on etcd it also bounds waiting for a
    /// leader (at least etcd's connect timeout, 2 s).
    #[arg(long, value_name = "DURATION", value_parser = duration, group = "waiting")]
    pub(crate) wait: Option<Duration>,
    /// Try once: exit 75 at once if the lock is busy.
    #[arg(long, group = "waiting")]
    pub(crate) no_wait: bool,
    /// Wait as long as it takes for a busy lock.
    #[arg(long, group = "waiting")]
    pub(crate) wait_forever: bool,
    /// Wait outside the fair queue: by default a waiting run takes a place
    /// in the key's queue, where the store keeps one, and hosts get the
    /// lock in the order they asked for it (SPEC F1); without the queue
    /// the fastest host after each release wins.
    #[arg(long)]
    pub(crate) no_queue: bool,
    /// How long CMD's process group has between SIGTERM (or a forwarded
    /// signal) and SIGKILL: after a lost lock, past --max-runtime, after a
    /// signal withlock forwards, and for what CMD leaves running when it
    /// exits. If withlock itself dies, the group has the shorter of this
    /// and a third of --ttl.
    #[arg(long, value_name = "DURATION", default_value = "10s", value_parser = duration)]
    pub(crate) grace: Duration,
    /// Terminate CMD's group after it ran this long (SIGTERM, then SIGKILL
    /// after --grace) and exit 124, as timeout(1).
    #[arg(long, value_name = "DURATION", value_parser = positive_duration)]
    pub(crate) max_runtime: Option<Duration>,
    /// Keep the lock at least this long after it was taken, even when CMD
    /// ends sooner (ShedLock's lockAtLeastFor): the lock is then left to
    /// expire, so a job that cron starts on several hosts at slightly
    /// different times runs once per period. Default: 0 (release when CMD
    /// ends). At most 7 days.
    #[arg(long, value_name = "DURATION", value_parser = duration)]
    pub(crate) lock_at_least: Option<Duration>,
    /// The exit code when the lock is busy (as flock -E): 0 makes a busy
    /// lock a success.
    #[arg(long, value_name = "N", default_value_t = crate::exit::BUSY)]
    pub(crate) busy_exit: u8,
    /// Write one line to stderr when CMD starts (key, host, node id,
    /// fencing token, time waited) and one when it ends (time run, exit
    /// code, why the lock ended), as text or JSON. Off by default.
    #[arg(long, value_name = "FORMAT")]
    pub(crate) log_format: Option<LogFormat>,
    /// This host's name in the lock, as `list` and `inspect` show it.
    /// Default: `<hostname>:<pid>`.
    #[arg(long, env = "WITHLOCK_NODE_ID", value_name = "ID")]
    pub(crate) node_id: Option<String>,
    /// Say nothing when the lock is busy: no status line while waiting,
    /// no line when giving up and no --log-format record of the run (the
    /// exit code still says it: 75, or --busy-exit). There is no status
    /// line when stderr is not a terminal either.
    #[arg(long, short)]
    pub(crate) quiet: bool,
    /// The command and its arguments, after `--`.
    #[arg(last = true, required = true, value_name = "CMD")]
    pub(crate) command: Vec<OsString>,
}

/// `withlock list`.
#[derive(Debug, Args)]
pub(crate) struct ListArgs {
    #[command(flatten)]
    pub(crate) store: StoreArgs,
    /// Only keys starting with P.
    #[arg(long, value_name = "P", default_value = "")]
    pub(crate) prefix: String,
    /// One JSON array of objects instead of a table.
    #[arg(long)]
    pub(crate) json: bool,
}

/// `withlock inspect`.
#[derive(Debug, Args)]
pub(crate) struct InspectArgs {
    #[command(flatten)]
    pub(crate) store: StoreArgs,
    /// The lock key.
    #[arg(value_name = "KEY", value_parser = non_empty_key)]
    pub(crate) key: String,
    /// One JSON object instead of text.
    #[arg(long)]
    pub(crate) json: bool,
}

/// `withlock release`.
#[derive(Debug, Args)]
pub(crate) struct ReleaseArgs {
    #[command(flatten)]
    pub(crate) store: StoreArgs,
    /// The lock key.
    #[arg(value_name = "KEY", value_parser = non_empty_key)]
    pub(crate) key: String,
    /// Required: free the key even though another host holds it.
    #[arg(long)]
    pub(crate) force: bool,
}

/// `withlock status`.
#[derive(Debug, Args)]
pub(crate) struct StatusArgs {
    #[command(flatten)]
    pub(crate) store: StoreArgs,
    /// The lock key.
    #[arg(value_name = "KEY", value_parser = non_empty_key)]
    pub(crate) key: String,
    /// One JSON object instead of text.
    #[arg(long)]
    pub(crate) json: bool,
}

/// `withlock migrate`.
#[derive(Debug, Args)]
pub(crate) struct MigrateArgs {
    #[command(flatten)]
    pub(crate) store: StoreArgs,
}

/// `withlock __supervise`: what `run` tells the supervisor.
#[derive(Debug, Args)]
pub(crate) struct SuperviseArgs {
    /// The process id of the `withlock run` that started it.
    #[arg(long)]
    pub(crate) parent: i32,
    /// If that process dies, how long the group has between SIGTERM and
    /// SIGKILL.
    #[arg(long, value_parser = duration)]
    pub(crate) grace: Duration,
    /// The name the command is run as (its `argv[0]`).
    #[arg(long)]
    pub(crate) arg0: OsString,
    /// The resolved program, then its arguments.
    #[arg(last = true, required = true)]
    pub(crate) command: Vec<OsString>,
}

/// A human duration: `500ms`, `30s`, `5m`, `1h 30m`.
fn duration(text: &str) -> Result<Duration, String> {
    humantime::parse_duration(text)
        .map_err(|e| format!("{e} (a duration such as 500ms, 30s or 5m)"))
}

/// A duration above zero.
fn positive_duration(text: &str) -> Result<Duration, String> {
    match duration(text)? {
        d if d.is_zero() => Err("the duration must be above zero".to_owned()),
        d => Ok(d),
    }
}

/// A key the command takes: not empty, no control characters (a newline
/// or an escape in a key would garble every line that shows it). The
/// library itself takes any key without NUL.
fn non_empty_key(text: &str) -> Result<String, &'static str> {
    if text.is_empty() {
        Err("the lock key is empty")
    } else if text.chars().any(char::is_control) {
        Err("the lock key has a control character (newline, tab, escape…)")
    } else {
        Ok(text.to_owned())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_identifiers() {
        for ok in ["locks", "_x", "Locks2", "withlock_test_1_ab"] {
            assert!(is_plain_identifier(ok), "{ok}");
        }
        for bad in ["", "1a", "a-b", "a b", "a\"b", "ä", &"x".repeat(64)] {
            assert!(!is_plain_identifier(bad), "{bad}");
        }
    }

    #[test]
    fn keys_without_control_characters() {
        assert!(non_empty_key("a b {c}").is_ok());
        assert!(non_empty_key("a\nb").is_err());
        assert!(non_empty_key("").is_err());
        assert!(positive_duration("0s").is_err());
        assert_eq!(positive_duration("2s"), Ok(Duration::from_secs(2)));
    }
}

//! The command line, as clap parses it.

use std::ffi::OsString;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};

/// The exit codes, as `--help` shows them.
const EXIT_CODES: &str = "\
Exit codes of `withlock run`:
  N      the command's own exit code, when it ran and the lock was held
         the whole time (128 + S when it died of signal S)
  64     bad arguments (EX_USAGE); nothing was touched
  69     the lock backend could not be reached or failed (EX_UNAVAILABLE);
         the command did not run
  75     the lock was busy until the wait ran out (EX_TEMPFAIL); the
         command did not run
  79     the lock was lost while the command ran: the command was sent
         SIGTERM, then SIGKILL after --grace, whatever it then returned
  126    the command could not be executed; 127: it was not found
  128+S  withlock got signal S while waiting; the command did not run
Admin commands exit 0, 64 or 69; `release --force` exits 65 (EX_DATAERR)
when the key is not a withlock lock (a list, a hash, a value without an
expiry or of another format): it was left untouched.";

/// Where the locks are: the backend URL and its table or prefix.
const STORE_HELP: &str = "\
Backends, by URL scheme:
  redis://[user:pass@]host:port[/db], rediss://…
      one Redis server: the lock is the Redis key itself
  redis+cluster://[user:pass@]host:port[,host:port…], rediss+cluster://…
      a Redis Cluster (7.0 or later), found from any of its nodes; the
      user and password are used on every node
  redis+sentinel://[user:pass@]host:port[,host:port…]/MASTER
      the primary that the Sentinels at host:port name MASTER (the user and
      password are the Sentinels'; the primary is reached without one)
  postgres://, postgresql://
      one row per key in a table (created if missing by `withlock run`);
      see --schema and --table
Every backend has the same list, inspect and release commands.";

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
    /// CMD gets WITHLOCK_KEY and WITHLOCK_FENCING_TOKEN in its environment.
    /// It runs in a process group of its own: SIGTERM, SIGINT and SIGHUP
    /// sent to withlock are forwarded to that group, and if the lock is
    /// lost while CMD runs, the group gets SIGTERM at once and SIGKILL
    /// after --grace. (Being in a group of its own, CMD cannot read from
    /// the terminal.) The lock is released once CMD has exited.
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
    /// locked_until). Anything else is refused with exit 65 and left as it
    /// was. The release is announced as a release is, so waiters take the
    /// key at once; the holder finds the lock gone at its next extension:
    /// meant for a holder known to be dead.
    #[command(after_long_help = format!("{STORE_HELP}\n\n{EXIT_CODES}"))]
    Release(ReleaseArgs),
}

/// The lock backend's URL and settings, common to every subcommand.
#[derive(Debug, Args)]
pub(crate) struct StoreArgs {
    /// The lock backend: redis://, rediss://, redis+cluster://,
    /// rediss+cluster://, redis+sentinel://, postgres:// or postgresql://
    /// (see below; never printed: it may hold a password).
    #[arg(long, env = "WITHLOCK_URL", value_name = "URL", hide_env_values = true)]
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
    /// library's retries (10 more attempts 200 ms apart, about 2 s).
    #[arg(long, value_name = "DURATION", value_parser = duration, group = "waiting")]
    pub(crate) wait: Option<Duration>,
    /// Try once: exit 75 at once if the lock is busy.
    #[arg(long, group = "waiting")]
    pub(crate) no_wait: bool,
    /// Wait as long as it takes for a busy lock.
    #[arg(long, group = "waiting")]
    pub(crate) wait_forever: bool,
    /// After a lost lock, how long CMD has between SIGTERM and SIGKILL.
    #[arg(long, value_name = "DURATION", default_value = "10s", value_parser = duration)]
    pub(crate) grace: Duration,
    /// This host's name in the lock, as `list` and `inspect` show it.
    /// Default: `<hostname>:<pid>`.
    #[arg(long, env = "WITHLOCK_NODE_ID", value_name = "ID")]
    pub(crate) node_id: Option<String>,
    /// No status line while waiting (there is none when stderr is not a
    /// terminal either).
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

/// A human duration: `500ms`, `30s`, `5m`, `1h 30m`.
fn duration(text: &str) -> Result<Duration, String> {
    humantime::parse_duration(text)
        .map_err(|e| format!("{e} (a duration such as 500ms, 30s or 5m)"))
}

fn non_empty_key(text: &str) -> Result<String, &'static str> {
    if text.is_empty() {
        Err("the lock key is empty")
    } else {
        Ok(text.to_owned())
    }
}

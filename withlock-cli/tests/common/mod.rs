//! What the tests of the `withlock` binary share: a store of each kind in a
//! namespace of its own, the binary, and a scratch directory the child
//! commands write to.

#![allow(dead_code, unreachable_pub)]

use std::path::{Path, PathBuf};
use std::process::{Output, Stdio};
use std::time::{Duration, Instant};

use lock_core::{LockHandle, Locker, LockerOptions};
use lock_postgres::sqlx;
use lock_postgres::testing::TestBackend;
use lock_redis::testing::Namespace;
use lock_redis::{redis, RedisBackend};
use tokio::process::{Child, Command};

/// The binary under test.
pub const BIN: &str = env!("CARGO_BIN_EXE_withlock");

/// The longest any one run of the binary may take in a test.
pub const RUN_BOUND: Duration = Duration::from_secs(30);

/// Makes one test per backend from `async fn $name(store: Store)`.
#[macro_export]
macro_rules! on_every_backend {
    ($($name:ident),* $(,)?) => {
        mod redis {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name($crate::common::Store::redis().await).await;
                }
            )*
        }
        mod postgres {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name($crate::common::Store::postgres().await).await;
                }
            )*
        }
    };
}

/// A real store, isolated for one test: Redis keys under a random prefix
/// (deleted afterwards), or a PostgreSQL schema of its own (dropped
/// afterwards).
pub enum Store {
    Redis {
        url: String,
        namespace: Namespace,
        backend: RedisBackend,
    },
    Postgres {
        url: String,
        backend: TestBackend,
    },
}

/// What the store holds for one key, read with the store's own commands.
#[derive(Debug, PartialEq, Eq)]
pub struct Stored {
    /// The owner token of the holder, if the key is held.
    pub owner: Option<String>,
    /// The last fencing token drawn for the key.
    pub fencing_token: Option<u64>,
}

impl Store {
    pub async fn redis() -> Self {
        let url = withlock_test_servers::redis::server_url().await;
        Self::Redis {
            namespace: Namespace::new(&url),
            backend: RedisBackend::from_url(&url).unwrap(),
            url,
        }
    }

    pub async fn postgres() -> Self {
        let url = withlock_test_servers::postgres::database_url();
        Self::Postgres {
            backend: TestBackend::new(&url).await.unwrap(),
            url,
        }
    }

    /// A key for this test.
    pub fn key(&self, name: &str) -> String {
        match self {
            Self::Redis { namespace, .. } => namespace.key(name),
            Self::Postgres { .. } => name.to_owned(),
        }
    }

    /// The prefix every key of [`key`](Self::key) has.
    pub fn prefix(&self) -> &str {
        match self {
            Self::Redis { namespace, .. } => namespace.prefix(),
            Self::Postgres { .. } => "",
        }
    }

    /// `--url` and, for PostgreSQL, `--schema`.
    pub fn args(&self) -> Vec<String> {
        match self {
            Self::Redis { url, .. } => vec!["--url".into(), url.clone()],
            Self::Postgres { url, backend } => vec![
                "--url".into(),
                url.clone(),
                "--schema".into(),
                backend.schema().name().to_owned(),
            ],
        }
    }

    /// `withlock SUBCOMMAND` on this store.
    pub fn cmd(&self, subcommand: &str) -> Command {
        let mut command = withlock([subcommand]);
        command.args(self.args());
        command
    }

    /// A node of its own on this store, named `node_id`.
    pub fn locker(&self, node_id: &str) -> Locker {
        let options = LockerOptions::default().node_id(node_id);
        match self {
            Self::Redis { backend, .. } => Locker::with_options(backend.clone(), options),
            Self::Postgres { backend, .. } => {
                Locker::with_options(backend.backend().clone(), options)
            }
        }
        .unwrap()
    }

    /// Takes `key` as node `node_id` for a minute, as another host would.
    pub async fn hold(&self, key: &str, node_id: &str) -> (Locker, LockHandle) {
        let locker = self.locker(node_id);
        let mut handle = locker.handle(key, Duration::from_secs(60)).unwrap();
        assert!(handle.acquire().await.unwrap(), "{key} was not free");
        (locker, handle)
    }

    /// What the store holds for `key`, read directly.
    pub async fn stored(&self, key: &str) -> Stored {
        match self {
            Self::Redis { backend, .. } => {
                let mut conn = backend.pool().get().await.unwrap();
                let (owner, token): (Option<String>, Option<u64>) = redis::pipe()
                    .get(key)
                    .get(backend.fence_key(key))
                    .query_async(&mut conn)
                    .await
                    .unwrap();
                Stored {
                    owner,
                    fencing_token: token,
                }
            }
            Self::Postgres { backend, .. } => {
                let sql = format!(
                    "SELECT CASE WHEN locked_until >= clock_timestamp() AT TIME ZONE 'UTC' \
                     THEN locked_by END, sequence FROM {} WHERE key = $1",
                    backend.qualified_table()
                );
                let row: Option<(Option<String>, i64)> = sqlx::query_as(&sql)
                    .bind(key)
                    .fetch_optional(backend.pool())
                    .await
                    .unwrap();
                let (owner, token) = row.map_or((None, None), |(o, t)| (o, Some(t)));
                Stored {
                    owner,
                    fencing_token: token.map(|t| u64::try_from(t).unwrap()),
                }
            }
        }
    }

    /// Takes `key` away from its holder by hand, for a minute: another
    /// owner's value in its place.
    pub async fn steal(&self, key: &str) {
        let thief = "thief/0123456789abcdef0123456789abcdef";
        match self {
            Self::Redis { backend, .. } => {
                let mut conn = backend.pool().get().await.unwrap();
                let _: () = redis::cmd("SET")
                    .arg(key)
                    .arg(thief)
                    .arg("XX")
                    .arg("PX")
                    .arg(60_000)
                    .query_async(&mut conn)
                    .await
                    .unwrap();
            }
            Self::Postgres { backend, .. } => {
                let sql = format!(
                    "UPDATE {} SET locked_by = $2, \
                     locked_until = clock_timestamp() AT TIME ZONE 'UTC' + interval '1 minute' \
                     WHERE key = $1 AND locked_by IS NOT NULL",
                    backend.qualified_table()
                );
                let done = sqlx::query(&sql)
                    .bind(key)
                    .bind(thief)
                    .execute(backend.pool())
                    .await
                    .unwrap();
                assert_eq!(done.rows_affected(), 1, "{key} was not held");
            }
        }
        assert_eq!(self.stored(key).await.owner.as_deref(), Some(thief));
    }
}

/// How a key is taken from its holder by hand, without another owner.
#[derive(Clone, Copy, Debug)]
pub enum Tamper {
    /// `DEL` on Redis, `DELETE` of the row on PostgreSQL.
    Delete,
    /// The row set free (`locked_by = NULL`) on PostgreSQL; `DEL` on Redis,
    /// which has no free state.
    Free,
}

impl Store {
    /// Frees or deletes `key` by hand while it is held.
    pub async fn tamper(&self, key: &str, how: Tamper) {
        match self {
            Self::Redis { backend, .. } => {
                let mut conn = backend.pool().get().await.unwrap();
                let deleted: i64 = redis::cmd("DEL")
                    .arg(key)
                    .query_async(&mut conn)
                    .await
                    .unwrap();
                assert_eq!(deleted, 1, "{key} was not held");
            }
            Self::Postgres { backend, .. } => {
                let table = backend.qualified_table();
                let sql = match how {
                    Tamper::Delete => format!("DELETE FROM {table} WHERE key = $1"),
                    Tamper::Free => format!(
                        "UPDATE {table} SET locked_by = NULL \
                         WHERE key = $1 AND locked_by IS NOT NULL"
                    ),
                };
                let done = sqlx::query(&sql)
                    .bind(key)
                    .execute(backend.pool())
                    .await
                    .unwrap();
                assert_eq!(done.rows_affected(), 1, "{key} was not held");
            }
        }
    }
}

/// `withlock ARGS…` with no `WITHLOCK_*` from the test's environment, no
/// stdin, and stdout and stderr captured.
pub fn withlock<I, S>(args: I) -> Command
where
    I: IntoIterator<Item = S>,
    S: AsRef<std::ffi::OsStr>,
{
    let mut command = Command::new(BIN);
    for (name, _) in std::env::vars_os() {
        if name.to_string_lossy().starts_with("WITHLOCK_") {
            command.env_remove(name);
        }
    }
    command
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    command
}

/// Runs the command to its end, within [`RUN_BOUND`].
pub async fn finish(command: &mut Command) -> Output {
    let child = command.spawn().unwrap();
    wait(child).await
}

/// Waits for a spawned `withlock` to end, within [`RUN_BOUND`].
pub async fn wait(child: Child) -> Output {
    tokio::time::timeout(RUN_BOUND, child.wait_with_output())
        .await
        .expect("withlock did not exit in time")
        .unwrap()
}

/// Runs the command to its end (within [`RUN_BOUND`]) and checks that it
/// exited with `expected`; the failure shows the arguments and stderr.
pub async fn run_expecting(command: &mut Command, expected: i32) -> Output {
    let args = args_of(command);
    let output = finish(command).await;
    assert_eq!(code(&output), expected, "{args}: {}", stderr(&output));
    output
}

/// Waits for a spawned `withlock` to end (within [`RUN_BOUND`]) and checks
/// that it exited with `expected`; the failure shows stderr.
pub async fn wait_expecting(child: Child, expected: i32) -> Output {
    let output = wait(child).await;
    assert_eq!(code(&output), expected, "{}", stderr(&output));
    output
}

/// The command's arguments, for a failure message.
fn args_of(command: &Command) -> String {
    command
        .as_std()
        .get_args()
        .map(|a| a.to_string_lossy().into_owned())
        .collect::<Vec<_>>()
        .join(" ")
}

/// The authority of `url`: what follows the scheme up to the path, user
/// and password included (`redis://u:pw@h:1/2` gives `u:pw@h:1`), for a
/// test that builds another URL to the same server.
pub fn authority(url: &str) -> &str {
    let (_, rest) = url
        .split_once("://")
        .unwrap_or_else(|| panic!("no scheme in {url:?}"));
    rest.split('/').next().unwrap_or(rest)
}

/// The `host:port` of `url`: its [`authority`] without the user and
/// password (`redis://u:pw@h:1/2` gives `h:1`).
pub fn host_port(url: &str) -> &str {
    let authority = authority(url);
    authority
        .rsplit_once('@')
        .map_or(authority, |(_, host)| host)
}

/// The `host:port` of each of `urls`, comma-separated, as a multi-host
/// URL (Sentinel, Cluster) lists them.
pub fn hosts_of(urls: &[String]) -> String {
    urls.iter()
        .map(|u| host_port(u.as_str()))
        .collect::<Vec<_>>()
        .join(",")
}

/// The exit code, and stderr as text.
pub fn code(output: &Output) -> i32 {
    output
        .status
        .code()
        .unwrap_or_else(|| panic!("withlock died of a signal: {output:?}"))
}

pub fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

pub fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// A directory of its own for one test, removed on drop.
pub struct Scratch(PathBuf);

impl Scratch {
    pub fn new() -> Self {
        let dir =
            std::env::temp_dir().join(format!("withlock-cli-test-{:016x}", rand::random::<u64>()));
        std::fs::create_dir_all(&dir).unwrap();
        Self(dir)
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }

    /// The path of `name`, as a shell word.
    pub fn sh(&self, name: &str) -> String {
        format!("'{}'", self.path(name).display())
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Waits until `path` exists and is not empty, within ten seconds.
pub async fn appears(path: &Path) -> String {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Ok(text) = std::fs::read_to_string(path) {
            if !text.is_empty() {
                return text;
            }
        }
        assert!(
            Instant::now() < deadline,
            "{} never appeared",
            path.display()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Whether the process `pid` still exists (a zombie counts as gone).
pub fn alive(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => !stat
            .rsplit_once(')')
            .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z')),
        Err(_) => false,
    }
}

/// Waits (within ten seconds) until the process `pid` catches `signal`:
/// its handler is installed, as `/proc/PID/status` (`SigCgt`) shows. The
/// handshake for a signal sent to a withlock that does not run a command
/// yet.
pub async fn catches(pid: u32, signal: i32) {
    let deadline = Instant::now() + Duration::from_secs(10);
    let bit = 1u64 << (signal - 1);
    loop {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
        let caught = status
            .lines()
            .find_map(|l| l.strip_prefix("SigCgt:"))
            .and_then(|mask| u64::from_str_radix(mask.trim(), 16).ok())
            .unwrap_or(0);
        if caught & bit != 0 {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "process {pid} never caught signal {signal}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Waits until none of `pids` is alive, within `bound`; gives how long it
/// took.
pub async fn all_gone(pids: &[i32], bound: Duration) -> Duration {
    let started = Instant::now();
    loop {
        let alive: Vec<i32> = pids.iter().copied().filter(|&p| alive(p)).collect();
        if alive.is_empty() {
            return started.elapsed();
        }
        assert!(
            started.elapsed() < bound,
            "{alive:?} still alive after {bound:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A number read from a file the command wrote, once it is there.
pub async fn number(path: &Path) -> i32 {
    appears(path).await.trim().parse().unwrap()
}

/// Runs SQL on the shared PostgreSQL server as its superuser.
pub async fn sql(statements: &str) {
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect(&withlock_test_servers::postgres::database_url())
        .await
        .unwrap();
    sqlx::raw_sql(statements).execute(&pool).await.unwrap();
    pool.close().await;
}

/// A PostgreSQL role of its own for one test, with LOGIN, dropped (with
/// every privilege granted to it) on drop.
pub struct Role {
    pub name: String,
}

impl Role {
    pub async fn create(options: &str) -> Self {
        let name = format!("withlock_test_role_{:016x}", rand::random::<u64>());
        sql(&format!("CREATE ROLE \"{name}\" {options}")).await;
        Self { name }
    }

    /// The test server's URL with this role as the user.
    pub fn url(&self) -> String {
        let url = withlock_test_servers::postgres::database_url();
        let (scheme, rest) = url.split_once("://").unwrap();
        let host = rest.rsplit_once('@').map_or(rest, |(_, host)| host);
        format!("{scheme}://{}@{host}", self.name)
    }
}

impl Drop for Role {
    fn drop(&mut self) {
        let name = self.name.clone();
        let _ = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            runtime.block_on(sql(&format!(
                "DROP OWNED BY \"{name}\"; DROP ROLE IF EXISTS \"{name}\""
            )));
        })
        .join();
    }
}

/// A Redis ACL user of its own on the shared server, deleted on drop.
pub struct AclUser {
    pub name: String,
    pub password: String,
    client: redis::Client,
    server: String,
}

impl AclUser {
    /// `ACL SETUSER` with `rules` after `on >password`.
    pub async fn create(rules: &str) -> Self {
        let url = withlock_test_servers::redis::server_url().await;
        let client = redis::Client::open(url.as_str()).unwrap();
        let name = format!("withlock-test-{:016x}", rand::random::<u64>());
        let password = format!("{:032x}", rand::random::<u128>());
        let mut conn = client.get_multiplexed_async_connection().await.unwrap();
        let mut cmd = redis::cmd("ACL");
        cmd.arg("SETUSER")
            .arg(&name)
            .arg("on")
            .arg(format!(">{password}"));
        for rule in rules.split_whitespace() {
            cmd.arg(rule);
        }
        let () = cmd.query_async(&mut conn).await.unwrap();
        let server = host_port(&url).to_owned();
        Self {
            name,
            password,
            client,
            server,
        }
    }

    /// The server's URL as this user, with `password`.
    pub fn url_with(&self, password: &str) -> String {
        format!("redis://{}:{password}@{}", self.name, self.server)
    }
}

impl Drop for AclUser {
    fn drop(&mut self) {
        if let Ok(mut conn) = self.client.get_connection() {
            let _: redis::RedisResult<i64> = redis::cmd("ACL")
                .arg("DELUSER")
                .arg(&self.name)
                .query(&mut conn);
        }
    }
}

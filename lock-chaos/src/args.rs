//! The command line: `chaos run …`, `chaos worker …` (started by `run`),
//! `chaos analyse DIR`.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use crate::event::FaultKind;

/// The usage text.
pub const USAGE: &str = "\
usage:
  chaos run --backend redis|postgres|etcd|redis-cluster [--seconds 60] [--procs 3]
            [--tasks 4] [--keys 4 (redis-cluster: 6)]
            [--ttl 1s (redis-cluster: 2s)] [--hold 200ms] [--grace 500ms] [--heal 3s] [--liveness-bound 5s]
            [--faults kind,kind…] [--fence-url URL] [--out DIR]
            [--shuffle-queue true (tests the order check: it must fail)]
  chaos analyse DIR
  (chaos worker … is started by chaos run)

The fence store is a table of its own, dropped at the end, on --fence-url
(default: DATABASE_URL, else postgres://postgres@127.0.0.1:5432/test).
Exit status: 0 clean, 1 violations found, 2 the run could not be made.";

/// A bad command line.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ArgsError {
    /// No or an unknown subcommand.
    #[error("unknown command; expected run, worker or analyse")]
    UnknownCommand,
    /// A flag this command does not take.
    #[error("unknown flag {0}")]
    UnknownFlag(String),
    /// A flag without its value.
    #[error("flag {0} needs a value")]
    MissingValue(String),
    /// A required flag is missing.
    #[error("flag --{0} is required")]
    Required(&'static str),
    /// A value that does not parse.
    #[error("bad value {value:?} for --{flag}")]
    BadValue {
        /// The flag.
        flag: &'static str,
        /// What was given.
        value: String,
    },
}

/// The lock store under test.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    /// `lock-redis`.
    Redis,
    /// `lock-postgres`.
    Postgres,
    /// `lock-etcd` on a 3-member cluster.
    Etcd,
    /// `lock-redis`'s `RedisClusterBackend` on 3 masters with a replica
    /// each.
    RedisCluster,
}

impl Backend {
    /// `redis`, `postgres`, `etcd` or `redis-cluster`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Redis => "redis",
            Self::Postgres => "postgres",
            Self::Etcd => "etcd",
            Self::RedisCluster => "redis-cluster",
        }
    }

    /// The default lock ttl: 2 s on Redis Cluster, shorter than a failover
    /// (`cluster-node-timeout` 2 s, then the election), 1 s elsewhere.
    pub fn default_ttl(self) -> Duration {
        match self {
            Self::RedisCluster => Duration::from_secs(2),
            _ => Duration::from_secs(1),
        }
    }

    /// The default number of keys: 6 on Redis Cluster (two per master),
    /// 4 elsewhere.
    pub fn default_keys(self) -> u32 {
        match self {
            Self::RedisCluster => 6,
            _ => 4,
        }
    }
}

/// What to do.
#[derive(Clone, Debug)]
pub enum Command {
    /// Coordinate a run.
    Run(RunArgs),
    /// Be one worker of a run.
    Worker(WorkerArgs),
    /// Analyse the log of an earlier run.
    Analyse(PathBuf),
}

/// `chaos run`.
#[derive(Clone, Debug)]
pub struct RunArgs {
    /// The store under test.
    pub backend: Backend,
    /// How long faults are injected. Default: 60 s.
    pub seconds: u64,
    /// Worker processes. Default: 3.
    pub procs: u32,
    /// Tasks per worker. Default: 4.
    pub tasks: u32,
    /// Keys. Default: 4 (Redis Cluster: 6, spread evenly over the masters).
    pub keys: u32,
    /// The lock ttl. Default: 1 s (Redis Cluster: 2 s).
    pub ttl: Duration,
    /// The longest ordinary hold; one section in eight holds one to two
    /// ttls instead, so that extensions run. Default: 200 ms.
    pub hold: Duration,
    /// The grace of each worker's `Locker::shutdown`: shorter than a long
    /// hold, so that shutdown has locks to release. Default: 500 ms.
    pub grace: Duration,
    /// The quiet time after each fault heals. Default: 3 s.
    pub heal: Duration,
    /// How soon after a fault heals a fresh lock must complete; also the
    /// quiet time after the last fault. Default: 5 s.
    pub liveness_bound: Duration,
    /// The faults to inject, in schedule order. Default: all of the
    /// backend's ([`FaultKind::for_backend`]).
    pub faults: Vec<FaultKind>,
    /// The fence store. Default: `DATABASE_URL` or the shared test server.
    pub fence_url: String,
    /// Where the logs and the report go. Default: a new temporary directory.
    pub out: Option<PathBuf>,
    /// Shuffle each read of the fair queue before it is logged: a queue
    /// out of order on purpose, which the order check must report. For
    /// testing the check only. Default: false.
    pub shuffle_queue: bool,
}

/// `chaos worker`, as `chaos run` starts it.
#[derive(Clone, Debug)]
pub struct WorkerArgs {
    /// The store under test.
    pub backend: Backend,
    /// Its URL.
    pub lock_url: String,
    /// The fence store's URL.
    pub fence_url: String,
    /// The fence table.
    pub fence_table: String,
    /// The keys.
    pub keys: Vec<String>,
    /// This worker's index.
    pub worker: u32,
    /// Tasks.
    pub tasks: u32,
    /// The lock ttl.
    pub ttl: Duration,
    /// The longest ordinary hold.
    pub hold: Duration,
    /// The shutdown grace.
    pub grace: Duration,
    /// The log file.
    pub log: PathBuf,
}

/// Parses `args` (without the program name).
///
/// # Errors
///
/// [`ArgsError`] for anything it does not understand.
pub fn parse(args: &[String]) -> Result<Command, ArgsError> {
    let (command, rest) = args.split_first().ok_or(ArgsError::UnknownCommand)?;
    match command.as_str() {
        "run" => parse_run(flags(rest)?).map(Command::Run),
        "worker" => parse_worker(flags(rest)?).map(Command::Worker),
        "analyse" | "analyze" => match rest {
            [dir] => Ok(Command::Analyse(dir.into())),
            _ => Err(ArgsError::Required("DIR")),
        },
        _ => Err(ArgsError::UnknownCommand),
    }
}

struct Flags(BTreeMap<String, String>);

fn flags(args: &[String]) -> Result<Flags, ArgsError> {
    let mut map = BTreeMap::new();
    let mut it = args.iter();
    while let Some(flag) = it.next() {
        let name = flag
            .strip_prefix("--")
            .ok_or_else(|| ArgsError::UnknownFlag(flag.clone()))?;
        let value = it
            .next()
            .ok_or_else(|| ArgsError::MissingValue(flag.clone()))?;
        map.insert(name.to_owned(), value.clone());
    }
    Ok(Flags(map))
}

impl Flags {
    fn take(&mut self, flag: &'static str) -> Option<String> {
        self.0.remove(flag)
    }

    fn required(&mut self, flag: &'static str) -> Result<String, ArgsError> {
        self.take(flag).ok_or(ArgsError::Required(flag))
    }

    fn parsed<T: std::str::FromStr>(
        &mut self,
        flag: &'static str,
        default: T,
    ) -> Result<T, ArgsError> {
        match self.take(flag) {
            None => Ok(default),
            Some(value) => value
                .parse()
                .map_err(|_| ArgsError::BadValue { flag, value }),
        }
    }

    fn duration(&mut self, flag: &'static str, default: Duration) -> Result<Duration, ArgsError> {
        match self.take(flag) {
            None => Ok(default),
            Some(value) => parse_duration(&value).ok_or(ArgsError::BadValue { flag, value }),
        }
    }

    fn backend(&mut self) -> Result<Backend, ArgsError> {
        match self.required("backend")?.as_str() {
            "redis" => Ok(Backend::Redis),
            "postgres" => Ok(Backend::Postgres),
            "etcd" => Ok(Backend::Etcd),
            "redis-cluster" => Ok(Backend::RedisCluster),
            other => Err(ArgsError::BadValue {
                flag: "backend",
                value: other.to_owned(),
            }),
        }
    }

    fn done(self) -> Result<(), ArgsError> {
        match self.0.into_keys().next() {
            Some(flag) => Err(ArgsError::UnknownFlag(format!("--{flag}"))),
            None => Ok(()),
        }
    }
}

fn parse_run(mut f: Flags) -> Result<RunArgs, ArgsError> {
    let backend = f.backend()?;
    let faults = match f.take("faults") {
        None => FaultKind::for_backend(backend.name()).to_vec(),
        Some(list) => list
            .split(',')
            .map(|name| {
                FaultKind::allowed(backend.name())
                    .into_iter()
                    .find(|k| k.name() == name)
                    .ok_or_else(|| ArgsError::BadValue {
                        flag: "faults",
                        value: name.to_owned(),
                    })
            })
            .collect::<Result<_, _>>()?,
    };
    let args = RunArgs {
        backend,
        seconds: f.parsed("seconds", 60)?,
        procs: f.parsed("procs", 3)?,
        tasks: f.parsed("tasks", 4)?,
        keys: f.parsed("keys", backend.default_keys())?,
        ttl: f.duration("ttl", backend.default_ttl())?,
        hold: f.duration("hold", Duration::from_millis(200))?,
        grace: f.duration("grace", Duration::from_millis(500))?,
        heal: f.duration("heal", Duration::from_secs(3))?,
        liveness_bound: f.duration("liveness-bound", Duration::from_secs(5))?,
        faults,
        fence_url: f
            .take("fence-url")
            .unwrap_or_else(withlock_test_servers::postgres::database_url),
        out: f.take("out").map(PathBuf::from),
        shuffle_queue: f.parsed("shuffle-queue", false)?,
    };
    f.done()?;
    if args.procs == 0 || args.tasks == 0 || args.keys == 0 {
        return Err(ArgsError::BadValue {
            flag: "procs/tasks/keys",
            value: "0".into(),
        });
    }
    Ok(args)
}

fn parse_worker(mut f: Flags) -> Result<WorkerArgs, ArgsError> {
    let args = WorkerArgs {
        backend: f.backend()?,
        lock_url: f.required("lock-url")?,
        fence_url: f.required("fence-url")?,
        fence_table: f.required("fence-table")?,
        keys: f.required("keys")?.split(',').map(str::to_owned).collect(),
        worker: f.parsed("worker", 0)?,
        tasks: f.parsed("tasks", 4)?,
        ttl: f.duration("ttl", Duration::from_secs(1))?,
        hold: f.duration("hold", Duration::from_millis(200))?,
        grace: f.duration("grace", Duration::from_secs(3))?,
        log: f.required("log")?.into(),
    };
    f.done()?;
    Ok(args)
}

/// `1s`, `1.5s`, `250ms`.
pub fn parse_duration(text: &str) -> Option<Duration> {
    let (number, unit) = match text.strip_suffix("ms") {
        Some(n) => (n, 1e-3),
        None => (text.strip_suffix('s')?, 1.0),
    };
    let value: f64 = number.parse().ok()?;
    (value.is_finite() && value >= 0.0).then(|| Duration::from_secs_f64(value * unit))
}

/// `1500ms`, the inverse of [`parse_duration`].
pub fn format_duration(d: Duration) -> String {
    format!("{}ms", d.as_millis())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(s: &str) -> Vec<String> {
        s.split_whitespace().map(str::to_owned).collect()
    }

    #[test]
    fn durations_parse() {
        assert_eq!(parse_duration("1s"), Some(Duration::from_secs(1)));
        assert_eq!(parse_duration("1.5s"), Some(Duration::from_millis(1500)));
        assert_eq!(parse_duration("250ms"), Some(Duration::from_millis(250)));
        assert_eq!(parse_duration("5"), None);
        assert_eq!(parse_duration("-1s"), None);
        let d = Duration::from_millis(1234);
        assert_eq!(parse_duration(&format_duration(d)), Some(d));
    }

    #[test]
    fn run_takes_defaults_and_refuses_unknown_flags() {
        let Command::Run(run) = parse(&strings("run --backend redis --seconds 30")).unwrap() else {
            panic!("not run")
        };
        assert_eq!(
            (run.backend, run.seconds, run.procs, run.shuffle_queue),
            (Backend::Redis, 30, 3, false)
        );
        assert_eq!(run.faults, FaultKind::for_backend("redis"));
        assert!(matches!(
            parse(&strings("run --backend redis --colour red")),
            Err(ArgsError::UnknownFlag(_))
        ));
        assert!(matches!(
            parse(&strings("run --backend redis --faults pg_restart")),
            Err(ArgsError::BadValue { flag: "faults", .. })
        ));
        let Command::Run(run) = parse(&strings(
            "run --backend postgres --faults pg_restart,worker_stop",
        ))
        .unwrap() else {
            panic!("not run")
        };
        assert_eq!(run.faults, [FaultKind::PgRestart, FaultKind::WorkerStop]);
    }

    #[test]
    fn the_cluster_backends_have_their_defaults_and_faults() {
        let Command::Run(run) = parse(&strings("run --backend redis-cluster")).unwrap() else {
            panic!("not run")
        };
        assert_eq!(
            (run.backend, run.ttl, run.keys),
            (Backend::RedisCluster, Duration::from_secs(2), 6)
        );
        assert_eq!(
            run.faults,
            [
                FaultKind::MasterStopShort,
                FaultKind::ClientKill,
                FaultKind::WorkerStop,
                FaultKind::MasterStop,
                FaultKind::MasterKill,
            ]
        );
        let Command::Run(run) = parse(&strings(
            "run --backend redis-cluster --faults master_stop_short,client_kill",
        ))
        .unwrap() else {
            panic!("not run")
        };
        assert_eq!(
            run.faults,
            [FaultKind::MasterStopShort, FaultKind::ClientKill]
        );
        let Command::Run(run) = parse(&strings(
            "run --backend etcd --faults follower_stop,leader_kill",
        ))
        .unwrap() else {
            panic!("not run")
        };
        assert_eq!(run.faults, [FaultKind::FollowerStop, FaultKind::LeaderKill]);
        assert!(matches!(
            parse(&strings("run --backend etcd --faults master_stop")),
            Err(ArgsError::BadValue { flag: "faults", .. })
        ));
    }
}

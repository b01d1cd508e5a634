//! The log: one JSON object a line, written by the workers (sections,
//! shutdown) and the coordinator (faults, exits, leak check, run), read back
//! by the analysis. Every time is microseconds of `CLOCK_MONOTONIC`, which
//! all processes of the machine share.

use std::fs::{File, OpenOptions};
use std::io::{self, BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, PoisonError};

use serde::{Deserialize, Serialize};

/// Microseconds of `CLOCK_MONOTONIC`: comparable between the processes of
/// one machine, unlike [`std::time::Instant`], and never stepped by NTP,
/// unlike [`std::time::SystemTime`].
pub fn now_us() -> u64 {
    let ts = nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC)
        .unwrap_or_else(|e| panic!("CLOCK_MONOTONIC is always readable on Linux: {e}"));
    let secs = u64::try_from(ts.tv_sec()).unwrap_or(0);
    let micros = u64::try_from(ts.tv_nsec()).unwrap_or(0) / 1000;
    secs * 1_000_000 + micros
}

/// One line of the log.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Event {
    /// The run as a whole (coordinator, written at its end).
    Run(RunInfo),
    /// A worker is set up and starts its tasks.
    WorkerStart {
        /// The worker's index.
        worker: u32,
        /// Its process id.
        pid: u32,
        /// When.
        t: u64,
    },
    /// One `with_lock` call of a worker task.
    Section(Section),
    /// A fault the coordinator injected and healed.
    Fault(Fault),
    /// A worker's graceful shutdown (written by the worker).
    Shutdown(ShutdownRecord),
    /// How a worker process ended (coordinator).
    WorkerExit {
        /// The worker's index.
        worker: u32,
        /// It exited by itself after SIGTERM, with status 0, in time.
        graceful: bool,
        /// Its exit status, as text.
        status: String,
        /// When it was seen to end.
        t: u64,
    },
    /// The check, after every worker ended, that no key is held (coordinator).
    LeakCheck(LeakCheck),
    /// The live places of a key's fair queue, as the store orders them
    /// (coordinator's sampler, [`queue`](crate::queue)).
    Queue(QueueSnapshot),
}

/// The run's parameters and bounds.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RunInfo {
    /// `redis`, `postgres`, `etcd` or `redis-cluster`.
    pub backend: String,
    /// When the workers were all ready.
    pub t_begin: u64,
    /// When the fault schedule ended and the workers were told to stop.
    pub t_end: u64,
    /// Worker processes.
    pub procs: u32,
    /// Tasks per worker.
    pub tasks: u32,
    /// The keys used.
    pub keys: Vec<String>,
    /// The lock ttl, in ms.
    pub ttl_ms: u64,
    /// How soon after a fault heals some section must complete, in ms.
    pub liveness_bound_ms: u64,
    /// Whether a loss on a key that no fault touched is a violation
    /// ([`Check::UnfaultedLoss`](crate::analysis::Check::UnfaultedLoss)):
    /// on the backends whose faults touch some keys only (a Redis Cluster
    /// master serves a third of them).
    #[serde(default)]
    pub check_unfaulted_losses: bool,
    /// The workers' fair-queue ticket ttl, in ms: how long a waiter's
    /// place lives after its last attempt \[F2\].
    #[serde(default = "default_ticket_ttl_ms")]
    pub ticket_ttl_ms: u64,
    /// The workers' fair-queue claim deadline, in ms: how long a grant
    /// waits to be taken up \[F3\].
    #[serde(default = "default_claim_ms")]
    pub claim_ms: u64,
}

fn default_ticket_ttl_ms() -> u64 {
    3_000
}

fn default_claim_ms() -> u64 {
    2_000
}

/// What a `with_lock` call gave.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// The callback's output: the lock was held throughout, says the driver.
    Ok,
    /// `LockError::Lost`: the holder was told of its loss.
    Lost,
    /// `LockError::NotAcquired`: the callback did not run.
    NotAcquired,
    /// Any other error.
    Failed,
    /// The call did not return within the worker's watchdog.
    Hung,
}

/// One `with_lock` call.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Section {
    /// The key.
    pub key: String,
    /// The worker's index.
    pub worker: u32,
    /// The task's index within the worker.
    pub task: u32,
    /// The call's number within the task.
    pub seq: u64,
    /// When `with_lock` was called.
    pub t_call: u64,
    /// When it returned.
    pub t_return: u64,
    /// What it gave.
    pub outcome: Outcome,
    /// The loss cause or the error, as text.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cause: Option<String>,
    /// What the callback did, when it ran.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub held: Option<Held>,
    /// The release tries the backend saw for the callback's lock before
    /// `with_lock` returned, when there were any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub release: Option<ReleaseTrace>,
    /// The call's places in the store's fair queue, in the order its
    /// queued attempts first sent their owner tokens \[F1\]: one, the
    /// token it waited with and, when the callback ran, acquired with; none
    /// when it never queued. A later one after the driver gave a place up
    /// (a failed attempt, an acquisition answered too late, a grant that
    /// ran out while being taken): the call then queues again at the tail.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub queued: Vec<QueuedPlace>,
}

/// One place of a call in the store's fair queue, as the worker's backend
/// wrapper ([`trace`](crate::trace)) saw its queued attempts.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct QueuedPlace {
    /// The owner token of its attempts.
    pub owner: String,
    /// When its first attempt was sent.
    pub first_sent: u64,
    /// When its last attempt was sent.
    pub last_sent: u64,
    /// When an attempt of it failed on an error after it may have reached
    /// the store: the driver then leaves the place and queues again under
    /// a new owner token.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub failed_at: Vec<u64>,
    /// When an attempt of it was answered that it acquired the lock.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub acquired_at: Option<u64>,
    /// When this node sent a release under its owner token while the call
    /// went on (a grant or acquisition it gave up) or after the callback.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub released_at: Option<u64>,
}

impl Section {
    /// Whether the holder was told of its loss: `with_lock` gave
    /// `LockError::Lost`.
    pub fn told(&self) -> bool {
        self.outcome == Outcome::Lost
    }

    /// `w<worker>/t<task>/s<seq>`, also the writer id of its fenced writes.
    pub fn id(&self) -> String {
        format!("w{}/t{}/s{}", self.worker, self.task, self.seq)
    }
}

/// What a callback did.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Held {
    /// `ctx.fencing_token()`.
    pub token: u64,
    /// The callback's first instant.
    pub t_start: u64,
    /// The callback's last instant; `None` if it had not ended when the
    /// worker stopped waiting for it.
    pub t_end: Option<u64>,
    /// The fenced writes, in order.
    pub writes: Vec<FencedWrite>,
    /// When `ctx.lost()` resolved, if it did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub told_at: Option<u64>,
    /// `ctx.is_lost()` once `with_lock` had returned and the callback ended.
    pub ctx_lost: bool,
}

/// The release tries of one lock, as the worker's backend wrapper
/// ([`trace`](crate::trace)) saw them, in order.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ReleaseTrace {
    /// When the first try was sent.
    pub t_sent: u64,
    /// `ctx.is_lost()` just before the first try was sent: a loss the
    /// driver found before it released (an expired validity at settle, a
    /// failed extension) rather than one the release gave.
    pub lost_before: bool,
    /// The answer to each try.
    pub answers: Vec<ReleaseAnswer>,
    /// The last try's error, as text, if a try failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
}

/// The backend's answer to one release try.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReleaseAnswer {
    /// The key was this owner's and is freed.
    Released,
    /// The key was gone or another owner's.
    NotHeld,
    /// A backend error after which the try may have been applied.
    Error,
    /// A backend error before anything was sent (`BackendErrorKind::Unavailable`).
    ErrorNotSent,
}

/// The answer of the fence store to one write.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WriteResult {
    /// One row updated: the token was the highest seen.
    Accepted,
    /// No row updated: the store had seen a higher token.
    Refused,
    /// The write failed or timed out.
    Failed,
}

/// One fenced write to the separate store.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FencedWrite {
    /// When it was sent.
    pub t_sent: u64,
    /// When the answer came.
    pub t_done: u64,
    /// The answer.
    pub result: WriteResult,
    /// `ctx.is_lost()` just before it was sent.
    pub lost_before: bool,
}

/// The kinds of fault the coordinator injects.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FaultKind {
    /// SIGSTOP of one worker for longer than the ttl, then SIGCONT.
    WorkerStop,
    /// SIGSTOP of the lock server (for PostgreSQL: the postmaster and every
    /// backend) for longer than the ttl, then SIGCONT.
    ServerStop,
    /// Redis: SIGKILL of the server, then a restart with no data.
    ServerKill,
    /// Redis: `CLIENT KILL TYPE normal`.
    ClientKillNormal,
    /// Redis: `CLIENT KILL TYPE pubsub`.
    ClientKillPubsub,
    /// PostgreSQL: `pg_terminate_backend` of every worker connection.
    PgTerminate,
    /// PostgreSQL: `pg_terminate_backend` of the listening connections only.
    PgTerminateListen,
    /// PostgreSQL: `pg_ctl stop -m immediate` (a crash), then start again.
    PgRestart,
    /// PostgreSQL: `DELETE` of every lock row, counters included.
    PgDeleteRows,
    /// etcd: SIGKILL of the leader, a restart on its data once the others
    /// have elected a new one.
    LeaderKill,
    /// etcd: SIGKILL of a follower, a restart on its data.
    FollowerKill,
    /// etcd: SIGSTOP of the leader past the election timeout, then SIGCONT.
    LeaderStop,
    /// etcd: SIGSTOP of a follower (a minority) past the election timeout,
    /// then SIGCONT.
    FollowerStop,
    /// Redis Cluster: SIGSTOP of a master until its replica is promoted,
    /// then SIGCONT (it comes back as a replica).
    MasterStop,
    /// Redis Cluster: SIGKILL of a master, and once its replica is promoted
    /// a restart (empty; it comes back as a replica).
    MasterKill,
    /// Redis Cluster: SIGSTOP of a master for less than the
    /// `cluster-node-timeout` and half the ttl, then SIGCONT: no failover,
    /// and no held lock may be lost.
    MasterStopShort,
    /// Redis Cluster: `CLIENT KILL TYPE normal` and `pubsub` on every node:
    /// no held lock may be lost.
    ClientKill,
}

impl FaultKind {
    /// The faults injected on `backend` by default, in schedule order.
    pub fn for_backend(backend: &str) -> &'static [FaultKind] {
        match backend {
            "etcd" => &[
                Self::LeaderKill,
                Self::LeaderStop,
                Self::FollowerStop,
                Self::FollowerKill,
                Self::WorkerStop,
            ],
            // The failovers last: their time is the hardest to foresee, and
            // a short run still has room for them after the others.
            "redis-cluster" => &[
                Self::MasterStopShort,
                Self::ClientKill,
                Self::WorkerStop,
                Self::MasterStop,
                Self::MasterKill,
            ],
            "redis" => &[
                Self::WorkerStop,
                Self::ClientKillNormal,
                Self::ServerStop,
                Self::ClientKillPubsub,
                Self::ServerKill,
            ],
            "postgres" => &[
                Self::WorkerStop,
                Self::PgTerminate,
                Self::ServerStop,
                Self::PgTerminateListen,
                Self::PgRestart,
                Self::PgDeleteRows,
            ],
            _ => &[],
        }
    }

    /// The faults `--faults` may name for `backend`: the default ones.
    pub fn allowed(backend: &str) -> Vec<FaultKind> {
        Self::for_backend(backend).to_vec()
    }

    /// Whether the fault must cost no held lock: a loss that only such a
    /// fault touched is a violation where losses are checked per key
    /// ([`RunInfo::check_unfaulted_losses`]).
    pub fn keeps_locks(self) -> bool {
        matches!(self, Self::MasterStopShort | Self::ClientKill)
    }

    /// The snake-case name, as in the log.
    pub fn name(self) -> &'static str {
        match self {
            Self::WorkerStop => "worker_stop",
            Self::ServerStop => "server_stop",
            Self::ServerKill => "server_kill",
            Self::ClientKillNormal => "client_kill_normal",
            Self::ClientKillPubsub => "client_kill_pubsub",
            Self::PgTerminate => "pg_terminate",
            Self::PgTerminateListen => "pg_terminate_listen",
            Self::PgRestart => "pg_restart",
            Self::PgDeleteRows => "pg_delete_rows",
            Self::LeaderKill => "leader_kill",
            Self::FollowerKill => "follower_kill",
            Self::LeaderStop => "leader_stop",
            Self::FollowerStop => "follower_stop",
            Self::MasterStop => "master_stop",
            Self::MasterKill => "master_kill",
            Self::MasterStopShort => "master_stop_short",
            Self::ClientKill => "client_kill",
        }
    }
}

/// One injected fault.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Fault {
    /// What was done.
    pub kind: FaultKind,
    /// To whom: `w<i>`, `server`, an etcd member (`m<i>`) or a Redis
    /// Cluster node (`127.0.0.1:<port>`).
    pub target: String,
    /// The keys whose store the fault touched (a Redis Cluster master's
    /// keys); `None`: every key (one server, every etcd member's leases, a
    /// worker's own locks).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub keys: Option<Vec<String>>,
    /// When it began.
    pub t_start: u64,
    /// When it was healed (the server answers again, the worker runs).
    pub t_end: u64,
    /// What the injection reported (connections closed, pids stopped…).
    pub detail: String,
}

/// What `Locker::shutdown` gave in one worker.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ShutdownRecord {
    /// The worker's index.
    pub worker: u32,
    /// When SIGTERM (or the end of stdin) was seen.
    pub t_signal: u64,
    /// When `shutdown` returned.
    pub t_done: u64,
    /// The grace given, in ms.
    pub grace_ms: u64,
    /// The release timeout of the locker, in ms.
    pub release_timeout_ms: u64,
    /// `ShutdownReport::callbacks_finished`.
    pub callbacks_finished: bool,
    /// `ShutdownReport::released`.
    pub released: usize,
    /// `ShutdownReport::release_failures`.
    pub release_failures: usize,
    /// Tasks whose callback had run but whose call had not ended
    /// [`FINISH_WAIT`](crate::worker::FINISH_WAIT) after shutdown, aborted.
    pub aborted_tasks: usize,
    /// Tasks still waiting to acquire after shutdown (such calls never
    /// settle \[S2\]), ended.
    #[serde(default)]
    pub abandoned_waits: usize,
}

/// A check that no key is held: by a worker, the moment its
/// `Locker::shutdown` returned, for keys its own node holds; by the
/// coordinator, once every worker has ended, for any key.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LeakCheck {
    /// The worker that made it; `None` for the coordinator.
    #[serde(default)]
    pub by: Option<u32>,
    /// When it was made.
    pub t: u64,
    /// How many keys were looked at.
    pub keys_checked: usize,
    /// The keys still held (by the worker's node, for a worker's check),
    /// with what the store says of them.
    pub held: Vec<String>,
}

/// The live places of one key's fair queue, read from the store while
/// they stayed the same: reads from `t_first` to `t_last` (each time the
/// read was sent; the store answered a moment later) found exactly these
/// owner tokens, first come first.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct QueueSnapshot {
    /// The key.
    pub key: String,
    /// When the first read that found this order was sent.
    pub t_first: u64,
    /// When the last one was sent.
    pub t_last: u64,
    /// How many reads found it.
    pub reads: u32,
    /// The owner tokens of the live places, head first: Redis's queue
    /// sorted set by score, PostgreSQL's waiters by `ticket`, etcd's
    /// contender keys by create revision (the holder's key first, once it
    /// holds).
    pub owners: Vec<String>,
}

/// Appends events to a file, one whole line per write, so that a process
/// stopped or killed mid-run leaves every line before intact.
#[derive(Debug)]
pub struct LogWriter {
    file: Mutex<File>,
}

impl LogWriter {
    /// Creates (or appends to) the file at `path`.
    ///
    /// # Errors
    ///
    /// When the file cannot be opened.
    pub fn create(path: &Path) -> io::Result<Self> {
        let file = OpenOptions::new().create(true).append(true).open(path)?;
        Ok(Self {
            file: Mutex::new(file),
        })
    }

    /// Writes one event as one line.
    ///
    /// # Errors
    ///
    /// When the line cannot be written.
    pub fn write(&self, event: &Event) -> io::Result<()> {
        let mut line = serde_json::to_vec(event).map_err(io::Error::other)?;
        line.push(b'\n');
        self.file
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .write_all(&line)
    }
}

/// The events of a run, and how many lines could not be read.
#[derive(Clone, Debug, Default)]
pub struct RunLog {
    /// Every event, file by file.
    pub events: Vec<Event>,
    /// Lines that did not parse (a process killed mid-line leaves one).
    pub unreadable_lines: usize,
}

impl RunLog {
    /// Reads every `*.jsonl` file of `dir`.
    ///
    /// # Errors
    ///
    /// When the directory or a file cannot be read.
    pub fn read_dir(dir: &Path) -> io::Result<Self> {
        let mut files: Vec<PathBuf> = std::fs::read_dir(dir)?
            .filter_map(Result::ok)
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|x| x == "jsonl"))
            .collect();
        files.sort();
        let mut log = Self::default();
        for path in files {
            for line in BufReader::new(File::open(&path)?).lines() {
                let line = line?;
                if line.trim().is_empty() {
                    continue;
                }
                match serde_json::from_str(&line) {
                    Ok(event) => log.events.push(event),
                    Err(_) => log.unreadable_lines += 1,
                }
            }
        }
        Ok(log)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_clock_is_monotonic_and_in_microseconds() {
        let a = now_us();
        std::thread::sleep(std::time::Duration::from_millis(5));
        let b = now_us();
        assert!(b >= a + 4_000 && b < a + 1_000_000, "{a} then {b}");
    }

    #[test]
    fn events_round_trip_and_a_torn_line_is_counted() {
        let dir =
            std::env::temp_dir().join(format!("chaos-log-test-{:08x}", rand::random::<u32>()));
        std::fs::create_dir_all(&dir).unwrap();
        let writer = LogWriter::create(&dir.join("w.jsonl")).unwrap();
        let section = Event::Section(Section {
            key: "k".into(),
            worker: 1,
            task: 2,
            seq: 3,
            t_call: 10,
            t_return: 20,
            outcome: Outcome::Lost,
            cause: Some("the key expired".into()),
            held: Some(Held {
                token: 7,
                t_start: 11,
                t_end: Some(19),
                writes: vec![FencedWrite {
                    t_sent: 12,
                    t_done: 13,
                    result: WriteResult::Refused,
                    lost_before: false,
                }],
                told_at: Some(18),
                ctx_lost: true,
            }),
            release: Some(ReleaseTrace {
                t_sent: 19,
                lost_before: false,
                answers: vec![ReleaseAnswer::Error, ReleaseAnswer::NotHeld],
                last_error: Some("timed out".into()),
            }),
            queued: vec![QueuedPlace {
                owner: "chaos-w1/0123456789abcdef0123456789abcdef".into(),
                first_sent: 5,
                last_sent: 9,
                failed_at: vec![8],
                acquired_at: Some(10),
                released_at: Some(19),
            }],
        });
        writer.write(&section).unwrap();
        let queue = Event::Queue(QueueSnapshot {
            key: "k".into(),
            t_first: 30,
            t_last: 40,
            reads: 2,
            owners: vec!["chaos-w0/a".into(), "chaos-w2/b".into()],
        });
        writer.write(&queue).unwrap();
        std::fs::write(dir.join("torn.jsonl"), "{\"type\":\"sect").unwrap();
        let log = RunLog::read_dir(&dir).unwrap();
        assert_eq!(log.events, vec![section, queue]);
        assert_eq!(log.unreadable_lines, 1);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

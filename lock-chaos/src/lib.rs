//! A multi-process fault checker for withlock (SPEC §5 Reliability): it
//! proves mutual exclusion modulo loss reports, fencing-token order and
//! graceful shutdown on the real backends, under faults.
//!
//! `chaos run` starts a lock server of its own (`redis-server`, a
//! PostgreSQL made with `initdb`, three etcd members, or a Redis Cluster of
//! three masters with a replica each) on free loopback ports, and worker
//! processes (`chaos worker`, the same binary). Each worker runs tasks that
//! loop over `with_lock` on a few keys with a 1 s ttl (Redis Cluster: six
//! keys, two per master, with a 2 s ttl, shorter than a failover). Inside the critical
//! section a task writes its fencing token twice (at once, and after a
//! random hold; one hold in eight lasts one to two ttls, so that extensions
//! run) to a fence table on a separate PostgreSQL server, which takes a
//! write only if no higher token was written before. Every call is one log
//! line. Meanwhile the coordinator injects faults, a few seconds apart;
//! at the end it sends SIGTERM, each worker calls `Locker::shutdown`, checks
//! that its node holds nothing the moment that returns and exits, the
//! coordinator checks the store once more, and [`analysis::analyse`] reads
//! the logs.
//!
//! # Commands
//!
//! ```text
//! # the tests: the analysis on planted violations, and ~40 s per backend
//! # (Redis Cluster: 40 s with a 2 s heal)
//! cargo test -p lock-chaos -- --nocapture          # CHAOS_SECONDS=… to change
//! # a long run
//! cargo run -p lock-chaos --release -- run --backend redis --seconds 600
//! cargo run -p lock-chaos --release -- run --backend postgres --seconds 600
//! # the clusters (etcd and protoc on PATH: `.ci/install-etcd`)
//! cargo run -p lock-chaos -- run --backend etcd --seconds 60
//! cargo run -p lock-chaos -- run --backend redis-cluster --seconds 120
//! # every worker on one hot key: the fair queue full, its order checked
//! cargo run -p lock-chaos --release -- run --backend redis --seconds 150 \
//!     --keys 1 --liveness-bound 8s
//! # one fault over and over
//! cargo run -p lock-chaos --release -- run --backend redis --seconds 150 \
//!     --faults server_kill --heal 1500ms
//! # analyse the logs of a run again
//! cargo run -p lock-chaos -- analyse /tmp/withlock-chaos-redis-…
//! ```
//!
//! `chaos` with no arguments prints every option. The fence table goes on
//! `--fence-url` (default `DATABASE_URL`, else
//! `postgres://postgres@127.0.0.1:5432/test`); every address must be a
//! loopback one. `RUST_LOG` sets the workers' tracing (default `warn`),
//! written to `worker-<i>.stderr`.
//!
//! # Faults
//!
//! | fault | backend | what |
//! |---|---|---|
//! | `worker_stop` | all | SIGSTOP of one worker (in turn) for 2.5 ttl, then SIGCONT |
//! | `server_stop` | both | SIGSTOP of the server (PostgreSQL: the postmaster and every backend) for 2.5 ttl |
//! | `server_kill` | Redis | SIGKILL, then a restart with no data: locks and fencing counters gone |
//! | `client_kill_normal`, `client_kill_pubsub` | Redis | `CLIENT KILL TYPE normal` / `pubsub` |
//! | `pg_terminate`, `pg_terminate_listen` | PostgreSQL | `pg_terminate_backend` of every worker connection / of the listening ones |
//! | `pg_restart` | PostgreSQL | `pg_ctl stop -m immediate` (a crash), then start |
//! | `pg_delete_rows` | PostgreSQL | `DELETE` of every lock row: locks and `sequence` counters gone |
//! | `leader_kill`, `follower_kill` | etcd | SIGKILL of the leader / a follower (in turn) for 2.5 ttl, then a restart on its data |
//! | `leader_stop`, `follower_stop` | etcd | SIGSTOP of the leader / a follower (a minority) for 2.5 ttl (far past the 100 ms election timeout), then SIGCONT |
//! | `master_stop` | Redis Cluster | SIGSTOP of a master (in turn) until its replica is promoted, then SIGCONT; it rejoins as a replica |
//! | `master_kill` | Redis Cluster | SIGKILL of a master until its replica is promoted, then a restart, empty; it rejoins as a replica |
//! | `master_stop_short` | Redis Cluster | SIGSTOP of a master (in turn) for half a ttl, at most 1 s (the node timeout is 2 s), then SIGCONT: no failover; logged as a `master_stop` if one came all the same |
//! | `client_kill` | Redis Cluster | `CLIENT KILL TYPE normal` and `pubsub` on every node |
//!
//! etcd and Redis Cluster run `worker_stop` too. A Redis Cluster master
//! fault records the keys its master served.
//!
//! # Checks
//!
//! See [`analysis`]: exclusion modulo loss reports, token order, refused
//! writes only from holders told of their loss, liveness after each fault
//! (with the longest unavailability per fault), no leak after graceful
//! shutdown, the agreement of `with_lock`'s outcome with the lock
//! context, and the fair queue's order (below). Losses are counted by the fault that touched the key's store
//! or its holder; on Redis Cluster a loss on a key whose master no fault
//! touched, or only `master_stop_short` or `client_kill` (a held lock
//! outlasts both), is a violation \[L4\]. On every backend a finished
//! callback whose release failed on a backend error, its lock not lost
//! when the release was sent, must get its output, not `Lost` \[O6\]: each
//! worker's backend is wrapped ([`trace`]) to record every release try.
//! Per fault, the report counts the locks held through it. Two holders at
//! once that nothing told, where the store lost the lock's write (Redis
//! restarted empty, a Redis Cluster failover of the key's master), are
//! counted apart when the fence stopped them and are violations when it
//! did not. The analysis proves itself on planted violations in its unit
//! tests.
//!
//! ## The fair queue's order
//!
//! While faults are injected, the coordinator reads each key's fair queue
//! \[F1\] from the store every 20 ms with the store's own client
//! ([`queue`]): the live places, head first, as the backend orders them
//! (Redis: the queue sorted set by score, places whose `alive_until` in
//! the waiters hash has not passed by the server's `TIME`; PostgreSQL:
//! `<table>_waiters` by `ticket`, `alive_until` not passed; etcd: the
//! name's contender keys by create revision, valued with owner tokens).
//! Each worker logs its call's places by owner token (the backend
//! wrapper of [`trace`] sees the call's queued attempts and the releases
//! under their tokens); the last is the token it acquired with when its
//! callback ran. The rule
//! ([`Check::QueueOrder`](analysis::Check::QueueOrder), see
//! `analysis/order.rs`): when a read found waiter A ahead of waiter B, and
//! B then acquired first (a lower fencing token than A's, or its callback
//! started while A's call still waited), or a later read found B ahead,
//! something between the last read of the old order and the change must
//! let A's place die or the store lose its queue, else it is a violation.
//! What excuses a change, and only this: A's worker stopped
//! (`worker_stop`, until a ticket ttl after it resumed); the store lost
//! its queue or let every place die (`server_kill`, `server_stop`,
//! `pg_restart`, a Redis Cluster failover of the key's master: until a
//! ticket ttl after the heal); A's worker began its shutdown; A's call
//! gave the place up and queued again under a new owner token after a
//! queued attempt failed (its answer lost) or was answered too late to
//! use; A's call never logged. A that gave up, timed out or was cancelled
//! before B acquired leaves the pair undecided; a fault on another
//! worker, cut connections or notifications, etcd member faults and
//! deleted lock rows excuse nothing. A grant that A's node dropped as run
//! out while the store still held it for A (past the ttl after A's last
//! attempt, within the claim deadline: the driver counts the grant's
//! validity from that attempt plus the ttl, not the claim) is a known
//! defect of the driver, counted apart rather than reported until it is
//! fixed. The report gives the pairs seen, checked (in order, excused by
//! reason, out of order, out of order by a dropped grant) and undecided;
//! `--shuffle-queue true` shuffles every read
//! before it is logged, a queue out of order on purpose that the check
//! must report (a test does). Redis Cluster's queue is not read.
//!
//! # Output
//!
//! The directory (`--out`, default a new one under the temporary
//! directory) holds `coordinator.jsonl` (faults, exits, leak check, the run),
//! `queue.jsonl` (the reads of the fair queue, one line per run of reads
//! that found the same order, see [`event::QueueSnapshot`]),
//! `worker-<i>.jsonl` (one line per call, see [`event::Section`]),
//! `worker-<i>.stderr`, and `report.json` ([`analysis::Report`]). The
//! summary is printed. Exit status: 0 clean, 1 violations, 2 the run could
//! not be made.
//!
//! # Processes
//!
//! The coordinator ends everything it started on every exit path, panics
//! included, through guards that own the child handles (never a kill by
//! name). Ctrl-C ends the fault schedule and still stops the workers
//! gracefully. If the coordinator itself is killed, the workers see their
//! stdin close and shut down, the lock servers are killed by their
//! watchdogs (withlock-test-servers'), which remove their directories; the
//! fence table is left, and the next run drops fence tables older than an
//! hour.
//!
//! | module | what |
//! |---|---|
//! | [`event`] | the log lines, the shared clock |
//! | [`analysis`] | the checks, the report |
//! | [`fence`] | the fenced store |
//! | [`worker`] | one worker process |
//! | [`coordinator`] | the run: servers, workers, faults, leak check |
//! | [`server`] | the lock servers, their faults, reading who holds a key |
//! | [`queue`] | the reads of the fair queue's order |
//! | [`trace`] | the workers' record of each lock's release tries and each call's place in the queue |
//! | [`args`] | the command line |

pub mod analysis;
pub mod args;
pub mod coordinator;
pub mod event;
pub mod fence;
pub mod queue;
pub mod server;
pub mod trace;
pub mod worker;

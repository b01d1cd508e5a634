//! [`Check::QueueOrder`]: the fair queue grants in the store's arrival
//! order \[F1\].
//!
//! The coordinator reads each key's live places, head first, every 20 ms
//! ([`queue`](crate::queue)); each worker logs the owner token its call
//! queued with ([`Section::queued`]), which is the token it acquired
//! with when its callback ran. For two waiters A and B seen in one read
//! with A ahead of B, the order of the pair is then observed again by
//! every later read that holds both, and decided by the first of the two
//! to acquire while the other still waits:
//!
//! - both acquired with those tokens: the lower fencing token (the store
//!   draws them in grant order) acquired first, when its callback
//!   started;
//! - one acquired (its callback started) before the other's call ended
//!   without the lock, or while the other's call waited on under a new
//!   owner token: it acquired first;
//! - otherwise (one left before the other acquired, neither acquired) the
//!   pair is not decided.
//!
//! Every change of the pair's order from one observation to the next (a
//! later read, or the decision) must be explained by an event between
//! the last observation of the old order and the first of the new, that
//! legitimately lets the waiter that was ahead, X, lose its place:
//!
//! 1. X's worker was stopped (`worker_stop`): from the stop to a ticket
//!    ttl after it was resumed, X's place may die and X rejoin at the tail,
//!    or a grant to X run out before X took it up \[F2, F3\];
//! 2. the store lost the queue or let every place die: `server_kill`
//!    (Redis restarted empty), `server_stop` (Redis or PostgreSQL paused
//!    for 2.5 ttls, most of a ticket ttl, with no attempt renewing a
//!    place), `pg_restart` (PostgreSQL down for seconds), a Redis Cluster
//!    failover of the key's master (`master_stop`, `master_kill`): from
//!    the fault's start to a ticket ttl after its heal;
//! 3. X's worker began its graceful shutdown, which leaves its places
//!    \[S1\];
//! 4. X's call gave this place up and queued again at the tail under a new
//!    owner token, for a cause its worker recorded: a queued attempt of X
//!    failed after it may have reached the store (the driver leaves the
//!    place, so that the attempt's clean-up, which releases under X's
//!    token, never frees the key under a later holder \[F2, C1\]), or an
//!    attempt of X was answered that it acquired, too late to use \[H6\];
//! 5. X's call was never logged (a worker killed mid-call).
//!
//! A place given up for no such cause is not excused: a grant its own
//! node dropped while the store still held it for the waiter is out of
//! order.
//!
//! X giving up, timing out or being cancelled needs no excuse: its call
//! ended without the lock, which leaves the pair undecided. Nothing else
//! excuses a change: not a fault on another worker (a stopped holder's
//! lock expires and goes to the head), not cut connections or
//! notifications (a grantee whose grant message was lost takes the grant
//! up with its next heartbeat, within the claim deadline), not a member
//! fault of etcd (its leases outlive an election), not deleted lock rows.
//! A change that none of these explains is a violation.
//!
//! A pair whose order was decided before any read saw it (etcd: the
//! holder's key heads the line) is counted apart, not checked.

use std::collections::{BTreeMap, HashMap};

use serde::{Deserialize, Serialize};

use super::{line, start, Analysis, Check};
use crate::event::{Event, FaultKind, QueueSnapshot, QueuedPlace, Section};

/// The figures of the order check.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct QueueOrderSummary {
    /// Reads of the queue that found two live places or more on a key.
    pub reads: usize,
    /// Pairs of waiters seen in the store's queue together.
    pub pairs: usize,
    /// Pairs checked whose order never changed: the one ahead acquired
    /// first.
    pub in_order: usize,
    /// Pairs checked whose order changed, each change explained by an
    /// event that lets the waiter ahead lose its place.
    pub excused: usize,
    /// The excused pairs by the first explanation of their change.
    pub excuses: BTreeMap<String, usize>,
    /// Pairs checked whose order changed with nothing to explain it (each
    /// one a violation).
    pub out_of_order: usize,
    /// Pairs whose order was never observed to change nor decided: one
    /// waiter left without the lock before the other acquired, or neither
    /// acquired with its token.
    pub undecided: usize,
    /// Pairs decided before any read saw them: the first to acquire had
    /// already acquired (etcd's line shows the holder's key first).
    #[serde(default)]
    pub acquired_before_read: usize,
}

impl QueueOrderSummary {
    /// Pairs the check applied to: in order, excused or out of order.
    pub fn checked(&self) -> usize {
        self.in_order + self.excused + self.out_of_order
    }
}

/// How a waiter's place ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Exit {
    /// Its callback ran with this fencing token, starting at `at`.
    Acquired { token: u64, at: u64 },
    /// Its call ended at `at` without the lock.
    Left { at: u64 },
    /// Its call gave it up and queued again under a new owner token; the
    /// call still waited until `call_end`.
    Superseded { call_end: u64 },
}

#[derive(Clone, Copy)]
struct Waiter<'l> {
    section: &'l Section,
    place: &'l QueuedPlace,
    exit: Exit,
}

/// One observation of a pair's order.
#[derive(Clone, Copy, Debug)]
struct Seen<'l> {
    t_first: u64,
    t_last: u64,
    /// The owner token ahead.
    ahead: &'l str,
    /// The read, when a read saw it (`None`: the decision).
    read: Option<&'l QueueSnapshot>,
}

/// A pair's verdict.
enum Verdict {
    InOrder,
    Excused(String),
    OutOfOrder,
    Undecided,
    AcquiredBeforeRead,
}

impl<'l> Analysis<'l> {
    /// [`Check::QueueOrder`].
    pub(super) fn queue_order(&mut self) {
        let mut reads: BTreeMap<&'l str, Vec<&'l QueueSnapshot>> = BTreeMap::new();
        for e in self.events {
            if let Event::Queue(q) = e {
                reads.entry(q.key.as_str()).or_default().push(q);
            }
        }
        if reads.is_empty() {
            return;
        }
        let waiters = self.waiters();
        let mut summary = QueueOrderSummary::default();
        for (key, mut snapshots) in reads {
            snapshots.sort_by_key(|q| q.t_first);
            // Each pair, keyed by its two tokens in text order, with every
            // read that saw both.
            let mut pairs: BTreeMap<(&str, &str), Vec<Seen<'l>>> = BTreeMap::new();
            for q in &snapshots {
                summary.reads += q.reads as usize;
                for (i, a) in q.owners.iter().enumerate() {
                    for b in &q.owners[i + 1..] {
                        let pair = if a < b { (a, b) } else { (b, a) };
                        pairs
                            .entry((pair.0.as_str(), pair.1.as_str()))
                            .or_default()
                            .push(Seen {
                                t_first: q.t_first,
                                t_last: q.t_last,
                                ahead: a,
                                read: Some(q),
                            });
                    }
                }
            }
            summary.pairs += pairs.len();
            for ((a, b), seen) in pairs {
                match self.pair(key, a, b, seen, &waiters) {
                    Verdict::InOrder => summary.in_order += 1,
                    Verdict::Excused(why) => {
                        summary.excused += 1;
                        *summary.excuses.entry(why).or_insert(0) += 1;
                    }
                    Verdict::OutOfOrder => summary.out_of_order += 1,
                    Verdict::Undecided => summary.undecided += 1,
                    Verdict::AcquiredBeforeRead => summary.acquired_before_read += 1,
                }
            }
        }
        self.report.summary.queue_order = Some(summary);
    }

    /// Each owner token a call queued with, and how its place ended.
    fn waiters(&self) -> HashMap<&'l str, Waiter<'l>> {
        let mut waiters = HashMap::new();
        for &s in &self.sections {
            let last = s.queued.len().saturating_sub(1);
            for (i, place) in s.queued.iter().enumerate() {
                let exit = match &s.held {
                    _ if i < last => Exit::Superseded {
                        call_end: s.t_return,
                    },
                    Some(held) => Exit::Acquired {
                        token: held.token,
                        at: start(s),
                    },
                    None => Exit::Left { at: s.t_return },
                };
                waiters.insert(
                    place.owner.as_str(),
                    Waiter {
                        section: s,
                        place,
                        exit,
                    },
                );
            }
        }
        waiters
    }

    /// The verdict on the pair `a`, `b` of `key`, seen as `seen` says;
    /// each unexplained change is reported.
    fn pair(
        &mut self,
        key: &str,
        a: &'l str,
        b: &'l str,
        mut seen: Vec<Seen<'l>>,
        waiters: &HashMap<&'l str, Waiter<'l>>,
    ) -> Verdict {
        let (wa, wb) = (waiters.get(a), waiters.get(b));
        let decided = match (wa.map(|w| w.exit), wb.map(|w| w.exit)) {
            (
                Some(Exit::Acquired {
                    token: ta,
                    at: at_a,
                }),
                Some(Exit::Acquired {
                    token: tb,
                    at: at_b,
                }),
            ) => Some(if ta < tb { (a, at_a) } else { (b, at_b) }),
            // The other's call still waited: left later, or gave this
            // place up and waited on under a new token.
            (
                Some(Exit::Acquired { at, .. }),
                Some(Exit::Left { at: end } | Exit::Superseded { call_end: end }),
            ) if at < end => Some((a, at)),
            (
                Some(Exit::Left { at: end } | Exit::Superseded { call_end: end }),
                Some(Exit::Acquired { at, .. }),
            ) if at < end => Some((b, at)),
            _ => None,
        };
        // The reads before the decision, runs of one order merged.
        seen.sort_by_key(|s| s.t_first);
        if let Some((_, at)) = decided {
            seen.retain(|s| s.t_first < at);
            if seen.is_empty() {
                return Verdict::AcquiredBeforeRead;
            }
        }
        let mut merged: Vec<Seen<'l>> = Vec::with_capacity(seen.len() + 1);
        for s in seen {
            match merged.last_mut() {
                Some(last) if last.ahead == s.ahead => last.t_last = last.t_last.max(s.t_last),
                _ => merged.push(s),
            }
        }
        if let Some((first, at)) = decided {
            merged.push(Seen {
                t_first: at,
                t_last: at,
                ahead: first,
                read: None,
            });
        }
        let mut excused = None;
        let mut out_of_order = false;
        for w in merged.windows(2) {
            let (before, after) = (w[0], w[1]);
            if before.ahead == after.ahead {
                continue;
            }
            let from = before.t_last.min(after.t_first);
            let ahead = waiters.get(before.ahead);
            if let Some(why) = self.excuse(key, ahead, from, after.t_first) {
                excused.get_or_insert(why);
            } else {
                out_of_order = true;
                self.report_change(key, before, after, waiters);
            }
        }
        match (out_of_order, excused, decided) {
            (true, ..) => Verdict::OutOfOrder,
            (false, Some(why), _) => Verdict::Excused(why),
            (false, None, Some(_)) => Verdict::InOrder,
            (false, None, None) => Verdict::Undecided,
        }
    }

    /// What lets the place of `ahead` (on `key`) die or the queue be lost
    /// between `from` and `to`, if anything.
    fn excuse(&self, key: &str, ahead: Option<&Waiter<'l>>, from: u64, to: u64) -> Option<String> {
        let Some(ahead) = ahead else {
            return Some("the waiter ahead was never logged".to_owned());
        };
        let reach = self.ticket_ttl;
        let during = |f: &&&crate::event::Fault| f.t_start <= to && f.t_end + reach >= from;
        let worker = format!("w{}", ahead.section.worker);
        if self
            .faults
            .iter()
            .filter(during)
            .any(|f| f.kind == FaultKind::WorkerStop && f.target == worker)
        {
            return Some("worker_stop of the waiter ahead".to_owned());
        }
        if let Some(f) = self.faults.iter().filter(during).find(|f| {
            loses_queue(f.kind) && f.keys.as_ref().is_none_or(|k| k.iter().any(|k| k == key))
        }) {
            return Some(format!("{} lost the queue", f.kind.name()));
        }
        let shut_down = self.events.iter().any(|e| {
            matches!(e, Event::Shutdown(r) if r.worker == ahead.section.worker && r.t_signal <= to)
        });
        if shut_down {
            return Some("shutdown of the waiter ahead".to_owned());
        }
        if !matches!(ahead.exit, Exit::Superseded { .. }) {
            return None;
        }
        // Given up by its own call, which queued again under a new token.
        let place = ahead.place;
        if place.failed_at.iter().any(|&t| t <= to) {
            return Some("the waiter ahead left after a failed attempt".to_owned());
        }
        if place.acquired_at.is_some_and(|t| t <= to) {
            return Some("the waiter ahead acquired too late to use".to_owned());
        }
        None
    }

    fn report_change(
        &mut self,
        key: &str,
        before: Seen<'l>,
        after: Seen<'l>,
        waiters: &HashMap<&'l str, Waiter<'l>>,
    ) {
        let describe = |owner: &str| match waiters.get(owner) {
            None => format!("{owner} (no call logged)"),
            Some(w) => {
                let what = match w.exit {
                    Exit::Acquired { token, at } => {
                        format!("acquired token {token} at {}", self.at(at))
                    }
                    Exit::Left { at } => format!("left without the lock at {}", self.at(at)),
                    Exit::Superseded { .. } => format!(
                        "gave this place up and queued again under a new token{}",
                        w.place.released_at.map_or_else(String::new, |t| format!(
                            ", its node having released under this one at {}",
                            self.at(t)
                        ))
                    ),
                };
                format!("{} ({what})", w.section.id())
            }
        };
        let behind = after.ahead;
        let how = match after.read {
            Some(_) => format!("a read at {} found it ahead", self.at(after.t_first)),
            None => "it acquired first".to_owned(),
        };
        let message = format!(
            "key {key:?}: {} was ahead of {} in the store's queue (last read at {}), \
             then {how}, and nothing between let the place ahead die or the store lose the \
             queue",
            describe(before.ahead),
            describe(behind),
            self.at(before.t_last),
        );
        let mut lines = Vec::new();
        for owner in [before.ahead, behind] {
            if let Some(w) = waiters.get(owner) {
                lines.push(line(w.section));
            }
        }
        for read in [before.read, after.read].into_iter().flatten() {
            lines.push(serde_json::to_string(&Event::Queue(read.clone())).unwrap_or_default());
        }
        self.report.add(Check::QueueOrder, message, lines);
    }
}

/// Whether a fault on the store loses its queue or lets every place in it
/// die (see the module docs).
pub fn loses_queue(kind: FaultKind) -> bool {
    matches!(
        kind,
        FaultKind::ServerKill
            | FaultKind::ServerStop
            | FaultKind::PgRestart
            | FaultKind::MasterStop
            | FaultKind::MasterKill
    )
}

//! The checks over a run's log (SPEC §5):
//!
//! 1. [`Check::Exclusion`]: two critical sections on one key overlap in
//!    time only if the older holder was told of its loss (its `with_lock`
//!    gave `Lost`).
//! 2. [`Check::TokenOrder`]: fencing tokens are unique per key and increase
//!    in the order the callbacks started.
//! 3. [`Check::RefusedWrite`]: the fence store refuses a write only from a
//!    holder that was told of its loss.
//! 4. [`Check::Liveness`]: after each fault heals, a lock taken afterwards
//!    completes within the bound; no call hangs.
//! 5. [`Check::Leak`]: no key is held once every worker has shut down.
//!
//! And two the driver's contract implies: [`Check::Context`] (`with_lock`'s
//! outcome and `ctx.is_lost()` agree \[O6\]) and [`Check::Shutdown`]
//! (every worker shut down in time and released everything \[S1, S3\]).
//! Where a fault touches some keys only (a Redis Cluster master),
//! [`Check::UnfaultedLoss`]: a lock whose key's store and holder no fault
//! touched, or only one that must cost no held lock (a master stopped
//! short of a failover, connections cut), is never reported lost \[L4\].
//! On every backend, [`Check::LostAfterRelease`]: a finished callback whose
//! release failed on a backend error gets its output, not `Lost` \[O6\].
//! Where the coordinator read the fair queue, [`Check::QueueOrder`]:
//! waiters acquire in the order the store's queue held them, unless an
//! event that lets the place ahead die comes between (the rule, and the
//! exact list of excuses, in `order.rs`) \[F1\].
//!
//! A store that loses a lock's write (Redis restarted empty, a Redis
//! Cluster failover to a replica that missed it, or the old master
//! answering for a moment after it resumed) can have two holders at once
//! with neither told. Such an overlap is counted apart if the fence
//! stopped it: no write of the lower token was accepted after one of the
//! higher; otherwise it is an exclusion violation.
//!
//! A section's critical section is its callback, from its first to its
//! last instant: the lock is taken before the first and released after the
//! last, so a correct lock never shows two overlapping.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use crate::event::{
    Event, Fault, FaultKind, FencedWrite, LeakCheck, Outcome, ReleaseAnswer, RunInfo, RunLog,
    Section, WriteResult,
};

mod order;
mod report;

pub use order::{loses_queue, QueueOrderSummary};
pub use report::{Check, FaultSummary, Report, Summary, Violation, MAX_EXAMPLES, MAX_FAULT_LINES};

/// The liveness bound when the log has no [`RunInfo`].
pub const DEFAULT_LIVENESS_BOUND_MS: u64 = 5_000;

/// Slack on top of grace and release timeout that a shutdown may take.
pub const SHUTDOWN_SLACK_MS: u64 = 1_000;

/// The lock ttl when the log has no [`RunInfo`].
pub const DEFAULT_TTL_MS: u64 = 1_000;

/// The fair queue's ticket ttl when the log has no [`RunInfo`].
pub const DEFAULT_TICKET_TTL_MS: u64 = 3_000;

/// The fair queue's claim deadline when the log has no [`RunInfo`].
pub const DEFAULT_CLAIM_MS: u64 = 2_000;

/// A fault touches the locks of its keys from its start until this many
/// ttls after its heal: a holder finds its loss at its next extension.
pub const FAULT_REACH_TTLS: u64 = 2;

/// Runs every check over `log`.
pub fn analyse(log: &RunLog) -> Report {
    let mut a = Analysis::new(log);
    a.count_outcomes();
    a.losses();
    a.exclusion();
    a.token_order();
    a.refused_writes();
    a.context();
    a.lost_after_release();
    a.queue_order();
    a.liveness();
    a.leaks();
    a.shutdown();
    a.report
}

struct Analysis<'l> {
    report: Report,
    sections: Vec<&'l Section>,
    faults: Vec<&'l Fault>,
    events: &'l [Event],
    run_keys: Vec<&'l str>,
    begin: u64,
    end: u64,
    bound: u64,
    /// The lock ttl, in µs.
    ttl: u64,
    /// The fair queue's ticket ttl, in µs.
    ticket_ttl: u64,
    check_unfaulted_losses: bool,
}

fn line(section: &Section) -> String {
    serde_json::to_string(section).unwrap_or_else(|e| format!("<unserialisable section: {e}>"))
}

impl<'l> Analysis<'l> {
    fn new(log: &'l RunLog) -> Self {
        let mut run: Option<&RunInfo> = None;
        let mut sections = Vec::new();
        let mut faults = Vec::new();
        for event in &log.events {
            match event {
                Event::Run(info) => run = Some(info),
                Event::Section(s) => sections.push(s),
                Event::Fault(f) => faults.push(f),
                _ => {}
            }
        }
        faults.sort_by_key(|f| f.t_start);
        let first = sections.iter().map(|s| s.t_call).min().unwrap_or(0);
        let last = sections.iter().map(|s| s.t_return).max().unwrap_or(0);
        let (begin, end, bound) = match run {
            Some(r) => (r.t_begin, r.t_end, r.liveness_bound_ms * 1000),
            None => (first, last, DEFAULT_LIVENESS_BOUND_MS * 1000),
        };
        let ttl = run.map_or(DEFAULT_TTL_MS, |r| r.ttl_ms) * 1000;
        let ticket_ttl = run.map_or(DEFAULT_TICKET_TTL_MS, |r| r.ticket_ttl_ms) * 1000;
        let report = Report {
            summary: Summary {
                run: run.cloned(),
                unreadable_lines: log.unreadable_lines,
                ..Summary::default()
            },
            counts: Check::ALL.iter().map(|&c| (c, 0)).collect(),
            violations: Vec::new(),
        };
        Self {
            report,
            sections,
            faults,
            events: &log.events,
            run_keys: run.map_or_else(Vec::new, |r| r.keys.iter().map(String::as_str).collect()),
            begin,
            end,
            bound,
            ttl,
            ticket_ttl,
            check_unfaulted_losses: run.is_some_and(|r| r.check_unfaulted_losses),
        }
    }

    /// `+12.345s`: a time relative to the run's start.
    fn at(&self, t: u64) -> String {
        let rel = i128::from(t) - i128::from(self.begin);
        format!("{:+.3}s", rel as f64 / 1e6)
    }

    /// The sections whose callback ran, per key, in the order they started.
    fn held_by_key(&self) -> BTreeMap<&'l str, Vec<&'l Section>> {
        let mut by_key: BTreeMap<&str, Vec<&Section>> = BTreeMap::new();
        for s in &self.sections {
            if s.held.is_some() {
                by_key.entry(s.key.as_str()).or_default().push(s);
            }
        }
        for v in by_key.values_mut() {
            v.sort_by_key(|s| (start(s), s.t_call));
        }
        by_key
    }

    fn count_outcomes(&mut self) {
        let s = &mut self.report.summary;
        for section in &self.sections {
            s.calls += 1;
            if let Some(held) = &section.held {
                s.sections += 1;
                for w in &held.writes {
                    match w.result {
                        WriteResult::Accepted => s.writes_accepted += 1,
                        WriteResult::Refused => s.writes_refused += 1,
                        WriteResult::Failed => s.writes_failed += 1,
                    }
                }
            }
            let name = serde_json::to_value(section.outcome)
                .ok()
                .and_then(|v| v.as_str().map(str::to_owned))
                .unwrap_or_default();
            *s.outcomes.entry(name).or_insert(0) += 1;
            if section.outcome == Outcome::Lost {
                let cause = without_numbers(section.cause.as_deref().unwrap_or_default());
                *s.loss_causes.entry(cause).or_insert(0) += 1;
            }
        }
    }

    /// Whether the store was restarted empty (`server_kill`) while
    /// `section` held its lock, before anything could tell its holder: a
    /// callback that settled then with its validity intact, whose release
    /// failed on the dead connection, gets its output \[O6\], and the
    /// lock's only protection is the fence, which refuses its stale writes
    /// (a write the fence accepted from it after the newer holder's would
    /// still be reported by the fence store's own check). The one residual
    /// assumption the README states.
    fn store_lost_its_data_under(&self, section: &Section) -> bool {
        let (from, to) = (start(section), end(section));
        section.outcome == Outcome::Ok
            && self
                .faults
                .iter()
                .any(|f| f.kind == FaultKind::ServerKill && f.t_start >= from && f.t_start <= to)
    }

    /// Whether `f`, from its start to [`FAULT_REACH_TTLS`] after its heal,
    /// overlaps `from..=to` and touches the lock of `section`: its holder
    /// (`worker_stop`) or its key's store.
    fn touches(&self, f: &Fault, section: &Section, from: u64, to: u64) -> bool {
        let reach = f.t_end + FAULT_REACH_TTLS * self.ttl;
        if f.t_start > to || reach < from {
            return false;
        }
        match f.kind {
            FaultKind::WorkerStop => f.target == format!("w{}", section.worker),
            _ => f.keys.as_ref().is_none_or(|k| k.contains(&section.key)),
        }
    }

    /// Whether a failover of the key's Redis Cluster master touches
    /// `from..=to`: the promoted replica may have missed a lock's write,
    /// and the old master answers as one for a moment after it resumes.
    fn failover_under(&self, section: &Section, from: u64, to: u64) -> bool {
        self.faults.iter().any(|f| {
            matches!(f.kind, FaultKind::MasterStop | FaultKind::MasterKill)
                && self.touches(f, section, from, to)
        })
    }

    /// Losses per the fault that touched them, and \[L4\] where checked.
    fn losses(&mut self) {
        let stopping: HashMap<u32, u64> = self
            .events
            .iter()
            .filter_map(|e| match e {
                Event::Shutdown(r) => Some((r.worker, r.t_signal)),
                _ => None,
            })
            .collect();
        for s in self.sections.clone() {
            if s.outcome != Outcome::Lost {
                continue;
            }
            // Cut off by its worker's graceful shutdown [S1].
            if stopping.get(&s.worker).is_some_and(|&t| s.t_return >= t) {
                *self
                    .report
                    .summary
                    .losses_by_fault
                    .entry("shutdown".to_owned())
                    .or_insert(0) += 1;
                continue;
            }
            let touching: Vec<&Fault> = self
                .faults
                .iter()
                .copied()
                .filter(|f| self.touches(f, s, s.t_call, s.t_return))
                .collect();
            // A fault that must cost no held lock (a master stopped short
            // of a failover, connections cut) excuses none.
            let excusing: Vec<&Fault> = touching
                .iter()
                .copied()
                .filter(|f| !f.kind.keeps_locks())
                .collect();
            let by = excusing
                .iter()
                .find(|f| f.kind == FaultKind::WorkerStop)
                .or(excusing.first())
                .or(touching.first())
                .map_or("none", |f| f.kind.name());
            *self
                .report
                .summary
                .losses_by_fault
                .entry(by.to_owned())
                .or_insert(0) += 1;
            if excusing.is_empty() && self.check_unfaulted_losses {
                let why = match touching.first() {
                    Some(f) => format!(
                        "and only {} of {} touched its key's store or its holder, \
                         which must cost no held lock",
                        f.kind.name(),
                        f.target
                    ),
                    None => "and no fault touched its key's store or its holder".to_owned(),
                };
                let message = format!(
                    "key {:?}: {} (token {}, called at {}) was reported lost ({}) at {}, {why}",
                    s.key,
                    s.id(),
                    token(s),
                    self.at(s.t_call),
                    s.cause.as_deref().unwrap_or("no cause"),
                    self.at(s.t_return),
                );
                self.report
                    .add(Check::UnfaultedLoss, message, vec![line(s)]);
            }
        }
    }

    /// For two holders at once that nothing told, explained by the store
    /// losing its data: the fence stopped them if no write of the lower
    /// token was accepted after one of the higher.
    fn fence_stopped(a: &Section, b: &Section) -> bool {
        let (low, high) = if token(a) < token(b) { (a, b) } else { (b, a) };
        if token(low) == token(high) {
            return false;
        }
        fn accepted(s: &Section) -> impl Iterator<Item = &FencedWrite> {
            s.held
                .iter()
                .flat_map(|h| h.writes.iter())
                .filter(|w| w.result == WriteResult::Accepted)
        }
        let first_high = accepted(high).map(|w| w.t_done).min();
        first_high.is_none_or(|t| accepted(low).all(|w| w.t_sent < t))
    }

    /// Check 1.
    fn exclusion(&mut self) {
        for (key, v) in self.held_by_key() {
            for (i, a) in v.iter().enumerate() {
                let a_end = end(a);
                for b in &v[i + 1..] {
                    if start(b) >= a_end {
                        break;
                    }
                    self.report.summary.overlaps += 1;
                    // The older holder is the one that started first, unless
                    // the other called first and was told: it may have taken
                    // the lock first and started late (a stall between the
                    // acquisition and its callback's first instant).
                    let excused = a.told() || (b.told() && b.t_call <= start(a));
                    if excused {
                        self.report.summary.overlaps_after_loss_report += 1;
                        continue;
                    }
                    let overlap_end = a_end.min(end(b));
                    if self.store_lost_its_data_under(a)
                        || self.failover_under(a, start(b), overlap_end)
                    {
                        if Self::fence_stopped(a, b) {
                            self.report.summary.overlaps_after_data_loss += 1;
                        } else {
                            let message = format!(
                                "key {key:?}: {} (token {}) and {} (token {}) held the lock at once \
                                 from {} after the store lost its data, and the fence did not stop \
                                 the older token: it accepted a write of the lower token after one \
                                 of the higher",
                                a.id(),
                                token(a),
                                b.id(),
                                token(b),
                                self.at(start(b)),
                            );
                            self.report
                                .add(Check::Exclusion, message, vec![line(a), line(b)]);
                        }
                        continue;
                    }
                    let message = format!(
                        "key {key:?}: {} (token {}, {}..{}, {:?}) overlaps {} (token {}, from {}) \
                         and the older holder was not told of a loss",
                        a.id(),
                        token(a),
                        self.at(start(a)),
                        self.at(a_end),
                        a.outcome,
                        b.id(),
                        token(b),
                        self.at(start(b)),
                    );
                    self.report
                        .add(Check::Exclusion, message, vec![line(a), line(b)]);
                }
            }
        }
    }

    /// Check 2.
    fn token_order(&mut self) {
        for (key, v) in self.held_by_key() {
            let mut seen: HashMap<u64, &Section> = HashMap::new();
            let mut max: Option<&Section> = None;
            for s in v {
                let t = token(s);
                if let Some(first) = seen.insert(t, s) {
                    let message = format!(
                        "key {key:?}: token {t} given twice, to {} at {} and to {} at {}",
                        first.id(),
                        self.at(start(first)),
                        s.id(),
                        self.at(start(s)),
                    );
                    self.report
                        .add(Check::TokenOrder, message, vec![line(first), line(s)]);
                    continue;
                }
                match max {
                    Some(m) if t < token(m) => {
                        // A holder that called before the highest one started
                        // and was told of its loss may have acquired first.
                        if s.told() && s.t_call <= start(m) {
                            continue;
                        }
                        let message = format!(
                            "key {key:?}: token went back from {} ({} at {}) to {t} ({} at {})",
                            token(m),
                            m.id(),
                            self.at(start(m)),
                            s.id(),
                            self.at(start(s)),
                        );
                        self.report
                            .add(Check::TokenOrder, message, vec![line(m), line(s)]);
                    }
                    _ => max = Some(s),
                }
            }
        }
    }

    /// Check 3.
    fn refused_writes(&mut self) {
        for s in self.sections.clone() {
            let Some(held) = &s.held else { continue };
            for w in held
                .writes
                .iter()
                .filter(|w| w.result == WriteResult::Refused)
            {
                if s.told() {
                    self.report.summary.refused_by_told_holders += 1;
                    continue;
                }
                if self.store_lost_its_data_under(s) || self.failover_under(s, start(s), end(s)) {
                    self.report.summary.refused_after_data_loss += 1;
                    continue;
                }
                let message = format!(
                    "key {:?}: the fence store refused the write of {} (token {}) at {}, \
                     and with_lock gave {:?}, not Lost",
                    s.key,
                    s.id(),
                    held.token,
                    self.at(w.t_sent),
                    s.outcome,
                );
                self.report.add(Check::RefusedWrite, message, vec![line(s)]);
            }
        }
    }

    /// `with_lock`'s outcome and the context agree \[O6\].
    fn context(&mut self) {
        for s in self.sections.clone() {
            let Some(held) = &s.held else { continue };
            let ctx_says_lost = held.ctx_lost || held.told_at.is_some();
            let wrong = match s.outcome {
                Outcome::Ok => ctx_says_lost.then_some("gave Ok but the context says lost"),
                Outcome::Lost => (!held.ctx_lost).then_some("gave Lost but ctx.is_lost() is false"),
                _ => None,
            };
            if let Some(wrong) = wrong {
                let message = format!("key {:?}: with_lock of {} {wrong}", s.key, s.id());
                self.report.add(Check::Context, message, vec![line(s)]);
            }
        }
    }

    /// \[O6\] A release that fails on a backend error after a callback
    /// settled with its validity intact proves nothing either way: the call
    /// gives the callback's output. Only a release answer that finds the key
    /// gone or another owner's makes it `Lost`, and not even that after a
    /// failed try that may have freed the key. So a finished callback whose
    /// lock was not lost when its release was first sent (the driver had
    /// found no expiry or failed extension), whose release failed, and
    /// which `with_lock` answered `Lost` is a violation: with a backend-error
    /// cause always; as taken when the release found the key gone only
    /// after a try that may have freed it. Other causes (shutdown's own
    /// release) are left out.
    fn lost_after_release(&mut self) {
        for s in self.sections.clone() {
            let (Some(held), Some(release)) = (&s.held, &s.release) else {
                continue;
            };
            if held.t_end.is_none() || release.lost_before {
                continue;
            }
            let failed =
                |a: &ReleaseAnswer| matches!(a, ReleaseAnswer::Error | ReleaseAnswer::ErrorNotSent);
            if !release.answers.iter().any(failed) {
                continue;
            }
            self.report.summary.release_errors_after_settle += 1;
            if s.outcome != Outcome::Lost {
                continue;
            }
            let cause = s.cause.as_deref().unwrap_or_default();
            // "Not held" after a try that may have freed the key.
            let taken_after_maybe_freed = release
                .answers
                .iter()
                .position(|a| *a == ReleaseAnswer::NotHeld)
                .is_some_and(|at| release.answers[..at].contains(&ReleaseAnswer::Error));
            let wrong = if cause.starts_with(BACKEND_LOSS) {
                // Only the failed release can have given it: nothing else
                // is sent once the callback settled with its lock.
                true
            } else if cause.starts_with(TAKEN_LOSS) {
                // An extension in flight when the callback settled may find
                // the key taken itself; the answers then hold no "not held"
                // after a try that may have freed the key.
                taken_after_maybe_freed
            } else {
                false
            };
            if !wrong {
                continue;
            }
            let answers: Vec<String> = release.answers.iter().map(|a| format!("{a:?}")).collect();
            let message = format!(
                "key {:?}: the callback of {} (token {}) ended at {} with its lock not lost, \
                 its release failed ({}: {}), and with_lock gave Lost ({}): a failed release \
                 gives the callback's output",
                s.key,
                s.id(),
                held.token,
                self.at(end(s)),
                answers.join(", "),
                release.last_error.as_deref().unwrap_or("no error text"),
                s.cause.as_deref().unwrap_or("no cause"),
            );
            self.report
                .add(Check::LostAfterRelease, message, vec![line(s)]);
        }
    }

    /// Check 4, and the per-fault figures.
    fn liveness(&mut self) {
        for s in self.sections.clone() {
            if s.outcome == Outcome::Hung {
                let message = format!(
                    "key {:?}: with_lock of {} called at {} did not return within the watchdog",
                    s.key,
                    s.id(),
                    self.at(s.t_call)
                );
                self.report.add(Check::Liveness, message, vec![line(s)]);
            }
        }
        let mut completions: Vec<&Section> = self
            .sections
            .iter()
            .copied()
            .filter(|s| s.outcome == Outcome::Ok && s.held.is_some())
            .collect();
        completions.sort_by_key(|s| s.t_return);
        // Per key, the time covered by callbacks that completed with Ok:
        // the key served someone.
        let mut served: BTreeMap<&str, Vec<(u64, u64)>> = BTreeMap::new();
        for s in &completions {
            served
                .entry(s.key.as_str())
                .or_default()
                .push((start(s), end(s)));
        }
        for intervals in served.values_mut() {
            *intervals = merge(std::mem::take(intervals));
        }
        let keys: BTreeSet<&str> = if self.run_keys.is_empty() {
            served.keys().copied().collect()
        } else {
            self.run_keys.iter().copied().collect()
        };
        for f in self.faults.clone() {
            let heal = f.t_end;
            let deadline = (heal + self.bound).min(self.end.max(heal));
            let first = completions
                .iter()
                .find(|s| start(s) >= heal && s.t_return >= heal);
            let recovery = first
                .filter(|s| s.t_return <= deadline)
                .map(|s| (s.t_return - heal) / 1000);
            if recovery.is_none() {
                let message = format!(
                    "{} of {} healed at {}: no lock taken afterwards completed within {} ms{}",
                    f.kind.name(),
                    f.target,
                    self.at(heal),
                    (deadline - heal) / 1000,
                    match first {
                        Some(s) =>
                            format!(" (the first came {} ms after)", (s.t_return - heal) / 1000),
                        None => " (none came at all)".to_owned(),
                    }
                );
                let fault = serde_json::to_string(f).unwrap_or_default();
                self.report.add(Check::Liveness, message, vec![fault]);
            }
            let (gap, gap_key) = keys
                .iter()
                .map(|k| {
                    let intervals = served.get(k).map_or(&[][..], Vec::as_slice);
                    // Up to the first successful section begun after the heal.
                    let until = intervals
                        .iter()
                        .map(|&(s, _)| s)
                        .find(|&s| s >= heal)
                        .map_or(deadline, |s| s.min(deadline));
                    (longest_gap(intervals, f.t_start, until), *k)
                })
                .max()
                .unwrap_or((0, ""));
            let fault = FaultSummary {
                kind: f.kind,
                target: f.target.clone(),
                at_ms: ((i128::from(f.t_start) - i128::from(self.begin)) / 1000) as i64,
                duration_ms: f.t_end.saturating_sub(f.t_start) / 1000,
                recovery_ms: recovery,
                longest_unavailability_ms: gap / 1000,
                unavailable_key: (!gap_key.is_empty()).then(|| gap_key.to_owned()),
                held_through: self.held_through(f),
            };
            let s = &mut self.report.summary;
            s.longest_unavailability_ms = s
                .longest_unavailability_ms
                .max(fault.longest_unavailability_ms);
            *s.fault_counts.entry(f.kind).or_insert(0) += 1;
            s.faults.push(fault);
        }
    }

    /// Locks on keys `f` touched, taken before it began and given back
    /// with `Ok` after it healed: for a fault that must cost no held lock,
    /// what shows that some were put to the test.
    fn held_through(&self, f: &Fault) -> usize {
        self.sections
            .iter()
            .filter(|s| {
                s.outcome == Outcome::Ok
                    && s.held.is_some()
                    && start(s) < f.t_start
                    && s.t_return > f.t_end
                    && self.touches(f, s, start(s), s.t_return)
            })
            .count()
    }

    /// Check 5.
    fn leaks(&mut self) {
        let checks: Vec<_> = self
            .events
            .iter()
            .filter_map(|e| match e {
                Event::LeakCheck(c) => Some(c),
                _ => None,
            })
            .collect();
        if !checks.iter().any(|c| c.by.is_none()) {
            self.report.add(
                Check::Leak,
                "the final leak check did not run".to_owned(),
                Vec::new(),
            );
        }
        for check in checks {
            let s = &mut self.report.summary;
            match check.by {
                None => {
                    s.leak_keys_checked =
                        Some(s.leak_keys_checked.unwrap_or(0) + check.keys_checked);
                }
                Some(_) => s.worker_leak_checks += 1,
            }
            s.leaked += check.held.len();
            for held in &check.held {
                let message = match check.by {
                    None => format!("held after every worker shut down: {held}"),
                    Some(w) => {
                        format!("held by worker {w}'s node when its shutdown returned: {held}")
                    }
                };
                let line = serde_json::to_string(check).unwrap_or_default();
                self.report.add(Check::Leak, message, vec![line]);
            }
        }
    }

    /// Every worker shut down in time, releasing everything.
    fn shutdown(&mut self) {
        let mut started = BTreeSet::new();
        let mut shut = BTreeMap::new();
        let mut exits = BTreeMap::new();
        let mut checked = BTreeSet::new();
        for e in self.events {
            match e {
                Event::LeakCheck(LeakCheck { by: Some(w), .. }) => {
                    checked.insert(*w);
                }
                Event::WorkerStart { worker, .. } => {
                    started.insert(*worker);
                }
                Event::Shutdown(r) => {
                    shut.insert(r.worker, r);
                }
                Event::WorkerExit {
                    worker, graceful, ..
                } => {
                    exits.insert(*worker, (*graceful, e));
                }
                _ => {}
            }
        }
        self.report.summary.workers = started.len();
        for w in started {
            if !checked.contains(&w) {
                self.report.add(
                    Check::Leak,
                    format!("worker {w} did not check its own keys when its shutdown returned"),
                    Vec::new(),
                );
            }
            match shut.get(&w) {
                None => self.report.add(
                    Check::Shutdown,
                    format!("worker {w} logged no shutdown"),
                    Vec::new(),
                ),
                Some(r) => {
                    self.report.summary.released_by_shutdown += r.released;
                    let line =
                        serde_json::to_string(&Event::Shutdown((*r).clone())).unwrap_or_default();
                    let took_ms = r.t_done.saturating_sub(r.t_signal) / 1000;
                    let limit_ms = r.grace_ms + r.release_timeout_ms + SHUTDOWN_SLACK_MS;
                    if took_ms > limit_ms {
                        self.report.add(
                            Check::Shutdown,
                            format!("worker {w}: shutdown took {took_ms} ms, over grace + release timeout + slack = {limit_ms} ms"),
                            vec![line.clone()],
                        );
                    }
                    if r.release_failures > 0 {
                        self.report.add(
                            Check::Shutdown,
                            format!(
                                "worker {w}: {} of {} shutdown releases failed on a healthy server",
                                r.release_failures, r.released
                            ),
                            vec![line],
                        );
                    }
                }
            }
            match exits.get(&w) {
                Some((true, _)) => self.report.summary.graceful_exits += 1,
                Some((false, e)) => self.report.add(
                    Check::Shutdown,
                    format!("worker {w} did not exit gracefully"),
                    vec![serde_json::to_string(e).unwrap_or_default()],
                ),
                None => self.report.add(
                    Check::Shutdown,
                    format!("worker {w}: no exit recorded"),
                    Vec::new(),
                ),
            }
        }
    }
}

/// `text` with every number (`653.9`, `12`) replaced by `N`, so that
/// causes differing only in a measured time count together.
fn without_numbers(text: &str) -> String {
    let chars: Vec<char> = text.chars().collect();
    let digit = |i: usize| chars.get(i).is_some_and(char::is_ascii_digit);
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    while i < chars.len() {
        if !digit(i) {
            out.push(chars[i]);
            i += 1;
            continue;
        }
        out.push('N');
        // The rest of the number: digits, and a point followed by a digit.
        while digit(i) || (chars.get(i) == Some(&'.') && digit(i + 1)) {
            i += 1;
        }
    }
    out
}

/// How `LossCause::Backend` reads in a section's cause.
const BACKEND_LOSS: &str = "backend errors:";
/// How `LossCause::Taken` reads.
const TAKEN_LOSS: &str = "another owner took the key";

fn start(s: &Section) -> u64 {
    s.held.as_ref().map_or(s.t_call, |h| h.t_start)
}

/// The callback's last instant; a callback that never ended (a call
/// dropped by the watchdog) is taken to end when its call returned.
fn end(s: &Section) -> u64 {
    s.held
        .as_ref()
        .and_then(|h| h.t_end)
        .unwrap_or(s.t_return)
        .max(start(s))
}

fn token(s: &Section) -> u64 {
    s.held.as_ref().map_or(0, |h| h.token)
}

/// Sorted, disjoint intervals covering the same time as `intervals`.
fn merge(mut intervals: Vec<(u64, u64)>) -> Vec<(u64, u64)> {
    intervals.sort_unstable();
    let mut merged: Vec<(u64, u64)> = Vec::with_capacity(intervals.len());
    for (s, e) in intervals {
        match merged.last_mut() {
            Some(last) if s <= last.1 => last.1 = last.1.max(e),
            _ => merged.push((s, e)),
        }
    }
    merged
}

/// The longest stretch of `[from, until]` that `served` (sorted, disjoint
/// intervals) does not cover.
fn longest_gap(served: &[(u64, u64)], from: u64, until: u64) -> u64 {
    let mut covered_to = from;
    let mut longest = 0;
    for &(s, e) in served {
        if e <= covered_to {
            continue;
        }
        if s >= until {
            break;
        }
        longest = longest.max(s.saturating_sub(covered_to));
        covered_to = e;
    }
    longest.max(until.saturating_sub(covered_to))
}

#[cfg(test)]
mod tests;

//! What the analysis found: the figures of a run, the violations per
//! check, and the printed summary.

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

use super::QueueOrderSummary;
use crate::event::{FaultKind, RunInfo};

/// Violations kept as examples per check; all are counted.
pub const MAX_EXAMPLES: usize = 20;

/// Runs with more faults than this print one line per kind only.
pub const MAX_FAULT_LINES: usize = 16;

/// The properties checked.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Check {
    /// Overlapping sections without a loss report of the older holder.
    Exclusion,
    /// A fencing token repeated or going back.
    TokenOrder,
    /// A refused fenced write by a holder not told of its loss.
    RefusedWrite,
    /// No progress after a fault healed, or a call that hung.
    Liveness,
    /// A key held after graceful shutdown, or no leak check.
    Leak,
    /// `with_lock`'s outcome and the lock context disagree.
    Context,
    /// A worker that did not shut down, or not in time, or failed releases.
    Shutdown,
    /// A lock reported lost although no fault touched its key's store or
    /// its holder \[L4\]: checked where faults touch some keys only
    /// ([`RunInfo::check_unfaulted_losses`]).
    UnfaultedLoss,
    /// A finished callback, its lock not lost when its release was sent,
    /// answered `Lost` because the release failed on a backend error
    /// \[O6\].
    LostAfterRelease,
    /// Two waiters of the fair queue acquired in the other order than the
    /// store's queue held them, or the queue changed their order, with no
    /// fault or event that lets the place ahead die \[F1\].
    QueueOrder,
}

impl Check {
    /// Every check, in report order.
    pub const ALL: [Check; 10] = [
        Self::Exclusion,
        Self::TokenOrder,
        Self::RefusedWrite,
        Self::Liveness,
        Self::Leak,
        Self::Context,
        Self::Shutdown,
        Self::UnfaultedLoss,
        Self::LostAfterRelease,
        Self::QueueOrder,
    ];

    /// The snake-case name.
    pub fn name(self) -> &'static str {
        match self {
            Self::Exclusion => "exclusion",
            Self::TokenOrder => "token_order",
            Self::RefusedWrite => "refused_write",
            Self::Liveness => "liveness",
            Self::Leak => "leak",
            Self::Context => "context",
            Self::Shutdown => "shutdown",
            Self::UnfaultedLoss => "unfaulted_loss",
            Self::LostAfterRelease => "lost_after_release",
            Self::QueueOrder => "queue_order",
        }
    }
}

/// One violation, with the log lines that show it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Violation {
    /// Which check.
    pub check: Check,
    /// What is wrong, with times relative to the run's start.
    pub message: String,
    /// The sections (or other events) involved, as log lines.
    pub lines: Vec<String>,
}

/// One fault and what it cost.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FaultSummary {
    /// What was done.
    pub kind: FaultKind,
    /// To whom.
    pub target: String,
    /// When it began, ms after the run began.
    pub at_ms: i64,
    /// How long it lasted until healed, in ms.
    pub duration_ms: u64,
    /// From healing to the first completion of a lock taken after it, in
    /// ms; `None` when none came within the bound.
    pub recovery_ms: Option<u64>,
    /// The longest time, from the fault's start to the first successful
    /// section begun after it healed, that one key served nobody: no
    /// callback that `with_lock` then returned `Ok` for was running on it.
    /// In ms.
    pub longest_unavailability_ms: u64,
    /// The key of that longest gap.
    pub unavailable_key: Option<String>,
    /// Locks on the keys it touched (for a worker stop, that worker's)
    /// taken before it began whose `with_lock` returned `Ok` after it
    /// healed: for a fault that must cost no held lock, how many were put
    /// to the test.
    #[serde(default)]
    pub held_through: usize,
}

/// The figures of a run.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    /// The run, when the log has it.
    pub run: Option<RunInfo>,
    /// `with_lock` calls.
    pub calls: usize,
    /// Calls whose callback ran.
    pub sections: usize,
    /// Calls per outcome.
    pub outcomes: BTreeMap<String, usize>,
    /// Lost calls per cause, numbers in the cause's text shown as `N`.
    pub loss_causes: BTreeMap<String, usize>,
    /// Lost calls per the fault that touched them: `worker_stop` when the
    /// holder itself was stopped, else the kind of a fault on the key's
    /// store (on Redis Cluster: the key's master) from the call to a
    /// couple of ttls after the heal; `shutdown` when the worker's
    /// graceful shutdown cut it off; `none` when no fault did.
    #[serde(default)]
    pub losses_by_fault: BTreeMap<String, usize>,
    /// Calls whose callback ended with its lock not lost and whose release
    /// failed on a backend error at least once before `with_lock` returned
    /// (each must give the callback's output or find the key taken \[O6\]).
    #[serde(default)]
    pub release_errors_after_settle: usize,
    /// Pairs of sections on one key that overlapped in time.
    pub overlaps: usize,
    /// Of those, the ones whose older holder was told of its loss.
    pub overlaps_after_loss_report: usize,
    /// Of those, the ones whose older holder held the lock while the store
    /// lost its data and was not told: Redis restarted empty
    /// (`server_kill`) and its release failed, which gives the callback's
    /// output \[O6\]; or a failover of the key's Redis Cluster master
    /// (`master_stop`, `master_kill`) during the overlap, to a replica
    /// that missed the lock's write or with the old master answering for a
    /// moment after it resumed. The fence refuses the stale holder's
    /// writes; an overlap where it did not is an exclusion violation.
    #[serde(default)]
    pub overlaps_after_data_loss: usize,
    /// Fenced writes accepted by the store.
    pub writes_accepted: usize,
    /// Fenced writes refused by the store.
    pub writes_refused: usize,
    /// Of those, the ones by holders told of their loss.
    pub refused_by_told_holders: usize,
    /// Of those, the ones by holders whose store was restarted empty, or
    /// whose key's Redis Cluster master failed over, while they held the
    /// lock.
    #[serde(default)]
    pub refused_after_data_loss: usize,
    /// Fenced writes that failed or timed out.
    pub writes_failed: usize,
    /// The fair queue's order check, when the queue was read.
    #[serde(default)]
    pub queue_order: Option<QueueOrderSummary>,
    /// Every fault, in order.
    pub faults: Vec<FaultSummary>,
    /// Faults per kind.
    pub fault_counts: BTreeMap<FaultKind, usize>,
    /// The longest unavailability of any fault, in ms.
    pub longest_unavailability_ms: u64,
    /// Keys checked for leaks once every worker had ended, when that ran.
    pub leak_keys_checked: Option<usize>,
    /// Workers that checked, when their shutdown returned, that their node
    /// held nothing.
    pub worker_leak_checks: usize,
    /// Keys found held after shutdown.
    pub leaked: usize,
    /// Workers that started.
    pub workers: usize,
    /// Workers that exited gracefully.
    pub graceful_exits: usize,
    /// Locks released by the workers' shutdowns.
    pub released_by_shutdown: usize,
    /// Log lines that could not be read.
    pub unreadable_lines: usize,
}

/// What the analysis found.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Report {
    /// The figures.
    pub summary: Summary,
    /// Violations per check.
    pub counts: BTreeMap<Check, usize>,
    /// Up to [`MAX_EXAMPLES`] violations per check.
    pub violations: Vec<Violation>,
}

impl Report {
    /// No check found a violation.
    pub fn is_clean(&self) -> bool {
        self.counts.values().all(|&n| n == 0)
    }

    /// How many violations `check` found.
    pub fn count(&self, check: Check) -> usize {
        self.counts.get(&check).copied().unwrap_or(0)
    }

    pub(super) fn add(&mut self, check: Check, message: String, lines: Vec<String>) {
        let n = self.counts.entry(check).or_insert(0);
        *n += 1;
        if *n <= MAX_EXAMPLES {
            self.violations.push(Violation {
                check,
                message,
                lines,
            });
        }
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = &self.summary;
        if let Some(run) = &s.run {
            writeln!(
                f,
                "chaos {}: {:.1} s, {} workers x {} tasks, {} keys, ttl {} ms",
                run.backend,
                run.t_end.saturating_sub(run.t_begin) as f64 / 1e6,
                run.procs,
                run.tasks,
                run.keys.len(),
                run.ttl_ms
            )?;
        }
        let kinds: Vec<String> = s
            .fault_counts
            .iter()
            .map(|(k, n)| format!("{} {n}", k.name()))
            .collect();
        writeln!(f, "faults: {} ({})", s.faults.len(), kinds.join(", "))?;
        let outcomes: Vec<String> = s.outcomes.iter().map(|(k, n)| format!("{k} {n}")).collect();
        writeln!(
            f,
            "calls: {} ({}); callbacks run: {}",
            s.calls,
            outcomes.join(", "),
            s.sections
        )?;
        if !s.loss_causes.is_empty() {
            writeln!(f, "losses by cause:")?;
            for (cause, n) in &s.loss_causes {
                writeln!(f, "  {n:>5}  {cause}")?;
            }
        }
        if !s.losses_by_fault.is_empty() {
            let by: Vec<String> = s
                .losses_by_fault
                .iter()
                .map(|(k, n)| format!("{k} {n}"))
                .collect();
            writeln!(
                f,
                "losses by the fault on the key's store or its holder: {}",
                by.join(", ")
            )?;
        }
        writeln!(
            f,
            "releases that failed after a callback settled with its lock: {}",
            s.release_errors_after_settle
        )?;
        writeln!(
            f,
            "overlaps: {} ({} after a loss report of the older holder, {} after the store lost its data under it)",
            s.overlaps, s.overlaps_after_loss_report, s.overlaps_after_data_loss
        )?;
        writeln!(
            f,
            "fenced writes: {} accepted, {} refused ({} by holders told of their loss, {} after the store lost its data under them), {} failed",
            s.writes_accepted,
            s.writes_refused,
            s.refused_by_told_holders,
            s.refused_after_data_loss,
            s.writes_failed
        )?;
        match &s.queue_order {
            Some(o) => {
                let excuses: Vec<String> =
                    o.excuses.iter().map(|(k, n)| format!("{k} {n}")).collect();
                writeln!(
                    f,
                    "fair queue order: {} pairs of waiters seen in the store's queue ({} reads); \
                     {} checked: {} in order, {} excused{}, {} out of order; {} undecided, {} \
                     acquired before a read saw them",
                    o.pairs,
                    o.reads,
                    o.checked(),
                    o.in_order,
                    o.excused,
                    if excuses.is_empty() {
                        String::new()
                    } else {
                        format!(" ({})", excuses.join(", "))
                    },
                    o.out_of_order,
                    o.undecided,
                    o.acquired_before_read
                )?;
            }
            None => writeln!(f, "fair queue order: no read saw two waiters")?,
        }
        writeln!(
            f,
            "longest unavailability: {} ms",
            s.longest_unavailability_ms
        )?;
        writeln!(
            f,
            "per fault kind: the longest fault, the slowest recovery (heal to the first \
             fresh lock completed), the longest time a key served nobody:"
        )?;
        writeln!(
            f,
            "  {:<20} {:>5} {:>13} {:>13} {:>20}",
            "fault", "count", "longest ms", "recovery ms", "unavailability ms"
        )?;
        for (kind, n) in &s.fault_counts {
            let of_kind = || s.faults.iter().filter(|x| x.kind == *kind);
            let duration = of_kind().map(|x| x.duration_ms).max().unwrap_or(0);
            // The slowest recovery; "none" when one never came.
            let recovery = of_kind()
                .map(|x| x.recovery_ms)
                .max_by_key(|r| r.unwrap_or(u64::MAX))
                .flatten()
                .map_or_else(|| "none".to_owned(), |r| r.to_string());
            let unavailable = of_kind()
                .map(|x| x.longest_unavailability_ms)
                .max()
                .unwrap_or(0);
            writeln!(
                f,
                "  {:<20} {n:>5} {duration:>13} {recovery:>13} {unavailable:>20}",
                kind.name()
            )?;
        }
        if s.faults.len() <= MAX_FAULT_LINES {
            for fault in &s.faults {
                writeln!(
                    f,
                    "  {:>+9.3}s {:<20} {:<7} {:>5} ms; recovered in {}; {} locks held through; longest unavailability {} ms{}",
                    fault.at_ms as f64 / 1e3,
                    fault.kind.name(),
                    fault.target,
                    fault.duration_ms,
                    fault.recovery_ms.map_or_else(|| "-".to_owned(), |r| format!("{r} ms")),
                    fault.held_through,
                    fault.longest_unavailability_ms,
                    fault
                        .unavailable_key
                        .as_ref()
                        .map_or_else(String::new, |k| format!(" ({k})")),
                )?;
            }
        }
        match s.leak_keys_checked {
            Some(n) => writeln!(
                f,
                "leak check: {n} keys after every worker ended, and each of {} workers' own keys \
                 when its shutdown returned: {} held",
                s.worker_leak_checks, s.leaked
            )?,
            None => writeln!(f, "leak check: not run")?,
        }
        writeln!(
            f,
            "shutdown: {} workers, {} exited gracefully, {} locks released by shutdown",
            s.workers, s.graceful_exits, s.released_by_shutdown
        )?;
        if s.unreadable_lines > 0 {
            writeln!(f, "unreadable log lines: {}", s.unreadable_lines)?;
        }
        if self.is_clean() {
            return writeln!(f, "violations: none");
        }
        let counts: Vec<String> = self
            .counts
            .iter()
            .filter(|(_, &n)| n > 0)
            .map(|(c, n)| format!("{} {n}", c.name()))
            .collect();
        writeln!(f, "VIOLATIONS: {}", counts.join(", "))?;
        for check in Check::ALL {
            for v in self.violations.iter().filter(|v| v.check == check).take(3) {
                writeln!(f, "  [{}] {}", check.name(), v.message)?;
                for l in &v.lines {
                    writeln!(f, "      {l}")?;
                }
            }
        }
        Ok(())
    }
}

//! The analysis proves itself on planted violations: each test plants one
//! in a clean log and checks that exactly that check reports it.

use super::*;
use crate::event::{
    FaultKind, FencedWrite, Held, LeakCheck, ReleaseAnswer, ReleaseTrace, ShutdownRecord,
};

const MS: u64 = 1000;
const KEY: &str = "k";

/// A section of worker `worker` on [`KEY`] holding token `token` from
/// `start_ms` to `end_ms`, with one accepted write.
fn section(
    worker: u32,
    seq: u64,
    token: u64,
    start_ms: u64,
    end_ms: u64,
    outcome: Outcome,
) -> Section {
    let lost = outcome == Outcome::Lost;
    Section {
        key: KEY.into(),
        worker,
        task: 0,
        seq,
        t_call: start_ms * MS - MS / 2,
        t_return: end_ms * MS + MS / 2,
        outcome,
        cause: lost.then(|| "the key expired before it was extended".into()),
        held: Some(Held {
            token,
            t_start: start_ms * MS,
            t_end: Some(end_ms * MS),
            writes: vec![FencedWrite {
                t_sent: start_ms * MS + 10,
                t_done: start_ms * MS + 20,
                result: WriteResult::Accepted,
                lost_before: false,
            }],
            told_at: lost.then_some(end_ms * MS),
            ctx_lost: lost,
        }),
        release: None,
        queued: Vec::new(),
    }
}

/// Section `seq` of [`clean_log`]: worker `seq % 2`, token `10 * seq`, from
/// `seq` tenths of a second for 80 ms.
fn clean_section(seq: u64, outcome: Outcome) -> Section {
    let start = seq * 100;
    section((seq % 2) as u32, seq, seq * 10, start, start + 80, outcome)
}

/// Two workers taking turns on one key for 60 s, every section 80 ms long
/// with a token ten more than the last; one worker stop from 10 s to
/// 12.5 s; shutdown and leak check clean.
fn clean_log() -> Vec<Event> {
    let mut events = vec![Event::Run(RunInfo {
        backend: "redis".into(),
        t_begin: 0,
        t_end: 60_000 * MS,
        procs: 2,
        tasks: 1,
        keys: vec![KEY.into()],
        ttl_ms: 1000,
        liveness_bound_ms: 5000,
        check_unfaulted_losses: false,
        ticket_ttl_ms: 3000,
        claim_ms: 2000,
    })];
    for worker in 0..2 {
        events.push(Event::WorkerStart {
            worker,
            pid: 100 + worker,
            t: 0,
        });
    }
    for seq in 1..600u64 {
        events.push(Event::Section(clean_section(seq, Outcome::Ok)));
    }
    events.push(Event::Fault(Fault {
        kind: FaultKind::WorkerStop,
        target: "w0".into(),
        t_start: 10_000 * MS,
        t_end: 12_500 * MS,
        detail: String::new(),
        keys: None,
    }));
    for worker in 0..2 {
        events.push(Event::Shutdown(ShutdownRecord {
            worker,
            t_signal: 60_000 * MS,
            t_done: 60_100 * MS,
            grace_ms: 2000,
            release_timeout_ms: 1000,
            callbacks_finished: true,
            released: 0,
            release_failures: 0,
            aborted_tasks: 0,
            abandoned_waits: 0,
        }));
        events.push(Event::WorkerExit {
            worker,
            graceful: true,
            status: "exit status: 0".into(),
            t: 60_200 * MS,
        });
    }
    for worker in 0..2 {
        events.push(Event::LeakCheck(LeakCheck {
            by: Some(worker),
            t: 60_100 * MS,
            keys_checked: 1,
            held: Vec::new(),
        }));
    }
    events.push(Event::LeakCheck(LeakCheck {
        by: None,
        t: 60_300 * MS,
        keys_checked: 1,
        held: Vec::new(),
    }));
    events
}

fn analyse_events(events: Vec<Event>) -> Report {
    analyse(&RunLog {
        events,
        unreadable_lines: 0,
    })
}

/// The report has violations of `check` only, `n` of them.
fn assert_only(report: &Report, check: Check, n: usize) {
    for c in Check::ALL {
        let expected = if c == check { n } else { 0 };
        assert_eq!(report.count(c), expected, "check {c:?} in:\n{report}");
    }
    assert!(report
        .violations
        .iter()
        .all(|v| v.check == check && !v.message.is_empty()));
}

/// A log with violations planted in it: [`clean_log`] with calls and
/// events added or changed, in the order the methods are called.
#[derive(Clone)]
struct Plant {
    events: Vec<Event>,
}

impl Plant {
    fn clean() -> Self {
        Self {
            events: clean_log(),
        }
    }

    /// What the analysis reports on the log.
    fn analyse(self) -> Report {
        analyse_events(self.events)
    }

    /// The log of a run on a Redis Cluster: a loss on a key no fault
    /// touched is a violation.
    fn on_a_cluster(self) -> Self {
        self.with_events(|e| {
            if let Event::Run(run) = e {
                run.backend = "redis-cluster".into();
                run.check_unfaulted_losses = true;
            }
        })
    }

    /// One more call, as `section` says.
    fn call(mut self, section: Section) -> Self {
        self.events.push(Event::Section(section));
        self
    }

    /// One more call of `worker`, answered `outcome`, holding token 515
    /// from 5.15 s to 5.19 s: it overlaps section 51 of the clean log
    /// (token 510, 5.1 s to 5.18 s).
    fn overlapping_51(self, worker: u32, outcome: Outcome) -> Self {
        self.call(section(worker, 9000, 515, 5150, 5190, outcome))
    }

    /// Section `seq` answered `Lost`, its holder told at its end.
    fn lost(self, seq: u64) -> Self {
        self.with_section(seq, |s| *s = clean_section(seq, Outcome::Lost))
    }

    /// Section `seq` with `cause` as its loss cause.
    fn cause(self, seq: u64, cause: &str) -> Self {
        self.with_section(seq, |s| s.cause = Some(cause.into()))
    }

    /// One more write in section `seq`, sent at `at_ms`, answered `result`
    /// 1 ms later.
    fn write(self, seq: u64, at_ms: u64, result: WriteResult) -> Self {
        self.with_held(seq, |held| {
            held.writes.push(FencedWrite {
                t_sent: at_ms * MS,
                t_done: (at_ms + 1) * MS,
                result,
                lost_before: false,
            });
        })
    }

    /// The calls made from `from_ms` to `to_ms` found the key busy.
    fn busy(self, from_ms: u64, to_ms: u64) -> Self {
        self.with_sections(|s| {
            let t = s.t_call / MS;
            if (from_ms..to_ms).contains(&t) {
                s.outcome = Outcome::NotAcquired;
                s.held = None;
            }
        })
    }

    /// Section `seq` turned into a finished callback whose release tries
    /// gave `answers`, its lock not lost when the first was sent, and that
    /// `with_lock` answered with `outcome`.
    fn failed_release(self, seq: u64, answers: &[ReleaseAnswer], outcome: Outcome) -> Self {
        self.with_section(seq, |s| {
            let lost = outcome == Outcome::Lost;
            s.outcome = outcome;
            s.cause = lost
                .then(|| "backend errors: nothing confirms the lock was held throughout".into());
            let held = s.held.as_mut().unwrap();
            let end = held.t_end.unwrap();
            held.ctx_lost = lost;
            held.told_at = lost.then_some(end + 300);
            s.release = Some(ReleaseTrace {
                t_sent: end + 100,
                lost_before: false,
                answers: answers.to_vec(),
                last_error: Some("lock backend step timed out".into()),
            });
        })
    }

    /// A fault of `kind` on every key, on `target`, from `from_ms` to
    /// `to_ms`.
    fn fault(mut self, kind: FaultKind, target: &str, from_ms: u64, to_ms: u64) -> Self {
        self.events.push(Event::Fault(Fault {
            kind,
            target: target.into(),
            t_start: from_ms * MS,
            t_end: to_ms * MS,
            detail: String::new(),
            keys: None,
        }));
        self
    }

    /// A failover of the master serving `keys`, `kind`, from `from_ms` to
    /// `to_ms`.
    fn failover(mut self, kind: FaultKind, keys: &[&str], from_ms: u64, to_ms: u64) -> Self {
        self.events.push(Event::Fault(Fault {
            kind,
            target: "127.0.0.1:7000".into(),
            t_start: from_ms * MS,
            t_end: to_ms * MS,
            detail: String::new(),
            keys: Some(keys.iter().map(|k| (*k).to_owned()).collect()),
        }));
        self
    }

    /// Section `seq` changed by `change`.
    fn with_section(mut self, seq: u64, change: impl FnOnce(&mut Section)) -> Self {
        let section = self.sections_mut().find(|s| s.seq == seq).unwrap();
        change(section);
        self
    }

    /// What section `seq` held, changed by `change`.
    fn with_held(self, seq: u64, change: impl FnOnce(&mut Held)) -> Self {
        self.with_section(seq, |s| change(s.held.as_mut().unwrap()))
    }

    /// Every section changed by `change`.
    fn with_sections(mut self, change: impl FnMut(&mut Section)) -> Self {
        self.sections_mut().for_each(change);
        self
    }

    /// Every event changed by `change`.
    fn with_events(mut self, change: impl FnMut(&mut Event)) -> Self {
        self.events.iter_mut().for_each(change);
        self
    }

    /// The log without the events `drop` picks.
    fn without(mut self, drop: impl Fn(&Event) -> bool) -> Self {
        self.events.retain(|e| !drop(e));
        self
    }

    fn sections_mut(&mut self) -> impl Iterator<Item = &mut Section> {
        self.events.iter_mut().filter_map(|e| match e {
            Event::Section(s) => Some(s),
            _ => None,
        })
    }
}

#[test]
fn a_clean_log_passes_with_its_figures() {
    let report = Plant::clean().analyse();
    assert!(report.is_clean(), "{report}");
    let s = &report.summary;
    assert_eq!((s.calls, s.sections, s.writes_accepted), (599, 599, 599));
    assert_eq!((s.overlaps, s.writes_refused, s.leaked), (0, 0, 0));
    assert_eq!((s.workers, s.graceful_exits), (2, 2));
    assert_eq!((s.leak_keys_checked, s.worker_leak_checks), (Some(1), 2));
    assert_eq!(s.fault_counts.get(&FaultKind::WorkerStop), Some(&1));
    let fault = &s.faults[0];
    // The first section to start after the heal at 12.5 s starts then and
    // returns 80.5 ms later.
    assert_eq!(fault.recovery_ms, Some(80));
    // The 20 ms between two sections.
    assert_eq!(fault.longest_unavailability_ms, 20);
    assert!(report.to_string().contains("violations: none"), "{report}");
}

#[test]
fn an_overlap_without_a_loss_report_is_reported() {
    // Starts while token 510 (5.1 s to 5.18 s) is held, both Ok.
    let report = Plant::clean().overlapping_51(1, Outcome::Ok).analyse();
    assert_only(&report, Check::Exclusion, 1);
    assert_eq!(report.summary.overlaps, 1);
    assert_eq!(report.violations[0].lines.len(), 2);
}

#[test]
fn an_overlap_after_the_older_holder_was_told_is_allowed() {
    let report = Plant::clean()
        .lost(51)
        .overlapping_51(0, Outcome::Ok)
        .analyse();
    assert!(report.is_clean(), "{report}");
    assert_eq!(report.summary.overlaps, 1);
    assert_eq!(report.summary.overlaps_after_loss_report, 1);
}

/// `log` with the store restarted empty (`server_kill`, 20 ms) at `at_ms`,
/// and an Ok section of token 9000 from 5.15 s, which overlaps the clean
/// log's section 510 (5100..5180).
fn with_store_restarted_empty_at(log: Plant, at_ms: u64) -> Plant {
    log.fault(FaultKind::ServerKill, "server", at_ms, at_ms + 20)
        .overlapping_51(0, Outcome::Ok)
}

#[test]
fn an_overlap_after_the_store_restarted_empty_under_the_older_holder_is_explained() {
    // The older holder (510, 5100..5180) answered Ok: the store was
    // restarted empty at 5.12 s, its release failed [O6]; 9000 took the
    // key from the empty store at 5.15 s.
    let report = with_store_restarted_empty_at(Plant::clean(), 5_120).analyse();
    assert!(report.is_clean(), "{report}");
    assert_eq!(report.summary.overlaps_after_data_loss, 1);
    assert_eq!(report.summary.overlaps_after_loss_report, 0);
}

#[test]
fn a_store_restart_outside_the_older_holders_section_explains_nothing() {
    // Just after the older holder's section (5100..5180) ended.
    let report = with_store_restarted_empty_at(Plant::clean(), 5_185).analyse();
    assert_only(&report, Check::Exclusion, 1);
}

#[test]
fn an_overlap_where_only_the_newer_holder_was_told_is_reported() {
    let report = Plant::clean().overlapping_51(0, Outcome::Lost).analyse();
    assert_only(&report, Check::Exclusion, 1);
}

#[test]
fn a_holder_that_acquired_first_and_started_late_is_the_older_one() {
    // Called at 5.09 s, got token 505 before 510 was drawn, stalled, and its
    // callback began at 5.15 s: told of its loss, so the overlap with 510
    // and its lower token are both accounted for.
    let mut late = section(0, 9000, 505, 5150, 5190, Outcome::Lost);
    late.t_call = 5090 * MS;
    let report = Plant::clean().call(late).analyse();
    assert!(report.is_clean(), "{report}");
    assert_eq!(report.summary.overlaps_after_loss_report, 1);
}

#[test]
fn a_token_going_back_is_reported() {
    // The store lost its counter: one section draws 3 where 4990 would come.
    let report = Plant::clean().with_held(500, |h| h.token = 3).analyse();
    assert_only(&report, Check::TokenOrder, 1);
    assert!(
        report.violations[0].message.contains("went back"),
        "{report}"
    );
}

#[test]
fn a_token_given_twice_is_reported() {
    let report = Plant::clean().with_held(300, |h| h.token = 100).analyse();
    assert_only(&report, Check::TokenOrder, 1);
    assert!(report.violations[0].message.contains("twice"), "{report}");
}

#[test]
fn a_refused_write_by_a_holder_not_told_is_reported() {
    let report = Plant::clean()
        .with_held(42, |h| h.writes[0].result = WriteResult::Refused)
        .analyse();
    assert_only(&report, Check::RefusedWrite, 1);
    assert_eq!(report.summary.writes_refused, 1);
}

#[test]
fn a_refused_write_by_a_holder_told_of_its_loss_is_allowed() {
    let report = Plant::clean()
        .lost(42)
        .with_held(42, |h| h.writes[0].result = WriteResult::Refused)
        .analyse();
    assert!(report.is_clean(), "{report}");
    assert_eq!(report.summary.refused_by_told_holders, 1);
}

#[test]
fn a_key_left_held_is_a_leak() {
    let log = Plant::clean().with_events(|e| {
        if let Event::LeakCheck(c @ LeakCheck { by: None, .. }) = e {
            c.held.push("k held by withlock-1/abc for 900 ms".into());
        }
    });
    assert_only(&log.analyse(), Check::Leak, 1);
}

#[test]
fn a_key_held_by_a_node_whose_shutdown_returned_is_a_leak() {
    let report = Plant::clean()
        .with_events(|e| {
            if let Event::LeakCheck(LeakCheck {
                by: Some(1), held, ..
            }) = e
            {
                held.push("k held by chaos-w1/abc, expiring in 700 ms".into());
            }
        })
        .analyse();
    assert_only(&report, Check::Leak, 1);
    assert!(
        report.violations[0].message.contains("worker 1"),
        "{report}"
    );
}

#[test]
fn a_worker_that_did_not_check_its_own_keys_is_reported() {
    let log =
        Plant::clean().without(|e| matches!(e, Event::LeakCheck(LeakCheck { by: Some(0), .. })));
    assert_only(&log.analyse(), Check::Leak, 1);
}

#[test]
fn a_missing_final_leak_check_is_reported() {
    let log = Plant::clean().without(|e| matches!(e, Event::LeakCheck(LeakCheck { by: None, .. })));
    assert_only(&log.analyse(), Check::Leak, 1);
}

#[test]
fn no_progress_after_a_fault_is_reported_with_its_unavailability() {
    // Nothing completes from the fault's start to 6 s after it healed, over
    // the 5 s bound; calls made meanwhile found the key busy.
    let report = Plant::clean().busy(10_000, 18_500).analyse();
    assert_only(&report, Check::Liveness, 1);
    let fault = &report.summary.faults[0];
    assert_eq!(fault.recovery_ms, None);
    // From the end of the last section (10.08 s, called just before the
    // fault) to the deadline (12.5 s + 5 s).
    assert_eq!(fault.longest_unavailability_ms, 7420);
}

#[test]
fn slow_recovery_within_the_bound_is_measured_not_reported() {
    let report = Plant::clean().busy(10_000, 14_000).analyse();
    assert!(report.is_clean(), "{report}");
    let fault = &report.summary.faults[0];
    // The first call made at 14 s or later starts at 14.1 s and returns at
    // 14.1805 s; the last section before it ended at 10.08 s.
    assert_eq!(fault.recovery_ms, Some(1680));
    assert_eq!(fault.longest_unavailability_ms, 4020);
    assert_eq!(report.summary.longest_unavailability_ms, 4020);
}

#[test]
fn a_call_that_hung_is_a_liveness_violation() {
    let log = Plant::clean().with_section(7, |s| {
        s.outcome = Outcome::Hung;
        s.held = None;
    });
    assert_only(&log.analyse(), Check::Liveness, 1);
}

#[test]
fn ok_while_the_context_says_lost_is_reported() {
    let log = Plant::clean().with_held(9, |h| h.ctx_lost = true);
    assert_only(&log.analyse(), Check::Context, 1);
}

#[test]
fn a_worker_that_did_not_shut_down_gracefully_is_reported() {
    let report = Plant::clean()
        .without(|e| matches!(e, Event::Shutdown(r) if r.worker == 1))
        .with_events(|e| {
            if let Event::WorkerExit {
                worker: 1,
                graceful,
                ..
            } = e
            {
                *graceful = false;
            }
        })
        .analyse();
    assert_only(&report, Check::Shutdown, 2);
    assert_eq!(report.summary.graceful_exits, 1);
}

#[test]
fn a_slow_shutdown_and_failed_releases_are_reported() {
    let log = Plant::clean().with_events(|e| {
        if let Event::Shutdown(r) = e {
            if r.worker == 0 {
                r.t_done = r.t_signal + 5_000 * MS;
                r.released = 2;
                r.release_failures = 1;
            }
        }
    });
    assert_only(&log.analyse(), Check::Shutdown, 2);
}

#[test]
fn examples_are_capped_but_every_violation_is_counted() {
    let report = Plant::clean()
        .with_sections(|s| s.held.as_mut().unwrap().writes[0].result = WriteResult::Refused)
        .analyse();
    assert_eq!(report.count(Check::RefusedWrite), 599);
    assert_eq!(report.violations.len(), MAX_EXAMPLES);
    assert!(report.to_string().contains("refused_write 599"), "{report}");
}

#[test]
fn loss_causes_are_counted_without_their_numbers() {
    assert_eq!(
        without_numbers("extension did not finish within 653.9ms, twice: 2.")
            + &without_numbers(" 7"),
        "extension did not finish within Nms, twice: N. N"
    );
}

#[test]
fn unavailability_is_time_no_successful_section_covered() {
    let served = merge(vec![(6, 8), (1, 2), (7, 9), (3, 4)]);
    assert_eq!(served, [(1, 2), (3, 4), (6, 9)]);
    // From 1.5 to 7: uncovered 2..3 and 4..6.
    assert_eq!(longest_gap(&served, 1, 7), 2);
    // Nothing served after 9 up to 20.
    assert_eq!(longest_gap(&served, 5, 20), 11);
    // Nothing at all: the whole window.
    assert_eq!(longest_gap(&[], 3, 10), 7);
    // A long hold covering the whole window: no unavailability.
    assert_eq!(longest_gap(&[(0, 100)], 3, 10), 0);
}

#[test]
fn an_overlap_during_a_failover_of_the_keys_master_that_the_fence_stopped_is_explained() {
    // The replica promoted at 5.14 s missed the write of 510 (5100..5180,
    // Ok): 515 took the key from it at 5.15 s; 510's second write, after
    // 515's first, was refused.
    let report = Plant::clean()
        .failover(FaultKind::MasterStop, &[KEY], 3_000, 5_140)
        .write(51, 5_170, WriteResult::Refused)
        .overlapping_51(0, Outcome::Ok)
        .on_a_cluster()
        .analyse();
    assert!(report.is_clean(), "{report}");
    assert_eq!(report.summary.overlaps_after_data_loss, 1);
    assert_eq!(report.summary.refused_after_data_loss, 1);
}

#[test]
fn an_overlap_the_fence_did_not_stop_is_reported_even_during_a_failover() {
    let report = Plant::clean()
        .failover(FaultKind::MasterKill, &[KEY], 3_000, 5_140)
        // 510's second write, after 515's first, was accepted.
        .write(51, 5_170, WriteResult::Accepted)
        .overlapping_51(0, Outcome::Ok)
        .on_a_cluster()
        .analyse();
    assert_only(&report, Check::Exclusion, 1);
    assert!(
        report.violations[0].message.contains("did not stop"),
        "{report}"
    );
}

#[test]
fn a_failover_of_another_master_explains_no_overlap() {
    let report = Plant::clean()
        .failover(FaultKind::MasterStop, &["other"], 3_000, 5_140)
        .overlapping_51(0, Outcome::Ok)
        .on_a_cluster()
        .analyse();
    assert_only(&report, Check::Exclusion, 1);
}

#[test]
fn a_loss_on_a_key_whose_master_no_fault_touched_is_reported_on_a_cluster() {
    // Another master failed over while 420 (4200..4280) was reported lost.
    let log = Plant::clean()
        .failover(FaultKind::MasterStop, &["other"], 3_000, 5_000)
        .lost(42);
    let report = log.clone().on_a_cluster().analyse();
    assert_only(&report, Check::UnfaultedLoss, 1);
    assert_eq!(report.summary.losses_by_fault.get("none"), Some(&1));
    // Where faults touch every key, it is a figure only.
    let report = log.analyse();
    assert!(report.is_clean(), "{report}");
    assert_eq!(report.summary.losses_by_fault.get("none"), Some(&1));
}

#[test]
fn a_loss_on_the_faulted_masters_key_or_of_a_stopped_holder_is_allowed() {
    // 420 (4200..4280) while its master failed over; 110 (11000..11080) of
    // w0 while w0 was stopped (10 s to 12.5 s).
    let report = Plant::clean()
        .failover(FaultKind::MasterStop, &[KEY], 3_000, 4_100)
        .lost(42)
        .lost(110)
        .on_a_cluster()
        .analyse();
    assert!(report.is_clean(), "{report}");
    let by = &report.summary.losses_by_fault;
    assert_eq!(
        (by.get("master_stop"), by.get("worker_stop"), by.get("none")),
        (Some(&1), Some(&1), None)
    );
}

#[test]
fn a_loss_by_the_workers_own_shutdown_is_no_unfaulted_loss() {
    // Returns at 60.0805 s, after w1's shutdown began at 60 s.
    let report = Plant::clean()
        .on_a_cluster()
        .call(section(1, 9000, 6000, 59_990, 60_080, Outcome::Lost))
        .analyse();
    assert!(report.is_clean(), "{report}");
    assert_eq!(report.summary.losses_by_fault.get("shutdown"), Some(&1));
}

#[test]
fn l4_a_loss_only_a_short_master_stop_or_cut_connections_touched_is_reported_on_a_cluster() {
    // 420 (4200..4280) while its master was stopped short of a failover;
    // 1100 (11000..11080, w0, stopped from 10 s to 12.5 s) while every
    // connection was cut: the worker stop excuses it; 2000 (20000..20080)
    // after the connections were cut at 19.9 s is reported.
    let report = Plant::clean()
        .failover(FaultKind::MasterStopShort, &[KEY], 4_000, 5_000)
        .fault(FaultKind::ClientKill, "every node", 11_000, 11_010)
        .fault(FaultKind::ClientKill, "every node", 19_900, 19_910)
        // Held by 3000 (30000..30080, Ok) from before to after: kept.
        .fault(FaultKind::ClientKill, "every node", 30_010, 30_020)
        .lost(42)
        .lost(110)
        .lost(200)
        .on_a_cluster()
        .analyse();
    assert_only(&report, Check::UnfaultedLoss, 2);
    let kept: Vec<usize> = report
        .summary
        .faults
        .iter()
        .filter(|f| f.kind == FaultKind::ClientKill)
        .map(|f| f.held_through)
        .collect();
    assert_eq!(kept, [0, 0, 1]);
    let by = &report.summary.losses_by_fault;
    assert_eq!(
        (
            by.get("master_stop_short"),
            by.get("client_kill"),
            by.get("worker_stop")
        ),
        (Some(&1), Some(&1), Some(&1))
    );
    assert!(
        report.violations[0].message.contains("master_stop_short"),
        "{report}"
    );
}

const TAKEN: &str = "another owner took the key, or it was deleted or freed while held";

#[test]
fn o6_a_finished_callback_answered_lost_because_its_release_failed_is_reported() {
    let report = Plant::clean()
        .failed_release(42, &[ReleaseAnswer::Error], Outcome::Lost)
        // A retry finding the key gone after a try that may have freed it
        // proves nothing either.
        .failed_release(
            43,
            &[ReleaseAnswer::Error, ReleaseAnswer::NotHeld],
            Outcome::Lost,
        )
        .cause(43, TAKEN)
        .analyse();
    assert_only(&report, Check::LostAfterRelease, 2);
    assert_eq!(report.summary.release_errors_after_settle, 2);
    assert!(
        report.violations[0].message.contains("w0/t0/s42"),
        "{report}"
    );
}

#[test]
fn o6_a_failed_release_that_gave_the_output_or_found_the_key_taken_is_allowed() {
    let report = Plant::clean()
        // The amended O6: the output stands.
        .failed_release(42, &[ReleaseAnswer::Error], Outcome::Ok)
        // A try that never reached the store, then "not held": taken.
        .failed_release(
            43,
            &[ReleaseAnswer::ErrorNotSent, ReleaseAnswer::NotHeld],
            Outcome::Lost,
        )
        .cause(43, TAKEN)
        // Lost before the release was sent (expired at settle, or extensions
        // failed), whatever the release then did.
        .failed_release(44, &[ReleaseAnswer::Error], Outcome::Lost)
        .with_section(44, |s| s.release.as_mut().unwrap().lost_before = true)
        // Released by the worker's own shutdown.
        .failed_release(45, &[ReleaseAnswer::Error], Outcome::Lost)
        .cause(45, "the locker shut down and released the lock")
        // Found taken by an extension in flight when the callback settled.
        .failed_release(46, &[ReleaseAnswer::Error], Outcome::Lost)
        .cause(46, TAKEN)
        .analyse();
    assert!(report.is_clean(), "{report}");
    // All but 44: the lock was not lost when their release failed.
    assert_eq!(report.summary.release_errors_after_settle, 4);
}

#[test]
fn the_loss_causes_read_as_the_driver_writes_them() {
    use lock_core::{BackendError, LossCause};
    let backend = LossCause::Backend(BackendError::setup(std::io::Error::other("down")));
    assert!(backend.to_string().starts_with(BACKEND_LOSS), "{backend}");
    assert!(LossCause::Taken.to_string().starts_with(TAKEN_LOSS));
    assert_eq!(LossCause::Taken.to_string(), TAKEN);
}

mod order;

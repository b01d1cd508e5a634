//! The order check of the fair queue on planted reads of the store's
//! queue: sections 51 (worker 1, token 510, from 5.1 s) and 52 (worker 0,
//! token 520, from 5.2 s) of the clean log, queued as `o51` and `o52`.

use super::*;
use crate::event::{QueueSnapshot, QueuedPlace};

/// A place of owner token `owner`, its attempts sent from 4.9 s to 5 s.
fn place(owner: &str) -> QueuedPlace {
    QueuedPlace {
        owner: owner.into(),
        first_sent: 4_900 * MS,
        last_sent: 5_000 * MS,
        ..QueuedPlace::default()
    }
}

impl Plant {
    /// Section `seq` queued as `o<seq>`.
    fn queued(self, seq: u64) -> Self {
        self.with_section(seq, |s| s.queued = vec![place(&format!("o{seq}"))])
    }

    /// Section `seq` gave its place `o<seq>` up as `change` says, and
    /// queued again as `o<seq>-again`, before it acquired.
    fn queued_again(self, seq: u64, change: impl FnOnce(&mut QueuedPlace)) -> Self {
        self.with_section(seq, |s| {
            let mut first = place(&format!("o{seq}"));
            change(&mut first);
            s.queued = vec![first, place(&format!("o{seq}-again"))];
        })
    }

    /// Reads of the queue from `from_ms` to `to_ms` found `owners`, head
    /// first.
    fn read(mut self, from_ms: u64, to_ms: u64, owners: &[&str]) -> Self {
        self.events.push(Event::Queue(QueueSnapshot {
            key: KEY.into(),
            t_first: from_ms * MS,
            t_last: to_ms * MS,
            reads: 3,
            owners: owners.iter().map(|o| (*o).to_owned()).collect(),
        }));
        self
    }

    /// 51 and 52 queued, called at 4.9 s.
    fn two_waiters(self) -> Self {
        self.queued(51)
            .queued(52)
            .with_section(51, |s| s.t_call = 4_900 * MS)
            .with_section(52, |s| s.t_call = 4_900 * MS)
    }
}

fn order(report: &Report) -> &QueueOrderSummary {
    report
        .summary
        .queue_order
        .as_ref()
        .expect("the queue was read")
}

#[test]
fn f1_waiters_acquiring_in_the_queues_order_pass() {
    let report = Plant::clean()
        .two_waiters()
        .read(5_000, 5_050, &["o51", "o52"])
        .analyse();
    assert!(report.is_clean(), "{report}");
    let o = order(&report);
    assert_eq!((o.pairs, o.checked(), o.in_order, o.reads), (1, 1, 1, 3));
    assert!(
        report.to_string().contains("1 checked: 1 in order"),
        "{report}"
    );
}

#[test]
fn f1_a_waiter_behind_that_acquires_first_is_out_of_order() {
    // o52 was ahead; o51 acquired first (token 510 < 520).
    let report = Plant::clean()
        .two_waiters()
        .read(5_000, 5_050, &["o52", "o51"])
        .analyse();
    assert_only(&report, Check::QueueOrder, 1);
    assert_eq!(order(&report).out_of_order, 1);
    let v = &report.violations[0];
    assert!(
        v.message.contains("w0/t0/s52") && v.message.contains("it acquired first"),
        "{report}"
    );
    // Both sections and the read.
    assert_eq!(v.lines.len(), 3, "{report}");
}

#[test]
fn f1_a_waiter_behind_that_acquires_while_the_one_ahead_still_waits_is_out_of_order() {
    // o52 never acquired: its call gave up at 5.28 s, after o51 took the
    // lock at 5.1 s.
    let report = Plant::clean()
        .two_waiters()
        .with_section(52, |s| {
            s.outcome = Outcome::NotAcquired;
            s.held = None;
        })
        .read(5_000, 5_050, &["o52", "o51"])
        .analyse();
    assert_only(&report, Check::QueueOrder, 1);
    assert!(
        report.violations[0]
            .message
            .contains("left without the lock"),
        "{report}"
    );
}

#[test]
fn f1_a_waiter_ahead_that_left_first_decides_nothing() {
    // o52 gave up at 5.06 s, before o51 acquired.
    let report = Plant::clean()
        .two_waiters()
        .with_section(52, |s| {
            s.outcome = Outcome::NotAcquired;
            s.held = None;
            s.t_return = 5_060 * MS;
        })
        .read(5_000, 5_050, &["o52", "o51"])
        .analyse();
    assert!(report.is_clean(), "{report}");
    let o = order(&report);
    assert_eq!((o.checked(), o.undecided), (0, 1));
}

#[test]
fn f1_the_queue_changing_its_order_by_itself_is_out_of_order() {
    // Reads found o52 ahead, then o51 ahead with nothing in between; o51
    // then acquired first, as the later read said.
    let report = Plant::clean()
        .two_waiters()
        .read(4_950, 5_000, &["o52", "o51"])
        .read(5_020, 5_050, &["o51", "o52"])
        .analyse();
    assert_only(&report, Check::QueueOrder, 1);
    assert!(
        report.violations[0].message.contains("a read at +5.020s"),
        "{report}"
    );
}

#[test]
fn f2_the_waiter_ahead_stopped_excuses_the_change() {
    // Worker 0 (o102's, ahead) is stopped from 10 s to 12.5 s; o101
    // (worker 1) acquires first at 10.1 s.
    let report = Plant::clean()
        .queued(101)
        .queued(102)
        .read(9_900, 9_950, &["o102", "o101"])
        .analyse();
    assert!(report.is_clean(), "{report}");
    let o = order(&report);
    assert_eq!((o.checked(), o.excused), (1, 1));
    assert_eq!(
        o.excuses.get("worker_stop of the waiter ahead"),
        Some(&1),
        "{o:?}"
    );
}

#[test]
fn f2_another_workers_stop_excuses_nothing() {
    // o103 (worker 1, ahead) is not the stopped worker 0; o102 acquires
    // first.
    let report = Plant::clean()
        .queued(102)
        .queued(103)
        .read(9_900, 9_950, &["o103", "o102"])
        .analyse();
    assert_only(&report, Check::QueueOrder, 1);
}

#[test]
fn f1_a_store_that_lost_its_queue_excuses_the_change_and_cut_connections_do_not() {
    let inverted = || {
        Plant::clean()
            .two_waiters()
            .read(5_000, 5_050, &["o52", "o51"])
    };
    let report = inverted()
        .fault(FaultKind::ServerKill, "server", 5_060, 5_080)
        .analyse();
    assert!(report.is_clean(), "{report}");
    assert_eq!(
        order(&report).excuses.get("server_kill lost the queue"),
        Some(&1)
    );
    let report = inverted()
        .fault(FaultKind::ClientKillPubsub, "server", 5_060, 5_080)
        .analyse();
    assert_only(&report, Check::QueueOrder, 1);
    // Long over by the read: a ticket ttl after its heal.
    let report = inverted()
        .fault(FaultKind::ServerKill, "server", 1_000, 1_020)
        .analyse();
    assert_only(&report, Check::QueueOrder, 1);
}

#[test]
fn f1_a_pair_decided_before_any_read_saw_it_is_not_counted() {
    // As etcd's line shows the holder first: o51 acquired at 5.1 s.
    let report = Plant::clean()
        .two_waiters()
        .read(5_150, 5_170, &["o51", "o52"])
        .analyse();
    assert!(report.is_clean(), "{report}");
    let o = order(&report);
    assert_eq!(
        (o.pairs, o.checked(), o.undecided, o.acquired_before_read),
        (1, 0, 0, 1)
    );
}

#[test]
fn without_reads_of_the_queue_there_is_no_order_figure() {
    let report = Plant::clean().two_waiters().analyse();
    assert!(report.summary.queue_order.is_none());
    assert!(
        report.to_string().contains("no read saw two waiters"),
        "{report}"
    );
}

#[test]
fn f2_a_place_given_up_after_a_failed_attempt_excuses_the_change() {
    // o52's attempt failed at 5.02 s (its answer lost): its call left the
    // place and queued again at the tail, so o51 goes first.
    let report = Plant::clean()
        .two_waiters()
        .queued_again(52, |p| p.failed_at = vec![5_020 * MS])
        .read(5_000, 5_050, &["o52", "o51"])
        .analyse();
    assert!(report.is_clean(), "{report}");
    assert_eq!(
        order(&report)
            .excuses
            .get("the waiter ahead left after a failed attempt"),
        Some(&1)
    );
}

#[test]
fn f3_a_grant_given_up_with_no_cause_is_out_of_order() {
    // o52 (last attempt at 5 s) was released by its own node at 5.06 s, a
    // grant given up long before it could have run out, and queued again,
    // with no failed attempt, no late answer and no fault: not excused.
    let report = Plant::clean()
        .two_waiters()
        .queued_again(52, |p| p.released_at = Some(5_060 * MS))
        .read(5_000, 5_050, &["o52", "o51"])
        .analyse();
    assert_only(&report, Check::QueueOrder, 1);
    assert!(
        report.violations[0]
            .message
            .contains("gave this place up and queued again under a new token, its node having released under this one at +5.060s"),
        "{report}"
    );
    // An attempt answered that it acquired, too late to use [H6]: excused.
    let report = Plant::clean()
        .two_waiters()
        .queued_again(52, |p| p.acquired_at = Some(5_060 * MS))
        .read(5_000, 5_050, &["o52", "o51"])
        .analyse();
    assert!(report.is_clean(), "{report}");
}

#[test]
fn f3_a_grant_dropped_within_its_claim_deadline_is_out_of_order() {
    // o52's only attempt was at 4.1 s; its node released a grant to it at
    // 5.095 s, within the claim deadline (2 s) after that attempt, and o51
    // acquired at 5.1 s: the grant was still the waiter's in the store, so
    // dropping it put o51 ahead: a violation, whether or not the ttl had
    // passed since the attempt.
    let dropped_at = |ms: u64| {
        Plant::clean()
            .two_waiters()
            .queued_again(52, |p| {
                p.first_sent = 4_100 * MS;
                p.last_sent = 4_100 * MS;
                p.released_at = Some(ms * MS);
            })
            .read(4_900, 5_050, &["o52", "o51"])
            .analyse()
    };
    assert_only(&dropped_at(5_095), Check::QueueOrder, 1);
    assert_only(&dropped_at(5_050), Check::QueueOrder, 1);
}

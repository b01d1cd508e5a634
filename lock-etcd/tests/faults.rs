//! Exclusion and fencing on a real 3-member etcd cluster while members
//! are killed, restarted and stopped (`--election-timeout 100`): fencing
//! tokens increase in the order the sections start, no two sections
//! overlap unless the older one was reported lost, and locking goes on
//! after each fault.

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::EtcdClusterExt;
use lock_etcd::{EtcdBackend, EtcdConfig, LockConfig, LockError, Locker, LockerOptions};
use tokio::time::Instant;
use withlock_test_servers::etcd::EtcdCluster;

#[derive(Clone, Copy, Debug)]
struct Section {
    token: u64,
    /// When its call began waiting for the name.
    asked: Instant,
    start: Instant,
    end: Instant,
    lost: bool,
}

/// Four workers on two nodes (a backend each, on `config`) take `key`
/// over and over for `run_for`, while `fault` runs; gives every section.
async fn workload<F>(config: EtcdConfig, key: &str, run_for: Duration, fault: F) -> Vec<Section>
where
    F: std::future::Future<Output = ()>,
{
    let sections = Arc::new(Mutex::new(Vec::new()));
    let deadline = Instant::now() + run_for;
    let mut workers = Vec::new();
    for n in 0..2 {
        let backend = EtcdBackend::connect(config.clone()).await.unwrap();
        let locker =
            Locker::with_options(backend, LockerOptions::default().node_id(format!("n{n}")))
                .unwrap();
        for w in 0..2u64 {
            let (locker, key, sections) = (locker.clone(), key.to_owned(), Arc::clone(&sections));
            workers.push(tokio::spawn(async move {
                let cfg = LockConfig::default()
                    .ttl(Duration::from_secs(1))
                    .wait_forever()
                    .retry_delay(Duration::from_millis(50));
                let mut j = 0u64;
                while Instant::now() < deadline {
                    j += 1;
                    let hold = Duration::from_millis(20 + 15 * ((j + w) % 4));
                    let seen = Arc::new(Mutex::new(None));
                    let s = Arc::clone(&seen);
                    let asked = Instant::now();
                    let got = locker
                        .with_lock_config(&key, &cfg, move |ctx| async move {
                            let start = Instant::now();
                            tokio::time::sleep(hold).await;
                            *s.lock().unwrap() = Some((ctx.fencing_token(), start, Instant::now()));
                        })
                        .await;
                    let lost = match &got {
                        Ok(()) => false,
                        Err(LockError::Lost { .. }) => true,
                        Err(other) => panic!("only losses are expected, got {other:?}"),
                    };
                    // A lost call may return before its callback ends:
                    // its section is then counted as lost, open-ended.
                    let record = *seen.lock().unwrap();
                    if let Some((token, start, end)) = record {
                        sections.lock().unwrap().push(Section {
                            token,
                            asked,
                            start,
                            end,
                            lost,
                        });
                    }
                }
            }));
        }
    }
    fault.await;
    for worker in workers {
        tokio::time::timeout(run_for + Duration::from_secs(30), worker)
            .await
            .expect("a worker hung")
            .unwrap();
    }
    let mut all = sections.lock().unwrap().clone();
    all.sort_by_key(|s| s.start);
    all
}

/// Tokens increase in start order, and an overlap follows a loss report.
fn check(sections: &[Section]) {
    assert!(sections.len() >= 10, "too little progress: {sections:?}");
    for pair in sections.windows(2) {
        assert!(
            pair[1].token > pair[0].token,
            "token {} started after token {} [H4]",
            pair[1].token,
            pair[0].token
        );
    }
    let mut by_token = sections.to_vec();
    by_token.sort_by_key(|s| s.token);
    for (i, older) in by_token.iter().enumerate() {
        for newer in &by_token[i + 1..] {
            if newer.start < older.end {
                assert!(
                    older.lost,
                    "sections {} and {} overlap and the older was not told it lost its lock",
                    older.token, newer.token
                );
            }
        }
    }
}

/// Sections that started after `at`: locking goes on.
fn after(sections: &[Section], at: Instant) -> usize {
    sections.iter().filter(|s| s.start > at).count()
}

const ELECTION: Duration = Duration::from_secs(10);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn faults_leader_sigkill_and_restart() {
    let cluster = EtcdCluster::start(3).await.unwrap();
    let key = lock_conformance::Namespace::new().key("leader-kill");
    let healed = Arc::new(Mutex::new(None));
    let h = Arc::clone(&healed);
    let fault = async {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let leader = cluster.wait_for_leader(ELECTION).await.unwrap();
        cluster.kill(leader);
        let next = cluster.wait_for_leader(ELECTION).await.unwrap();
        assert_ne!(next, leader);
        tokio::time::sleep(Duration::from_secs(1)).await;
        cluster.restart(leader).unwrap();
        cluster.wait_for_leader(ELECTION).await.unwrap();
        *h.lock().unwrap() = Some(Instant::now());
    };
    let sections = workload(cluster.config(), &key, Duration::from_secs(5), fault).await;
    check(&sections);
    let healed = healed.lock().unwrap().unwrap();
    assert!(
        after(&sections, healed) >= 1,
        "no section after the restart"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn faults_leader_sigstop_past_the_election_timeout() {
    let cluster = EtcdCluster::start(3).await.unwrap();
    let key = lock_conformance::Namespace::new().key("leader-stop");
    let healed = Arc::new(Mutex::new(None));
    let h = Arc::clone(&healed);
    let fault = async {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let leader = cluster.wait_for_leader(ELECTION).await.unwrap();
        cluster.pause(leader).unwrap();
        // The others elect a new leader (the timeout is 100 ms) while the
        // old one is stopped, and it stays stopped well past that.
        let next = cluster.wait_for_leader(ELECTION).await.unwrap();
        assert_ne!(next, leader);
        tokio::time::sleep(Duration::from_millis(1500)).await;
        cluster.resume(leader).unwrap();
        cluster.wait_for_leader(ELECTION).await.unwrap();
        *h.lock().unwrap() = Some(Instant::now());
    };
    let sections = workload(cluster.config(), &key, Duration::from_secs(5), fault).await;
    check(&sections);
    let healed = healed.lock().unwrap().unwrap();
    assert!(after(&sections, healed) >= 1, "no section after the resume");
}

/// A follower stopped (SIGSTOP: its connections stay open, it answers
/// nothing) while it is the endpoint both backends use: they fail over to
/// the next member within the failover timeout, and locking goes on at
/// its pace: no holder loses its lock (the keep-alives move with the
/// endpoint), every waiter gets the name within a bound, sections keep
/// coming while the member is stopped, and tokens increase.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn faults_minority_member_stopped_locking_goes_on() {
    let cluster = EtcdCluster::start(3).await.unwrap();
    let key = lock_conformance::Namespace::new().key("minority");
    let leader = cluster.wait_for_leader(ELECTION).await.unwrap();
    let follower = (leader + 1) % cluster.len();
    let window = Arc::new(Mutex::new(None));
    let w = Arc::clone(&window);
    let probe = EtcdBackend::connect(cluster.config_from(follower))
        .await
        .unwrap();
    assert_eq!(probe.endpoint(), cluster.endpoint(follower));
    let fault = async {
        tokio::time::sleep(Duration::from_millis(500)).await;
        cluster.pause(follower).unwrap();
        let stopped_at = Instant::now();
        // A backend of its own takes a lock at once on the next member.
        let cfg = LockConfig::default().ttl(Duration::from_secs(1));
        let probe_key = lock_conformance::Namespace::new().key("probe");
        tokio::time::timeout(
            Duration::from_secs(3),
            Locker::new(probe.clone()).with_lock_config(&probe_key, &cfg, |_| async {}),
        )
        .await
        .expect("a backend on the stopped member fails over")
        .unwrap();
        assert_ne!(probe.endpoint(), cluster.endpoint(follower));
        tokio::time::sleep(Duration::from_secs(4)).await;
        *w.lock().unwrap() = Some((stopped_at, Instant::now()));
        cluster.resume(follower).unwrap();
    };
    // The stopped follower is the first endpoint: the one in use.
    let config = cluster.config_from(follower);
    let sections = workload(config, &key, Duration::from_secs(6), fault).await;
    check(&sections);
    let (from, to) = window.lock().unwrap().unwrap();
    let lost: Vec<_> = sections.iter().filter(|s| s.lost).collect();
    assert!(
        lost.is_empty(),
        "a stopped minority member must not cost a holder its lock: {lost:?}"
    );
    // Failing over takes one failover timeout (300 ms) and a step or two
    // on the new member; the rest is the time the others held the name.
    let longest = sections.iter().map(|s| s.start - s.asked).max().unwrap();
    assert!(
        longest < Duration::from_secs(3),
        "a waiter waited {longest:?} for the name"
    );
    let mut gaps = sections
        .windows(2)
        .map(|p| p[1].start.saturating_duration_since(p[0].end));
    let widest = gaps.clone().fold(Duration::ZERO, Duration::max);
    assert!(
        gaps.all(|g| g < Duration::from_secs(2)),
        "the name stayed free for {widest:?} between two sections"
    );
    let during = sections
        .iter()
        .filter(|s| s.start > from && s.start < to)
        .count();
    assert!(
        during >= 10,
        "locking must go on while a minority member is stopped: {during} sections in 4 s"
    );
}

/// A holder cut off past its ttl loses its lease; a waiter on another
/// node gets the name with a higher token, and the holder is told it lost
/// the lock \[O6, H2\]. The holder's backend knows one member only, a
/// follower, which is stopped (SIGSTOP): its keep-alives reach nobody, as
/// a stopped holder's would not be sent. (Blocking the holder's runtime
/// no longer stops it: its keep-alives and extensions run on the
/// background runtime \[T1\].)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn faults_holder_stopped_past_its_ttl_is_told_and_replaced() {
    let cluster = EtcdCluster::start(3).await.unwrap();
    let leader = cluster
        .wait_for_leader(Duration::from_secs(20))
        .await
        .unwrap();
    let cut = (leader + 1) % cluster.len();
    let only = |member: usize| {
        EtcdConfig::new([cluster.endpoint(member)])
            .step_timeout(Duration::from_secs(1))
            .failover_timeout(Duration::from_millis(300))
            .connect_timeout(Duration::from_secs(5))
    };
    let others = EtcdConfig::new(
        (0..cluster.len())
            .filter(|&i| i != cut)
            .map(|i| cluster.endpoint(i)),
    )
    .step_timeout(Duration::from_secs(1))
    .failover_timeout(Duration::from_millis(300))
    .connect_timeout(Duration::from_secs(5));
    let key = lock_conformance::Namespace::new().key("holder-stop");

    let holder = Locker::with_options(
        EtcdBackend::connect(only(cut)).await.unwrap(),
        LockerOptions::default().node_id("stopped"),
    )
    .unwrap();
    let (held_tx, held_rx) = tokio::sync::oneshot::channel();
    let (taken_tx, taken_rx) = tokio::sync::oneshot::channel::<()>();
    let k = key.clone();
    let holding = tokio::spawn(async move {
        let cfg = LockConfig::default().ttl(Duration::from_secs(1));
        holder
            .with_lock_config(&k, &cfg, move |ctx| async move {
                let _ = held_tx.send(ctx.fencing_token());
                // Runs on until the name was taken over.
                let _ = taken_rx.await;
            })
            .await
    });
    let stopped_token = tokio::time::timeout(Duration::from_secs(10), held_rx)
        .await
        .unwrap()
        .unwrap();
    cluster.pause(cut).unwrap();
    let waiter = Locker::new(EtcdBackend::connect(others).await.unwrap());
    let cfg = LockConfig::default()
        .wait_forever()
        .retry_delay(Duration::from_millis(100));
    let token = tokio::time::timeout(
        Duration::from_secs(10),
        waiter.with_lock_config(&key, &cfg, |ctx| async move { ctx.fencing_token() }),
    )
    .await
    .expect("the waiter gets the name after the cut-off holder's lease ran out")
    .unwrap();
    assert!(token > stopped_token, "{token} after {stopped_token}");
    let _ = taken_tx.send(());
    cluster.resume(cut).unwrap();
    let got = tokio::time::timeout(Duration::from_secs(10), holding)
        .await
        .expect("the holder's call ends")
        .unwrap();
    assert!(
        matches!(got, Err(LockError::Lost { .. })),
        "the cut-off holder is told: {got:?}"
    );
}

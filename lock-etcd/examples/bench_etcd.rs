//! P8 on etcd, against the same etcd operations sent by hand in the same
//! run.
//!
//! - Uncontended cycle: one `with_lock` on a free name, in 25 short
//!   rounds (100 cycles of each kind, in an order that alternates from
//!   round to round; the ratio printed is the median of the rounds' own
//!   ratios, so that the machine's drift over seconds cancels out),
//!   against the backend's own operations by hand on the backend's own
//!   client: grant a lease; one transaction putting the contender key on
//!   it and reading the name's contenders (the lowest create revision
//!   holds); one transaction deleting the key if it still holds the owner
//!   token on its lease (and recording the fencing token); revoke the
//!   lease. Target ≤ 1.10x.
//! - 64 tasks on 64 distinct names, cycles/s of the same two, interleaved
//!   rounds. Target ≥ 0.85x.
//! - Handoff with queued waiters: a holder and four waiters on five nodes
//!   (a backend each, release notifications on, `retry_delay` 200 ms);
//!   from one callback returning to the next waiter's callback running,
//!   over every handoff while waiters are queued. Target p50 ≤ 2 ms.
//!
//! Against `ETCD_ENDPOINT` (an `http://host:2379` URL), or else a
//! single-member etcd of its own started by `withlock-test-servers` (Debian's
//! `etcd` on `PATH`, data on `/dev/shm`). Names are in a random namespace;
//! every lock is released, so nothing is left but the fencing records.
//! Run it in release mode; name parts to run only those:
//!
//! ```text
//! cargo run --release -p lock-etcd --example bench_etcd [cycle] [tasks] [handoff]
//! ```

use std::error::Error;
use std::time::{Duration, Instant};

use bench_support::{median, percentile, rotating_rounds, round_ratios, Spread};
use lock_etcd::etcd_client::{
    Client, Compare, CompareOp, GetOptions, PutOptions, SortOrder, SortTarget, Txn, TxnOp,
    TxnOpResponse,
};
use lock_etcd::{EtcdBackend, EtcdConfig, LockConfig, Locker, LockerOptions};
use withlock_test_servers::etcd::EtcdCluster;

#[path = "../../bench-support/bench_support.rs"]
mod bench_support;

type BoxError = Box<dyn Error + Send + Sync>;

fn node(backend: EtcdBackend, name: &str) -> Locker {
    Locker::with_options(backend, LockerOptions::default().node_id(name)).expect("node id")
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Raw,
    WithLock,
}

impl Kind {
    const ALL: [Self; 2] = [Self::Raw, Self::WithLock];

    fn name(self) -> &'static str {
        match self {
            Self::Raw => "by hand: grant, put+read txn, delete txn, revoke",
            Self::WithLock => "with_lock",
        }
    }
}

/// What the cycles run against, shared by every task.
#[derive(Clone)]
struct Clients {
    client: Client,
    locker: Locker,
    ttl_secs: i64,
}

impl Clients {
    fn new(backend: &EtcdBackend, name: &str) -> Self {
        Self {
            client: backend.client(),
            locker: node(backend.clone(), name),
            ttl_secs: i64::try_from(backend.effective_ttl(LockConfig::default().ttl).as_secs())
                .unwrap_or(30),
        }
    }

    /// One uncontended cycle of `kind` on `name`; `owner` is the hand-made
    /// cycle's owner token.
    async fn cycle(&self, kind: Kind, name: &str, owner: &str) -> Result<(), BoxError> {
        match kind {
            Kind::Raw => self.by_hand(name, owner).await,
            Kind::WithLock => Ok(self.locker.with_lock(name, |_| async {}).await?),
        }
    }

    /// The backend's acquisition and release, by hand.
    async fn by_hand(&self, name: &str, owner: &str) -> Result<(), BoxError> {
        let mut client = self.client.clone();
        let lease = client.lease_grant(self.ttl_secs, None).await?.id();
        let key = format!("{name}/{lease:x}");
        let contenders = GetOptions::new()
            .with_range(format!("{name}/g"))
            .with_keys_only()
            .with_sort(SortTarget::Create, SortOrder::Ascend);
        let answer = client
            .txn(Txn::new().and_then(vec![
                TxnOp::put(
                    key.clone(),
                    owner,
                    Some(PutOptions::new().with_lease(lease)),
                ),
                TxnOp::get(format!("{name}/0"), Some(contenders)),
            ]))
            .await?;
        let token = match answer.op_responses().get(1) {
            Some(TxnOpResponse::Get(read)) => read.kvs().first().map(|kv| kv.create_revision()),
            _ => None,
        }
        .ok_or("the read found no contender")?;
        assert_eq!(
            Some(token),
            answer.header().map(|h| h.revision()),
            "by hand: name busy"
        );
        let released = client
            .txn(
                Txn::new()
                    .when(vec![
                        Compare::value(key.clone(), CompareOp::Equal, owner),
                        Compare::lease(key.clone(), CompareOp::Equal, lease),
                    ])
                    .and_then(vec![
                        TxnOp::delete(key, None),
                        TxnOp::put(
                            format!("\0withlock/fencing/{name}"),
                            token.to_string(),
                            None,
                        ),
                    ]),
            )
            .await?;
        assert!(released.succeeded(), "by hand: not held at release");
        client.lease_revoke(lease).await?;
        Ok(())
    }
}

/// A random namespace for this run's names.
fn namespace() -> String {
    format!("bench-etcd-{:08x}", rand::random::<u32>())
}

async fn cycle(clients: &Clients, ns: &str) -> Result<(), BoxError> {
    const N: u32 = 100;
    const ROUNDS: usize = 25;
    let name = format!("{ns}/cycle");
    let owner = "p8/00000000000000000000000000000000";
    for _ in 0..50 {
        for kind in Kind::ALL {
            clients.cycle(kind, &name, owner).await?;
        }
    }
    let name = &name;
    let samples = rotating_rounds(Kind::ALL.len(), ROUNDS, |i| async move {
        let started = Instant::now();
        for _ in 0..N {
            clients.cycle(Kind::ALL[i], name, owner).await?;
        }
        Ok::<_, BoxError>(started.elapsed() / N)
    })
    .await?;
    let ratios = round_ratios(&samples[1], &samples[0]);
    println!(
        "P8 uncontended cycle, {ROUNDS} rounds of {N} cycles per kind, order alternating; \
         medians (target with_lock <= 1.10x by hand):"
    );
    for (kind, s) in Kind::ALL.into_iter().zip(&samples) {
        println!("  {:<50} {:>10.1?}", kind.name(), median(s.clone()));
    }
    Spread::of(&ratios).print("with_lock / by hand");
    Ok(())
}

async fn tasks(clients: &Clients, ns: &str) -> Result<(), BoxError> {
    const TASKS: usize = 64;
    const CYCLES: u32 = 30;
    const ROUNDS: usize = 5;
    let run = |kind: Kind| async move {
        let mut running = Vec::new();
        for i in 0..TASKS {
            let (clients, name) = (clients.clone(), format!("{ns}/tasks-{i}"));
            running.push(tokio::spawn(async move {
                let owner = format!("p8/{i:032x}");
                for _ in 0..CYCLES {
                    clients.cycle(kind, &name, &owner).await?;
                }
                Ok::<_, BoxError>(())
            }));
        }
        for task in running {
            task.await??;
        }
        Ok::<_, BoxError>(())
    };
    for kind in Kind::ALL {
        run(kind).await?;
    }
    let cycles = f64::from(CYCLES) * TASKS as f64;
    let run = &run;
    let samples = rotating_rounds(Kind::ALL.len(), ROUNDS, |i| async move {
        let started = Instant::now();
        run(Kind::ALL[i]).await?;
        Ok::<_, BoxError>(cycles / started.elapsed().as_secs_f64())
    })
    .await?;
    let ratios = round_ratios(&samples[1], &samples[0]);
    println!(
        "P8 {TASKS} tasks on distinct names, {ROUNDS} rounds, order alternating; medians \
         (target with_lock >= 0.85x by hand):"
    );
    for (kind, s) in Kind::ALL.into_iter().zip(&samples) {
        println!("  {:<50} {:>7.0} cycles/s", kind.name(), median(s.clone()));
    }
    Spread::of(&ratios).print("with_lock / by hand");
    Ok(())
}

/// Handoffs between callbacks while waiters are queued: a holder and
/// `WAITERS` waiters, each on a node (and backend) of its own.
async fn handoff(config: &EtcdConfig, ns: &str) -> Result<(), BoxError> {
    const WAITERS: usize = 4;
    const ROUNDS: usize = 40;
    let mut nodes = Vec::new();
    for i in 0..=WAITERS {
        nodes.push(node(
            EtcdBackend::connect(config.clone()).await?,
            &format!("n{i}"),
        ));
    }
    let name = format!("{ns}/handoff");
    let cfg = LockConfig::default()
        .wait_forever()
        .retry_delay(Duration::from_millis(200));
    let mut latencies = Vec::new();
    for _ in 0..ROUNDS {
        let (go, wait_go) = tokio::sync::oneshot::channel::<()>();
        let (held_tx, held_rx) = tokio::sync::oneshot::channel::<()>();
        let (holder, n) = (nodes[0].clone(), name.clone());
        let holding = tokio::spawn(async move {
            holder
                .with_lock(&n, move |_| async move {
                    let _ = held_tx.send(());
                    let _ = wait_go.await;
                    Instant::now()
                })
                .await
        });
        held_rx.await?;
        let mut waiting = Vec::new();
        for waiter in &nodes[1..] {
            let (w, n) = (waiter.clone(), name.clone());
            waiting.push(tokio::spawn(async move {
                w.with_lock_config(&n, &cfg, |_| async {
                    let ran = Instant::now();
                    // Held a moment, so the next waiter is queued behind.
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    (ran, Instant::now())
                })
                .await
            }));
        }
        // Every waiter has found the name busy and waits on its watch.
        tokio::time::sleep(Duration::from_millis(100)).await;
        let _ = go.send(());
        let released = holding.await??;
        let mut spans = Vec::new();
        for w in waiting {
            spans.push(w.await??);
        }
        spans.sort();
        let mut previous_end = released;
        for (ran, ended) in spans {
            latencies.push(ran.saturating_duration_since(previous_end));
            previous_end = ended;
        }
    }
    latencies.sort();
    println!(
        "P8 handoff with {WAITERS} queued waiters on nodes of their own, retry_delay 200 ms, \
         notifications on: p50 {:?}, p90 {:?}, p99 {:?}, max {:?} ({} handoffs; target p50 <= 2 ms)",
        percentile(&latencies, 0.50),
        percentile(&latencies, 0.90),
        percentile(&latencies, 0.99),
        latencies[latencies.len() - 1],
        latencies.len(),
    );
    Ok(())
}

fn main() -> Result<(), BoxError> {
    let parts: Vec<String> = std::env::args().skip(1).collect();
    if let Some(bad) = parts
        .iter()
        .find(|p| !["cycle", "tasks", "handoff"].contains(&p.as_str()))
    {
        return Err(format!(
            "unknown argument {bad:?}; usage: bench_etcd [cycle] [tasks] [handoff]"
        )
        .into());
    }
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?
        .block_on(run(&parts))
}

async fn run(parts: &[String]) -> Result<(), BoxError> {
    let wanted = |part: &str| parts.is_empty() || parts.iter().any(|p| p == part);
    // The server of its own, if any, lives until the end.
    let (config, _own) = match std::env::var("ETCD_ENDPOINT") {
        Ok(endpoint) => (EtcdConfig::new([endpoint]), None),
        Err(_) => {
            let own = EtcdCluster::start(1).await?;
            (EtcdConfig::new(own.endpoints()), Some(own))
        }
    };
    let backend = EtcdBackend::connect(config.clone()).await?;
    println!("lock-etcd benchmark against {backend:?}");
    let ns = namespace();
    let started = Instant::now();
    if wanted("cycle") {
        cycle(&Clients::new(&backend, "cycle"), &ns).await?;
    }
    if wanted("tasks") {
        tasks(&Clients::new(&backend, "tasks"), &ns).await?;
    }
    if wanted("handoff") {
        handoff(&config, &ns).await?;
    }
    println!("total {:.1?}", started.elapsed());
    Ok(())
}

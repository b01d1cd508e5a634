//! Ruby Locker's "common pattern" as a test (SPEC F1): its README tells
//! users to sleep a random second after each run so that other servers get
//! a turn. With the fair queue no sleep is needed: three lockers (three
//! nodes, each its own backend) loop `with_lock` on one key with a 50 ms
//! section and no pause, for 60 s (`COMMON_PATTERN_SECONDS`), and
//!
//! - each gets a third of the acquisitions, within 3 points;
//! - nobody holds the key twice in a row while another node waits: a node
//!   that asked before the holder's section ended (by more than a
//!   margin for the request in flight) is served before the holder again.
//!
//! On every backend with the queue: memory (on tokio's paused clock),
//! Redis (the shared server), PostgreSQL (the shared server, a schema of
//! the test's own) and etcd (a member of the test binary's own), the three
//! stores at once in one test, so the minute is paid once.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::time::Instant;
use withlock::{LockBackend, LockConfig, Locker, LockerOptions};

/// The section each holder runs.
const SECTION: Duration = Duration::from_millis(50);
/// How long a request may be in flight and still land after a release
/// that began later: a node that asked less than this before the
/// holder's section ended may rightly come after the holder's next turn.
const IN_FLIGHT: Duration = Duration::from_millis(25);

fn seconds() -> Duration {
    Duration::from_secs(
        std::env::var("COMMON_PATTERN_SECONDS")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(60),
    )
}

/// One acquisition: who, when it asked, when its section ended.
#[derive(Clone, Copy, Debug)]
struct Turn {
    node: usize,
    asked: Instant,
    ended: Instant,
}

/// Runs the pattern with `backends` (one node each) on `key`, and checks
/// it.
async fn common_pattern<B: LockBackend + 'static>(
    name: &'static str,
    options: LockerOptions,
    backends: Vec<B>,
    key: String,
) {
    let turns: Arc<Mutex<Vec<Turn>>> = Arc::default();
    let stop = Instant::now() + seconds();
    let n = backends.len();
    let mut loops = Vec::new();
    for (i, backend) in backends.into_iter().enumerate() {
        let locker =
            Locker::with_options(backend, options.clone().node_id(format!("{name}-{i}"))).unwrap();
        let (turns, key) = (Arc::clone(&turns), key.clone());
        loops.push(tokio::spawn(async move {
            let config = LockConfig::default().wait_forever();
            while Instant::now() < stop {
                let asked = Instant::now();
                let turns = Arc::clone(&turns);
                locker
                    .with_lock_config(&key, &config, move |_| async move {
                        tokio::time::sleep(SECTION).await;
                        let ended = Instant::now();
                        turns
                            .lock()
                            .unwrap_or_else(PoisonError::into_inner)
                            .push(Turn {
                                node: i,
                                asked,
                                ended,
                            });
                    })
                    .await
                    .unwrap_or_else(|e| panic!("{name}: node {i}: {e:?}"));
            }
            locker.shutdown(Duration::from_secs(10)).await;
        }));
    }
    for each in loops {
        each.await.unwrap();
    }
    let turns = turns.lock().unwrap_or_else(PoisonError::into_inner).clone();
    let mut counts = vec![0usize; n];
    for turn in &turns {
        counts[turn.node] += 1;
    }
    let total = turns.len();
    let shares: Vec<f64> = counts
        .iter()
        .map(|&c| 100.0 * c as f64 / total as f64)
        .collect();
    eprintln!("{name}: {total} acquisitions, shares {shares:.1?} %");
    assert!(total >= 100, "{name}: only {total} acquisitions");
    for (node, share) in shares.iter().enumerate() {
        assert!(
            (share - 100.0 / n as f64).abs() <= 3.0,
            "{name}: node {node} got {share:.1} % of {total} acquisitions: {shares:.1?}"
        );
    }
    // Twice in a row while another waited: the next turn of some other
    // node asked well before this holder's section ended, yet the holder
    // was served again first.
    let mut twice = Vec::new();
    for (i, pair) in turns.windows(2).enumerate() {
        let (first, again) = (pair[0], pair[1]);
        if first.node != again.node {
            continue;
        }
        let waited = turns[i + 2..]
            .iter()
            .filter(|t| t.node != first.node)
            .take(n)
            .any(|t| t.asked + IN_FLIGHT < first.ended);
        if waited {
            twice.push((i, first.node));
        }
    }
    assert!(
        twice.is_empty(),
        "{name}: held twice in a row while another node waited, at turns (index, node) {twice:?} of {total}"
    );
}

/// On tokio's paused clock: the minute passes at once.
#[tokio::test(start_paused = true)]
async fn f1_the_common_pattern_needs_no_sleep_on_memory() {
    let backend = lock_memory::MemoryBackend::new();
    // The locker's background work on the test's paused clock.
    common_pattern(
        "memory",
        LockerOptions::default().caller_runtime(true),
        vec![backend.clone(), backend.clone(), backend],
        "common pattern".to_owned(),
    )
    .await;
}

/// The three stores at once: the minute is paid once (the test harness
/// runs as many tests at a time as there are cores, two here).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f1_the_common_pattern_needs_no_sleep_on_redis_postgres_and_etcd() {
    tokio::join!(on_redis(), on_postgres(), on_etcd());
}

async fn on_redis() {
    let url = withlock_test_servers::redis::server_url().await;
    let ns = lock_redis::testing::Namespace::new(&url);
    let backends = (0..3)
        .map(|_| lock_redis::RedisBackend::from_url(&url).unwrap())
        .collect();
    common_pattern(
        "redis",
        LockerOptions::default(),
        backends,
        ns.key("common pattern"),
    )
    .await;
}

async fn on_postgres() {
    let url = withlock_test_servers::postgres::database_url();
    let schema = lock_postgres::testing::TestSchema::create(&url)
        .await
        .unwrap();
    let mut backends = Vec::new();
    for _ in 0..3 {
        let pool = lock_postgres::sqlx::postgres::PgPoolOptions::new()
            .max_connections(4)
            .connect_lazy(&url)
            .unwrap();
        let backend = lock_postgres::PostgresBackend::with_config(
            pool,
            schema.config(lock_postgres::PostgresConfig::default()),
        )
        .unwrap();
        backend.migrate().await.unwrap();
        backends.push(backend);
    }
    common_pattern(
        "postgres",
        LockerOptions::default(),
        backends,
        "common pattern".to_owned(),
    )
    .await;
    schema.drop_now().await.unwrap();
}

async fn on_etcd() {
    let etcd = withlock_test_servers::etcd::shared_server().await;
    let mut backends = Vec::new();
    for _ in 0..3 {
        backends.push(lock_etcd::EtcdBackend::from_url(&etcd.url()).await.unwrap());
    }
    let key = format!("common-pattern-{:016x}", rand_suffix());
    common_pattern("etcd", LockerOptions::default(), backends, key).await;
}

/// A key no other run of the test shares on the binary's own etcd.
fn rand_suffix() -> u64 {
    use std::hash::{BuildHasher, RandomState};
    RandomState::new().hash_one(std::process::id())
}

//! The fair queue on etcd [F1–F3, A9]: etcd's own queue of contender keys,
//! each waiter's key on a lease of its ticket ttl, moved to the lock's
//! lease when it holds; `etcdctl lock` waits in the same queue.

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use common::{EtcdClusterExt, Etcdctl};
use lock_etcd::etcd_client::{EventType, GetOptions, WatchOptions};
use lock_etcd::lock_core::{
    AcquireOutcome, BackendError, Lease, LockAdmin, LockBackend, OwnerToken, QueueTerms,
    ReleaseOutcome,
};
use lock_etcd::{EtcdBackend, LockConfig, Locker, LockerOptions};
use tokio::sync::oneshot;
use tokio::time::Instant;
use withlock_test_servers::etcd::{shared_server, EtcdCluster};

const SOON: Duration = Duration::from_secs(10);
const LONG: Duration = Duration::from_secs(30);

fn key(name: &str) -> String {
    lock_conformance::Namespace::new().key(name)
}

fn node(backend: impl LockBackend, name: &str) -> Locker {
    Locker::with_options(backend, LockerOptions::default().node_id(name)).unwrap()
}

/// A contender key as etcd holds it.
#[derive(Clone, Debug)]
struct Contender {
    key: String,
    create_revision: i64,
    lease: i64,
    value: String,
}

impl Contender {
    /// The lease the key's name gives (`<name>/<lease hex>`).
    fn named_lease(&self) -> i64 {
        i64::from_str_radix(self.key.rsplit_once('/').unwrap().1, 16).unwrap()
    }
}

/// The contender keys of `name`, lowest create revision first.
async fn line(backend: &EtcdBackend, name: &str) -> Vec<Contender> {
    let read = backend
        .client()
        .kv_client()
        .get(format!("{name}/"), Some(GetOptions::new().with_prefix()))
        .await
        .unwrap();
    let mut line: Vec<Contender> = read
        .kvs()
        .iter()
        .map(|kv| Contender {
            key: String::from_utf8_lossy(kv.key()).into_owned(),
            create_revision: kv.create_revision(),
            lease: kv.lease(),
            value: String::from_utf8_lossy(kv.value()).into_owned(),
        })
        .collect();
    line.sort_by_key(|c| c.create_revision);
    line
}

/// Waits until `name` has `n` contender keys; gives them.
async fn until_line(backend: &EtcdBackend, name: &str, n: usize) -> Vec<Contender> {
    let deadline = Instant::now() + SOON;
    loop {
        let now = line(backend, name).await;
        if now.len() == n {
            return now;
        }
        assert!(
            Instant::now() < deadline,
            "{name} never had {n} contenders: {now:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A lease's time to live, -1 when it is gone.
async fn lease_ttl(backend: &EtcdBackend, lease: i64) -> i64 {
    backend
        .client()
        .lease_client()
        .time_to_live(lease, None)
        .await
        .unwrap()
        .ttl()
}

async fn take(backend: &EtcdBackend, name: &str, owner: &OwnerToken) -> Lease {
    match backend.try_acquire(name, owner, LONG).await.unwrap() {
        AcquireOutcome::Acquired { fencing_token } => {
            Lease::new(name, owner.clone(), fencing_token)
        }
        busy => panic!("{name} should be free: {busy:?}"),
    }
}

/// A patient waiter that queues with `terms`.
fn queued(terms: QueueTerms) -> LockConfig {
    LockConfig::default()
        .wait_forever()
        .retry_delay(Duration::from_millis(100))
        .fair_queue(terms)
}

/// \[F1, H4\] Waiters on separate backends (as separate processes would
/// have) are served in the order their keys reached etcd, each by a grant
/// from the previous holder's release; each waits with its key on a
/// ticket lease (the lease its name gives unused), and holds with it
/// moved to the lock's lease its name gives, its create revision the
/// fencing token, increasing through the queue.
#[tokio::test]
async fn f1_waiters_of_separate_backends_are_served_in_arrival_order() {
    const WAITERS: usize = 5;
    let server = shared_server().await;
    let observer = server.backend().await;
    let name = key("fifo");
    let holder = take(&observer, &name, &OwnerToken::new("holder")).await;

    let order = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    let mut backends = Vec::new();
    for i in 0..WAITERS {
        let backend = server.backend().await;
        backends.push(backend.clone());
        let (order, k, check) = (Arc::clone(&order), name.clone(), observer.clone());
        let n = node(backend, &format!("w{i}"));
        tasks.push(tokio::spawn(async move {
            let inside = k.clone();
            n.with_lock_config(&k, &queued(QueueTerms::DEFAULT), |ctx| async move {
                let token = ctx.fencing_token();
                // The holder's key: the lowest, its value this lock's, moved
                // by the first extension from its ticket lease to the
                // lock's lease its name gives.
                let deadline = Instant::now() + SOON;
                let held = loop {
                    let held = line(&check, &inside).await;
                    if held[0].lease == held[0].named_lease() || Instant::now() > deadline {
                        break held;
                    }
                    tokio::time::sleep(Duration::from_millis(5)).await;
                };
                assert_eq!(held[0].lease, held[0].named_lease(), "{held:?}");
                order.lock().unwrap_or_else(PoisonError::into_inner).push((
                    i,
                    token,
                    held[0].clone(),
                ));
                tokio::time::sleep(Duration::from_millis(50)).await;
            })
            .await
        }));
        // The next arrives once this one's key stands in line.
        let now = until_line(&observer, &name, i + 2).await;
        let own = &now[i + 1];
        assert!(own.value.starts_with(&format!("w{i}/")), "{now:?}");
        assert_ne!(
            own.lease,
            own.named_lease(),
            "a waiter's key is on its ticket lease: {own:?}"
        );
        assert!(lease_ttl(&observer, own.lease).await <= 3);
        assert!(
            lease_ttl(&observer, own.named_lease()).await > 3,
            "the lease its name gives is the lock's, unused while it waits"
        );
    }
    assert_eq!(
        observer.release(&holder).await.unwrap(),
        ReleaseOutcome::Released
    );
    for task in tasks {
        tokio::time::timeout(SOON, task)
            .await
            .expect("every waiter gets the key")
            .unwrap()
            .unwrap();
    }
    let order = order.lock().unwrap_or_else(PoisonError::into_inner).clone();
    let served: Vec<usize> = order.iter().map(|(i, ..)| *i).collect();
    assert_eq!(served, (0..WAITERS).collect::<Vec<_>>(), "{order:?}");
    let mut last = holder.fencing_token();
    for (i, token, held) in &order {
        assert!(
            *token > last,
            "tokens increase through the queue: {order:?}"
        );
        last = *token;
        assert_eq!(held.create_revision, i64::try_from(*token).unwrap());
        assert!(held.value.starts_with(&format!("w{i}/")), "{held:?}");
    }
    assert!(line(&observer, &name).await.is_empty());
    // [T2] No place is left behind.
    for backend in &backends {
        assert_eq!(state(backend, "queue_places"), 0);
        assert_eq!(state(backend, "leases"), 0);
    }
}

/// \[F1, L5\] The admin shows a holder that came through the queue as
/// running (its key on the lease its name gives), not as kept by a
/// minimum hold.
#[tokio::test]
async fn f1_a_holder_from_the_queue_shows_as_running() {
    let server = shared_server().await;
    let backend = server.backend().await;
    let name = key("admin");
    let holder = take(&backend, &name, &OwnerToken::new("holder")).await;
    let waiter = OwnerToken::new("waiter");
    let terms = QueueTerms::DEFAULT;
    let busy = backend
        .try_acquire_queued(&name, &waiter, LONG, terms)
        .await
        .unwrap();
    assert!(busy.is_busy(), "{busy:?}");
    backend.release(&holder).await.unwrap();
    // Its own attempt finds it the lowest and takes the lock.
    let got = backend
        .try_acquire_queued(&name, &waiter, LONG, terms)
        .await
        .unwrap();
    let AcquireOutcome::Acquired { fencing_token } = got else {
        panic!("the waiter is the lowest: {got:?}");
    };
    let [held] = &line(&backend, &name).await[..] else {
        panic!("one key");
    };
    assert_eq!(
        held.lease,
        held.named_lease(),
        "on the lock's lease: {held:?}"
    );
    let info = backend.inspect(&name).await.unwrap();
    assert!(info.is_held() && !info.is_kept(), "{info:?}");
    assert_eq!(info.fencing_token, Some(fencing_token));
    let lease = Lease::new(name.as_str(), waiter, fencing_token);
    assert_eq!(
        backend.release(&lease).await.unwrap(),
        ReleaseOutcome::Released
    );
}

/// \[F2\] A waiter that stops renewing its place (its process stalled) is
/// skipped once its ticket lease runs out: its key goes, the waiter
/// behind it is next and is granted the key at the release; the stalled
/// waiter, back, joins at the tail.
#[tokio::test]
async fn f2_a_waiter_that_stops_renewing_is_skipped_after_its_ticket_ttl() {
    let server = shared_server().await;
    let observer = server.backend().await;
    let name = key("stalled");
    let holder = take(&observer, &name, &OwnerToken::new("holder")).await;

    // Queued by hand, then never renewed.
    let stalled_backend = server.backend().await;
    let stalled = OwnerToken::new("stalled");
    let ticket = QueueTerms::new(Duration::from_secs(1), Duration::from_secs(1));
    let answer = stalled_backend
        .try_acquire_queued(&name, &stalled, LONG, ticket)
        .await
        .unwrap();
    assert!(answer.is_busy(), "{answer:?}");
    let joined = Instant::now();
    let before = until_line(&observer, &name, 2).await;

    // A live waiter behind it.
    let (in_tx, in_rx) = oneshot::channel();
    let live = node(server.backend().await, "live");
    let n = name.clone();
    let task = tokio::spawn(async move {
        live.with_lock_config(&n, &queued(QueueTerms::DEFAULT), |ctx| async move {
            let _ = in_tx.send(ctx.fencing_token());
        })
        .await
    });
    until_line(&observer, &name, 3).await;

    // The stalled waiter's key goes with its ticket lease (1 s, and the
    // lessor's lag).
    let gone = until_line(&observer, &name, 2).await;
    let skipped_after = joined.elapsed();
    assert!(
        skipped_after <= Duration::from_millis(2_500),
        "skipped after {skipped_after:?}"
    );
    assert_eq!(gone[0].key, before[0].key);
    assert!(gone[1].value.starts_with("live/"), "{gone:?}");

    observer.release(&holder).await.unwrap();
    let token = tokio::time::timeout(SOON, in_rx)
        .await
        .expect("the live waiter is granted the key")
        .unwrap();
    tokio::time::timeout(SOON, task)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert!(token > holder.fencing_token());

    // Back, the stalled waiter joins at the tail: behind a new holder.
    let again = take(&observer, &name, &OwnerToken::new("again")).await;
    let answer = stalled_backend
        .try_acquire_queued(&name, &stalled, LONG, ticket)
        .await
        .unwrap();
    assert!(answer.is_busy(), "{answer:?}");
    let now = line(&observer, &name).await;
    assert_eq!(now.len(), 2, "{now:?}");
    assert!(now[1].value == stalled.as_str() && now[1].create_revision > now[0].create_revision);
    stalled_backend.leave_queue(&name, &stalled).await.unwrap();
    observer.release(&again).await.unwrap();
}

/// \[F2\] Leaving the queue deletes the waiter's key and revokes both its
/// leases; leaving again is harmless.
#[tokio::test]
async fn f2_leave_deletes_the_key_and_revokes_its_leases() {
    let server = shared_server().await;
    let backend = server.backend().await;
    let name = key("leave");
    let holder = take(&backend, &name, &OwnerToken::new("holder")).await;
    let waiter = OwnerToken::new("waiter");
    let busy = backend
        .try_acquire_queued(&name, &waiter, LONG, QueueTerms::DEFAULT)
        .await
        .unwrap();
    assert!(busy.is_busy(), "{busy:?}");
    let now = line(&backend, &name).await;
    let place = now[1].clone();
    assert_eq!(place.value, waiter.as_str());

    backend.leave_queue(&name, &waiter).await.unwrap();
    let after = line(&backend, &name).await;
    assert_eq!(after.len(), 1, "{after:?}");
    assert_eq!(after[0].key, now[0].key);
    assert_eq!(lease_ttl(&backend, place.lease).await, -1, "ticket lease");
    assert_eq!(
        lease_ttl(&backend, place.named_lease()).await,
        -1,
        "lock lease"
    );
    assert_eq!(state(&backend, "queue_places"), 0);
    backend.leave_queue(&name, &waiter).await.unwrap();
    backend.release(&holder).await.unwrap();
}

fn state(backend: &EtcdBackend, what: &str) -> usize {
    backend
        .state_counts()
        .into_iter()
        .find(|(name, _)| *name == what)
        .map_or(0, |(_, n)| n)
}

/// \[F1\] A try-once call never queues and never puts a key: a busy
/// attempt reads the contenders and writes nothing (etcd's watchers see
/// no put), so nothing stands in line after it; nor does a waiting call
/// that opted out of the queue leave one.
#[tokio::test]
async fn f1_a_try_once_attempt_puts_no_key() {
    let server = shared_server().await;
    let backend = server.backend().await;
    let name = key("once");
    let holder = take(&backend, &name, &OwnerToken::new("holder")).await;
    let (_watcher, mut events) = backend
        .client()
        .watch_client()
        .watch(format!("{name}/"), Some(WatchOptions::new().with_prefix()))
        .await
        .unwrap()
        .split();

    let n = node(server.backend().await, "once");
    let once = LockConfig::default().retry_attempts(0);
    let got = n.with_lock_config(&name, &once, |_| async {}).await;
    assert!(got.as_ref().is_err_and(|e| e.is_busy()), "{got:?}");
    let opted_out = LockConfig::default()
        .retry_attempts(2)
        .retry_delay(Duration::from_millis(20))
        .no_queue();
    let got = n.with_lock_config(&name, &opted_out, |_| async {}).await;
    assert!(got.as_ref().is_err_and(|e| e.is_busy()), "{got:?}");

    assert_eq!(line(&backend, &name).await.len(), 1);
    // Nothing was written under the name meanwhile: the next event is
    // the holder's release.
    backend.release(&holder).await.unwrap();
    let message = loop {
        let message = tokio::time::timeout(SOON, events.message())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        // The watch's confirmation first.
        if !message.events().is_empty() {
            break message;
        }
    };
    let kinds: Vec<_> = message.events().iter().map(|e| e.event_type()).collect();
    assert_eq!(kinds, vec![EventType::Delete], "{message:?}");
    assert_eq!(state(&backend, "queue_places"), 0);
}

/// A waiter that reports when its callback starts, and holds until told.
fn holding_waiter(
    backend: EtcdBackend,
    id: &str,
    name: &str,
) -> (
    tokio::task::JoinHandle<()>,
    oneshot::Receiver<u64>,
    oneshot::Sender<()>,
) {
    let n = node(backend, id);
    let (in_tx, in_rx) = oneshot::channel();
    let (done_tx, done_rx) = oneshot::channel::<()>();
    let name = name.to_owned();
    let task = tokio::spawn(async move {
        n.with_lock_config(&name, &queued(QueueTerms::DEFAULT), |ctx| async move {
            let _ = in_tx.send(ctx.fencing_token());
            let _ = done_rx.await;
        })
        .await
        .unwrap();
    });
    (task, in_rx, done_tx)
}

/// \[F1, F5\] `etcdctl lock` waits in the same queue as withlock's
/// waiters, both ways: with a withlock holder, a withlock waiter `a`,
/// then `etcdctl lock`, then a withlock waiter `b` in line, the holder's
/// release goes to `a`, `a`'s to etcdctl (while `b` waits on), and
/// etcdctl's unlock to `b`.
#[tokio::test]
async fn f5_etcdctl_lock_waits_in_the_same_queue() {
    let server = shared_server().await;
    let observer = server.backend().await;
    let name = key("etcdctl");
    let holder = take(&observer, &name, &OwnerToken::new("holder")).await;

    let (a, mut a_in, a_done) = holding_waiter(server.backend().await, "a", &name);
    until_line(&observer, &name, 2).await;
    let mut etcdctl = Etcdctl::start(server, &name);
    until_line(&observer, &name, 3).await;
    let (b, mut b_in, b_done) = holding_waiter(server.backend().await, "b", &name);
    let line_up = until_line(&observer, &name, 4).await;
    assert!(line_up[1].value.starts_with("a/"), "{line_up:?}");
    assert_eq!(line_up[2].value, "", "etcdctl's key: {line_up:?}");
    assert!(line_up[3].value.starts_with("b/"), "{line_up:?}");

    observer.release(&holder).await.unwrap();
    let a_token = tokio::time::timeout(SOON, &mut a_in)
        .await
        .expect("a is granted the key")
        .unwrap();
    etcdctl.holds_nothing_for(Duration::from_millis(300)).await;
    drop(a_done);
    a.await.unwrap();
    let their_key = etcdctl.held().await;
    assert_eq!(their_key, line_up[2].key);
    assert!(
        tokio::time::timeout(Duration::from_millis(500), &mut b_in)
            .await
            .is_err(),
        "b took the key while etcdctl held it"
    );
    etcdctl.stop().await;
    let b_token = tokio::time::timeout(SOON, &mut b_in)
        .await
        .expect("b gets the key after etcdctl")
        .unwrap();
    assert!(b_token > a_token);
    drop(b_done);
    b.await.unwrap();
    assert!(line(&observer, &name).await.is_empty());
}

/// Counts the acquisition attempts of a backend, queued and not.
#[derive(Debug)]
struct Counting {
    inner: EtcdBackend,
    attempts: Arc<AtomicU64>,
}

lock_etcd::lock_core::forward_lock_backend!(Counting => inner {
    async fn try_acquire(
        &self,
        key: &str,
        owner: &OwnerToken,
        ttl: Duration,
    ) -> Result<AcquireOutcome, BackendError> {
        self.attempts.fetch_add(1, Ordering::SeqCst);
        self.inner.try_acquire(key, owner, ttl).await
    }

    async fn try_acquire_queued(
        &self,
        key: &str,
        owner: &OwnerToken,
        ttl: Duration,
        terms: QueueTerms,
    ) -> Result<AcquireOutcome, BackendError> {
        self.attempts.fetch_add(1, Ordering::SeqCst);
        self.inner.try_acquire_queued(key, owner, ttl, terms).await
    }
});

/// Loops `nodes` lockers (each on its own backend) on one key for
/// `rounds` turns each, with a 2 ms section and no pause; gives the
/// acquisition attempts per handoff and the handoffs per second.
async fn hot_key(
    server: &EtcdCluster,
    name: &str,
    nodes: usize,
    rounds: usize,
    config: LockConfig,
) -> (f64, f64) {
    let attempts = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    let started = Instant::now();
    for i in 0..nodes {
        let backend = Counting {
            inner: server.backend().await,
            attempts: Arc::clone(&attempts),
        };
        let n = node(backend, &format!("n{i}"));
        let name = name.to_owned();
        tasks.push(tokio::spawn(async move {
            for _ in 0..rounds {
                n.with_lock_config(&name, &config, |_| async {
                    tokio::time::sleep(Duration::from_millis(2)).await;
                })
                .await
                .unwrap();
            }
        }));
    }
    for task in tasks {
        tokio::time::timeout(SOON * 6, task).await.unwrap().unwrap();
    }
    let handoffs = (nodes * rounds) as f64;
    (
        attempts.load(Ordering::SeqCst) as f64 / handoffs,
        handoffs / started.elapsed().as_secs_f64(),
    )
}

/// \[F1, F4\] Attempts per handoff on a hot key, 6 nodes on separate
/// backends: queued, a release grants the key to the next waiter, which
/// starts without an attempt, so each call costs about one attempt (its
/// queued attempt, which joins the queue; the heartbeats of a 30 s ticket
/// ttl do not come in so short a run). Opted out of the queue, every
/// release wakes every node's waiter to try: several attempts per
/// handoff. Printed for the README; `--nocapture` shows them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f1_a_handoff_costs_about_one_attempt() {
    const NODES: usize = 6;
    const ROUNDS: usize = 20;
    let server = shared_server().await;
    let terms = QueueTerms::new(Duration::from_secs(30), Duration::from_secs(2));
    let patient = LockConfig::default()
        .wait_forever()
        .retry_delay(Duration::from_millis(100));
    let (queued_per, queued_rate) = hot_key(
        server,
        &key("hot-queued"),
        NODES,
        ROUNDS,
        patient.fair_queue(terms),
    )
    .await;
    let (unqueued_per, unqueued_rate) = hot_key(
        server,
        &key("hot-unqueued"),
        NODES,
        ROUNDS,
        patient.no_queue(),
    )
    .await;
    println!(
        "etcd hot key, {NODES} nodes x {ROUNDS} turns, 2 ms section: queued {queued_per:.2} attempts/handoff, {queued_rate:.0} handoffs/s; unqueued {unqueued_per:.2} attempts/handoff, {unqueued_rate:.0} handoffs/s"
    );
    assert!(
        queued_per <= 1.2,
        "queued: {queued_per:.2} attempts per handoff"
    );
}

/// \[F1\] A waiter that waited longer than its lock's ttl finds the
/// lease its key's name gives run out (it is not kept alive while the
/// waiter waits): taking up its grant grants it again under the same id,
/// and the lock is then kept alive on it as any other.
#[tokio::test]
async fn f1_a_waiter_longer_than_its_ttl_takes_up_its_grant_on_its_named_lease() {
    let server = shared_server().await;
    let observer = server.backend().await;
    let name = key("long-wait");
    let holder = take(&observer, &name, &OwnerToken::new("holder")).await;
    let backend = server.backend().await;
    let ttl = backend.min_ttl();
    let (in_tx, in_rx) = oneshot::channel();
    let (done_tx, done_rx) = oneshot::channel::<()>();
    let n = node(backend, "w");
    let k = name.clone();
    let task = tokio::spawn(async move {
        let config = queued(QueueTerms::DEFAULT).ttl(ttl);
        n.with_lock_config(&k, &config, |ctx| async move {
            let _ = in_tx.send(ctx.fencing_token());
            let _ = done_rx.await;
        })
        .await
        .unwrap();
    });
    let waiting = until_line(&observer, &name, 2).await;
    let named = waiting[1].named_lease();
    // The lock's lease its name gives runs out while it waits.
    let deadline = Instant::now() + SOON;
    while lease_ttl(&observer, named).await >= 0 {
        assert!(Instant::now() < deadline, "the unused lease never ran out");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    observer.release(&holder).await.unwrap();
    tokio::time::timeout(SOON, in_rx).await.unwrap().unwrap();
    // Held on that lease, granted again, and kept alive past its ttl.
    tokio::time::sleep(ttl * 2).await;
    let [held] = &line(&observer, &name).await[..] else {
        panic!("one key");
    };
    assert_eq!(held.key, waiting[1].key);
    assert_eq!(held.lease, named, "{held:?}");
    assert!(lease_ttl(&observer, named).await >= 0, "the lease lives");
    drop(done_tx);
    task.await.unwrap();
    assert!(line(&observer, &name).await.is_empty());
}

/// \[F6, D3\] The queue needs no right beyond the lock's own (`readwrite`
/// on the names' prefix): a least-privilege user's waiters queue (their
/// keys stand in line while the name is held) and are served in order.
#[tokio::test]
async fn f6_a_least_privilege_user_queues() {
    let cluster = EtcdCluster::start(1).await.unwrap();
    cluster.enable_auth().unwrap();
    cluster
        .add_user("app", "withlock-app", "readwrite", &["app/"])
        .unwrap();
    let connect = || async {
        EtcdBackend::connect(cluster.user_config("app"))
            .await
            .unwrap()
    };
    let root = EtcdBackend::connect(cluster.user_config("root"))
        .await
        .unwrap();
    let name = "app/queued";
    let holder_backend = connect().await;
    let holder = take(&holder_backend, name, &OwnerToken::new("holder")).await;
    let (a, mut a_in, a_done) = holding_waiter(connect().await, "a", name);
    until_line(&root, name, 2).await;
    let (b, mut b_in, b_done) = holding_waiter(connect().await, "b", name);
    let waiting = until_line(&root, name, 3).await;
    assert!(waiting[1].value.starts_with("a/") && waiting[2].value.starts_with("b/"));

    holder_backend.release(&holder).await.unwrap();
    let a_token = tokio::time::timeout(SOON, &mut a_in)
        .await
        .unwrap()
        .unwrap();
    assert!(
        tokio::time::timeout(Duration::from_millis(300), &mut b_in)
            .await
            .is_err(),
        "b took the key while a held it"
    );
    drop(a_done);
    a.await.unwrap();
    let b_token = tokio::time::timeout(SOON, &mut b_in)
        .await
        .unwrap()
        .unwrap();
    assert!(b_token > a_token);
    drop(b_done);
    b.await.unwrap();
    assert!(line(&root, name).await.is_empty());
}

/// \[A9\] A crashed holder's key (its lease never kept alive) is taken by
/// the queue's head as soon as etcd's lessor revokes the lease: the
/// deletion reaches the head's backend on its watch, a grant. The lag
/// past the lease's ttl is the lessor's (it checks expiries every 500 ms);
/// printed for the README, bounded at a second.
#[tokio::test]
async fn a9_a_crashed_holders_key_goes_to_the_head_when_its_lease_ends() {
    let server = shared_server().await;
    let observer = server.backend().await;
    let mut lags = Vec::new();
    for round in 0..3 {
        let name = key(&format!("crashed-{round}"));
        let ttl = observer.min_ttl();
        let sent = Instant::now();
        let crashed = OwnerToken::new("crashed");
        let got = observer.try_acquire(&name, &crashed, ttl).await.unwrap();
        assert!(matches!(got, AcquireOutcome::Acquired { .. }), "{got:?}");
        let n = node(server.backend().await, "head");
        let config = queued(QueueTerms::DEFAULT).retry_delay(Duration::from_secs(10));
        let took_at = tokio::time::timeout(
            SOON,
            n.with_lock_config(&name, &config, |_| async { Instant::now() }),
        )
        .await
        .unwrap()
        .unwrap();
        let lag = took_at.saturating_duration_since(sent + ttl);
        assert!(took_at >= sent + ttl, "taken before the lease's end");
        assert!(
            lag <= Duration::from_secs(1),
            "taken {lag:?} after the lease's end"
        );
        lags.push(lag);
    }
    println!("a crashed holder's key taken {lags:?} after its lease's ttl");
}

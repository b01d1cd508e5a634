//! The fair queue across nodes \[F1–F3, F5, F6\] and waiting until a
//! crashed holder's lock expires \[A9\].
//!
//! A case whose behaviour needs the queue runs it where the backend
//! declares both the queue and the release notifications that carry its
//! grants (the driver queues only then); elsewhere it checks what such a
//! backend must still do: exclusion, and waiting that works unqueued.

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use lock_core::{
    AcquireOutcome, BackendError, BackendErrorKind, DynLockBackend, ExtendOutcome, Lease,
    LockBackend, LockConfig, LockError, OwnerToken, QueueTerms, ReleaseOutcome,
};
use tokio::sync::{oneshot, Notify};
use tokio::time::Instant;

use crate::counting::CountingBackend;
use crate::faults::Step;
use crate::support::{
    node, once, patient, scaled, within, BackendFactory, Namespace, RETRY, SHORT_TTL, SOON,
};

/// A ttl no step of these cases outlives.
const LONG: Duration = Duration::from_secs(30);

/// Whether waiters queue on `backend`: it keeps the fair queue and has the
/// release notifications that carry its grants.
fn queues(backend: &DynLockBackend) -> bool {
    let caps = backend.capabilities();
    caps.fair_queue && caps.release_notifications
}

/// State the tasks of a case share, with a wake-up at every change, so
/// that a task waits for an event instead of sleeping.
struct Board<T> {
    state: Mutex<T>,
    changed: Notify,
}

impl<T> Board<T> {
    fn new(state: T) -> Arc<Self> {
        Arc::new(Self {
            state: Mutex::new(state),
            changed: Notify::new(),
        })
    }

    fn update<R>(&self, f: impl FnOnce(&mut T) -> R) -> R {
        let answer = f(&mut self.state.lock().unwrap_or_else(PoisonError::into_inner));
        self.changed.notify_waiters();
        answer
    }

    fn read<R>(&self, f: impl FnOnce(&T) -> R) -> R {
        f(&self.state.lock().unwrap_or_else(PoisonError::into_inner))
    }

    /// Waits until `f` finds what it looks for.
    async fn until<R>(&self, f: impl Fn(&T) -> Option<R>) -> R {
        loop {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            // Registered before the state is read, so a change between the
            // two wakes it.
            changed.as_mut().enable();
            let found = self.read(&f);
            if let Some(found) = found {
                return found;
            }
            changed.await;
        }
    }
}

/// Takes `key` by hand for `owner`: a node steered step by step, or one
/// that then crashes.
async fn take(backend: &DynLockBackend, key: &str, owner: &OwnerToken, ttl: Duration) -> Lease {
    match backend.try_acquire(key, owner, ttl).await {
        Ok(AcquireOutcome::Acquired { fencing_token }) => {
            Lease::new(key, owner.clone(), fencing_token)
        }
        other => panic!("key {key:?} should be free: {other:?}"),
    }
}

/// A node's backend that tells when the node's waiter waits: once a
/// queued attempt answered busy (it made or renewed the node's place)
/// where the backend queues, else once an attempt answered busy. A
/// handshake that does not depend on how many attempts the driver makes
/// before it queues.
struct Waiting {
    inner: Arc<DynLockBackend>,
    queues: bool,
    /// Attempts answered, queued or not, whatever the answer.
    answered: AtomicU64,
    /// Attempts answered busy, queued or not.
    busy: AtomicU64,
    /// Queued attempts answered busy.
    queued: AtomicU64,
    changed: Notify,
}

impl Waiting {
    fn new(backend: &Arc<DynLockBackend>) -> Arc<Self> {
        Arc::new(Self {
            inner: Arc::clone(backend),
            queues: queues(&**backend),
            answered: AtomicU64::new(0),
            busy: AtomicU64::new(0),
            queued: AtomicU64::new(0),
            changed: Notify::new(),
        })
    }

    /// How many times the node was found waiting: its queued attempts
    /// answered busy where the backend queues, else its attempts answered
    /// busy.
    fn waits(&self) -> u64 {
        let count = if self.queues {
            &self.queued
        } else {
            &self.busy
        };
        count.load(Ordering::SeqCst)
    }

    /// Attempts answered so far, queued or not.
    fn answered(&self) -> u64 {
        self.answered.load(Ordering::SeqCst)
    }

    /// Waits until the node was found waiting `n` times.
    async fn until_waits(&self, n: u64) {
        loop {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            if self.waits() >= n {
                return;
            }
            changed.await;
        }
    }

    fn record(&self, answer: &Result<AcquireOutcome, BackendError>, queued: bool) {
        if matches!(answer, Ok(AcquireOutcome::Busy { .. })) {
            self.busy.fetch_add(1, Ordering::SeqCst);
            if queued {
                self.queued.fetch_add(1, Ordering::SeqCst);
            }
        }
        self.answered.fetch_add(1, Ordering::SeqCst);
        self.changed.notify_waiters();
    }
}

impl fmt::Debug for Waiting {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Waiting")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

lock_core::forward_lock_backend!(Waiting => inner {
    async fn try_acquire(
        &self,
        key: &str,
        owner: &OwnerToken,
        ttl: Duration,
    ) -> Result<AcquireOutcome, BackendError> {
        let answer = self.inner.try_acquire(key, owner, ttl).await;
        self.record(&answer, false);
        answer
    }

    async fn try_acquire_queued(
        &self,
        key: &str,
        owner: &OwnerToken,
        ttl: Duration,
        terms: QueueTerms,
    ) -> Result<AcquireOutcome, BackendError> {
        let answer = self.inner.try_acquire_queued(key, owner, ttl, terms).await;
        self.record(&answer, true);
        answer
    }
});

/// What a backend without the queue must still do where a case of the
/// queue stands: a waiter gets the key soon after its holder lets go, with
/// a greater fencing token.
async fn unqueued_waiting_works(backend: &Arc<DynLockBackend>, key: &str) {
    let holder = take(&**backend, key, &OwnerToken::new("holder"), LONG).await;
    let waiting = Waiting::new(backend);
    let w = node(Arc::clone(&waiting), "waiter");
    let k = key.to_owned();
    let waiter = tokio::spawn(async move {
        w.with_lock_config(&k, &patient(), |ctx| async move { ctx.fencing_token() })
            .await
    });
    within(SOON, "the waiter waits", waiting.until_waits(1)).await;
    assert_eq!(
        backend.release(&holder).await.unwrap(),
        ReleaseOutcome::Released
    );
    let token = within(SOON, "the waiter gets the freed key", waiter)
        .await
        .unwrap()
        .expect("waiting works unqueued");
    assert!(
        token > holder.fencing_token(),
        "fencing tokens increase: {token} after {}",
        holder.fencing_token()
    );
}

/// A spawned waiter, its callback's report (when it started and its
/// fencing token) and what ends its callback (dropping it).
type HoldingWaiter = (
    tokio::task::JoinHandle<Result<(), LockError>>,
    oneshot::Receiver<(Instant, u64)>,
    oneshot::Sender<()>,
);

/// A waiter on `key` through `waiting`, spawned: once its callback runs
/// it reports when and with which fencing token, then holds the key until
/// the sender returned is dropped.
fn spawn_holding_waiter(
    waiting: &Arc<Waiting>,
    name: &str,
    key: &str,
    config: LockConfig,
) -> HoldingWaiter {
    let w = node(Arc::clone(waiting), name);
    let (in_tx, in_rx) = oneshot::channel();
    let (done_tx, done_rx) = oneshot::channel::<()>();
    let k = key.to_owned();
    let task = tokio::spawn(async move {
        w.with_lock_config(&k, &config, move |ctx| async move {
            let _ = in_tx.send((Instant::now(), ctx.fencing_token()));
            let _ = done_rx.await;
        })
        .await
    });
    (task, in_rx, done_tx)
}

/// How many nodes f1's rotation serves.
const ROTATING: usize = 8;
/// Grants counted in f1's rotation with the queue: 25 turns of each node.
const ROTATION_GRANTS: usize = 200;
/// Grants counted without the queue, whose order is not checked.
const UNQUEUED_GRANTS: usize = 48;

/// What f1's nodes saw.
#[derive(Default)]
struct Rotation {
    /// Each grant in order: the node that held the key and its fencing
    /// token.
    held: Vec<(usize, u64)>,
    /// For a grant whose node goes on: the count of that node's waits
    /// ([`Waiting::waits`]) at which it is in the queue again (its next
    /// call's first queued attempt found the key busy and made its place
    /// at the tail).
    waits_again_at: HashMap<usize, u64>,
    /// Callbacks inside now.
    inside: usize,
    /// Callbacks that entered while another was inside.
    overlaps: usize,
}

/// \[F1\] Nodes are served in the order they arrived in the store's queue,
/// and each release grants the key to the head alone: 8 nodes with one
/// waiter each queue one after the other behind a holder (each once the
/// one before was answered busy on its queued attempt), then take 200
/// grants in turn, each node joining the tail again after its turn (its
/// successor lets go only once it waits again). The grants go round in
/// arrival order, strictly; fencing tokens increase through grants; and
/// a release does not wake the other waiters to try (at most two attempts
/// per call, heartbeats aside). Without the queue, the nodes still share
/// the key, one at a time, with increasing fencing tokens.
pub async fn f1_nodes_are_served_in_arrival_order(factory: Arc<dyn BackendFactory>) {
    let backend = factory.backend().await;
    let queued = queues(&*backend);
    let ns = Namespace::new();
    let key = ns.key("f1-order");
    let grants = if queued {
        ROTATION_GRANTS
    } else {
        UNQUEUED_GRANTS
    };
    let holder = node(Arc::clone(&backend), "holder");
    let mut held = holder.handle(&key, LONG).unwrap();
    assert!(held.acquire().await.unwrap());

    let waiting: Vec<_> = (0..ROTATING).map(|_| Waiting::new(&backend)).collect();
    let board = Board::new(Rotation::default());
    let started = Instant::now();
    let mut tasks = Vec::new();
    for (i, w) in waiting.iter().enumerate() {
        let n = node(Arc::clone(w), &format!("n{i}"));
        let (k, board, all) = (key.clone(), Arc::clone(&board), waiting.clone());
        tasks.push(tokio::spawn(async move {
            loop {
                let (b, c) = (Arc::clone(&board), all.clone());
                let g = n
                    .with_lock_config(&k, &patient(), move |ctx| async move {
                        let g = b.update(|r| {
                            r.inside += 1;
                            if r.inside > 1 {
                                r.overlaps += 1;
                            }
                            r.held.push((i, ctx.fencing_token()));
                            r.held.len() - 1
                        });
                        // The node served before this one waits in the
                        // queue again before this one lets go: it is then
                        // at the tail.
                        let before = g
                            .checked_sub(1)
                            .filter(|_| queued && g < grants)
                            .map(|p| (p, b.read(|r| r.held[p].0)))
                            .filter(|(_, prev)| *prev != i);
                        if let Some((p, prev)) = before {
                            let at = b.until(|r| r.waits_again_at.get(&p).copied()).await;
                            c[prev].until_waits(at).await;
                        }
                        b.update(|r| r.inside -= 1);
                        g
                    })
                    .await
                    .unwrap_or_else(|e| panic!("n{i}: a patient waiter gets the key: {e}"));
                if g + 1 >= grants {
                    return;
                }
                // Nothing of this node attempts between its release and
                // its next call, whose first queued attempt makes its
                // place (the key is held: the next node's grant).
                let waits = all[i].waits();
                board.update(|r| r.waits_again_at.insert(g, waits + 1));
            }
        }));
        // The next node arrives once this one waits in the queue (or,
        // without the queue, has found the key busy).
        within(
            SOON,
            &format!("n{i} waits behind the holder"),
            w.until_waits(1),
        )
        .await;
    }
    assert!(held.release().await.unwrap());
    within(SOON * 12, "the rotation ends", async {
        for task in tasks {
            task.await.unwrap();
        }
    })
    .await;
    let elapsed = started.elapsed();

    let (sequence, overlaps) = board.read(|r| (r.held.clone(), r.overlaps));
    assert_eq!(overlaps, 0, "two nodes held the key at once");
    // After the last counted grant each other node is served once more.
    assert_eq!(
        sequence.len(),
        grants + ROTATING - 1,
        "grants: {sequence:?}"
    );
    for pair in sequence.windows(2) {
        assert!(
            pair[1].1 > pair[0].1,
            "fencing tokens must increase through grants: {pair:?}"
        );
    }
    if !queued {
        return;
    }
    if let Some(g) = (0..sequence.len()).find(|g| sequence[*g].0 != g % ROTATING) {
        let around: Vec<usize> = sequence[g.saturating_sub(ROTATING)..]
            .iter()
            .take(2 * ROTATING)
            .map(|(n, _)| *n)
            .collect();
        panic!(
            "grant {g} went to n{} where the arrival order gives n{}; the nodes served from grant {}: {around:?}",
            sequence[g].0,
            g % ROTATING,
            g.saturating_sub(ROTATING)
        );
    }
    // Each call: at most an unqueued first attempt and its queued one (a
    // grant taken up by an attempt instead of its message replaces no
    // more than one of them); a waiter also renews its place every
    // heartbeat (a third of the 3 s ticket ttl), and may try once at a
    // holder's expiry in between. A release that woke every waiter to
    // try would cost 7 more per grant.
    let attempts: u64 = waiting.iter().map(|w| w.answered()).sum();
    let heartbeats = (elapsed.as_secs_f64() / QueueTerms::DEFAULT.heartbeat().as_secs_f64()).ceil();
    let allowed = 2 * sequence.len() as u64 + ROTATING as u64 * 2 * (heartbeats as u64 + 1);
    assert!(
        attempts <= allowed,
        "{} grants in {elapsed:?} cost {attempts} attempts, more than {allowed}: waiters were woken to try",
        sequence.len()
    );
}

/// How many nodes share the key in f1's second case, and their tasks each.
const SHARING: usize = 3;
const TASKS_PER_NODE: usize = 3;
/// Turns counted in f1's second case.
const TURNS: usize = 150;
/// Its critical section.
const SECTION: Duration = Duration::from_millis(2);

/// One turn of f1's second case.
#[derive(Clone, Copy, Debug)]
struct Turn {
    node: usize,
    token: u64,
    /// Whether another node had a waiter in the queue when this turn's
    /// callback ended, so at its release.
    others_queued: bool,
}

/// What f1's second case saw.
#[derive(Default)]
struct Turns {
    held: Vec<Turn>,
    /// Whether each node's waiter is in the queue: its queued attempt
    /// found the key busy since the node's last turn began.
    queued: [bool; SHARING],
    inside: usize,
    overlaps: usize,
}

/// A node's backend that marks on the board when the node's waiter is in
/// the queue: its queued attempt answered busy.
struct MarksQueued {
    inner: Arc<DynLockBackend>,
    node: usize,
    board: Arc<Board<Turns>>,
}

impl fmt::Debug for MarksQueued {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MarksQueued")
            .field("inner", &self.inner)
            .field("node", &self.node)
            .finish_non_exhaustive()
    }
}

lock_core::forward_lock_backend!(MarksQueued => inner {
    async fn try_acquire_queued(
        &self,
        key: &str,
        owner: &OwnerToken,
        ttl: Duration,
        terms: QueueTerms,
    ) -> Result<AcquireOutcome, BackendError> {
        let answer = self.inner.try_acquire_queued(key, owner, ttl, terms).await;
        if matches!(answer, Ok(AcquireOutcome::Busy { .. })) {
            self.board.update(|t| t.queued[self.node] = true);
        }
        answer
    }
});

/// \[F1\] With several waiters per node, no node is served twice in a row
/// while another node has a waiter in the queue (the unit of the queue is
/// the node: its next task joins the tail), and each node gets about a
/// third of 150 turns: 3 nodes with 3 tasks each loop on one key with a
/// 2 ms section, with no pause. Without the queue, the turns still
/// exclude each other.
pub async fn f1_a_node_is_not_served_twice_while_another_waits(factory: Arc<dyn BackendFactory>) {
    let backend = factory.backend().await;
    let queued = queues(&*backend);
    let ns = Namespace::new();
    let key = ns.key("f1-share");
    let board = Board::new(Turns::default());
    let mut tasks = Vec::new();
    for i in 0..SHARING {
        let marks = MarksQueued {
            inner: Arc::clone(&backend),
            node: i,
            board: Arc::clone(&board),
        };
        let n = node(marks, &format!("n{i}"));
        for _ in 0..TASKS_PER_NODE {
            let (n, k, board) = (n.clone(), key.clone(), Arc::clone(&board));
            tasks.push(tokio::spawn(async move {
                loop {
                    let b = Arc::clone(&board);
                    let g = n
                        .with_lock_config(&k, &patient(), move |ctx| async move {
                            let g = b.update(|t| {
                                t.queued[i] = false;
                                t.inside += 1;
                                if t.inside > 1 {
                                    t.overlaps += 1;
                                }
                                t.held.push(Turn {
                                    node: i,
                                    token: ctx.fencing_token(),
                                    others_queued: false,
                                });
                                t.held.len() - 1
                            });
                            tokio::time::sleep(SECTION).await;
                            b.update(|t| {
                                t.inside -= 1;
                                t.held[g].others_queued =
                                    (0..SHARING).any(|j| j != i && t.queued[j]);
                            });
                            g
                        })
                        .await
                        .unwrap_or_else(|e| panic!("n{i}: a patient waiter gets the key: {e}"));
                    if g + 1 >= TURNS {
                        return;
                    }
                }
            }));
        }
    }
    within(SOON * 12, "the turns end", async {
        for task in tasks {
            task.await.unwrap();
        }
    })
    .await;

    let (turns, overlaps) = board.read(|t| (t.held.clone(), t.overlaps));
    assert_eq!(overlaps, 0, "two nodes held the key at once");
    assert!(turns.len() >= TURNS, "{} turns", turns.len());
    for pair in turns.windows(2) {
        assert!(
            pair[1].token > pair[0].token,
            "fencing tokens must increase: {pair:?}"
        );
    }
    if !queued {
        return;
    }
    let nodes: Vec<usize> = turns.iter().map(|t| t.node).collect();
    for (g, pair) in turns.windows(2).enumerate() {
        assert!(
            !pair[0].others_queued || pair[1].node != pair[0].node,
            "n{} was served twice in a row (turns {g} and {}) while another node waited in the queue; nodes served: {nodes:?}",
            pair[0].node,
            g + 1
        );
    }
    // The check above proves something only if other nodes were queued at
    // most releases; with a waiter of each node always in line, they are.
    let counted = &turns[..TURNS];
    let contended = counted.iter().filter(|t| t.others_queued).count();
    assert!(
        contended * 10 >= TURNS * 8,
        "only {contended} of {TURNS} releases found another node's waiter in the queue: the waiters did not queue; nodes served: {nodes:?}"
    );
    for i in 0..SHARING {
        let share = counted.iter().filter(|t| t.node == i).count();
        assert!(
            share * 100 >= TURNS * 23 && share * 100 <= TURNS * 43,
            "n{i} got {share} of {TURNS} turns, not about a third (23% to 43%); nodes served: {nodes:?}"
        );
    }
}

/// \[F1\] A try-once call never queues and leaves nothing behind, nor does
/// a waiting call that opted out of the queue: once the holder lets go,
/// another owner takes the key at once (a place left behind would have
/// been granted it). Where the queue is kept, the same probe finds the
/// key granted to a waiter that did queue: the release gives it to the
/// head, leaving no moment in which another can take it.
pub async fn f1_a_try_once_call_leaves_nothing(factory: Arc<dyn BackendFactory>) {
    let backend = factory.backend().await;
    let ns = Namespace::new();
    let key = ns.key("f1-once");
    let holder = node(Arc::clone(&backend), "holder");
    let mut held = holder.handle(&key, LONG).unwrap();
    assert!(held.acquire().await.unwrap());

    let counting = CountingBackend::new(Arc::clone(&backend));
    let try_once = node(counting.clone(), "once");
    let err = within(
        SOON,
        "a try-once call",
        try_once.with_lock_config(&key, &once(), |_| async {}),
    )
    .await
    .expect_err("the key is held");
    assert!(
        matches!(err, LockError::NotAcquired { attempts: 1, .. }),
        "got {err:?}"
    );
    assert_eq!(
        counting.calls(Step::TryAcquire),
        1,
        "a try-once call makes one attempt, unqueued"
    );
    let opted_out = node(Arc::clone(&backend), "opted-out");
    let cfg = LockConfig::default()
        .retry_attempts(2)
        .retry_delay(RETRY)
        .no_queue();
    let err = within(
        SOON,
        "a waiting call without the queue",
        opted_out.with_lock_config(&key, &cfg, |_| async {}),
    )
    .await
    .expect_err("the key is held");
    assert!(err.is_busy(), "got {err:?}");

    assert!(held.release().await.unwrap());
    let probe = OwnerToken::new("probe");
    let lease = match backend.try_acquire(&key, &probe, LONG).await.unwrap() {
        AcquireOutcome::Acquired { fencing_token } => {
            Lease::new(key.as_str(), probe, fencing_token)
        }
        busy => panic!("the key was given to a call that should have left nothing: {busy:?}"),
    };
    assert_eq!(
        backend.release(&lease).await.unwrap(),
        ReleaseOutcome::Released
    );
    if !queues(&*backend) {
        return;
    }

    // The probe can tell: a waiter that queued is granted the key.
    assert!(held.acquire().await.unwrap());
    let waiting = Waiting::new(&backend);
    let w = node(Arc::clone(&waiting), "queued");
    let (inside_tx, inside_rx) = oneshot::channel();
    let (done_tx, done_rx) = oneshot::channel::<()>();
    let k = key.clone();
    let waiter = tokio::spawn(async move {
        w.with_lock_config(&k, &patient(), move |_| async move {
            let _ = inside_tx.send(());
            let _ = done_rx.await;
        })
        .await
    });
    within(SOON, "the waiter queues", waiting.until_waits(1)).await;
    assert!(held.release().await.unwrap());
    let probe = OwnerToken::new("probe");
    let answer = backend.try_acquire(&key, &probe, LONG).await.unwrap();
    assert!(
        answer.is_busy(),
        "the release must grant the key to the queued waiter, leaving it free to nobody else: {answer:?}"
    );
    within(SOON, "the queued waiter starts on its grant", inside_rx)
        .await
        .unwrap();
    drop(done_tx);
    within(SOON, "the queued waiter ends", waiter)
        .await
        .unwrap()
        .unwrap();
}

/// How a waiter of f2's first case stops waiting.
#[derive(Clone, Copy, Debug)]
enum Gone {
    /// Its task is aborted.
    Aborted,
    /// Its future is dropped (as a timeout around it does).
    Dropped,
    /// Its retries run out.
    GaveUp,
}

/// \[F2\] A waiter in the queue that is cancelled (its task aborted), whose
/// future is dropped, or that gives up leaves its place at once: after
/// the holder lets go, a new waiter gets the key well within the claim
/// deadline (2 s, scaled as the ttls are) that a grant to the dead place
/// would have held it for, and the ticket ttl (3 s) the place would have
/// lived.
pub async fn f2_a_cancelled_waiter_leaves_at_once(factory: Arc<dyn BackendFactory>) {
    let backend = factory.backend().await;
    let ns = Namespace::new();
    let key = ns.key("f2-gone");
    let terms = QueueTerms::new(
        scaled(&*backend, Duration::from_secs(3)),
        scaled(&*backend, Duration::from_secs(2)),
    );
    let promptly = scaled(&*backend, Duration::from_secs(1));
    let cfg = patient().fair_queue(terms);
    let holder = node(Arc::clone(&backend), "holder");
    let mut held = holder.handle(&key, LONG).unwrap();
    for how in [Gone::Aborted, Gone::Dropped, Gone::GaveUp] {
        assert!(held.acquire().await.unwrap());
        let waiting = Waiting::new(&backend);
        let w = node(Arc::clone(&waiting), &format!("{how:?}"));
        let queued = waiting.until_waits(1);
        match how {
            Gone::Aborted => {
                let k = key.clone();
                let task =
                    tokio::spawn(async move { w.with_lock_config(&k, &cfg, |_| async {}).await });
                within(SOON, "the waiter queues", queued).await;
                task.abort();
                assert!(task.await.unwrap_err().is_cancelled());
            }
            Gone::Dropped => {
                let call = w.with_lock_config(&key, &cfg, |_| async {});
                within(SOON, "the waiter queues", async {
                    tokio::select! {
                        got = call => panic!("the key is held, yet: {got:?}"),
                        () = queued => {}
                    }
                })
                .await;
            }
            Gone::GaveUp => {
                let gives_up = LockConfig::default()
                    .retry_attempts(2)
                    .retry_delay(RETRY * 3)
                    .retry_jitter(Duration::ZERO)
                    .fair_queue(terms);
                let err = within(
                    SOON,
                    "the waiter gives up",
                    w.with_lock_config(&key, &gives_up, |_| async {}),
                )
                .await
                .expect_err("the key is held");
                assert!(err.is_busy(), "got {err:?}");
                assert!(waiting.waits() >= 1, "it waited (in the queue, where kept)");
            }
        }
        let released_at = Instant::now();
        assert!(held.release().await.unwrap());
        let next = node(Arc::clone(&backend), "next");
        within(
            SOON,
            "a new waiter gets the key",
            next.with_lock_config(&key, &cfg, |_| async {}),
        )
        .await
        .unwrap();
        let took = released_at.elapsed();
        assert!(
            took < promptly,
            "{how:?}: the next waiter got the key {took:?} after the release; the gone waiter's place was not left at once (claim deadline {:?})",
            terms.claim
        );
    }
}

/// \[F2\] A waiter that stops renewing its place (a stall: one queued
/// attempt by hand, with the shortest ticket ttl, then silence) is
/// skipped once its ticket ttl has passed: the release grants the key to
/// the waiter behind it at once, not after the stalled one's claim
/// deadline. When the stalled one comes back it joins the tail: behind a
/// waiter that queued while it was gone, it is not the head, the next
/// release grants the key to that waiter, and only the one after to it.
pub async fn f2_a_stalled_waiter_is_skipped_and_rejoins_at_the_tail(
    factory: Arc<dyn BackendFactory>,
) {
    let backend = factory.backend().await;
    let ns = Namespace::new();
    let key = ns.key("f2-stalled");
    if !queues(&*backend) {
        unqueued_waiting_works(&backend, &key).await;
        return;
    }
    let caps = backend.capabilities();
    let promptly = scaled(&*backend, Duration::from_secs(1));
    let holder = take(&*backend, &key, &OwnerToken::new("holder"), LONG).await;

    // A: one queued attempt, then silence.
    let stalled = OwnerToken::new("stalled");
    let a_terms = QueueTerms::new(
        scaled(&*backend, QueueTerms::MIN_TICKET_TTL),
        scaled(&*backend, Duration::from_secs(2)),
    );
    let first = backend
        .try_acquire_queued(&key, &stalled, LONG, a_terms)
        .await
        .unwrap();
    let lapses_by = Instant::now() + caps.effective_ttl(a_terms.ticket_ttl);
    assert!(first.is_busy(), "the key is held: {first:?}");

    // B: a waiter behind it.
    let b_waiting = Waiting::new(&backend);
    let (b, b_in, b_done) = spawn_holding_waiter(&b_waiting, "b", &key, patient());
    within(SOON, "b queues", b_waiting.until_waits(1)).await;
    // Nothing to wait on but time: A's place lapses.
    tokio::time::sleep_until(lapses_by + scaled(&*backend, Duration::from_millis(250))).await;
    let released_at = Instant::now();
    assert_eq!(
        backend.release(&holder).await.unwrap(),
        ReleaseOutcome::Released
    );
    let (b_at, b_token) = within(SOON, "b gets the key", b_in).await.unwrap();
    let took = b_at - released_at;
    assert!(
        took < promptly,
        "b got the key {took:?} after the release: the stalled place was not skipped (a grant to it holds the key for its claim deadline, {:?})",
        a_terms.claim
    );
    assert!(b_token > holder.fencing_token());

    // C queues while A is gone; then A comes back.
    let c_waiting = Waiting::new(&backend);
    let (c, c_in, c_done) = spawn_holding_waiter(&c_waiting, "c", &key, patient());
    within(SOON, "c queues", c_waiting.until_waits(1)).await;
    let back = backend
        .try_acquire_queued(&key, &stalled, LONG, a_terms)
        .await
        .unwrap();
    assert!(
        matches!(back, AcquireOutcome::Busy { expires_in: None, .. }),
        "the stalled waiter came back behind c: busy, and not told the holder's expiry as the head is: {back:?}"
    );
    drop(b_done);
    within(SOON, "b ends", b).await.unwrap().unwrap();
    let after_b = backend
        .try_acquire_queued(&key, &stalled, LONG, a_terms)
        .await
        .unwrap();
    assert!(
        after_b.is_busy(),
        "b's release granted the key to the waiter that came back after c: {after_b:?}"
    );
    let (_, c_token) = within(SOON, "c gets the key", c_in).await.unwrap();
    assert!(c_token > b_token);
    drop(c_done);
    within(SOON, "c ends", c).await.unwrap().unwrap();
    // Now it is its turn (its grant, or the free key if its place lapsed).
    match backend
        .try_acquire_queued(&key, &stalled, LONG, a_terms)
        .await
        .unwrap()
    {
        AcquireOutcome::Acquired { fencing_token } => {
            assert!(fencing_token > c_token);
            let lease = Lease::new(key.as_str(), stalled, fencing_token);
            assert_eq!(
                backend.release(&lease).await.unwrap(),
                ReleaseOutcome::Released
            );
        }
        busy => panic!("after c, nobody is ahead of the returned waiter: {busy:?}"),
    }
}

/// \[F3\] A grantee that never takes up its grant (placed by hand with a
/// claim deadline of 300 ms, scaled, then gone) loses it: the release
/// announces the grant to it, nobody else holds the key before the claim
/// deadline, and the waiter behind it gets the key within the claim
/// deadline plus its own heartbeat, with a fencing token greater than the
/// grant's. The late grantee can then neither take up, extend nor release
/// the key.
pub async fn f3_an_unclaimed_grant_passes_on_within_the_claim_deadline(
    factory: Arc<dyn BackendFactory>,
) {
    let backend = factory.backend().await;
    let ns = Namespace::new();
    let key = ns.key("f3-claim");
    if !queues(&*backend) {
        unqueued_waiting_works(&backend, &key).await;
        return;
    }
    let caps = backend.capabilities();
    let holder = take(&*backend, &key, &OwnerToken::new("holder"), LONG).await;
    let claim = scaled(&*backend, Duration::from_millis(300));
    let grantee = OwnerToken::new("grantee");
    let a_terms = QueueTerms::new(scaled(&*backend, Duration::from_secs(3)), claim);
    let placed = backend
        .try_acquire_queued(&key, &grantee, LONG, a_terms)
        .await
        .unwrap();
    assert!(placed.is_busy(), "the key is held: {placed:?}");

    let b_terms = QueueTerms::new(
        scaled(&*backend, Duration::from_millis(600)),
        scaled(&*backend, Duration::from_secs(2)),
    );
    let b_waiting = Waiting::new(&backend);
    let (b, b_in, b_done) =
        spawn_holding_waiter(&b_waiting, "b", &key, patient().fair_queue(b_terms));
    within(SOON, "b queues", b_waiting.until_waits(1)).await;
    let mut watch = backend.watch_release(&key).await.unwrap();
    let released_at = Instant::now();
    assert_eq!(
        backend.release(&holder).await.unwrap(),
        ReleaseOutcome::Released
    );
    let grant = within(SOON, "the release announces its grant", async {
        loop {
            watch.released().await;
            if let Some(grant) = watch.grant() {
                break grant;
            }
        }
    })
    .await;
    assert_eq!(
        &*grant.owner,
        grantee.as_str(),
        "the key is granted to the head of the queue"
    );
    assert!(
        grant.fencing_token > holder.fencing_token(),
        "a grant draws a new fencing token: {grant:?} after {}",
        holder.fencing_token()
    );

    let (b_at, b_token) = within(SOON * 2, "b gets the key", b_in).await.unwrap();
    let waited = b_at - released_at;
    assert!(
        waited + Duration::from_millis(10) >= claim,
        "b got the key {waited:?} after the release, while the grant's claim deadline ({claim:?}) had not passed"
    );
    let bound = caps.effective_ttl(claim)
        + b_terms.heartbeat()
        + scaled(&*backend, Duration::from_millis(500));
    assert!(
        waited <= bound,
        "b got the key {waited:?} after the release: more than the claim deadline {claim:?} plus b's heartbeat {:?} and a margin ({bound:?} in all)",
        b_terms.heartbeat()
    );
    assert!(
        b_token > grant.fencing_token,
        "fencing tokens increase through grants: b has {b_token}, the lost grant had {}",
        grant.fencing_token
    );

    // The late grantee changes nothing.
    let late = Lease::new(key.as_str(), grantee.clone(), grant.fencing_token);
    assert_eq!(
        backend.release(&late).await.unwrap(),
        ReleaseOutcome::NotHeld
    );
    let extended = backend.extend(&late, LONG).await.unwrap();
    assert_ne!(
        extended,
        ExtendOutcome::Extended,
        "a lost grant is not extended"
    );
    let taken_up = backend
        .try_acquire_queued(&key, &grantee, LONG, a_terms)
        .await
        .unwrap();
    assert!(
        taken_up.is_busy(),
        "a grant is not taken up after its claim deadline: {taken_up:?}"
    );
    backend.leave_queue(&key, &grantee).await.unwrap();
    drop(b_done);
    within(SOON, "b ends", b).await.unwrap().unwrap();
}

/// \[A9\] A crashed holder's lock (taken by hand with a short ttl, never
/// extended nor released) is taken by a waiter soon after it expires,
/// though the waiter's retry delay is 10 s and nothing announces an
/// expiry: the busy answer said how long the lock had left, and the
/// waiter tries again then, queued (as the head) or not. "Soon" is
/// 250 ms (scaled as the ttls are, for a store whose expiry lags, such
/// as etcd's lessor). A store whose busy answers do not say it (checked
/// by hand first) is held to its retry delay instead, made short.
pub async fn a9_a_crashed_holders_lock_is_taken_soon_after_it_expires(
    factory: Arc<dyn BackendFactory>,
) {
    let backend = factory.backend().await;
    let ns = Namespace::new();
    let caps = backend.capabilities();
    let ttl = scaled(&*backend, SHORT_TTL);
    let soon_after = scaled(&*backend, Duration::from_millis(250));

    let probed = ns.key("a9-probe");
    let probe_holder = take(&*backend, &probed, &OwnerToken::new("holder"), ttl).await;
    let answer = backend
        .try_acquire(&probed, &OwnerToken::new("probe"), ttl)
        .await
        .unwrap();
    let AcquireOutcome::Busy { expires_in, .. } = answer else {
        panic!("the key is held: {answer:?}");
    };
    if let Some(left) = expires_in {
        assert!(
            left <= caps.effective_ttl(ttl) + Duration::from_millis(5),
            "the holder has at most its ttl ({ttl:?}) left, not {left:?}"
        );
    }
    backend.release(&probe_holder).await.unwrap();
    let (retry_delay, bound) = match expires_in {
        Some(_) => (Duration::from_secs(10), soon_after),
        None => {
            let delay = scaled(&*backend, Duration::from_millis(200));
            (delay, delay + soon_after)
        }
    };

    for queued in [true, false] {
        let key = ns.key(if queued { "a9-queued" } else { "a9-unqueued" });
        let mut cfg = LockConfig::default()
            .wait_forever()
            .retry_delay(retry_delay)
            .retry_jitter(Duration::ZERO);
        if !queued {
            cfg = cfg.no_queue();
        }
        let sent = Instant::now();
        let _crashed = take(&*backend, &key, &OwnerToken::new("crashed"), ttl).await;
        let expired_by = Instant::now() + caps.effective_ttl(ttl);
        let w = node(Arc::clone(&backend), "waiter");
        let took_at = within(
            caps.effective_ttl(ttl) + bound + SOON,
            "the waiter gets the crashed holder's key",
            w.with_lock_config(&key, &cfg, |_| async { Instant::now() }),
        )
        .await
        .unwrap();
        assert!(
            took_at + Duration::from_millis(5) >= sent + ttl,
            "the waiter took the key before the crashed holder's lock expired"
        );
        assert!(
            took_at <= expired_by + bound,
            "{}: the waiter got the key {:?} after the crashed holder's lock expired, more than {bound:?} (retry delay {retry_delay:?}; the busy answer said {expires_in:?} left)",
            if queued { "queued" } else { "unqueued" },
            took_at.saturating_duration_since(expired_by)
        );
    }
}

/// What f5's callers saw.
#[derive(Default)]
struct Mix {
    /// Each turn in order: the node and its fencing token.
    held: Vec<(usize, u64)>,
    inside: usize,
    overlaps: usize,
}

/// Leaves f5's section when dropped.
struct Leaves(Arc<Board<Mix>>);

impl Drop for Leaves {
    fn drop(&mut self) {
        self.0.update(|m| m.inside -= 1);
    }
}

/// \[F5\] Callers in the queue and callers that opted out exclude each
/// other on one key: 2 nodes in the queue (2 tasks each) and 2 that
/// poll outside it loop with a 5 ms section for 3 s (scaled); no two
/// sections overlap, fencing tokens increase, and once every call has
/// stopped (those still waiting or inside dropped) the key is free soon.
///
/// The bound within which a poller outside the queue gets the key is not
/// checked here: it differs per backend (memory, Redis and PostgreSQL
/// leave a 600 ms gap after 10 s of grants in a row; etcd builds none,
/// as every etcd lock client waits in the same line, see its README) and
/// no capability declares it, so each backend's own tests prove theirs.
pub async fn f5_queued_and_unqueued_callers_exclude_each_other(factory: Arc<dyn BackendFactory>) {
    let backend = factory.backend().await;
    let queued = queues(&*backend);
    let ns = Namespace::new();
    let key = ns.key("f5-mix");
    let run_for = scaled(&*backend, Duration::from_secs(3));
    let section = Duration::from_millis(5);
    let board = Board::new(Mix::default());
    let started = Instant::now();
    let mut tasks = Vec::new();
    // Nodes 0 and 1 queue, 2 and 3 do not.
    for i in 0..4 {
        let in_queue = i < 2;
        let n = node(
            Arc::clone(&backend),
            &format!("{}{i}", if in_queue { "queued" } else { "outside" }),
        );
        let cfg = if in_queue {
            patient()
        } else {
            patient().no_queue()
        };
        for _ in 0..if in_queue { 2 } else { 1 } {
            let (n, k, board) = (n.clone(), key.clone(), Arc::clone(&board));
            tasks.push(tokio::spawn(async move {
                while let Some(left) = run_for.checked_sub(started.elapsed()) {
                    let b = Arc::clone(&board);
                    let call = n.with_lock_config(&k, &cfg, move |ctx| async move {
                        b.update(|m| {
                            m.inside += 1;
                            if m.inside > 1 {
                                m.overlaps += 1;
                            }
                            m.held.push((i, ctx.fencing_token()));
                        });
                        // Out also when the timeout below drops the call
                        // in its section (its lock is released after).
                        let _out = Leaves(b);
                        tokio::time::sleep(section).await;
                    });
                    // A waiter still waiting at the end is dropped.
                    match tokio::time::timeout(left, call).await {
                        Ok(got) => got.unwrap_or_else(|e| panic!("node {i}: {e}")),
                        Err(_) => return,
                    }
                }
            }));
        }
    }
    within(run_for + SOON * 2, "the callers end", async {
        for task in tasks {
            task.await.unwrap();
        }
    })
    .await;

    // The calls dropped at the end, waiting or inside, left nothing
    // behind: their places are left and their locks released.
    let after = node(Arc::clone(&backend), "after");
    within(
        SOON,
        "the key is free once every caller stopped",
        after.with_lock_config(&key, &patient(), |_| async {}),
    )
    .await
    .unwrap();

    let (held, overlaps) = board.read(|m| (m.held.clone(), m.overlaps));
    assert_eq!(
        overlaps, 0,
        "a caller in the queue and one outside it held the key at once"
    );
    for pair in held.windows(2) {
        assert!(
            pair[1].1 > pair[0].1,
            "fencing tokens must increase: {pair:?}"
        );
    }
    if queued {
        let turns = |i: usize| held.iter().filter(|(n, _)| *n == i).count();
        assert!(
            turns(0) + turns(1) >= 10,
            "the callers in the queue kept the key busy: {} turns",
            turns(0) + turns(1)
        );
    }
}

/// A backend whose store refuses the fair queue, as one without the
/// queue's table or rights does: each queued attempt is a setup error.
struct RefusesQueue {
    inner: Arc<DynLockBackend>,
    refused: AtomicU64,
}

impl fmt::Debug for RefusesQueue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RefusesQueue")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

lock_core::forward_lock_backend!(RefusesQueue => inner {
    async fn try_acquire_queued(
        &self,
        key: &str,
        owner: &OwnerToken,
        ttl: Duration,
        terms: QueueTerms,
    ) -> Result<AcquireOutcome, BackendError> {
        let _ = (key, owner, ttl, terms);
        self.refused.fetch_add(1, Ordering::SeqCst);
        Err(BackendError::message(
            BackendErrorKind::Setup,
            "permission denied for the fair queue (refused by the conformance case)",
        ))
    }
});

/// \[F6\] Where the store refuses the queue (its table or rights missing:
/// every queued attempt a setup error), waiting falls back to unqueued
/// waiting and is never a setup error: a waiter with the default config
/// gets the key once its holder lets go, and waiters that give up, on
/// that node and on a fresh one, say the key was busy.
pub async fn f6_a_backend_without_the_queue_waits_unqueued(factory: Arc<dyn BackendFactory>) {
    let backend = factory.backend().await;
    let declared = queues(&*backend);
    let ns = Namespace::new();
    let key = ns.key("f6-refused");
    let refusing = Arc::new(RefusesQueue {
        inner: Arc::clone(&backend),
        refused: AtomicU64::new(0),
    });
    let holder = node(Arc::clone(&backend), "holder");
    let mut held = holder.handle(&key, LONG).unwrap();
    assert!(held.acquire().await.unwrap());

    let counting = CountingBackend::new(Arc::clone(&refusing));
    let w = node(counting.clone(), "waiter");
    let (l, k) = (w.clone(), key.clone());
    let waiter = tokio::spawn(async move {
        l.with_lock(&k, |ctx| async move { ctx.fencing_token() })
            .await
    });
    within(
        SOON,
        "the waiter waits",
        counting.until_answered(Step::TryAcquire, 2),
    )
    .await;
    if declared {
        assert!(
            refusing.refused.load(Ordering::SeqCst) >= 1,
            "a waiting call asks for the queue by default"
        );
    }
    let holder_token = held.fencing_token().unwrap();
    assert!(held.release().await.unwrap());
    let token = within(SOON, "the waiter gets the key", waiter)
        .await
        .unwrap()
        .unwrap_or_else(|e| panic!("waiting falls back to unqueued waiting: {e}"));
    assert!(token > holder_token);

    assert!(held.acquire().await.unwrap());
    let gives_up = LockConfig::default().retry_attempts(2).retry_delay(RETRY);
    let fresh = node(Arc::clone(&refusing), "fresh");
    for n in [&w, &fresh] {
        let err = within(
            SOON,
            "a waiter gives up",
            n.with_lock_config(&key, &gives_up, |_| async {}),
        )
        .await
        .expect_err("the key is held");
        assert!(
            matches!(&err, LockError::NotAcquired { attempts: 3, source, .. }
                if source.as_ref().is_none_or(|e| !e.is_permanent())),
            "{}: a refused queue is never a setup error: {err:?}",
            n.node_id()
        );
    }
    assert!(held.release().await.unwrap());
}

/// \[F6\] A call that requires the queue (`require_fair_queue`) never
/// waits unqueued: on a backend that keeps no queue it fails at once with
/// `InvalidInput::FairQueueUnavailable`, having sent nothing; where the
/// store refuses the queue, it fails with the store's setup error at its
/// first queued attempt, the holder's lock untouched. Where the queue
/// works, a required call waits in it and gets the key.
pub async fn f6_a_required_queue_fails_rather_than_wait_unqueued(factory: Arc<dyn BackendFactory>) {
    let backend = factory.backend().await;
    let ns = Namespace::new();
    let key = ns.key("f6-required");
    let required = patient().require_fair_queue();
    if !queues(&*backend) {
        let counting = CountingBackend::new(Arc::clone(&backend));
        let n = node(counting.clone(), "required");
        let err = n
            .with_lock_config(&key, &required, |_| async {})
            .await
            .expect_err("no queue to wait in");
        assert!(
            matches!(
                &err,
                LockError::InvalidInput(lock_core::InvalidInput::FairQueueUnavailable { .. })
            ),
            "a clear error: {err:?}"
        );
        assert_eq!(counting.total_calls(), 0, "nothing was sent");
        return;
    }
    let holder = node(Arc::clone(&backend), "holder");
    let mut held = holder.handle(&key, LONG).unwrap();
    assert!(held.acquire().await.unwrap());
    let holder_token = held.fencing_token().unwrap();

    let refusing = Arc::new(RefusesQueue {
        inner: Arc::clone(&backend),
        refused: AtomicU64::new(0),
    });
    let n = node(Arc::clone(&refusing), "refused");
    let err = within(
        SOON,
        "a required queue the store refuses fails at once",
        n.with_lock_config(&key, &required, |_| async {}),
    )
    .await
    .expect_err("the store refuses the queue");
    assert!(
        matches!(&err, LockError::NotAcquired { source: Some(e), .. } if e.is_permanent()),
        "the store's setup error: {err:?}"
    );
    assert_eq!(refusing.refused.load(Ordering::SeqCst), 1);
    assert!(
        held.renew().await.unwrap(),
        "the holder's lock is untouched"
    );

    let counting = CountingBackend::new(Arc::clone(&backend));
    let w = node(counting.clone(), "waiter");
    let k = key.clone();
    let waiter = tokio::spawn(async move {
        w.with_lock_config(&k, &required, |ctx| async move { ctx.fencing_token() })
            .await
    });
    // Its plain attempt and its queued one answered: it holds a place.
    within(
        SOON,
        "the required waiter queues",
        counting.until_answered(Step::TryAcquire, 2),
    )
    .await;
    assert!(held.release().await.unwrap());
    let token = within(SOON, "the required waiter gets the key", waiter)
        .await
        .unwrap()
        .unwrap();
    assert!(token > holder_token);
}

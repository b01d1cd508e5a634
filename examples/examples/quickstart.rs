//! Quickstart: three nodes of a cluster share one lock backend.
//!
//! Three [`Locker`]s on one in-memory backend stand for three nodes. The
//! program walks through what `with_lock` promises, checks each promise and
//! exits non-zero as soon as one does not hold:
//!
//! - (a) exclusion: the nodes run the same job at once, one after the other;
//! - (b) giving up: a bounded number of attempts ends in `NotAcquired`, and
//!   the callback did not run;
//! - (c) fencing tokens strictly increase from one holder to the next;
//! - (d) reentrancy: `with_lock` on the held key inside the callback runs at
//!   once, under the same lock;
//! - (e) a lost lock: another owner takes the key, `with_lock` returns
//!   `Lost` at once and the callback learns it through its context;
//! - (f) shutdown: a node releases the locks it holds, and another node
//!   takes them at once.
//!
//! It needs nothing but cargo:
//!
//! ```text
//! cargo run -p withlock-examples --example quickstart
//! ```

use std::error::Error;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use lock_memory::lock_core::{
    async_trait, AcquireOutcome, BackendError, Capabilities, ExtendOutcome, ExtendRequest, Hold,
    Lease, LockBackend, LockConfig, LockError, Locker, LockerOptions, LossCause, OwnerToken,
    ReleaseOutcome, ReleaseWatch,
};
use lock_memory::MemoryBackend;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinSet;

type Result<T = (), E = Box<dyn Error>> = std::result::Result<T, E>;

#[tokio::main]
async fn main() -> Result {
    // Every step ends on its own in well under a second; the limit only
    // turns a hang into a failure.
    tokio::time::timeout(Duration::from_secs(20), run())
        .await
        .map_err(|_| "quickstart did not finish within 20 s")??;
    println!("\nquickstart: all steps behaved as described");
    Ok(())
}

async fn run() -> Result {
    let backend = MemoryBackend::new();
    let node =
        |id: &str| Locker::with_options(backend.clone(), LockerOptions::default().node_id(id));
    let nodes = [node("node-a")?, node("node-b")?, node("node-c")?];

    exclusion(&nodes).await?;
    giving_up(&nodes).await?;
    fencing_tokens(&nodes).await?;
    reentrancy(&nodes).await?;
    lost_lock(&backend).await?;
    shutdown(&nodes).await?;
    Ok(())
}

/// (a) The three nodes start the same job twice each, all at once.
async fn exclusion(nodes: &[Locker; 3]) -> Result {
    println!("(a) Exclusion: node-a, node-b and node-c each start the job \"report:rebuild\" twice, all at once.");
    let inside = Arc::new(AtomicUsize::new(0));
    let most_inside = Arc::new(AtomicUsize::new(0));
    let (ran_tx, mut ran_rx) = mpsc::unbounded_channel();
    let mut calls = JoinSet::new();
    for node in nodes.iter().chain(nodes) {
        let (node, name) = (node.clone(), node.node_id().to_owned());
        let (inside, most_inside, ran_tx) = (inside.clone(), most_inside.clone(), ran_tx.clone());
        calls.spawn(async move {
            node.with_lock("report:rebuild", move |ctx| async move {
                let now_inside = inside.fetch_add(1, Ordering::SeqCst) + 1;
                most_inside.fetch_max(now_inside, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(50)).await;
                // Sent inside the critical section, so received in run order.
                let _ = ran_tx.send((name, ctx.fencing_token()));
                inside.fetch_sub(1, Ordering::SeqCst);
            })
            .await
        });
    }
    drop(ran_tx);
    while let Some(call) = calls.join_next().await {
        call??;
    }
    let mut runs = Vec::new();
    while let Some((name, token)) = ran_rx.recv().await {
        println!("    {name} ran the job (fencing token {token})");
        runs.push(token);
    }
    let most = most_inside.load(Ordering::SeqCst);
    println!("    6 runs, at most {most} node inside the job at any moment.");
    check(runs.len() == 6, "every call ran the job once")?;
    check(most == 1, "no two runs of the job overlapped")?;
    Ok(())
}

/// (b) node-b makes 1 + 2 attempts, 50 ms apart, while node-a holds the key.
async fn giving_up(nodes: &[Locker; 3]) -> Result {
    println!(
        "\n(b) Giving up: node-a holds \"invoice:42\"; node-b tries 1 + 2 times, 50 ms apart."
    );
    let (release, holder) = hold(&nodes[0], "invoice:42").await?;

    let ran = Arc::new(AtomicBool::new(false));
    let config = LockConfig::default()
        .retry_attempts(2)
        .retry_delay(Duration::from_millis(50))
        // An exact grid, so the wait is easy to check here; by default each
        // delay moves at random by up to 100 ms (capped at the delay).
        .retry_jitter(Duration::ZERO);
    let started = Instant::now();
    let ran_in_callback = ran.clone();
    let outcome = nodes[1]
        .with_lock_config("invoice:42", &config, move |_| async move {
            ran_in_callback.store(true, Ordering::SeqCst);
        })
        .await;
    let waited = started.elapsed();
    let Err(LockError::NotAcquired { attempts, .. }) = outcome else {
        return Err(format!("expected NotAcquired, got {outcome:?}").into());
    };
    let ran = ran.load(Ordering::SeqCst);
    println!("    node-b gave up after {attempts} attempts, {waited:.0?} later: NotAcquired.");
    println!("    Its callback ran: {ran}.");
    check(attempts == 3, "NotAcquired counts 3 attempts")?;
    check(
        waited >= Duration::from_millis(100),
        "the attempts were 50 ms apart",
    )?;
    check(!ran, "the callback did not run")?;

    let _ = release.send(());
    holder.await??;
    Ok(())
}

/// (c) The nodes take the same key in turn.
async fn fencing_tokens(nodes: &[Locker; 3]) -> Result {
    println!(
        "\n(c) Fencing tokens: node-a, node-b, node-c, then node-a again take \"ledger\" in turn."
    );
    let mut tokens = Vec::new();
    for node in [&nodes[0], &nodes[1], &nodes[2], &nodes[0]] {
        let token = node
            .with_lock("ledger", |ctx| async move { ctx.fencing_token() })
            .await?;
        println!("    {} got fencing token {token}", node.node_id());
        tokens.push(token);
    }
    check(
        tokens.windows(2).all(|pair| pair[0] < pair[1]),
        "fencing tokens strictly increase",
    )?;
    println!("    Each holder's token is greater than every earlier one, whichever node it is on.");
    Ok(())
}

/// (d) A `with_lock` on the held key, from inside the callback.
async fn reentrancy(nodes: &[Locker; 3]) -> Result {
    println!("\n(d) Reentrancy: inside its callback on \"config:reload\", node-a calls with_lock on that key again.");
    let (a, b) = (nodes[0].clone(), nodes[1].clone());
    let (outer, inner, inner_took, b_outcome) = nodes[0]
        .with_lock("config:reload", move |ctx| async move {
            let started = Instant::now();
            let inner = a
                .with_lock(
                    "config:reload",
                    |inner| async move { inner.fencing_token() },
                )
                .await?;
            let inner_took = started.elapsed();
            // Another node still finds the key busy.
            let once = LockConfig::default().retry_attempts(0);
            let b_outcome = b
                .with_lock_config("config:reload", &once, |_| async {})
                .await;
            Ok::<_, LockError>((ctx.fencing_token(), inner, inner_took, b_outcome))
        })
        .await??;
    println!("    The inner call ran after {inner_took:.1?}, with fencing token {inner} (outer call: {outer}).");
    println!(
        "    Meanwhile node-b's single attempt found the key busy: {}.",
        b_outcome.as_ref().is_err_and(LockError::is_not_acquired)
    );
    check(inner == outer, "the inner call sees the outer call's token")?;
    check(
        inner_took < Duration::from_millis(50),
        "the inner call ran at once",
    )?;
    check(
        b_outcome.is_err_and(|e| e.is_not_acquired()),
        "another node is still excluded",
    )?;
    Ok(())
}

/// (e) Another owner takes node-a's key while its callback runs.
async fn lost_lock(backend: &MemoryBackend) -> Result {
    println!("\n(e) Lost lock: node-a holds \"import:users\" with a 300 ms ttl; then an intruder takes the key.");
    let intruder = IntruderBackend::new(backend.clone());
    let node_a =
        Locker::with_options(intruder.clone(), LockerOptions::default().node_id("node-a"))?;
    let (started_tx, started_rx) = oneshot::channel();
    let (seen_tx, seen_rx) = oneshot::channel();
    let config = LockConfig::default().ttl(Duration::from_millis(300));
    let call = tokio::spawn(async move {
        node_a
            .with_lock_config("import:users", &config, move |ctx| async move {
                let _ = started_tx.send(());
                // Real work would check `ctx.is_lost()` before each write.
                let cause = ctx.lost().await;
                let _ = seen_tx.send((cause, ctx.is_lost()));
            })
            .await
    });
    started_rx.await?;
    intruder.steal_at_next_extension();
    let armed_at = Instant::now();

    let outcome = call.await?;
    let returned_after = armed_at.elapsed();
    let Err(LockError::Lost { cause, .. }) = &outcome else {
        return Err(format!("expected Lost, got {outcome:?}").into());
    };
    let holder = backend.holder("import:users");
    let holder_node = holder.as_ref().map_or("nobody", |h| h.node_id());
    println!(
        "    with_lock returned Lost ({cause}) {returned_after:.0?} after the intruder was let in."
    );
    println!("    The key is now held by {holder_node}.");
    check(matches!(cause, LossCause::Taken), "the cause is Taken")?;
    check(
        returned_after < Duration::from_millis(200),
        "the loss was seen at the next extension, about ttl/3 later",
    )?;
    check(holder_node == "intruder", "the intruder holds the key")?;

    let (seen_cause, is_lost) = tokio::time::timeout(Duration::from_secs(1), seen_rx).await??;
    println!("    The callback, still running, saw ctx.lost() resolve ({seen_cause}) and ctx.is_lost() = {is_lost}.");
    check(
        matches!(seen_cause, LossCause::Taken) && is_lost,
        "the callback learned of the loss",
    )?;
    Ok(())
}

/// (f) node-c shuts down while its callback still runs.
async fn shutdown(nodes: &[Locker; 3]) -> Result {
    println!("\n(f) Shutdown: node-c holds \"batch:export\" in a long callback, then shuts down with 200 ms of grace.");
    let c = nodes[2].clone();
    let (held_tx, held_rx) = oneshot::channel();
    let long_call = tokio::spawn(async move {
        c.with_lock("batch:export", |ctx| async move {
            let _ = held_tx.send(());
            tokio::select! {
                () = tokio::time::sleep(Duration::from_secs(60)) => "finished",
                _ = ctx.lost() => "stopped early",
            }
        })
        .await
    });
    held_rx.await?;

    let started = Instant::now();
    let report = nodes[2].shutdown(Duration::from_millis(200)).await;
    let took = started.elapsed();
    println!("    shutdown returned after {took:.0?}: {report:?}");
    check(
        !report.callbacks_finished,
        "the callback outlived the grace period",
    )?;
    check(
        report.released == 1 && report.release_failures == 0,
        "shutdown released the one lock node-c held",
    )?;

    let outcome = long_call.await?;
    println!("    node-c's call returned {outcome:?}.");
    check(
        outcome
            .as_ref()
            .is_err_and(|e| matches!(e.loss_cause(), Some(LossCause::Shutdown))),
        "node-c's call got Lost with cause Shutdown",
    )?;

    let once = LockConfig::default().retry_attempts(0);
    let token = nodes[0]
        .with_lock_config(
            "batch:export",
            &once,
            |ctx| async move { ctx.fencing_token() },
        )
        .await?;
    println!("    node-a took \"batch:export\" with a single attempt (fencing token {token}): no ttl to wait for.");

    let ran = Arc::new(AtomicBool::new(false));
    let ran_in_callback = ran.clone();
    let after = tokio::time::timeout(
        Duration::from_millis(200),
        nodes[2].with_lock("other-key", move |_| async move {
            ran_in_callback.store(true, Ordering::SeqCst);
        }),
    )
    .await;
    let ran = ran.load(Ordering::SeqCst);
    println!(
        "    A new with_lock on node-c settled within 200 ms: {}; its callback ran: {ran}.",
        after.is_ok()
    );
    check(
        after.is_err() && !ran,
        "a shut-down node never runs new callbacks",
    )?;
    Ok(())
}

/// Holds `key` on `node` until the returned sender fires or is dropped.
async fn hold(
    node: &Locker,
    key: &'static str,
) -> Result<(
    oneshot::Sender<()>,
    tokio::task::JoinHandle<Result<(), LockError>>,
)> {
    let (held_tx, held_rx) = oneshot::channel();
    let (release_tx, release_rx) = oneshot::channel::<()>();
    let node = node.clone();
    let holder = tokio::spawn(async move {
        node.with_lock(key, |_| async move {
            let _ = held_tx.send(());
            let _ = release_rx.await;
        })
        .await
    });
    held_rx.await?;
    Ok((release_tx, holder))
}

/// Fails the program with `claim` unless `holds`.
fn check(holds: bool, claim: &str) -> Result {
    if holds {
        Ok(())
    } else {
        Err(format!("this did not hold: {claim}").into())
    }
}

/// A backend in front of a [`MemoryBackend`] that can let an intruder in:
/// once armed, the next extension first frees the key and gives it to the
/// owner `intruder/…`, then goes on to the memory backend, which truthfully
/// answers [`ExtendOutcome::Taken`]. Every other step is forwarded as is.
#[derive(Clone, Debug)]
struct IntruderBackend {
    inner: MemoryBackend,
    armed: Arc<AtomicBool>,
}

impl IntruderBackend {
    fn new(inner: MemoryBackend) -> Self {
        Self {
            inner,
            armed: Arc::default(),
        }
    }

    /// Lets the intruder take the keys of the next extension.
    fn steal_at_next_extension(&self) {
        self.armed.store(true, Ordering::SeqCst);
    }

    async fn steal(&self, lease: &Lease, ttl: Duration) -> Result<(), BackendError> {
        self.inner.release(lease).await?;
        let intruder = OwnerToken::new("intruder");
        self.inner.try_acquire(lease.key(), &intruder, ttl).await?;
        Ok(())
    }
}

#[async_trait]
impl LockBackend for IntruderBackend {
    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }

    async fn try_acquire(
        &self,
        key: &str,
        owner: &OwnerToken,
        ttl: Duration,
    ) -> Result<AcquireOutcome, BackendError> {
        self.inner.try_acquire(key, owner, ttl).await
    }

    async fn extend(&self, lease: &Lease, ttl: Duration) -> Result<ExtendOutcome, BackendError> {
        if self.armed.swap(false, Ordering::SeqCst) {
            self.steal(lease, ttl).await?;
        }
        self.inner.extend(lease, ttl).await
    }

    async fn extend_many(
        &self,
        requests: &[ExtendRequest],
    ) -> Vec<Result<ExtendOutcome, BackendError>> {
        if self.armed.swap(false, Ordering::SeqCst) {
            for request in requests {
                if let Err(error) = self.steal(&request.lease, request.ttl).await {
                    return vec![Err(error); requests.len()];
                }
            }
        }
        self.inner.extend_many(requests).await
    }

    fn failure_domain(&self, key: &str) -> u64 {
        self.inner.failure_domain(key)
    }

    async fn release(&self, lease: &Lease) -> Result<ReleaseOutcome, BackendError> {
        self.inner.release(lease).await
    }

    async fn hold(&self, lease: &Lease, hold: Hold) -> Result<ExtendOutcome, BackendError> {
        self.inner.hold(lease, hold).await
    }

    async fn watch_release(&self, key: &str) -> Result<ReleaseWatch, BackendError> {
        self.inner.watch_release(key).await
    }
}

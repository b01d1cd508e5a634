//! Release notifications: one watch stream per backend, one watch on it
//! per name that somebody waits for.
//!
//! A name is freed when its holder's key (the contender with the lowest
//! create revision) is deleted: released, revoked, expired or deleted by
//! hand. The keys of attempts that found the name busy are deleted too,
//! a moment after they were put; waking the waiters for those would make
//! them try again, whose own deleted attempts would wake the others, and
//! so on while the name stays held. So each watch knows the name's
//! contenders (read when the watch is made, followed on the watch) and
//! wakes its waiters only when the lowest one goes.
//!
//! The next contender then holds, by etcd's rule \[F1\]: when it is a
//! waiter of this backend's fair queue, the wake-up is a grant to it
//! (`ReleaseHub::grant`, with its create revision as the fencing token and
//! as long as its ticket lease surely lives), and its waiter starts at once
//! without a round trip, while every other waiter of this backend waits
//! on; when it is a contender of another backend or client, the grant
//! names it, so no waiter here tries; only a name left without contenders
//! wakes every waiter to try. The contenders' values (owner tokens) are
//! followed for this, from the read that makes the watch and the watch's
//! own events: no read per release. A grant to a waiter of this backend
//! that is not taken up within its claim deadline is ended here \[F3\]:
//! the place's leases are revoked, and the next contender holds.
//!
//! A task owns the stream. A watch is in place once etcd confirmed it,
//! and `watch` returns only then, so no release after it is missed. When
//! the stream breaks, every waiter is woken (it may have missed a
//! release), and the watches still wanted are made again on a new stream.
//! The stream is on the endpoint in use: a stream that breaks, or whose
//! watch goes unconfirmed for the failover timeout, passes its endpoint
//! over, and after any failover the stream is made again on the new
//! endpoint, at once.
//!
//! The task runs on the background runtime \[T1\], so it outlives the
//! runtime the backend was made on. Watches that cannot be made again
//! (the endpoint still down) are tried again, the pause doubling from
//! 200 ms up to 5 s until a watch is confirmed, for as long as somebody
//! waits on their name.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use etcd_client::{EventType, GetOptions, WatchOptions, WatchRequestSender, WatchResponseStream};
use lock_core::{BackendError, BackendErrorKind, Grant, ReleaseHub};
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

use crate::backend::revoke;
use crate::endpoints::{Again, Endpoints};
use crate::error::step_error;
use crate::layout::{contender_range, is_contender};
use crate::queue::{Expired, Places, MIN_GRANT_CLAIM};

/// How often watches nobody waits on any more are cancelled.
const SWEEP: Duration = Duration::from_secs(2);

/// How long a broken stream waits before it is made again; doubled after
/// each rebuild that confirmed no watch, up to [`MAX_REBUILD_AFTER`].
const REBUILD_AFTER: Duration = Duration::from_millis(200);
const MAX_REBUILD_AFTER: Duration = Duration::from_secs(5);

type Reply = oneshot::Sender<Result<(), BackendError>>;

struct Command {
    name: Arc<str>,
    reply: Reply,
}

/// The handle of the watch task; the task ends when it is dropped.
#[derive(Debug)]
pub(crate) struct Watches {
    commands: mpsc::UnboundedSender<Command>,
    counts: Arc<Counts>,
}

/// The sizes of the task's per-name structures, as it last counted them.
#[derive(Debug, Default)]
pub(crate) struct Counts {
    /// Names with a watch, made or being made.
    pub(crate) names: AtomicUsize,
    /// Watches etcd confirmed.
    pub(crate) ids: AtomicUsize,
    /// Watches asked for and not confirmed yet.
    pub(crate) creating: AtomicUsize,
    /// Names to watch again on a new stream.
    pub(crate) rebuild: AtomicUsize,
}

impl Watches {
    /// Starts the task on the background runtime; the stream opens at the
    /// first watch.
    pub(crate) fn start(
        endpoints: &Arc<Endpoints>,
        hub: ReleaseHub,
        places: Arc<Places>,
        step_timeout: Duration,
    ) -> Self {
        let (commands, rx) = mpsc::unbounded_channel();
        let counts = Arc::new(Counts::default());
        let task = Task {
            counts: Arc::clone(&counts),
            rebuild_pause: REBUILD_AFTER,
            endpoints: Arc::clone(endpoints),
            hub,
            places,
            step_timeout,
            stream: None,
            trying: 0,
            names: HashMap::new(),
            by_id: HashMap::new(),
            creating: VecDeque::new(),
            rebuild: Vec::new(),
            rebuild_at: None,
            claims: Vec::new(),
        };
        endpoints.background().spawn(task.run(rx));
        Self { commands, counts }
    }

    /// The sizes of the task's per-name structures.
    pub(crate) fn counts(&self) -> &Counts {
        &self.counts
    }

    /// Makes sure a watch on `name` is in place.
    ///
    /// # Cancel safety
    ///
    /// A dropped call leaves the watch being made; it is cancelled once
    /// nobody waits on the name.
    pub(crate) async fn watch(&self, name: &str) -> Result<(), BackendError> {
        let (reply, answer) = oneshot::channel();
        self.commands
            .send(Command {
                name: name.into(),
                reply,
            })
            .map_err(|_| failed("the watch task stopped"))?;
        answer.await.map_err(|_| failed("the watch task stopped"))?
    }
}

fn failed(why: &'static str) -> BackendError {
    BackendError::message(BackendErrorKind::Request, why)
}

struct Watched {
    /// etcd's id of the watch, once it confirmed it.
    id: Option<i64>,
    /// Callers waiting for the confirmation.
    waiting: Vec<Reply>,
    /// The name's contenders.
    contenders: Line,
}

/// A name's contender keys, by key and by create revision, with their
/// values.
#[derive(Debug, Default)]
struct Line {
    revisions: HashMap<Vec<u8>, i64>,
    /// Each contender's key and value, by create revision.
    by_revision: BTreeMap<i64, (Vec<u8>, Vec<u8>)>,
}

impl Line {
    /// A contender put, or moved (the same create revision).
    fn put(&mut self, key: &[u8], revision: i64, value: &[u8]) {
        if let Some(old) = self.revisions.insert(key.to_vec(), revision) {
            if old != revision {
                self.by_revision.remove(&old);
            }
        }
        self.by_revision
            .insert(revision, (key.to_vec(), value.to_vec()));
    }

    /// A contender deleted: its create revision, if it was known.
    fn delete(&mut self, key: &[u8]) -> Option<i64> {
        let revision = self.revisions.remove(key)?;
        self.by_revision.remove(&revision);
        Some(revision)
    }

    /// The lowest create revision, and its contender's value.
    fn lowest(&self) -> Option<(i64, &[u8])> {
        self.by_revision
            .iter()
            .next()
            .map(|(revision, (_, value))| (*revision, value.as_slice()))
    }
}

struct Stream {
    sender: WatchRequestSender,
    responses: WatchResponseStream,
    /// The pin it was opened on.
    generation: u64,
}

struct Task {
    counts: Arc<Counts>,
    /// The pause before the next rebuild.
    rebuild_pause: Duration,
    endpoints: Arc<Endpoints>,
    hub: ReleaseHub,
    /// The places of this backend's waiters, to tell a grant to one.
    places: Arc<Places>,
    step_timeout: Duration,
    stream: Option<Stream>,
    /// The pin the stream is being opened on.
    trying: u64,
    names: HashMap<Arc<str>, Watched>,
    by_id: HashMap<i64, Arc<str>>,
    /// Names whose watch was asked for and not confirmed yet, in order
    /// (etcd confirms the watches of one stream in the order asked), with
    /// when each was asked.
    creating: VecDeque<(Arc<str>, Instant)>,
    /// Names to watch again on a new stream.
    rebuild: Vec<Arc<str>>,
    rebuild_at: Option<Instant>,
    /// \[F3\] The grants made to this backend's waiters and not known to
    /// be taken up: when each claim deadline passes, with the place's
    /// name, owner token and ticket lease.
    claims: Vec<(Instant, Arc<str>, Box<str>, i64)>,
}

async fn next_message(
    stream: &mut Option<Stream>,
) -> Result<Option<etcd_client::WatchResponse>, etcd_client::Error> {
    match stream {
        Some(stream) => stream.responses.message().await,
        None => std::future::pending().await,
    }
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

impl Task {
    async fn run(mut self, mut commands: mpsc::UnboundedReceiver<Command>) {
        let mut sweep = tokio::time::interval(SWEEP);
        sweep.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut switched = self.endpoints.subscribe();
        loop {
            self.count();
            let unconfirmed = self
                .creating
                .front()
                .map(|(_, asked)| *asked + self.endpoints.failover_after());
            tokio::select! {
                command = commands.recv() => match command {
                    None => return,
                    Some(Command { name, reply }) => {
                        self.watch(name, Some(reply)).await;
                    }
                },
                message = next_message(&mut self.stream) => match message {
                    Ok(Some(response)) => self.answer(&response),
                    Ok(None) | Err(_) => {
                        self.pass_over("the watch stream broke");
                        self.broken();
                    }
                },
                () = sleep_until(unconfirmed) => {
                    self.pass_over("a watch went unconfirmed");
                    self.broken();
                }
                Ok(()) = switched.changed() => {
                    // The endpoint changed: the stream moves to the new
                    // one now.
                    if self.stream.as_ref().is_some_and(|s| s.generation != *switched.borrow_and_update()) {
                        self.broken();
                        self.rebuild_at = Some(Instant::now());
                    }
                }
                () = sleep_until(self.rebuild_at) => self.rebuild().await,
                () = sleep_until(self.claims.iter().map(|c| c.0).min()) => self.claims_due(),
                _ = sweep.tick() => self.sweep().await,
            }
        }
    }

    fn count(&self) {
        let counts = &self.counts;
        counts.names.store(self.names.len(), Ordering::Relaxed);
        counts.ids.store(self.by_id.len(), Ordering::Relaxed);
        counts
            .creating
            .store(self.creating.len(), Ordering::Relaxed);
        counts.rebuild.store(self.rebuild.len(), Ordering::Relaxed);
    }

    /// Makes the watches still wanted again on a new stream; those that
    /// cannot be made now are tried again after a pause that doubles
    /// until a watch is confirmed.
    async fn rebuild(&mut self) {
        self.rebuild_at = None;
        let mut names = std::mem::take(&mut self.rebuild).into_iter();
        while let Some(name) = names.next() {
            if self.hub.is_watched(&name) && !self.watch(Arc::clone(&name), None).await {
                // The stream cannot be made: the rest waits too.
                self.rebuild.push(name);
                self.rebuild
                    .extend(names.filter(|name| self.hub.is_watched(name)));
                self.rebuild_at = Some(Instant::now() + self.rebuild_pause);
                self.rebuild_pause = (self.rebuild_pause * 2).min(MAX_REBUILD_AFTER);
                break;
            }
        }
        // Releases between the old stream and the new one were missed.
        self.hub.notify_all();
    }

    /// Makes the watch on `name` unless it is there or under way; says
    /// whether it is.
    async fn watch(&mut self, name: Arc<str>, reply: Option<Reply>) -> bool {
        if let Some(watched) = self.names.get_mut(&name) {
            match (watched.id, reply) {
                (Some(_), Some(reply)) => {
                    let _ = reply.send(Ok(()));
                }
                (None, Some(reply)) => watched.waiting.push(reply),
                (_, None) => {}
            }
            return true;
        }
        let made = tokio::time::timeout(self.step_timeout, self.make(&name)).await;
        let result = match made {
            Ok(Ok(contenders)) => {
                self.names.insert(
                    Arc::clone(&name),
                    Watched {
                        id: None,
                        waiting: reply.into_iter().collect(),
                        contenders,
                    },
                );
                self.creating.push_back((name, Instant::now()));
                return true;
            }
            Ok(Err(error)) => Err(error),
            Err(_) => {
                // The stream may be hung.
                if self.stream.is_none() {
                    self.endpoints
                        .failed(self.trying, &"no watch stream within the step timeout");
                }
                self.broken();
                Err(BackendError::timeout("watch", self.step_timeout))
            }
        };
        if let Some(reply) = reply {
            let _ = reply.send(result);
        }
        false
    }

    /// Reads the name's contenders and asks for a watch from the revision
    /// after that read, so that nothing between the two is missed.
    async fn make(&mut self, name: &str) -> Result<Line, BackendError> {
        let (start, end) = contender_range(name);
        // With values: the owner tokens of the grants.
        let read_options = GetOptions::new().with_range(end.clone());
        let read = self
            .endpoints
            .call(Again::Yes, |mut client| {
                let (start, options) = (start.clone(), read_options.clone());
                async move { client.get(start, Some(options)).await }
            })
            .await?;
        // A stream left on an endpoint passed over moves first.
        if self
            .stream
            .as_ref()
            .is_some_and(|s| s.generation != self.endpoints.generation())
        {
            self.broken();
            self.rebuild_at = Some(Instant::now());
        }
        let revision = read.header().map_or(0, |h| h.revision());
        let mut contenders = Line::default();
        for kv in read.kvs().iter().filter(|kv| is_contender(name, kv.key())) {
            contenders.put(kv.key(), kv.create_revision(), kv.value());
        }
        let options = WatchOptions::new()
            .with_range(end)
            .with_start_revision(revision + 1);
        match &mut self.stream {
            Some(stream) => stream
                .sender
                .watch(start, Some(options))
                .await
                .map_err(step_error)?,
            None => {
                let pin = self.endpoints.pin().await.map_err(step_error)?;
                self.trying = pin.generation;
                let (sender, responses) = pin
                    .client
                    .watch_client()
                    .watch(start, Some(options))
                    .await
                    .map_err(step_error)?
                    .split();
                self.stream = Some(Stream {
                    sender,
                    responses,
                    generation: pin.generation,
                });
            }
        }
        Ok(contenders)
    }

    fn answer(&mut self, response: &etcd_client::WatchResponse) {
        let id = response.watch_id();
        if response.created() {
            let Some((name, _)) = self.creating.pop_front() else {
                return;
            };
            let Some(watched) = self.names.get_mut(&name) else {
                return;
            };
            let result = if response.canceled() {
                Err(failed("etcd refused the watch"))
            } else {
                watched.id = Some(id);
                self.by_id.insert(id, Arc::clone(&name));
                self.rebuild_pause = REBUILD_AFTER;
                Ok(())
            };
            for reply in watched.waiting.drain(..) {
                let _ = reply.send(result.clone());
            }
            if result.is_err() {
                self.names.remove(&name);
            }
            // A create answer can carry no events: they come next.
            return;
        }
        let Some(name) = self.by_id.get(&id).cloned() else {
            return;
        };
        if response.canceled() {
            // Compacted past, or cancelled by etcd: waiters try again, and
            // the next wait makes a new watch.
            self.by_id.remove(&id);
            self.names.remove(&name);
            self.hub.notify(&name);
            return;
        }
        let Some(watched) = self.names.get_mut(&name) else {
            return;
        };
        let mut freed = false;
        for event in response.events() {
            let Some(kv) = event.kv() else { continue };
            if !is_contender(&name, kv.key()) {
                continue;
            }
            match event.event_type() {
                EventType::Put => {
                    watched
                        .contenders
                        .put(kv.key(), kv.create_revision(), kv.value());
                }
                EventType::Delete => {
                    let lowest = watched.contenders.lowest().map(|(revision, _)| revision);
                    match watched.contenders.delete(kv.key()) {
                        // The holder went: the next contender (or
                        // anyone) may take the name.
                        Some(revision) if Some(revision) == lowest => freed = true,
                        Some(_) => {}
                        // Not seen put: wake, to be safe.
                        None => freed = true,
                    }
                }
            }
        }
        if freed {
            let next = watched.contenders.lowest();
            if let Some(claim) = announce(&self.hub, &self.places, &name, next) {
                self.claims.push(claim);
            }
        }
    }

    /// \[F3\] Ends the grants to this backend's waiters whose claim
    /// deadline passed and that were not taken up: their places are
    /// removed and their leases revoked (which deletes their keys), and
    /// the next contender holds. A place a step is taking up is looked at
    /// again a claim deadline later.
    fn claims_due(&mut self) {
        let now = Instant::now();
        let mut later = Vec::new();
        self.claims.retain(|(due, name, owner, ticket)| {
            if *due > now {
                return true;
            }
            match self.places.expire_grant(name, owner, *ticket) {
                Expired::Lost(place) => {
                    tracing::debug!(name = %name, "a grant was not taken up within its claim deadline; the next waiter holds");
                    for lease in [place.ticket, place.hold] {
                        let endpoints = Arc::clone(&self.endpoints);
                        let after = self.step_timeout;
                        self.endpoints.background().spawn(async move {
                            let _ = tokio::time::timeout(after, revoke(&endpoints, lease)).await;
                        });
                    }
                }
                Expired::Taking => {
                    let again = now + self.places.grant(name, owner).map_or(SWEEP, |g| g.1);
                    later.push((again, Arc::clone(name), owner.clone(), *ticket));
                }
                Expired::Gone => {}
            }
            false
        });
        self.claims.extend(later);
    }

    /// The stream's endpoint failed: the next one is pinned.
    fn pass_over(&self, why: &'static str) {
        if let Some(stream) = &self.stream {
            self.endpoints.failed(stream.generation, &why);
        }
    }

    /// The stream broke: every caller waiting is answered, every waiter
    /// woken, and the watches still wanted are made again soon.
    fn broken(&mut self) {
        self.stream = None;
        self.creating.clear();
        self.by_id.clear();
        for (name, watched) in self.names.drain() {
            for reply in watched.waiting {
                let _ = reply.send(Err(failed("the watch stream broke")));
            }
            self.rebuild.push(name);
        }
        self.hub.notify_all();
        if !self.rebuild.is_empty() {
            self.rebuild_at = Some(Instant::now() + self.rebuild_pause);
        }
    }

    /// Cancels the watches nobody waits on any more.
    async fn sweep(&mut self) {
        let unwatched: Vec<(Arc<str>, i64)> = self
            .names
            .iter()
            .filter(|(name, w)| w.waiting.is_empty() && !self.hub.is_watched(name))
            .filter_map(|(name, w)| w.id.map(|id| (Arc::clone(name), id)))
            .collect();
        for (name, id) in unwatched {
            self.names.remove(&name);
            self.by_id.remove(&id);
            if let Some(stream) = &mut self.stream {
                if stream.sender.cancel(id).await.is_err() {
                    self.broken();
                    return;
                }
            }
        }
    }
}

/// Tells the waiters of `name` that its holder's key went, and `next`
/// (its create revision and value), if any, holds now \[F1, F4\]; gives
/// the claim deadline to watch of a grant to a waiter of this backend.
fn announce(
    hub: &ReleaseHub,
    places: &Places,
    name: &Arc<str>,
    next: Option<(i64, &[u8])>,
) -> Option<(Instant, Arc<str>, Box<str>, i64)> {
    let Some((revision, value)) = next else {
        // Nobody stands for the name: anyone may take it.
        hub.notify(name);
        return None;
    };
    let owner = std::str::from_utf8(value).unwrap_or_default();
    let fencing_token = u64::try_from(revision).unwrap_or_default();
    match places.grant(name, owner) {
        // One of this backend's waiters: its waiter starts on the grant,
        // which lasts its claim deadline after the waiter's last attempt
        // (and no longer than its ticket lease lives after it); a grant
        // not taken up by then is ended [F3].
        Some((ticket, claim, left)) if left >= MIN_GRANT_CLAIM => {
            hub.grant(name, Grant::new(owner, fencing_token, claim));
            Some((
                Instant::now() + claim,
                Arc::clone(name),
                owner.into(),
                ticket,
            ))
        }
        // Its ticket lease may run out before the grant could be used:
        // its waiter's attempt renews the lease and takes the lock.
        Some(_) => {
            hub.notify(name);
            None
        }
        // Another backend's contender (or etcd's own lock's) holds: the
        // grant names it, so no waiter here tries, while a holder's own
        // watch still wakes \[L5\].
        None => {
            hub.grant(name, Grant::new(owner, fencing_token, Duration::ZERO));
            None
        }
    }
}

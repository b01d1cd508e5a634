//! Release notifications: one watch stream per backend; on it, one watch
//! per queued waiter of this backend on its predecessor, and one watch
//! per name that a waiter outside the queue or a holder \[L5\] waits on.
//!
//! A queued waiter \[F1\] is served as etcd's own lock serves its
//! waiters (`waitDeletes`): its attempt hands over the keys it read below
//! its own (which can only go: no key is created below it), and the task
//! watches the highest of them alone, from etcd's current revision (a
//! watch from an earlier one waits for etcd's catching-up of lagging
//! watches, every 100 ms); once the watch is confirmed, the keys below
//! are read when anything was written since the last known revision, so
//! no deletion falls between. When the predecessor goes and nothing else
//! was below it (or it was seen moved to another lease first, which only
//! a holder's key is), the waiter's key holds and its grant is
//! announced; else the keys below are read again and the new highest
//! watched. A release thus reaches one backend, not every waiting one.
//!
//! The rest of this describes the watch of a name's whole line.
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

enum Command {
    /// Follow the name's whole line.
    Watch { name: Arc<str>, reply: Reply },
    /// Follow a queued waiter's predecessor.
    Follow(Follow),
}

/// What a queued waiter's busy attempt read below its own key \[F1\]:
/// the watch then follows the key just below it, as etcd's own lock's
/// waiters do.
#[derive(Debug)]
pub(crate) struct Follow {
    /// The name.
    pub(crate) name: Arc<str>,
    /// The waiter's owner token, its key's value.
    pub(crate) owner: Box<str>,
    /// The ticket lease of the place that attempt kept.
    pub(crate) ticket: i64,
    /// The create revision of the waiter's key.
    pub(crate) revision: i64,
    /// The contenders below it: create revision, key and lease.
    pub(crate) below: Vec<(i64, Vec<u8>, i64)>,
    /// The revision they were read at.
    pub(crate) read_at: i64,
}

/// A place whose predecessor the task follows, by name and owner token.
type PlaceKey = (Arc<str>, Box<str>);

/// What one of the stream's watches serves.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Target {
    /// A name's whole line.
    Range(Arc<str>),
    /// A queued waiter's predecessor, in the follow's generation.
    Pred(PlaceKey, u64),
}

/// A queued waiter of this backend whose predecessor is followed.
#[derive(Debug)]
struct Pred {
    ticket: i64,
    /// The create revision of the waiter's key.
    revision: i64,
    /// The contenders below the waiter's key that may still stand, by
    /// create revision, with their keys and leases: read, and then only
    /// ever fewer (no key can be created below it).
    below: BTreeMap<i64, (Vec<u8>, i64)>,
    /// The revision up to which `below` is known: the last read, or the
    /// last event seen.
    known_at: i64,
    /// The generation of the watch on the highest of `below`.
    generation: u64,
    /// etcd's id of that watch, once it confirmed it.
    id: Option<i64>,
    /// Whether that watch was asked for on the current stream.
    watching: bool,
    /// The create revision of the key that watch is on.
    target: Option<i64>,
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
    /// Queued waiters whose predecessor is followed.
    pub(crate) queued: AtomicUsize,
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
            preds: HashMap::new(),
            generation: 0,
            cancels: Vec::new(),
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
            .send(Command::Watch {
                name: name.into(),
                reply,
            })
            .map_err(|_| failed("the watch task stopped"))?;
        answer.await.map_err(|_| failed("the watch task stopped"))?
    }

    /// Has the task follow a queued waiter's predecessor \[F1\]. Nothing
    /// is missed while the watch is being made: it starts from the
    /// revision after the read.
    pub(crate) fn follow(&self, follow: Follow) {
        let _ = self.commands.send(Command::Follow(follow));
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
    /// The queued waiters of this backend whose predecessor is followed.
    preds: HashMap<PlaceKey, Pred>,
    /// The last generation given to a predecessor's watch.
    generation: u64,
    /// Watches to cancel: predecessors no longer followed.
    cancels: Vec<i64>,
    by_id: HashMap<i64, Target>,
    /// Watches asked for and not confirmed yet, in order (etcd confirms
    /// the watches of one stream in the order asked), with when each was
    /// asked.
    creating: VecDeque<(Target, Instant)>,
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
            self.cancel_stale().await;
            let unconfirmed = self
                .creating
                .front()
                .map(|(_, asked)| *asked + self.endpoints.failover_after());
            tokio::select! {
                command = commands.recv() => match command {
                    None => return,
                    Some(Command::Watch { name, reply }) => {
                        self.watch(name, Some(reply)).await;
                    }
                    Some(Command::Follow(follow)) => self.follow(follow).await,
                },
                message = next_message(&mut self.stream) => match message {
                    Ok(Some(response)) => {
                        for place in self.answer(&response) {
                            self.recheck(place).await;
                        }
                    }
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
        counts.queued.store(self.preds.len(), Ordering::Relaxed);
    }

    /// Makes the watches still wanted again on a new stream; those that
    /// cannot be made now are tried again after a pause that doubles
    /// until a watch is confirmed.
    async fn rebuild(&mut self) {
        self.rebuild_at = None;
        let mut names = std::mem::take(&mut self.rebuild).into_iter();
        let mut made = true;
        while let Some(name) = names.next() {
            if self.hub.is_watched(&name) && !self.watch(Arc::clone(&name), None).await {
                // The stream cannot be made: the rest waits too.
                self.rebuild.push(name);
                self.rebuild
                    .extend(names.filter(|name| self.hub.is_watched(name)));
                self.rebuild_at = Some(Instant::now() + self.rebuild_pause);
                self.rebuild_pause = (self.rebuild_pause * 2).min(MAX_REBUILD_AFTER);
                made = false;
                break;
            }
        }
        // The predecessors are followed again from what was known of
        // them: a watch from that revision on misses nothing.
        if made {
            let waiting: Vec<PlaceKey> = self
                .preds
                .iter()
                .filter(|(_, pred)| !pred.watching)
                .map(|(place, _)| place.clone())
                .collect();
            for place in waiting {
                self.retarget(place).await;
                if self.stream.is_none() {
                    break;
                }
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
                self.creating
                    .push_back((Target::Range(name), Instant::now()));
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
        let revision = read.header().map_or(0, |h| h.revision());
        let mut contenders = Line::default();
        for kv in read.kvs().iter().filter(|kv| is_contender(name, kv.key())) {
            contenders.put(kv.key(), kv.create_revision(), kv.value());
        }
        let options = WatchOptions::new()
            .with_range(end)
            .with_start_revision(revision + 1);
        self.send_watch(start.into_bytes(), options).await?;
        Ok(contenders)
    }

    /// Asks for a watch on the stream, which is opened first if there is
    /// none.
    async fn send_watch(
        &mut self,
        key: Vec<u8>,
        options: WatchOptions,
    ) -> Result<(), BackendError> {
        // A stream left on an endpoint passed over moves first.
        if self
            .stream
            .as_ref()
            .is_some_and(|s| s.generation != self.endpoints.generation())
        {
            self.broken();
            self.rebuild_at = Some(Instant::now());
        }
        match &mut self.stream {
            Some(stream) => stream
                .sender
                .watch(key, Some(options))
                .await
                .map_err(step_error)?,
            None => {
                let pin = self.endpoints.pin().await.map_err(step_error)?;
                self.trying = pin.generation;
                let (sender, responses) = pin
                    .client
                    .watch_client()
                    .watch(key, Some(options))
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
        Ok(())
    }

    /// \[F1\] A queued waiter's attempt found it busy: its predecessor is
    /// followed from what that attempt read, unless more is known already
    /// (an event or a read after it).
    async fn follow(&mut self, follow: Follow) {
        let Follow {
            name,
            owner,
            ticket,
            revision,
            below,
            read_at,
        } = follow;
        if self.places.get(&name, &owner).map(|p| p.ticket) != Some(ticket) {
            return;
        }
        let place = (name, owner);
        let below: BTreeMap<i64, (Vec<u8>, i64)> = below
            .into_iter()
            .filter(|(r, _, _)| *r < revision)
            .map(|(r, key, lease)| (r, (key, lease)))
            .collect();
        if let Some(pred) = self.preds.get_mut(&place) {
            if pred.ticket == ticket && pred.revision == revision {
                if pred.known_at >= read_at {
                    return;
                }
                // The same predecessor: its watch goes on.
                let same = pred.watching && pred.target == below.last_key_value().map(|(r, _)| *r);
                pred.below = below;
                pred.known_at = read_at;
                if same {
                    return;
                }
            } else {
                *pred = Pred::new(ticket, revision, below, read_at);
            }
        } else {
            self.preds
                .insert(place.clone(), Pred::new(ticket, revision, below, read_at));
        }
        self.retarget(place).await;
    }

    /// Watches the highest key still below the place's; with none below,
    /// the place's key is the lowest contender, which holds, and its grant
    /// is announced. The watch starts at etcd's current revision: one
    /// from an earlier revision would wait for etcd's catching-up of
    /// lagging watches (every 100 ms) for its events, old and new. What
    /// came between the last known revision and the watch's start is read
    /// once it is confirmed (see [`answer`](Self::answer)).
    async fn retarget(&mut self, place: PlaceKey) {
        self.generation += 1;
        let generation = self.generation;
        let Some(pred) = self.preds.get_mut(&place) else {
            return;
        };
        if let Some(id) = pred.id.take() {
            self.by_id.remove(&id);
            self.cancels.push(id);
        }
        pred.watching = false;
        pred.generation = generation;
        pred.target = pred.below.last_key_value().map(|(r, _)| *r);
        let Some((_, (key, _))) = pred.below.last_key_value() else {
            let revision = pred.revision;
            self.preds.remove(&place);
            self.granted(&place, revision);
            return;
        };
        let key = key.clone();
        if self.stream.is_none() && self.rebuild_at.is_some() {
            // The stream is down: the rebuild follows it.
            return;
        }
        let options = WatchOptions::new();
        match tokio::time::timeout(self.step_timeout, self.send_watch(key, options)).await {
            Ok(Ok(())) => {
                if let Some(pred) = self.preds.get_mut(&place) {
                    pred.watching = true;
                }
                self.creating
                    .push_back((Target::Pred(place, generation), Instant::now()));
            }
            Ok(Err(_)) | Err(_) => {
                self.rebuild_pause = (self.rebuild_pause * 2).min(MAX_REBUILD_AFTER);
                self.broken();
            }
        }
    }

    /// The place's predecessor went and something may still stand below
    /// it, or its watch started after the last revision known: the keys
    /// below are read (one round trip, as etcd's own lock does), and the
    /// highest followed (by the watch in place when it is the one
    /// watched: the read came after the watch's start, so nothing was
    /// missed), or the grant announced. A read that fails wakes the
    /// waiters, whose attempt finds out.
    async fn recheck(&mut self, place: PlaceKey) {
        let Some(revision) = self.preds.get(&place).map(|p| p.revision) else {
            return;
        };
        let (start, end) = contender_range(&place.0);
        let options = GetOptions::new()
            .with_range(end)
            .with_keys_only()
            .with_max_create_revision(revision - 1);
        let read = tokio::time::timeout(
            self.step_timeout,
            self.endpoints.call(Again::Yes, |mut client| {
                let (start, options) = (start.clone(), options.clone());
                async move { client.get(start, Some(options)).await }
            }),
        )
        .await;
        let Some(pred) = self.preds.get_mut(&place) else {
            return;
        };
        match read {
            Ok(Ok(read)) => {
                let read_at = read.header().map_or(0, |h| h.revision());
                // A read at the revision of the last event seen, or
                // later, knows all it does.
                if read_at >= pred.known_at {
                    pred.below = read
                        .kvs()
                        .iter()
                        .filter(|kv| is_contender(&place.0, kv.key()))
                        .filter(|kv| kv.create_revision() < revision)
                        .map(|kv| (kv.create_revision(), (kv.key().to_vec(), kv.lease())))
                        .collect();
                    pred.known_at = read_at;
                }
                let watched = pred.id.is_some()
                    && pred.below.last_key_value().map(|(r, _)| *r) == pred.target;
                if !watched {
                    self.retarget(place).await;
                }
            }
            Ok(Err(_)) | Err(_) => {
                if let Some(id) = pred.id.take() {
                    self.by_id.remove(&id);
                    self.cancels.push(id);
                }
                self.preds.remove(&place);
                self.hub.notify(&place.0);
            }
        }
    }

    /// The place's key is the lowest contender: its grant is announced,
    /// unless the place is gone.
    fn granted(&mut self, place: &PlaceKey, revision: i64) {
        let (name, owner) = place;
        if self.places.get(name, owner).is_none() {
            return;
        }
        if let Some(claim) = announce(
            &self.hub,
            &self.places,
            name,
            Some((revision, owner.as_bytes())),
        ) {
            self.claims.push(claim);
        }
    }

    /// Answers a watch response; gives the places whose keys below must
    /// be read again.
    fn answer(&mut self, response: &etcd_client::WatchResponse) -> Vec<PlaceKey> {
        let id = response.watch_id();
        if response.created() {
            let Some((target, _)) = self.creating.pop_front() else {
                return Vec::new();
            };
            match target {
                Target::Range(name) => self.range_created(&name, id, response.canceled()),
                Target::Pred(place, generation) => {
                    let Some(pred) = self
                        .preds
                        .get_mut(&place)
                        .filter(|p| p.generation == generation)
                    else {
                        // Followed no more.
                        if !response.canceled() {
                            self.cancels.push(id);
                        }
                        return Vec::new();
                    };
                    if response.canceled() {
                        // Compacted past: read again.
                        pred.watching = false;
                        return vec![place];
                    }
                    pred.id = Some(id);
                    self.rebuild_pause = REBUILD_AFTER;
                    // Its events are those after the revision it was made
                    // at: what came before, since the last known, is read.
                    let made_at = response.header().map_or(i64::MAX, |h| h.revision());
                    let read = made_at > pred.known_at;
                    self.by_id
                        .insert(id, Target::Pred(place.clone(), generation));
                    if read {
                        return vec![place];
                    }
                }
            }
            // A create answer can carry no events: they come next.
            return Vec::new();
        }
        match self.by_id.get(&id).cloned() {
            Some(Target::Range(name)) => {
                self.range_events(&name, id, response);
                Vec::new()
            }
            Some(Target::Pred(place, _)) => self.pred_events(place, id, response),
            None => Vec::new(),
        }
    }

    /// etcd confirmed (or refused) the watch of a name's line.
    fn range_created(&mut self, name: &Arc<str>, id: i64, canceled: bool) {
        let Some(watched) = self.names.get_mut(name) else {
            return;
        };
        let result = if canceled {
            Err(failed("etcd refused the watch"))
        } else {
            watched.id = Some(id);
            self.by_id.insert(id, Target::Range(Arc::clone(name)));
            self.rebuild_pause = REBUILD_AFTER;
            Ok(())
        };
        for reply in watched.waiting.drain(..) {
            let _ = reply.send(result.clone());
        }
        if result.is_err() {
            self.names.remove(name);
        }
    }

    /// The events of a name's line.
    fn range_events(&mut self, name: &Arc<str>, id: i64, response: &etcd_client::WatchResponse) {
        if response.canceled() {
            // Compacted past, or cancelled by etcd: waiters try again, and
            // the next wait makes a new watch.
            self.by_id.remove(&id);
            self.names.remove(name);
            self.hub.notify(name);
            return;
        }
        let Some(watched) = self.names.get_mut(name) else {
            return;
        };
        let mut freed = false;
        for event in response.events() {
            let Some(kv) = event.kv() else { continue };
            if !is_contender(name, kv.key()) {
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
            if let Some(claim) = announce(&self.hub, &self.places, name, next) {
                self.claims.push(claim);
            }
        }
    }

    /// The events of a queued waiter's predecessor: its deletion leaves
    /// the waiter the lowest when nothing else was below, and is read
    /// again otherwise; its move to another lease (a grant taken up, a
    /// minimum hold: only a holder's key moves) shows that nothing else
    /// stands below.
    fn pred_events(
        &mut self,
        place: PlaceKey,
        id: i64,
        response: &etcd_client::WatchResponse,
    ) -> Vec<PlaceKey> {
        let gone = self.places.get(&place.0, &place.1).map(|p| p.ticket)
            != self.preds.get(&place).map(|p| p.ticket);
        let Some(pred) = self.preds.get_mut(&place).filter(|_| !gone) else {
            // Left, taken or granted: followed no more.
            self.by_id.remove(&id);
            self.cancels.push(id);
            self.preds.remove(&place);
            return Vec::new();
        };
        if response.canceled() {
            self.by_id.remove(&id);
            pred.id = None;
            pred.watching = false;
            return vec![place];
        }
        let mut went = false;
        for event in response.events() {
            let Some(kv) = event.kv() else { continue };
            let Some((&target, (key, lease))) = pred.below.iter_mut().next_back() else {
                break;
            };
            if kv.key() != key.as_slice() {
                continue;
            }
            pred.known_at = pred.known_at.max(kv.mod_revision());
            match event.event_type() {
                EventType::Put if kv.create_revision() == target && kv.lease() != *lease => {
                    *lease = kv.lease();
                    pred.below.retain(|r, _| *r >= target);
                }
                EventType::Put => {}
                EventType::Delete => {
                    pred.below.remove(&target);
                    went = true;
                    break;
                }
            }
        }
        if !went {
            return Vec::new();
        }
        self.by_id.remove(&id);
        self.cancels.push(id);
        pred.id = None;
        pred.watching = false;
        if pred.below.is_empty() {
            let revision = pred.revision;
            self.preds.remove(&place);
            self.granted(&place, revision);
            Vec::new()
        } else {
            vec![place]
        }
    }

    /// Cancels the watches of predecessors no longer followed.
    async fn cancel_stale(&mut self) {
        if self.cancels.is_empty() {
            return;
        }
        let cancels = std::mem::take(&mut self.cancels);
        if let Some(stream) = &mut self.stream {
            for id in cancels {
                if stream.sender.cancel(id).await.is_err() {
                    self.broken();
                    return;
                }
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
        self.cancels.clear();
        for (name, watched) in self.names.drain() {
            for reply in watched.waiting {
                let _ = reply.send(Err(failed("the watch stream broke")));
            }
            self.rebuild.push(name);
        }
        for pred in self.preds.values_mut() {
            pred.id = None;
            pred.watching = false;
        }
        self.hub.notify_all();
        if !self.rebuild.is_empty() || !self.preds.is_empty() {
            self.rebuild_at = Some(Instant::now() + self.rebuild_pause);
        }
    }

    /// Cancels the watches nobody waits on any more, and stops following
    /// the predecessors of places that are gone.
    async fn sweep(&mut self) {
        let unwatched: Vec<(Arc<str>, i64)> = self
            .names
            .iter()
            .filter(|(name, w)| w.waiting.is_empty() && !self.hub.is_watched(name))
            .filter_map(|(name, w)| w.id.map(|id| (Arc::clone(name), id)))
            .collect();
        let places = &self.places;
        let mut stale = Vec::new();
        self.preds.retain(|(name, owner), pred| {
            let kept = places.get(name, owner).map(|p| p.ticket) == Some(pred.ticket);
            if !kept {
                stale.extend(pred.id);
            }
            kept
        });
        for id in stale {
            self.by_id.remove(&id);
            self.cancels.push(id);
        }
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

impl Pred {
    fn new(
        ticket: i64,
        revision: i64,
        below: BTreeMap<i64, (Vec<u8>, i64)>,
        known_at: i64,
    ) -> Self {
        Self {
            ticket,
            revision,
            below,
            known_at,
            generation: 0,
            id: None,
            watching: false,
            target: None,
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
            // Heard of on both watches (a waiter outside the queue keeps
            // the name's line followed): announced once.
            if !places.first_announcement(name, owner, revision) {
                return None;
            }
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

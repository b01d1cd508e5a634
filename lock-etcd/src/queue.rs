//! The fair queue \[F1–F3\]: etcd's own queue of contender keys, the
//! lowest create revision first, with each waiter's key kept on a lease
//! of its ticket ttl while it waits.
//!
//! A waiter's place is its contender key `<name>/<H hex>`, valued with
//! its owner token, on a *ticket lease* `T` of the ticket ttl, which its
//! attempts keep alive. `H` is a second lease, granted with `T` at the
//! first queued attempt and kept unused (no key on it, no keep-alive): the
//! lease the key moves to, with a put that keeps its create revision, when
//! the waiter becomes the holder. So a holder's key is on the lease its
//! name gives, as every acquisition's is (the admin tells a lock kept by
//! its minimum hold by a key on another lease than its name's \[H7\]),
//! and the release, extension and minimum hold of a lock taken through
//! the queue are those of any other lock. An `H` that ran out while its
//! waiter waited (a wait longer than the lock's ttl) is granted again
//! under the same id when the waiter becomes the holder.
//!
//! The places of this backend's waiters are kept here, by name and owner
//! token, so that the watch task can announce a release's next holder as
//! a grant when it is one of them \[F1\]: how long the grant lasts is
//! how long the ticket lease is sure to live.

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use etcd_client::{
    Compare, CompareOp, GetOptions, KeyValue, LeaseGrantOptions, PutOptions, SortOrder, SortTarget,
    Txn, TxnOp, TxnOpResponse,
};
use lock_core::{
    AcquireOutcome, BackendError, ExtendOutcome, Lease, OwnerToken, QueueTerms, ReleaseOutcome,
};
use tokio::time::Instant;

use crate::backend::{revoke, EtcdBackend};
use crate::endpoints::Again;
use crate::error::protocol;
use crate::layout::{contender_key, contender_range, is_contender};
use crate::watch::Follow;

/// A waiter's place in a name's queue, as this backend made it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Place {
    /// The ticket lease the key is on while it waits.
    pub(crate) ticket: i64,
    /// The ticket lease's ttl, in whole seconds.
    pub(crate) ticket_secs: i64,
    /// Until when the ticket lease surely lives, by this process's clock:
    /// the last grant or keep-alive that found it alive, from its send,
    /// plus its ttl.
    pub(crate) ticket_until: Instant,
    /// The lease the key is named after, and moves to when the waiter
    /// becomes the holder.
    pub(crate) hold: i64,
    /// Until when that lease surely lives, as `ticket_until` (it is not
    /// kept alive while the waiter waits).
    pub(crate) hold_until: Instant,
    /// How long a grant to it waits to be taken up \[F3\], as its terms
    /// say.
    pub(crate) claim: Duration,
    /// A step is moving its key to the hold lease (taking up a grant):
    /// the claim deadline does not end it meanwhile.
    pub(crate) taking: bool,
    /// The create revision of its key last announced as granted, so that
    /// the watch of its predecessor and the watch of the name's whole
    /// line (when a waiter outside the queue keeps one) announce a grant
    /// once.
    pub(crate) announced: i64,
}

impl Place {
    /// The place's contender key.
    pub(crate) fn key(&self, name: &str) -> String {
        contender_key(name, self.hold)
    }
}

/// The places of one name, by owner token.
type NamePlaces = HashMap<Box<str>, Place>;

/// The places of this backend's waiters, by name and owner token.
#[derive(Debug, Default)]
pub(crate) struct Places {
    map: Mutex<HashMap<Box<str>, NamePlaces>>,
}

impl Places {
    fn lock(&self) -> MutexGuard<'_, HashMap<Box<str>, NamePlaces>> {
        self.map.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The place of `owner` on `name`, if it has one.
    pub(crate) fn get(&self, name: &str, owner: &str) -> Option<Place> {
        self.lock().get(name)?.get(owner).copied()
    }

    /// Whether any waiter of this backend has a place.
    pub(crate) fn is_empty(&self) -> bool {
        self.lock().is_empty()
    }

    /// How many places this backend's waiters have.
    pub(crate) fn len(&self) -> usize {
        self.lock().values().map(HashMap::len).sum()
    }

    pub(crate) fn insert(&self, name: &str, owner: &str, place: Place) {
        self.lock()
            .entry(name.into())
            .or_default()
            .insert(owner.into(), place);
    }

    /// Changes the place of `owner` on `name`, if it is still the one on
    /// `ticket`.
    pub(crate) fn update(
        &self,
        name: &str,
        owner: &str,
        ticket: i64,
        change: impl FnOnce(&mut Place),
    ) {
        if let Some(place) = self
            .lock()
            .get_mut(name)
            .and_then(|places| places.get_mut(owner))
            .filter(|place| place.ticket == ticket)
        {
            change(place);
        }
    }

    /// Removes the place of `owner` on `name` if it is still the one on
    /// `ticket`; gives it when it was.
    pub(crate) fn remove(&self, name: &str, owner: &str, ticket: i64) -> Option<Place> {
        let mut map = self.lock();
        let places = map.get_mut(name)?;
        if places.get(owner)?.ticket != ticket {
            return None;
        }
        let place = places.remove(owner);
        if places.is_empty() {
            map.remove(name);
        }
        place
    }

    /// The grant to `owner` on `name`, when `owner` is a waiter of this
    /// backend \[F1, F3\]: its place's ticket lease, how long the grant
    /// lasts after the waiter's last attempt (its claim deadline, and no
    /// longer than the ticket lease lives after an attempt: each renews
    /// or grants it after it was sent), and how long the ticket lease
    /// surely has left now.
    pub(crate) fn grant(&self, name: &str, owner: &str) -> Option<(i64, Duration, Duration)> {
        let place = self.get(name, owner)?;
        Some((
            place.ticket,
            place.claim.min(secs(place.ticket_secs)),
            place.ticket_until.saturating_duration_since(Instant::now()),
        ))
    }

    /// Records that the place's key at `revision` was announced as
    /// granted; `false` when it already was.
    pub(crate) fn first_announcement(&self, name: &str, owner: &str, revision: i64) -> bool {
        let mut first = false;
        if let Some(place) = self
            .lock()
            .get_mut(name)
            .and_then(|places| places.get_mut(owner))
        {
            first = place.announced != revision;
            place.announced = revision;
        }
        first
    }

    /// Marks the place as being taken up; `false` when it is gone (its
    /// grant ran out, or it was left).
    pub(crate) fn start_taking(&self, name: &str, owner: &str, ticket: i64) -> bool {
        let mut found = false;
        self.update(name, owner, ticket, |place| {
            place.taking = true;
            found = true;
        });
        found
    }

    /// \[F3\] The claim deadline of a grant to the place on `ticket` has
    /// passed: the place is removed and given back to be revoked, unless a
    /// step is taking it up (then it is looked at again later) or it is
    /// gone (taken up, released or left).
    pub(crate) fn expire_grant(&self, name: &str, owner: &str, ticket: i64) -> Expired {
        match self.get(name, owner) {
            Some(place) if place.ticket == ticket && place.taking => Expired::Taking,
            Some(place) if place.ticket == ticket => match self.remove(name, owner, ticket) {
                Some(place) => Expired::Lost(place),
                None => Expired::Gone,
            },
            _ => Expired::Gone,
        }
    }
}

/// What the claim deadline found of a grant's place.
#[derive(Debug)]
pub(crate) enum Expired {
    /// Not taken up: removed, its leases to revoke.
    Lost(Place),
    /// A step is taking it up.
    Taking,
    /// Taken up, released or left.
    Gone,
}

/// A lease's ttl in whole seconds, as a duration.
pub(crate) fn secs(secs: i64) -> Duration {
    Duration::from_secs(u64::try_from(secs).unwrap_or(0))
}

/// How much of its ttl a waiter's hold lease must surely have left for a
/// promotion to keep it alive in the same round trip as the move: else
/// it is granted again (or kept alive) first.
const HOLD_MARGIN: Duration = Duration::from_millis(500);

/// The shortest grant the watch announces: a waiter of this backend
/// whose ticket lease may run out sooner is woken with a plain
/// notification, and its attempt renews the lease and takes the lock.
pub(crate) const MIN_GRANT_CLAIM: Duration = Duration::from_millis(100);

/// A contender key of a name, as a queued attempt reads it.
#[derive(Debug)]
pub(crate) struct Contender {
    key: Vec<u8>,
    create_revision: i64,
    lease: i64,
}

/// What a promotion found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Promoted {
    /// The key is on the lock's lease: the lock is held.
    Held,
    /// The key was gone or changed; `others` when other contenders stand
    /// for the name.
    Gone { others: bool },
}

/// The options of a read of a name's contenders: keys only, lowest
/// create revision first.
fn line_options(end: String) -> GetOptions {
    GetOptions::new()
        .with_range(end)
        .with_keys_only()
        .with_sort(SortTarget::Create, SortOrder::Ascend)
}

/// The contenders of `name` among `kvs`, lowest create revision first.
fn line_of(name: &str, kvs: &[KeyValue]) -> Vec<Contender> {
    let mut line: Vec<Contender> = kvs
        .iter()
        .filter(|kv| is_contender(name, kv.key()))
        .map(|kv| Contender {
            key: kv.key().to_vec(),
            create_revision: kv.create_revision(),
            lease: kv.lease(),
        })
        .collect();
    line.sort_by_key(|c| c.create_revision);
    line
}

/// The revision a read answered at.
fn revision(header: Option<&etcd_client::ResponseHeader>) -> i64 {
    header.map_or(0, etcd_client::ResponseHeader::revision)
}

fn fencing_token(revision: i64) -> Result<u64, BackendError> {
    u64::try_from(revision).map_err(|_| protocol("a negative create revision"))
}

impl EtcdBackend {
    /// [`LockBackend::try_acquire_queued`](lock_core::LockBackend::try_acquire_queued).
    pub(crate) async fn queued_attempt(
        &self,
        name: &str,
        owner: &OwnerToken,
        ttl: Duration,
        terms: QueueTerms,
    ) -> Result<AcquireOutcome, BackendError> {
        let renewed = self.inner.places.get(name, owner.as_str()).is_some();
        let (place, line, read_at) = self.keep_place(name, owner, ttl, terms).await?;
        let own = place.key(name);
        let Some(at) = line.iter().position(|c| c.key == own.as_bytes()) else {
            // Gone between its put and the read: the next attempt, at
            // once, puts it again.
            return Ok(AcquireOutcome::busy(Some(Duration::ZERO)));
        };
        if at == 0 {
            let revision = line[0].create_revision;
            return match self.promote(name, owner, place, revision, ttl).await? {
                Promoted::Held => Ok(AcquireOutcome::Acquired {
                    fencing_token: fencing_token(revision)?,
                }),
                // Changed under the attempt: the next one, at once, sees
                // how.
                Promoted::Gone { .. } => Ok(AcquireOutcome::busy(Some(Duration::ZERO))),
            };
        }
        // [F1] The watch follows the key just below this one (etcd's own
        // lock's way), and announces the grant when none is left below.
        if let Some(watches) = &self.inner.watches {
            watches.follow(Follow {
                name: name.into(),
                owner: owner.as_str().into(),
                ticket: place.ticket,
                revision: line[at].create_revision,
                below: line[..at]
                    .iter()
                    .map(|c| (c.create_revision, c.key.clone(), c.lease))
                    .collect(),
                read_at,
            });
        }
        // [A9] Only the next waiter reads how long the holder has left,
        // and only on a renewal: a waiter's first queued attempt, on the
        // way into the queue, is not slowed by it.
        let expires_in = if at == 1 && renewed {
            self.time_left(line[0].lease).await
        } else {
            None
        };
        // [F1] A grant to this waiter names its key's create revision: one
        // naming an earlier key of this owner (a place that lapsed) is
        // below it, and taken up by an attempt, not started on.
        Ok(AcquireOutcome::Busy {
            expires_in,
            last_token: Some(fencing_token(line[at].create_revision)?.saturating_sub(1)),
        })
    }

    /// The waiter's place, kept or made, and the name's contenders read
    /// after it.
    async fn keep_place(
        &self,
        name: &str,
        owner: &OwnerToken,
        ttl: Duration,
        terms: QueueTerms,
    ) -> Result<(Place, Vec<Contender>, i64), BackendError> {
        let places = &self.inner.places;
        if let Some(place) = places.get(name, owner.as_str()) {
            let sent = Instant::now();
            let (alive, line) = futures_util::future::join(
                self.inner.keep_alives.keep_alive(place.ticket),
                self.line(name),
            )
            .await;
            if alive? {
                let until = sent + secs(place.ticket_secs);
                places.update(name, owner.as_str(), place.ticket, |p| {
                    p.ticket_until = p.ticket_until.max(until);
                });
                let (line, read_at) = line?;
                let own = place.key(name);
                if line.iter().any(|c| c.key == own.as_bytes()) {
                    return Ok((place, line, read_at));
                }
                // The key is gone while its lease lives (deleted by hand,
                // or a clean-up's release of a grant): put again, at the
                // tail.
                let (line, read_at) = self.put_place(name, owner, &place).await?;
                return Ok((place, line, read_at));
            }
            // [F2] The ticket lease ran out (the waiter stalled past its
            // ticket ttl, and its key went with it): a new place, at the
            // tail.
            if places.remove(name, owner.as_str(), place.ticket).is_some() {
                self.revoke_in_background(place.hold);
            }
        }
        let place = self.join_queue(name, owner, ttl, terms).await?;
        let (line, read_at) = self.put_place(name, owner, &place).await?;
        Ok((place, line, read_at))
    }

    /// Grants a new place's two leases and records it, before its key is
    /// put (the watch may announce a grant to it as soon as it is).
    async fn join_queue(
        &self,
        name: &str,
        owner: &OwnerToken,
        ttl: Duration,
        terms: QueueTerms,
    ) -> Result<Place, BackendError> {
        let ticket_secs = self.lease_secs(terms.ticket_ttl);
        let hold_secs = self.lease_secs(ttl);
        let grant = |secs: i64| {
            self.call(Again::Yes, move |mut client| async move {
                client.lease_grant(secs, None).await
            })
        };
        let sent = Instant::now();
        let (ticket, hold) = futures_util::future::join(grant(ticket_secs), grant(hold_secs)).await;
        let (ticket, hold) = match (ticket, hold) {
            (Ok(ticket), Ok(hold)) => (ticket.id(), hold.id()),
            (Ok(granted), Err(error)) | (Err(error), Ok(granted)) => {
                self.revoke_in_background(granted.id());
                return Err(error);
            }
            (Err(error), Err(_)) => return Err(error),
        };
        let place = Place {
            ticket,
            ticket_secs,
            ticket_until: sent + secs(ticket_secs),
            hold,
            hold_until: sent + secs(hold_secs),
            claim: terms.claim,
            taking: false,
            announced: 0,
        };
        self.inner.places.insert(name, owner.as_str(), place);
        Ok(place)
    }

    /// Puts the place's key on its ticket lease (a key already there keeps
    /// its create revision) and reads the name's contenders.
    async fn put_place(
        &self,
        name: &str,
        owner: &OwnerToken,
        place: &Place,
    ) -> Result<(Vec<Contender>, i64), BackendError> {
        let (start, end) = contender_range(name);
        let txn = Txn::new().and_then(vec![
            TxnOp::put(
                place.key(name),
                owner.as_str(),
                Some(PutOptions::new().with_lease(place.ticket)),
            ),
            TxnOp::get(start, Some(line_options(end))),
        ]);
        // Sent twice, the put finds its own key and keeps its create
        // revision.
        let answer = self
            .call(Again::Yes, |mut client| {
                let txn = txn.clone();
                async move { client.txn(txn).await }
            })
            .await?;
        match answer.op_responses().get(1) {
            Some(TxnOpResponse::Get(read)) => {
                Ok((line_of(name, read.kvs()), revision(read.header())))
            }
            _ => Err(protocol("a queued attempt's read answered no range")),
        }
    }

    /// The name's contenders, lowest create revision first, and the
    /// revision they were read at.
    async fn line(&self, name: &str) -> Result<(Vec<Contender>, i64), BackendError> {
        let (start, end) = contender_range(name);
        let options = line_options(end);
        let read = self
            .call(Again::Yes, |mut client| {
                let (start, options) = (start.clone(), options.clone());
                async move { client.get(start, Some(options)).await }
            })
            .await?;
        Ok((line_of(name, read.kvs()), revision(read.header())))
    }

    /// \[A9\] How long the holder's lease has left: etcd answers whole
    /// seconds, rounded down, so a second is added (the waiter never
    /// tries before the lease's end); none for a key without a lease, or
    /// when etcd does not say (the watch and the heartbeat still wake the
    /// waiter).
    async fn time_left(&self, lease: i64) -> Option<Duration> {
        if lease == 0 {
            return None;
        }
        let answer = self
            .call(Again::Yes, |mut client| async move {
                client.lease_time_to_live(lease, None).await
            })
            .await;
        match answer {
            // Gone: its key went with it.
            Ok(answer) if answer.ttl() < 0 => Some(Duration::ZERO),
            Ok(answer) => Some(secs(answer.ttl()) + Duration::from_secs(1)),
            Err(error) => {
                tracing::debug!(error = %lock_core::ErrorChain(&error), lease, "the holder's lease's time to live was not read");
                None
            }
        }
    }

    /// Makes the place's key, at `revision`, the holder's: moved to its
    /// hold lease, with the lock's full ttl, keeping its create revision.
    /// The ticket lease is then revoked, and the lock's steps find the key
    /// on its lease as any other.
    async fn promote(
        &self,
        name: &str,
        owner: &OwnerToken,
        place: Place,
        revision: i64,
        ttl: Duration,
    ) -> Result<Promoted, BackendError> {
        // [F3] A grant whose claim deadline passed is gone: not taken up.
        if !self
            .inner
            .places
            .start_taking(name, owner.as_str(), place.ticket)
        {
            return Ok(Promoted::Gone { others: true });
        }
        let promoted = self.move_to_hold(name, owner, place, revision, ttl).await;
        // Still waiting (failed, or changed under the step): the claim
        // deadline may end it again.
        if !matches!(promoted, Ok(Promoted::Held)) {
            self.inner
                .places
                .update(name, owner.as_str(), place.ticket, |p| p.taking = false);
        }
        promoted
    }

    /// The move of [`promote`](Self::promote).
    async fn move_to_hold(
        &self,
        name: &str,
        owner: &OwnerToken,
        place: Place,
        revision: i64,
        ttl: Duration,
    ) -> Result<Promoted, BackendError> {
        let (start, end) = contender_range(name);
        let txn = move_key(place.key(name), owner, revision, place.hold).or_else(vec![TxnOp::get(
            start,
            Some(GetOptions::new().with_range(end).with_keys_only()),
        )]);
        // Sent twice, the move finds the key where the first put it, under
        // the same comparisons.
        let send = || {
            self.call(Again::Yes, |mut client| {
                let txn = txn.clone();
                async move { client.txn(txn).await }
            })
        };
        let sent = Instant::now();
        let (alive, answer) = if place.hold_until > sent + HOLD_MARGIN {
            // The hold lease lives through the round trip: its keep-alive
            // (which gives it the lock's full ttl) and the move together.
            futures_util::future::join(self.inner.keep_alives.keep_alive(place.hold), send()).await
        } else {
            self.renew_hold(place.hold, self.lease_secs(ttl)).await?;
            (Ok(true), send().await)
        };
        let answer = match answer {
            Ok(answer) => answer,
            Err(error) => {
                // The hold lease may have run out after all: granted again
                // first the next time.
                self.inner
                    .places
                    .update(name, owner.as_str(), place.ticket, |p| p.hold_until = sent);
                return Err(error);
            }
        };
        if !answer.succeeded() {
            let others = match answer.op_responses().first() {
                Some(TxnOpResponse::Get(read)) => {
                    read.kvs().iter().any(|kv| is_contender(name, kv.key()))
                }
                _ => false,
            };
            return Ok(Promoted::Gone { others });
        }
        match alive {
            Ok(true) => {
                // Its steps find the lock on its lease from now on (unless
                // a release or leave took the place meanwhile).
                if self
                    .inner
                    .places
                    .remove(name, owner.as_str(), place.ticket)
                    .is_some()
                {
                    self.remember(name, owner, place.hold);
                }
                self.revoke_in_background(place.ticket);
                Ok(Promoted::Held)
            }
            // Ran out before its keep-alive, which the margin rules out:
            // the key went with it.
            Ok(false) => {
                self.inner
                    .places
                    .update(name, owner.as_str(), place.ticket, |p| p.hold_until = sent);
                Ok(Promoted::Gone { others: true })
            }
            // Moved, but the lease's new ttl is not confirmed: the next
            // step moves it again (a no-op) and keeps the lease alive.
            Err(error) => Err(error),
        }
    }

    /// Gives the hold lease, which may have run out while its waiter
    /// waited, the lock's ttl: granted again under its id, or kept alive
    /// when it still lives.
    async fn renew_hold(&self, hold: i64, secs: i64) -> Result<(), BackendError> {
        for _ in 0..3 {
            let granted = self
                .call(Again::Yes, move |mut client| async move {
                    let options = LeaseGrantOptions::new().with_id(hold);
                    match client.lease_grant(secs, Some(options)).await {
                        Err(etcd_client::Error::GRpcStatus(status))
                            if status.message().contains("lease already exists") =>
                        {
                            Ok(false)
                        }
                        answer => answer.map(|_| true),
                    }
                })
                .await?;
            // Still there: kept alive, unless it ran out in between (then
            // granted again).
            if granted || self.inner.keep_alives.keep_alive(hold).await? {
                return Ok(());
            }
        }
        Err(protocol(
            "a queued waiter's hold lease could be neither granted nor kept alive",
        ))
    }

    /// \[F2\] Revokes the place's two leases, which deletes its key on
    /// either.
    pub(crate) async fn leave(&self, name: &str, owner: &OwnerToken) -> Result<(), BackendError> {
        let Some(place) = self.inner.places.get(name, owner.as_str()) else {
            return Ok(());
        };
        let endpoints = &self.inner.endpoints;
        let (ticket, hold) = futures_util::future::join(
            revoke(endpoints, place.ticket),
            revoke(endpoints, place.hold),
        )
        .await;
        ticket?;
        hold?;
        self.inner.places.remove(name, owner.as_str(), place.ticket);
        Ok(())
    }

    /// The first extension of a lock granted by the queue: its key moves
    /// to the lock's lease.
    pub(crate) async fn take_up(
        &self,
        lease: &Lease,
        ttl: Duration,
        place: Place,
    ) -> Result<ExtendOutcome, BackendError> {
        let (name, owner) = (lease.key(), lease.owner());
        let revision = match i64::try_from(lease.fencing_token()) {
            Ok(revision) if revision > 0 => revision,
            // No token: the key holds if it is the lowest.
            _ => match self.line(name).await?.0.first() {
                Some(c) if c.key == place.key(name).as_bytes() => c.create_revision,
                Some(_) => return Ok(ExtendOutcome::Taken),
                None => return Ok(ExtendOutcome::Expired),
            },
        };
        match self.promote(name, owner, place, revision, ttl).await? {
            Promoted::Held => Ok(ExtendOutcome::Extended),
            Promoted::Gone { others } => {
                // Lost before it was taken up: the place goes too.
                if self
                    .inner
                    .places
                    .remove(name, owner.as_str(), place.ticket)
                    .is_some()
                {
                    self.revoke_in_background(place.ticket);
                    self.revoke_in_background(place.hold);
                }
                Ok(if others {
                    ExtendOutcome::Taken
                } else {
                    ExtendOutcome::Expired
                })
            }
        }
    }

    /// The create revision under which the place's key holds, if it
    /// holds. A lease with a fencing token was granted \[F1\]: its token
    /// is the create revision of a key that was the lowest contender when
    /// the grant was announced, and no key can be created below it since,
    /// so that key holds for as long as it stands, which the step's own
    /// comparisons (its value and that create revision) check: no read.
    /// Without one (a clean-up after an attempt whose answer was lost),
    /// the key holds when the name's contenders, read, have it lowest.
    async fn holds(
        &self,
        name: &str,
        lease: &Lease,
        place: &Place,
    ) -> Result<Option<i64>, BackendError> {
        if let Ok(revision @ 1..) = i64::try_from(lease.fencing_token()) {
            return Ok(Some(revision));
        }
        let own = place.key(name);
        Ok(self
            .line(name)
            .await?
            .0
            .first()
            .filter(|c| c.key == own.as_bytes())
            .map(|c| c.create_revision))
    }

    /// The release of a lock whose grant was not taken up yet (its key
    /// still on its ticket lease), or of a waiter (a clean-up after an
    /// attempt whose answer was lost): the key is deleted, and its leases
    /// revoked, only when it holds (see [`holds`](Self::holds)); a
    /// waiter keeps its place. A grant's release is one round trip.
    pub(crate) async fn release_place(
        &self,
        lease: &Lease,
        place: Place,
    ) -> Result<ReleaseOutcome, BackendError> {
        let (name, owner) = (lease.key(), lease.owner());
        let Some(revision) = self.holds(name, lease, &place).await? else {
            return Ok(ReleaseOutcome::NotHeld);
        };
        // Taken first, so that a move under way does not remember it.
        self.inner.places.remove(name, owner.as_str(), place.ticket);
        let contender = place.key(name);
        let compares = vec![
            Compare::value(contender.clone(), CompareOp::Equal, owner.as_str()),
            Compare::create_revision(contender.clone(), CompareOp::Equal, revision),
        ];
        let answer = self
            .delete_contender(name, compares, contender, fencing_token(revision)?)
            .await;
        // The key may be on either lease; neither serves anything now.
        self.revoke_in_background(place.ticket);
        self.revoke_in_background(place.hold);
        Ok(if answer?.succeeded() {
            ReleaseOutcome::Released
        } else {
            ReleaseOutcome::NotHeld
        })
    }

    /// The minimum hold \[H7\] of a lock whose grant was not taken up yet:
    /// as [`hold`](lock_core::LockBackend::hold), its key moves from its
    /// ticket lease to a lease of the hold's time left; a waiter (not the
    /// lowest contender) is not moved.
    pub(crate) async fn hold_place(
        &self,
        lease: &Lease,
        place: Place,
        secs: i64,
    ) -> Result<ExtendOutcome, BackendError> {
        let (name, owner) = (lease.key(), lease.owner());
        let Some(revision) = self.holds(name, lease, &place).await? else {
            return Ok(ExtendOutcome::Taken);
        };
        self.inner.places.remove(name, owner.as_str(), place.ticket);
        let new = self
            .call(Again::Yes, |mut client| async move {
                client.lease_grant(secs, None).await
            })
            .await?
            .id();
        let txn = move_key(place.key(name), owner, revision, new);
        let answer = self
            .call(Again::Yes, |mut client| {
                let txn = txn.clone();
                async move { client.txn(txn).await }
            })
            .await;
        self.revoke_in_background(place.ticket);
        // Revoked before the answer: the admin tells a kept lock by its
        // key's named lease being gone.
        self.revoke_quietly(place.hold).await;
        if !answer?.succeeded() {
            self.revoke_in_background(new);
            return Ok(ExtendOutcome::Expired);
        }
        Ok(ExtendOutcome::Extended)
    }
}

/// The transaction that moves a contender key to `lease`, keeping its
/// create revision, only while it still holds `owner` with `revision`
/// (the put of a key that exists keeps its create revision).
fn move_key(key: String, owner: &OwnerToken, revision: i64, lease: i64) -> Txn {
    Txn::new()
        .when(vec![
            Compare::value(key.clone(), CompareOp::Equal, owner.as_str()),
            Compare::create_revision(key.clone(), CompareOp::Equal, revision),
        ])
        .and_then(vec![TxnOp::put(
            key,
            owner.as_str(),
            Some(PutOptions::new().with_lease(lease)),
        )])
}

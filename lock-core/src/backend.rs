//! The steps a storage system implements to serve as a lock backend.

use std::fmt;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use async_trait::async_trait;
use tokio::time::Instant;

use crate::error::BackendError;
use crate::notify::ReleaseWatch;

/// A backend behind a `dyn`, as [`Locker`](crate::Locker) holds it.
pub type DynLockBackend = dyn LockBackend;

/// The longest key, in bytes, that the driver accepts unless a backend
/// declares a lower limit in [`Capabilities::max_key_len`].
pub const MAX_KEY_LEN: usize = 1024;

/// The value that marks a lock as held by one acquisition: `<node id>/<32 hex>`.
///
/// The 32 hex digits are 128 random bits, drawn anew for every acquisition,
/// so that no other client can release or extend the lock by guessing.
/// `Debug` prints the node id only.
///
/// A drawn token writes its text at its first [`as_str`](Self::as_str),
/// once for all its clones: a backend in this process that compares tokens
/// (two drawn tokens compare by node id and bits) never pays for it.
#[derive(Clone)]
pub struct OwnerToken(Arc<Token>);

enum Token {
    /// Drawn by this process: the node id and the random bits, and the
    /// text once a backend asked for it.
    Drawn {
        node: Arc<str>,
        bits: u128,
        text: OnceLock<Box<str>>,
    },
    /// Read back from a backend.
    Read(Box<str>),
}

impl PartialEq for OwnerToken {
    fn eq(&self, other: &Self) -> bool {
        // Most comparisons are of a token with a clone of itself.
        if Arc::ptr_eq(&self.0, &other.0) {
            return true;
        }
        match (&*self.0, &*other.0) {
            // The text is the node id, `/` and the bits' 32 digits: equal
            // texts are equal parts.
            (
                Token::Drawn { node, bits, .. },
                Token::Drawn {
                    node: other_node,
                    bits: other_bits,
                    ..
                },
            ) => bits == other_bits && node == other_node,
            _ => self.as_str() == other.as_str(),
        }
    }
}

impl Eq for OwnerToken {}

impl std::hash::Hash for OwnerToken {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.as_str().hash(state);
    }
}

/// The two hex digits of every byte.
const HEX_PAIRS: [[u8; 2]; 256] = {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut pairs = [[0u8; 2]; 256];
    let mut i = 0;
    while i < 256 {
        pairs[i] = [HEX[i >> 4], HEX[i & 0xf]];
        i += 1;
    }
    pairs
};

/// 128 random bits for an owner token, from the thread's generator.
fn random_bits() -> u128 {
    rand::random()
}

impl OwnerToken {
    /// Draws a new token for `node_id`.
    pub fn new(node_id: &str) -> Self {
        Self::draw(&Arc::from(node_id))
    }

    /// Draws a new token for a node id already shared (the driver's, for
    /// every acquisition: no copy of it).
    pub(crate) fn draw(node_id: &Arc<str>) -> Self {
        Self(Arc::new(Token::Drawn {
            node: Arc::clone(node_id),
            bits: random_bits(),
            text: OnceLock::new(),
        }))
    }

    /// Draws new bits into this token, in place when no clone of it is left
    /// (a token is sent again only under its own bits: nobody can tell).
    pub(crate) fn redraw(&mut self, node_id: &Arc<str>) {
        match Arc::get_mut(&mut self.0) {
            Some(Token::Drawn { node, bits, text }) if Arc::ptr_eq(node, node_id) => {
                *bits = random_bits();
                text.take();
            }
            _ => *self = Self::draw(node_id),
        }
    }

    /// Wraps a value read back from a backend, such as one written by another
    /// client of the same wire format.
    pub fn from_value(value: impl Into<Box<str>>) -> Self {
        Self(Arc::new(Token::Read(value.into())))
    }

    /// The whole value, as a backend stores it.
    pub fn as_str(&self) -> &str {
        match &*self.0 {
            Token::Drawn { node, bits, text } => text.get_or_init(|| {
                let mut text = String::with_capacity(node.len() + 33);
                text.push_str(node);
                text.push('/');
                for byte in bits.to_be_bytes() {
                    let [high, low] = HEX_PAIRS[usize::from(byte)];
                    text.push(char::from(high));
                    text.push(char::from(low));
                }
                text.into_boxed_str()
            }),
            Token::Read(text) => text,
        }
    }

    /// Whether `value` is in the owner-token format, `<node id>/<32 hex>`
    /// with a non-empty node id: what every withlock node (and every
    /// client of the same wire format) writes as a lock's value.
    pub fn is_well_formed(value: &str) -> bool {
        value.rsplit_once('/').is_some_and(|(node, bits)| {
            !node.is_empty() && bits.len() == 32 && bits.bytes().all(|b| b.is_ascii_hexdigit())
        })
    }

    /// The node id part of the value.
    pub fn node_id(&self) -> &str {
        match &*self.0 {
            Token::Drawn { node, .. } => node,
            Token::Read(text) => text.rsplit_once('/').map_or(text, |(node, _)| node),
        }
    }
}

impl fmt::Debug for OwnerToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "OwnerToken({}/…)", self.node_id())
    }
}

/// One acquisition of a key: the key, the owner token that holds it and the
/// fencing token it was given.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Lease {
    key: Arc<str>,
    owner: OwnerToken,
    fencing_token: u64,
}

impl Lease {
    /// Describes an acquisition. Backends compare `key` and `owner` only; the
    /// fencing token is carried for the caller.
    pub fn new(key: impl Into<Arc<str>>, owner: OwnerToken, fencing_token: u64) -> Self {
        Self {
            key: key.into(),
            owner,
            fencing_token,
        }
    }

    /// The locked key.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The key, shared.
    pub fn key_arc(&self) -> &Arc<str> {
        &self.key
    }

    /// The token that holds the key.
    pub fn owner(&self) -> &OwnerToken {
        &self.owner
    }

    /// The fencing token this acquisition was given.
    pub fn fencing_token(&self) -> u64 {
        self.fencing_token
    }

    /// The owner token, for a lease kept to be used again.
    pub(crate) fn owner_mut(&mut self) -> &mut OwnerToken {
        &mut self.owner
    }

    pub(crate) fn set_fencing_token(&mut self, fencing_token: u64) {
        self.fencing_token = fencing_token;
    }
}

/// What one acquisition attempt found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AcquireOutcome {
    /// The key is now held by the owner token.
    Acquired {
        /// Strictly greater than every token given before for this key.
        fencing_token: u64,
    },
    /// Another owner holds the key. Not an error.
    Busy {
        /// How long the holder's lock has left, where the store knows it
        /// cheaply \[A9\] (Redis `PTTL`, PostgreSQL `locked_until - now()`,
        /// the memory deadline); `None` when it does not. A waiter never
        /// sleeps past it plus [`EXPIRY_MARGIN`]. A queued attempt
        /// ([`LockBackend::try_acquire_queued`]) gives it only to the
        /// queue's head: the others wait for their grant.
        expires_in: Option<Duration>,
        /// For a queued attempt ([`LockBackend::try_acquire_queued`]): the
        /// last fencing token the store had drawn for the key when it
        /// answered. A grant announced with a greater token was made after
        /// this answer, so the waiter may start on it without a round trip
        /// \[F1\]; an older one may have run out already. `None` when the
        /// store does not say: the driver then takes a grant up with a
        /// queued attempt. Always `None` for a plain attempt.
        last_token: Option<u64>,
    },
}

impl AcquireOutcome {
    /// Busy, with no word on when the holder's lock expires.
    pub const BUSY: Self = Self::Busy {
        expires_in: None,
        last_token: None,
    };

    /// Busy, the holder's lock expiring in `expires_in` if known.
    pub fn busy(expires_in: Option<Duration>) -> Self {
        Self::Busy {
            expires_in,
            last_token: None,
        }
    }

    /// Whether another owner holds the key.
    pub fn is_busy(&self) -> bool {
        matches!(self, Self::Busy { .. })
    }
}

/// How long after the holder's lock was due to expire a waiter tries
/// again \[A9\]: the store deletes an expired key within about a
/// millisecond of its expiry (Redis's active expiry, PostgreSQL's
/// comparison with `clock_timestamp()`), and the two clocks' rates differ
/// by far less over a ttl. No jitter applies to it.
pub const EXPIRY_MARGIN: Duration = Duration::from_millis(5);

/// The terms of a place in a backend's fair queue \[F1–F3\], as
/// [`LockConfig::fair_queue`](crate::LockConfig::fair_queue) gives them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
#[cfg_attr(
    feature = "serde",
    derive(serde::Serialize, serde::Deserialize),
    serde(default, deny_unknown_fields)
)]
pub struct QueueTerms {
    /// How long a place lives after the waiter's last attempt: the driver
    /// attempts (and so renews the place) every third of it while it
    /// waits, so a waiter that crashed or stalled is skipped within this
    /// much, and one that returns after it joins at the tail \[F2\].
    ///
    /// Default: 3 s. Range: [`QueueTerms::MIN_TICKET_TTL`] to
    /// [`QueueTerms::MAX_TICKET_TTL`].
    #[cfg_attr(feature = "serde", serde(with = "humantime_serde"))]
    pub ticket_ttl: Duration,
    /// How long a grant waits to be taken up: a release gives the lock to
    /// the queue's head for this long, and the grantee's first extension
    /// (sent as soon as it starts) makes it its own ttl. A grantee that
    /// died before that delays the next waiter by at most this \[F3\].
    ///
    /// Default: 2 s. Range: [`QueueTerms::MIN_CLAIM`] to
    /// [`QueueTerms::MAX_CLAIM`].
    #[cfg_attr(feature = "serde", serde(with = "humantime_serde"))]
    pub claim: Duration,
}

impl QueueTerms {
    /// The shortest ticket ttl accepted: three heartbeats in it must reach
    /// the store.
    pub const MIN_TICKET_TTL: Duration = Duration::from_millis(300);
    /// The longest ticket ttl accepted.
    pub const MAX_TICKET_TTL: Duration = Duration::from_secs(60);
    /// The shortest claim deadline accepted.
    pub const MIN_CLAIM: Duration = Duration::from_millis(100);
    /// The longest claim deadline accepted.
    pub const MAX_CLAIM: Duration = Duration::from_secs(60);
    /// The default terms: a ticket ttl of 3 s, a claim deadline of 2 s.
    pub const DEFAULT: Self = Self {
        ticket_ttl: Duration::from_secs(3),
        claim: Duration::from_secs(2),
    };

    /// Terms with this ticket ttl and claim deadline.
    pub fn new(ticket_ttl: Duration, claim: Duration) -> Self {
        Self { ticket_ttl, claim }
    }

    /// How often a queued waiter renews its place: a third of the ticket ttl.
    pub fn heartbeat(&self) -> Duration {
        self.ticket_ttl / 3
    }
}

impl Default for QueueTerms {
    fn default() -> Self {
        Self::DEFAULT
    }
}

/// What one extension found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExtendOutcome {
    /// The key was still held by the lease and now expires `ttl` from now.
    Extended,
    /// The key no longer exists: it expired or was deleted.
    Expired,
    /// Another owner holds the key.
    Taken,
}

/// What one release found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReleaseOutcome {
    /// The key was held by the lease and is now free.
    Released,
    /// The key was not held by the lease; nothing changed.
    NotHeld,
}

/// One lease to extend, with its ttl, for [`LockBackend::extend_many`].
#[derive(Clone, Debug)]
pub struct ExtendRequest {
    /// The lease to extend.
    pub lease: Lease,
    /// The new time to live, from the moment the backend applies it.
    pub ttl: Duration,
}

/// How long a lock whose callback settled early is left to live \[H7\],
/// for [`LockBackend::hold`]: until its acquisition plus the config's
/// [`hold_at_least`](crate::LockConfig::hold_at_least).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Hold {
    /// The minimum hold, counted from the acquisition. A store that records
    /// when it gave the key (PostgreSQL's `locked_at`) sets the expiry to
    /// that record plus this.
    pub since_acquired: Duration,
    /// What is left of it now by the driver's clock, counted from the
    /// moment the acquisition was answered (so never short of the store's
    /// own count). A store without its own record of the acquisition sets
    /// the expiry to this from now.
    pub from_now: Duration,
}

impl Hold {
    /// A hold of `since_acquired` from the acquisition, `from_now` of it left.
    pub fn new(since_acquired: Duration, from_now: Duration) -> Self {
        Self {
            since_acquired,
            from_now,
        }
    }
}

/// The results of a batch that one server answered as a whole, in the form
/// [`LockBackend::extend_many`] gives: each lease its own outcome, or, when
/// the round trip failed, every lease the batch's error. An answer with
/// another count of outcomes than `len` is a protocol error for every lease.
pub fn batch_results(
    len: usize,
    answer: Result<Vec<ExtendOutcome>, BackendError>,
) -> Vec<Result<ExtendOutcome, BackendError>> {
    match answer {
        Ok(outcomes) if outcomes.len() == len => outcomes.into_iter().map(Ok).collect(),
        Ok(outcomes) => {
            let error = BackendError::message(
                crate::error::BackendErrorKind::Protocol,
                format!("{} outcomes for {len} extensions", outcomes.len()),
            );
            vec![Err(error); len]
        }
        Err(error) => vec![Err(error); len],
    }
}

/// What a backend can do beyond the required steps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Capabilities {
    /// A short name for the store, the `backend` label of the driver's
    /// metrics (with the `metrics` feature of `lock-core`). A wrapper that
    /// forwards its inner backend's capabilities keeps its name.
    ///
    /// Default: `"custom"`.
    pub name: &'static str,
    /// [`LockBackend::watch_release`] gives real notifications. When false
    /// the driver never calls it and waits on its retry timer alone.
    ///
    /// Default: `false`.
    pub release_notifications: bool,
    /// The longest key the backend stores, in bytes.
    ///
    /// Default: [`MAX_KEY_LEN`].
    pub max_key_len: usize,
    /// How many leases one [`LockBackend::extend_many`] call may carry.
    ///
    /// Default: `1`.
    pub max_extend_batch: usize,
    /// The shortest ttl the store grants: the driver asks for at least
    /// this much, and counts validity and schedules extensions on what it
    /// asked for (see [`effective_ttl`](Self::effective_ttl)).
    ///
    /// Default: zero (any ttl the config accepts).
    pub min_ttl: Duration,
    /// The unit in which the store counts ttls (etcd's leases are whole
    /// seconds): the driver rounds every ttl up to a multiple of it, so a
    /// lock is never shorter than its config says.
    ///
    /// Default: zero (no rounding).
    pub ttl_granularity: Duration,
    /// The store keeps a fair queue of waiters \[F1\]:
    /// [`LockBackend::try_acquire_queued`] and
    /// [`LockBackend::leave_queue`] are real, and a release grants the key
    /// to the queue's head, announced with
    /// [`ReleaseHub::grant`](crate::ReleaseHub::grant). Needs
    /// [`release_notifications`](Self::release_notifications): the driver
    /// queues only when both are true.
    ///
    /// Default: `false`.
    pub fair_queue: bool,
}

impl Default for Capabilities {
    fn default() -> Self {
        Self {
            name: "custom",
            release_notifications: false,
            max_key_len: MAX_KEY_LEN,
            max_extend_batch: 1,
            min_ttl: Duration::ZERO,
            ttl_granularity: Duration::ZERO,
            fair_queue: false,
        }
    }
}

impl Capabilities {
    /// Sets [`Capabilities::name`]. Defaults to `"custom"`.
    #[must_use]
    pub fn with_name(mut self, name: &'static str) -> Self {
        self.name = name;
        self
    }

    /// Sets [`Capabilities::release_notifications`].
    #[must_use]
    pub fn with_release_notifications(mut self, yes: bool) -> Self {
        self.release_notifications = yes;
        self
    }

    /// Sets [`Capabilities::max_key_len`].
    #[must_use]
    pub fn with_max_key_len(mut self, len: usize) -> Self {
        self.max_key_len = len;
        self
    }

    /// Sets [`Capabilities::max_extend_batch`] (at least 1).
    #[must_use]
    pub fn with_max_extend_batch(mut self, n: usize) -> Self {
        self.max_extend_batch = n.max(1);
        self
    }

    /// Sets [`Capabilities::min_ttl`]. Defaults to zero.
    #[must_use]
    pub fn with_min_ttl(mut self, ttl: Duration) -> Self {
        self.min_ttl = ttl;
        self
    }

    /// Sets [`Capabilities::ttl_granularity`]. Defaults to zero.
    #[must_use]
    pub fn with_ttl_granularity(mut self, unit: Duration) -> Self {
        self.ttl_granularity = unit;
        self
    }

    /// Sets [`Capabilities::fair_queue`]. Defaults to `false`.
    #[must_use]
    pub fn with_fair_queue(mut self, yes: bool) -> Self {
        self.fair_queue = yes;
        self
    }

    /// Whether the driver queues waiters on this backend: it has the queue
    /// and the notifications that carry its grants.
    pub(crate) fn queues(&self) -> bool {
        self.fair_queue && self.release_notifications
    }

    /// The ttl the driver asks this store for when a config says `ttl`: at
    /// least [`min_ttl`](Self::min_ttl), rounded up to a multiple of
    /// [`ttl_granularity`](Self::ttl_granularity). Every step of the lock
    /// (acquisition, extensions, the validity the driver counts, the
    /// schedule of extensions) uses it, and [`LockHandle::ttl`] reports it.
    ///
    /// ```
    /// # use std::time::Duration;
    /// # use lock_core::Capabilities;
    /// let whole_seconds = Capabilities::default()
    ///     .with_min_ttl(Duration::from_secs(2))
    ///     .with_ttl_granularity(Duration::from_secs(1));
    /// assert_eq!(whole_seconds.effective_ttl(Duration::from_millis(500)), Duration::from_secs(2));
    /// assert_eq!(whole_seconds.effective_ttl(Duration::from_millis(2_100)), Duration::from_secs(3));
    /// assert_eq!(Capabilities::default().effective_ttl(Duration::from_millis(500)), Duration::from_millis(500));
    /// ```
    ///
    /// [`LockHandle::ttl`]: crate::LockHandle::ttl
    pub fn effective_ttl(&self, ttl: Duration) -> Duration {
        let ttl = ttl.max(self.min_ttl);
        let unit = self.ttl_granularity.as_nanos();
        if unit == 0 {
            return ttl;
        }
        let rounded = ttl.as_nanos().div_ceil(unit).saturating_mul(unit);
        u64::try_from(rounded).map_or(Duration::MAX, Duration::from_nanos)
    }

    /// Whether [`effective_ttl`](Self::effective_ttl) may change a ttl.
    pub(crate) fn adjusts_ttls(&self) -> bool {
        !self.min_ttl.is_zero() || !self.ttl_granularity.is_zero()
    }
}

/// The atomic steps of a lock store.
///
/// A backend implements single steps; everything with a timer or a policy
/// (retries, waiting, extension, lost-lock racing, reentrancy, shutdown)
/// lives once, in [`Locker`](crate::Locker).
///
/// # Contract
///
/// - A backend never sleeps, never retries and never spawns a renewal task:
///   each method is one attempt at one step, and a failure is returned as a
///   [`BackendError`] for the driver to act on.
/// - `try_acquire` takes the key only if nobody holds it (or its holder's
///   ttl has run out), gives it to `owner` for `ttl`, and returns a fencing
///   token strictly greater than every token given before for that key, by
///   any owner. A held key is [`AcquireOutcome::Busy`], not an error.
/// - `extend` and `extend_many` reset the expiry to `ttl` from now only if
///   the key is still held by the lease's owner token. They never create a
///   key that is missing.
/// - `release` frees the key only if it is still held by the lease's owner
///   token, says whether it was, and is idempotent.
/// - `extend`, `extend_many` and `release` compare the key and the owner
///   token only. The driver may pass a lease whose fencing token is `0` when
///   it cleans up after an attempt whose answer it never saw.
/// - A step by an owner that no longer holds the key never changes the key.
/// - Keys are opaque: any non-empty string up to
///   [`Capabilities::max_key_len`] bytes works, including spaces, unicode,
///   braces, glob and SQL metacharacters.
/// - Release notifications are optional and declared in
///   [`Capabilities::release_notifications`]. A backend that offers them
///   must have its subscription in place when `watch_release` returns, so
///   that a release after that moment is never missed; after a reconnect of
///   its subscription it wakes every watch, since it may have missed some.
///
/// # Cancel safety
///
/// The driver may drop any of these futures. A backend must then leave
/// nothing half-done that a later call with the same lease cannot undo: a
/// dropped `try_acquire` may have taken the key (the driver releases it with
/// the same owner token), a dropped `extend` or `release` may or may not have
/// been applied. The driver polls each acquisition and release in place;
/// when its caller is dropped with the step still pending, an acquisition
/// goes on to its end in a task of its own, and a release is sent again in
/// one, so a dropped `with_lock` never strands a lock.
///
/// # Dropping
///
/// The driver's background work (a clean-up release, an extender) keeps a
/// reference to the backend until it ends, so the last reference may be
/// dropped on the process's background thread
/// ([`background::THREAD_NAME`](crate::background::THREAD_NAME)), which
/// every locker of the process shares. A backend's `Drop` must not block
/// (no network round trip waited for, no thread joined): it would stall
/// the extension of every other lock meanwhile. Hand such work to a task
/// or a thread of its own and return.
#[async_trait]
pub trait LockBackend: fmt::Debug + Send + Sync + 'static {
    /// What this backend can do beyond the required steps.
    fn capabilities(&self) -> Capabilities;

    /// One attempt to take `key` for `owner`, expiring `ttl` from now.
    async fn try_acquire(
        &self,
        key: &str,
        owner: &OwnerToken,
        ttl: Duration,
    ) -> Result<AcquireOutcome, BackendError>;

    /// Resets the expiry of `lease` to `ttl` from now, if it still holds its key.
    async fn extend(&self, lease: &Lease, ttl: Duration) -> Result<ExtendOutcome, BackendError>;

    /// Extends many leases of this node, in one round trip where the store
    /// allows it. Returns one result per request, in order \[L4\]: a lease
    /// whose server failed gets that error, and the others their own
    /// outcomes, so a failure on one server never makes a lease on another
    /// look lost. The driver sends at most
    /// [`Capabilities::max_extend_batch`] requests per call, all of one
    /// [`failure_domain`](Self::failure_domain).
    async fn extend_many(
        &self,
        requests: &[ExtendRequest],
    ) -> Vec<Result<ExtendOutcome, BackendError>>;

    /// The server that answers for `key`, as a number: the driver never
    /// puts leases of two domains into one
    /// [`extend_many`](Self::extend_many) call, so one hung server delays
    /// only the leases it holds \[L4\]. A backend on one server returns
    /// `0` for every key; a clustered one, say, the identity of the master
    /// that serves the key's slot, as it knows it now (a stale answer costs
    /// one more round trip, never a wrong result).
    fn failure_domain(&self, key: &str) -> u64;

    /// Frees the key of `lease`, if it still holds it.
    async fn release(&self, lease: &Lease) -> Result<ReleaseOutcome, BackendError>;

    /// Leaves the key of `lease`, if it still holds it, to expire when its
    /// minimum hold ends, instead of releasing it \[H7\]: at the store's
    /// record of the acquisition plus [`Hold::since_acquired`] where the
    /// store keeps one, else [`Hold::from_now`] from now. The expiry may
    /// move earlier or later than it was. Answers as
    /// [`extend`](Self::extend) does; like it, it never creates a missing
    /// key. The driver sends no extension of the lease after it (and waits
    /// for any in flight before it); a backend whose `extend` resets the
    /// expiry to `ttl` from now may implement it as
    /// `extend(lease, hold.from_now)`.
    async fn hold(&self, lease: &Lease, hold: Hold) -> Result<ExtendOutcome, BackendError>;

    /// An optional synchronous fast path of
    /// [`try_acquire`](Self::try_acquire), for a backend that keeps its
    /// locks in this process: `Some(answer)` spares the driver a boxed
    /// future, and a dropped caller has nothing in flight. `now` is the
    /// driver's clock when it made the attempt; the lock expires `ttl`
    /// after it. The answer must be the one `try_acquire` would give at
    /// `now`. The default, `None`, makes the driver call `try_acquire`.
    ///
    /// It runs on the caller's task and must not block or wait (no
    /// network, no contended lock held for long): a backend that may
    /// wait leaves it at the default. The driver holds none of its own
    /// locks while it calls it.
    fn try_acquire_now(
        &self,
        key: &str,
        owner: &OwnerToken,
        ttl: Duration,
        now: Instant,
    ) -> Option<Result<AcquireOutcome, BackendError>> {
        let _ = (key, owner, ttl, now);
        None
    }

    /// An optional synchronous fast path of [`release`](Self::release), as
    /// [`try_acquire_now`](Self::try_acquire_now) is of `try_acquire`, with
    /// the same rules: `now` is the driver's clock when it let go of the
    /// lock, it must not block, and the driver holds none of its own locks
    /// while it calls it. The default, `None`, makes the driver call
    /// `release`.
    fn release_now(
        &self,
        lease: &Lease,
        now: Instant,
    ) -> Option<Result<ReleaseOutcome, BackendError>> {
        let _ = (lease, now);
        None
    }

    /// A watch that wakes when `key` may have become free. Called only when
    /// [`Capabilities::release_notifications`] is true; other backends return
    /// [`ReleaseWatch::never`].
    async fn watch_release(&self, key: &str) -> Result<ReleaseWatch, BackendError>;

    /// One attempt of a waiter in the key's fair queue \[F1–F3\], for a
    /// backend with [`Capabilities::fair_queue`]; the same `owner` for the
    /// whole wait. In one atomic step it:
    ///
    /// - takes up a grant: the key holds `owner` (a release gave it to
    ///   this waiter): the expiry becomes `ttl` from now, and the answer is
    ///   the grant's fencing token;
    /// - takes the key when it is free and nobody live is queued ahead of
    ///   `owner`, as [`try_acquire`](Self::try_acquire) would, and drops
    ///   the place;
    /// - else keeps (or makes, at the tail) the place of `owner`, alive
    ///   until [`QueueTerms::ticket_ttl`] from now, and answers
    ///   [`AcquireOutcome::Busy`], with the holder's time left only when
    ///   `owner` is the head.
    ///
    /// Places whose time ran out are skipped and removed. A release of a
    /// backend with the queue grants the key to the head, alive, for
    /// [`QueueTerms::claim`] (the head's own terms, kept with its place),
    /// with a new fencing token, and announces the grant to the head
    /// alone ([`ReleaseHub::grant`](crate::ReleaseHub::grant)).
    ///
    /// The default, for a backend without the queue, fails with a
    /// [`BackendErrorKind::Setup`](crate::BackendErrorKind::Setup) error:
    /// the driver then waits unqueued \[F6\], as it does when a store
    /// refuses the queue for a missing table or right.
    ///
    /// # Cancel safety
    ///
    /// As `try_acquire`'s: a dropped attempt may have made a place (the
    /// driver leaves it) or taken the key (the driver releases it).
    async fn try_acquire_queued(
        &self,
        key: &str,
        owner: &OwnerToken,
        ttl: Duration,
        terms: QueueTerms,
    ) -> Result<AcquireOutcome, BackendError> {
        let _ = (key, owner, ttl, terms);
        Err(BackendError::message(
            crate::error::BackendErrorKind::Setup,
            "this backend keeps no fair queue",
        ))
    }

    /// Removes the place of `owner` from the key's fair queue, if it has
    /// one; a grant made to `owner` and not taken up is handed on as a
    /// release would (to the next place, or freeing the key). Idempotent.
    /// The default does nothing.
    ///
    /// # Cancel safety
    ///
    /// A dropped call may or may not have been applied; the driver sends
    /// it again, and a place it misses lapses after its ticket ttl.
    async fn leave_queue(&self, key: &str, owner: &OwnerToken) -> Result<(), BackendError> {
        let _ = (key, owner);
        Ok(())
    }
}

/// Implements [`LockBackend`] for a type by forwarding every step to a
/// backend it holds, except the steps written out in the call.
///
/// A wrapper whose only job is to keep something alive as long as the
/// backend lives (a test namespace, a scratch schema) names the field that
/// holds the backend:
///
/// ```
/// use lock_memory::MemoryBackend;
///
/// #[derive(Debug)]
/// struct Scratch {
///     backend: MemoryBackend,
///     _cleanup: Vec<String>, // dropped with the backend
/// }
///
/// lock_core::forward_lock_backend!(Scratch => backend);
///
/// let _locker = lock_core::Locker::new(Scratch { backend: MemoryBackend::new(), _cleanup: Vec::new() });
/// ```
///
/// A wrapper that changes some steps writes them in braces after the
/// field, as it would in `impl LockBackend for …` (an `async fn` as
/// [`async_trait`](crate::async_trait) takes it); every other step is
/// forwarded. A generic wrapper starts with `impl<…>`:
///
/// ```
/// use std::sync::atomic::{AtomicUsize, Ordering};
/// use std::time::Duration;
///
/// use lock_core::{BackendError, Capabilities, Lease, LockBackend, Locker, ReleaseOutcome};
/// use lock_memory::MemoryBackend;
///
/// /// Asks the store for leases of a second at least.
/// #[derive(Debug)]
/// struct AtLeastASecond {
///     inner: MemoryBackend,
/// }
///
/// lock_core::forward_lock_backend!(AtLeastASecond => inner {
///     fn capabilities(&self) -> Capabilities {
///         let capabilities = self.inner.capabilities();
///         capabilities.with_min_ttl(capabilities.min_ttl.max(Duration::from_secs(1)))
///     }
/// });
///
/// /// Counts the releases sent to the backend it wraps.
/// #[derive(Debug)]
/// struct CountReleases<B> {
///     backend: B,
///     releases: AtomicUsize,
/// }
///
/// lock_core::forward_lock_backend!(impl<B: LockBackend> CountReleases<B> => backend {
///     // The memory backend's fast path (`release_now`) is not forwarded
///     // past this step: the count sees every release.
///     async fn release(&self, lease: &Lease) -> Result<ReleaseOutcome, BackendError> {
///         self.releases.fetch_add(1, Ordering::Relaxed);
///         self.backend.release(lease).await
///     }
/// });
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let wide = AtLeastASecond { inner: MemoryBackend::new() };
/// assert_eq!(wide.capabilities().min_ttl, Duration::from_secs(1));
///
/// let counted = std::sync::Arc::new(CountReleases {
///     backend: wide,
///     releases: AtomicUsize::new(0),
/// });
/// let locker = Locker::new(std::sync::Arc::clone(&counted));
/// locker.with_lock("k", |_| async {}).await.unwrap();
/// assert_eq!(counted.releases.load(Ordering::Relaxed), 1);
/// assert_eq!(counted.capabilities().min_ttl, Duration::from_secs(1));
/// # }
/// ```
///
/// A wrapper that writes out a step is never bypassed: a defaulted step
/// whose default is built from it is not forwarded, so its default runs
/// over the wrapper's step. Today these are the fast paths:
/// `try_acquire_now` is not forwarded when `try_acquire` is written out,
/// nor `release_now` when `release` is (write a fast path out yourself to
/// keep one). Every step added to the trait later follows the same rule:
/// `try_acquire_queued` is not forwarded when `try_acquire` is written out
/// (its default makes the driver wait unqueued; write it out too to keep
/// the queue).
#[macro_export]
macro_rules! forward_lock_backend {
    // `impl<…>`: the generics are gathered up to their closing `>`, counting
    // the `<` inside them (one `+` per level).
    (impl < $($rest:tt)*) => {
        $crate::forward_lock_backend!(@generics [] [] $($rest)*);
    };
    (@generics [$($generics:tt)*] [] > $($rest:tt)*) => {
        $crate::forward_lock_backend!(@field [$($generics)*] $($rest)*);
    };
    (@generics [$($generics:tt)*] [$($depth:tt)*] < $($rest:tt)*) => {
        $crate::forward_lock_backend!(@generics [$($generics)* <] [+ $($depth)*] $($rest)*);
    };
    (@generics [$($generics:tt)*] [+ $($depth:tt)*] > $($rest:tt)*) => {
        $crate::forward_lock_backend!(@generics [$($generics)* >] [$($depth)*] $($rest)*);
    };
    (@generics [$($generics:tt)*] [+ $($depth:tt)*] >> $($rest:tt)*) => {
        $crate::forward_lock_backend!(@generics [$($generics)* >] [$($depth)*] > $($rest)*);
    };
    (@generics [$($generics:tt)*] $depth:tt $next:tt $($rest:tt)*) => {
        $crate::forward_lock_backend!(@generics [$($generics)* $next] $depth $($rest)*);
    };
    (@field [$($generics:tt)*] $ty:ty => $field:ident $({ $($steps:tt)* })?) => {
        $crate::forward_lock_backend!(
            @impl [$($generics)*] $ty, this => &this.$field; $($($steps)*)?
        );
    };

    // The form for a backend that is reached through an expression of
    // `$this` (a smart pointer's `&**this`), as for `Arc<T>` here.
    (@impl [$($generics:tt)*] $ty:ty, $this:ident => $inner:expr $(; $($steps:tt)*)?) => {
        $crate::forward_lock_backend!(
            @steps [[$($generics)*] [$ty] $this [$inner]] [] [] $($($steps)*)?
        );
    };

    // The steps written out, kept as they are and named.
    (@steps $ctx:tt [$($items:tt)*] [$($names:ident)*]
        $(#[$attr:meta])* async fn $name:ident $params:tt $(-> $ret:ty)? $body:block
        $($rest:tt)*
    ) => {
        $crate::forward_lock_backend!(
            @steps $ctx
            [$($items)* $(#[$attr])* async fn $name $params $(-> $ret)? $body]
            [$($names)* $name]
            $($rest)*
        );
    };
    (@steps $ctx:tt [$($items:tt)*] [$($names:ident)*]
        $(#[$attr:meta])* fn $name:ident $params:tt $(-> $ret:ty)? $body:block
        $($rest:tt)*
    ) => {
        $crate::forward_lock_backend!(
            @steps $ctx
            [$($items)* $(#[$attr])* fn $name $params $(-> $ret)? $body]
            [$($names)* $name]
            $($rest)*
        );
    };
    (@steps $ctx:tt $items:tt $names:tt) => {
        $crate::forward_lock_backend!(
            @forward $ctx $items $names
            [
                capabilities try_acquire extend extend_many failure_domain release hold
                watch_release try_acquire_now release_now try_acquire_queued leave_queue
            ]
        );
    };

    // Each step of the trait in turn: forwarded unless written out.
    (@forward [[$($generics:tt)*] [$ty:ty] $this:ident [$inner:expr]] [$($items:tt)*] $names:tt []) => {
        #[$crate::async_trait]
        impl<$($generics)*> $crate::LockBackend for $ty {
            $($items)*
        }
    };
    (@forward $ctx:tt $items:tt $names:tt [$step:ident $($steps:ident)*]) => {
        $crate::forward_lock_backend!(@written $step $names $ctx $items $names [$($steps)*]);
    };
    (@written capabilities [capabilities $($more:ident)*] $ctx:tt $items:tt $names:tt $steps:tt) => {
        $crate::forward_lock_backend!(@forward $ctx $items $names $steps);
    };
    (@written try_acquire [try_acquire $($more:ident)*] $ctx:tt $items:tt $names:tt $steps:tt) => {
        $crate::forward_lock_backend!(@forward $ctx $items $names $steps);
    };
    (@written extend [extend $($more:ident)*] $ctx:tt $items:tt $names:tt $steps:tt) => {
        $crate::forward_lock_backend!(@forward $ctx $items $names $steps);
    };
    (@written extend_many [extend_many $($more:ident)*] $ctx:tt $items:tt $names:tt $steps:tt) => {
        $crate::forward_lock_backend!(@forward $ctx $items $names $steps);
    };
    (@written failure_domain [failure_domain $($more:ident)*] $ctx:tt $items:tt $names:tt $steps:tt) => {
        $crate::forward_lock_backend!(@forward $ctx $items $names $steps);
    };
    (@written release [release $($more:ident)*] $ctx:tt $items:tt $names:tt $steps:tt) => {
        $crate::forward_lock_backend!(@forward $ctx $items $names $steps);
    };
    (@written hold [hold $($more:ident)*] $ctx:tt $items:tt $names:tt $steps:tt) => {
        $crate::forward_lock_backend!(@forward $ctx $items $names $steps);
    };
    (@written watch_release [watch_release $($more:ident)*] $ctx:tt $items:tt $names:tt $steps:tt) => {
        $crate::forward_lock_backend!(@forward $ctx $items $names $steps);
    };
    (@written try_acquire_now [try_acquire_now $($more:ident)*] $ctx:tt $items:tt $names:tt $steps:tt) => {
        $crate::forward_lock_backend!(@forward $ctx $items $names $steps);
    };
    (@written release_now [release_now $($more:ident)*] $ctx:tt $items:tt $names:tt $steps:tt) => {
        $crate::forward_lock_backend!(@forward $ctx $items $names $steps);
    };
    (@written try_acquire_queued [try_acquire_queued $($more:ident)*] $ctx:tt $items:tt $names:tt $steps:tt) => {
        $crate::forward_lock_backend!(@forward $ctx $items $names $steps);
    };
    (@written leave_queue [leave_queue $($more:ident)*] $ctx:tt $items:tt $names:tt $steps:tt) => {
        $crate::forward_lock_backend!(@forward $ctx $items $names $steps);
    };
    // A defaulted step whose default is built from a step written out is
    // never forwarded: the trait's default then runs over the wrapper's
    // step, so the wrapper sees every call. The fast paths default to
    // `None`, which makes the driver call the step itself.
    (@written try_acquire_now [try_acquire $($more:ident)*] $ctx:tt $items:tt $names:tt $steps:tt) => {
        $crate::forward_lock_backend!(@forward $ctx $items $names $steps);
    };
    (@written release_now [release $($more:ident)*] $ctx:tt $items:tt $names:tt $steps:tt) => {
        $crate::forward_lock_backend!(@forward $ctx $items $names $steps);
    };
    // The queued attempt is an acquisition: a wrapper that writes out
    // `try_acquire` sees it as the default's setup error (the driver then
    // waits unqueued) unless it writes it out too; its place is then never
    // made, so `leave_queue` stays at the default as well.
    (@written try_acquire_queued [try_acquire $($more:ident)*] $ctx:tt $items:tt $names:tt $steps:tt) => {
        $crate::forward_lock_backend!(@forward $ctx $items $names $steps);
    };
    (@written $step:ident [$other:ident $($more:ident)*] $ctx:tt $items:tt $names:tt $steps:tt) => {
        $crate::forward_lock_backend!(@written $step [$($more)*] $ctx $items $names $steps);
    };
    (@written $step:ident [] $ctx:tt $items:tt $names:tt $steps:tt) => {
        $crate::forward_lock_backend!(@forwarded $step $ctx $items $names $steps);
    };

    // The forwarding body of each step.
    (@forwarded capabilities
        [$generics:tt $ty:tt $this:ident [$inner:expr]] [$($items:tt)*] $names:tt $steps:tt
    ) => {
        $crate::forward_lock_backend!(@forward [$generics $ty $this [$inner]] [$($items)*
            fn capabilities(&self) -> $crate::Capabilities {
                let $this = self;
                $crate::LockBackend::capabilities($inner)
            }
        ] $names $steps);
    };
    (@forwarded try_acquire
        [$generics:tt $ty:tt $this:ident [$inner:expr]] [$($items:tt)*] $names:tt $steps:tt
    ) => {
        $crate::forward_lock_backend!(@forward [$generics $ty $this [$inner]] [$($items)*
            async fn try_acquire(
                &self,
                key: &str,
                owner: &$crate::OwnerToken,
                ttl: ::std::time::Duration,
            ) -> ::std::result::Result<$crate::AcquireOutcome, $crate::BackendError> {
                let $this = self;
                $crate::LockBackend::try_acquire($inner, key, owner, ttl).await
            }
        ] $names $steps);
    };
    (@forwarded extend
        [$generics:tt $ty:tt $this:ident [$inner:expr]] [$($items:tt)*] $names:tt $steps:tt
    ) => {
        $crate::forward_lock_backend!(@forward [$generics $ty $this [$inner]] [$($items)*
            async fn extend(
                &self,
                lease: &$crate::Lease,
                ttl: ::std::time::Duration,
            ) -> ::std::result::Result<$crate::ExtendOutcome, $crate::BackendError> {
                let $this = self;
                $crate::LockBackend::extend($inner, lease, ttl).await
            }
        ] $names $steps);
    };
    (@forwarded extend_many
        [$generics:tt $ty:tt $this:ident [$inner:expr]] [$($items:tt)*] $names:tt $steps:tt
    ) => {
        $crate::forward_lock_backend!(@forward [$generics $ty $this [$inner]] [$($items)*
            async fn extend_many(
                &self,
                requests: &[$crate::ExtendRequest],
            ) -> ::std::vec::Vec<::std::result::Result<$crate::ExtendOutcome, $crate::BackendError>>
            {
                let $this = self;
                $crate::LockBackend::extend_many($inner, requests).await
            }
        ] $names $steps);
    };
    (@forwarded failure_domain
        [$generics:tt $ty:tt $this:ident [$inner:expr]] [$($items:tt)*] $names:tt $steps:tt
    ) => {
        $crate::forward_lock_backend!(@forward [$generics $ty $this [$inner]] [$($items)*
            fn failure_domain(&self, key: &str) -> u64 {
                let $this = self;
                $crate::LockBackend::failure_domain($inner, key)
            }
        ] $names $steps);
    };
    (@forwarded release
        [$generics:tt $ty:tt $this:ident [$inner:expr]] [$($items:tt)*] $names:tt $steps:tt
    ) => {
        $crate::forward_lock_backend!(@forward [$generics $ty $this [$inner]] [$($items)*
            async fn release(
                &self,
                lease: &$crate::Lease,
            ) -> ::std::result::Result<$crate::ReleaseOutcome, $crate::BackendError> {
                let $this = self;
                $crate::LockBackend::release($inner, lease).await
            }
        ] $names $steps);
    };
    (@forwarded hold
        [$generics:tt $ty:tt $this:ident [$inner:expr]] [$($items:tt)*] $names:tt $steps:tt
    ) => {
        $crate::forward_lock_backend!(@forward [$generics $ty $this [$inner]] [$($items)*
            async fn hold(
                &self,
                lease: &$crate::Lease,
                hold: $crate::Hold,
            ) -> ::std::result::Result<$crate::ExtendOutcome, $crate::BackendError> {
                let $this = self;
                $crate::LockBackend::hold($inner, lease, hold).await
            }
        ] $names $steps);
    };
    (@forwarded watch_release
        [$generics:tt $ty:tt $this:ident [$inner:expr]] [$($items:tt)*] $names:tt $steps:tt
    ) => {
        $crate::forward_lock_backend!(@forward [$generics $ty $this [$inner]] [$($items)*
            async fn watch_release(
                &self,
                key: &str,
            ) -> ::std::result::Result<$crate::ReleaseWatch, $crate::BackendError> {
                let $this = self;
                $crate::LockBackend::watch_release($inner, key).await
            }
        ] $names $steps);
    };
    (@forwarded try_acquire_now
        [$generics:tt $ty:tt $this:ident [$inner:expr]] [$($items:tt)*] $names:tt $steps:tt
    ) => {
        $crate::forward_lock_backend!(@forward [$generics $ty $this [$inner]] [$($items)*
            fn try_acquire_now(
                &self,
                key: &str,
                owner: &$crate::OwnerToken,
                ttl: ::std::time::Duration,
                now: $crate::__macro_support::Instant,
            ) -> ::std::option::Option<
                ::std::result::Result<$crate::AcquireOutcome, $crate::BackendError>,
            > {
                let $this = self;
                $crate::LockBackend::try_acquire_now($inner, key, owner, ttl, now)
            }
        ] $names $steps);
    };
    (@forwarded try_acquire_queued
        [$generics:tt $ty:tt $this:ident [$inner:expr]] [$($items:tt)*] $names:tt $steps:tt
    ) => {
        $crate::forward_lock_backend!(@forward [$generics $ty $this [$inner]] [$($items)*
            async fn try_acquire_queued(
                &self,
                key: &str,
                owner: &$crate::OwnerToken,
                ttl: ::std::time::Duration,
                terms: $crate::QueueTerms,
            ) -> ::std::result::Result<$crate::AcquireOutcome, $crate::BackendError> {
                let $this = self;
                $crate::LockBackend::try_acquire_queued($inner, key, owner, ttl, terms).await
            }
        ] $names $steps);
    };
    (@forwarded leave_queue
        [$generics:tt $ty:tt $this:ident [$inner:expr]] [$($items:tt)*] $names:tt $steps:tt
    ) => {
        $crate::forward_lock_backend!(@forward [$generics $ty $this [$inner]] [$($items)*
            async fn leave_queue(
                &self,
                key: &str,
                owner: &$crate::OwnerToken,
            ) -> ::std::result::Result<(), $crate::BackendError> {
                let $this = self;
                $crate::LockBackend::leave_queue($inner, key, owner).await
            }
        ] $names $steps);
    };
    (@forwarded release_now
        [$generics:tt $ty:tt $this:ident [$inner:expr]] [$($items:tt)*] $names:tt $steps:tt
    ) => {
        $crate::forward_lock_backend!(@forward [$generics $ty $this [$inner]] [$($items)*
            fn release_now(
                &self,
                lease: &$crate::Lease,
                now: $crate::__macro_support::Instant,
            ) -> ::std::option::Option<
                ::std::result::Result<$crate::ReleaseOutcome, $crate::BackendError>,
            > {
                let $this = self;
                $crate::LockBackend::release_now($inner, lease, now)
            }
        ] $names $steps);
    };

    // `Wrapper => field` and `Wrapper => field { steps }`.
    ($ty:ty => $field:ident $({ $($steps:tt)* })?) => {
        $crate::forward_lock_backend!(@field [] $ty => $field $({ $($steps)* })?);
    };
}

forward_lock_backend!(@impl [T: LockBackend + ?Sized] Arc<T>, this => &**this);
forward_lock_backend!(@impl [T: LockBackend + ?Sized] Box<T>, this => &**this);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owner_token_has_node_id_and_128_random_bits() {
        let a = OwnerToken::new("node-a");
        let b = OwnerToken::new("node-a");
        assert_ne!(a, b);
        let (node, hex) = a.as_str().rsplit_once('/').unwrap();
        assert_eq!(node, "node-a");
        assert_eq!(hex.len(), 32);
        assert!(hex.chars().all(|c| c.is_ascii_hexdigit()));
        assert_eq!(a.node_id(), "node-a");
        assert!(!format!("{a:?}").contains(hex));
    }

    #[test]
    fn tokens_drawn_on_many_threads_and_redrawn_are_all_distinct() {
        let draw = || {
            let node = Arc::from("n");
            let mut redrawn = OwnerToken::draw(&node);
            let mut texts = Vec::new();
            for _ in 0..200 {
                texts.push(OwnerToken::draw(&node).as_str().to_owned());
                redrawn.redraw(&node);
                texts.push(redrawn.as_str().to_owned());
            }
            texts
        };
        let other = std::thread::spawn(draw);
        let mut all = draw();
        all.extend(other.join().unwrap());
        let distinct: std::collections::HashSet<_> = all.iter().collect();
        assert_eq!(distinct.len(), all.len());
        // Random bits, not a count: each hex digit takes many values at
        // every place.
        for place in 0..32 {
            let digits: std::collections::HashSet<_> =
                all.iter().map(|t| t.as_bytes()[2 + place]).collect();
            assert!(digits.len() >= 12, "place {place}: {digits:?}");
        }
    }

    #[test]
    fn a_drawn_token_equals_its_text_read_back_and_hashes_the_same() {
        use std::hash::BuildHasher;
        let drawn = OwnerToken::new("node/a");
        let read = OwnerToken::from_value(drawn.as_str());
        assert_eq!(drawn, read);
        assert_eq!(read, drawn);
        assert_eq!(read.node_id(), "node/a");
        assert_eq!(drawn.node_id(), "node/a");
        let state = std::collections::hash_map::RandomState::new();
        assert_eq!(state.hash_one(&drawn), state.hash_one(&read));
        // Same node id, other bits: another owner, also against its text.
        let other = OwnerToken::new("node/a");
        assert_ne!(drawn, other);
        assert_ne!(OwnerToken::from_value(other.as_str()), drawn);
        assert_ne!(OwnerToken::from_value("node/a"), drawn);
    }

    #[test]
    fn a_backend_is_custom_unless_it_names_itself() {
        assert_eq!(Capabilities::default().name, "custom");
        assert_eq!(Capabilities::default().with_name("redis").name, "redis");
    }
}

//! The operator's functions ([`LockAdmin`]) on the memory backend.

use hashbrown::hash_map::EntryRef;
use lock_core::{async_trait, AdminError, BackendError, LockAdmin, LockInfo, OwnerToken};
use tokio::time::Instant;

use crate::{Holder, MemoryBackend, State};

/// Lists, inspects and force-releases the locks of this backend, each in
/// one step under the backend's lock, so it sees the locks as the steps
/// do. A forced release announces the key to its waiters as a release
/// does. Every lock here has an expiry; one whose owner token is not in
/// withlock's format (given to `try_acquire` by hand) is refused by
/// `force_release` \[D2\]. Fencing tokens are kept per key while its entry
/// is (see [`KEPT_FREE`](crate::KEPT_FREE)). A lock whose holder's run
/// ended before its minimum hold \[H7\] is recorded so in its entry by the
/// hold step, and shows its hold's time left as
/// [`LockInfo::minimum_hold_left`].
#[async_trait]
impl LockAdmin for MemoryBackend {
    async fn list_locks(&self, prefix: &str) -> Result<Vec<LockInfo>, BackendError> {
        let now = Instant::now();
        let mut held: Vec<LockInfo> = self
            .lock()
            .held
            .iter()
            .filter(|(key, _)| key.starts_with(prefix))
            .map(|(key, holder)| info(key, holder, now))
            .filter(LockInfo::is_held)
            .collect();
        held.sort_by(|a, b| a.key.cmp(&b.key));
        Ok(held)
    }

    async fn inspect(&self, key: &str) -> Result<LockInfo, BackendError> {
        let now = Instant::now();
        Ok(self
            .lock()
            .held
            .get(key)
            .map_or_else(|| LockInfo::free(key), |holder| info(key, holder, now)))
    }

    async fn force_release(&self, key: &str) -> Result<Option<LockInfo>, AdminError> {
        let now = Instant::now();
        let mut state = self.lock();
        let State { held, free, .. } = &mut *state;
        let EntryRef::Occupied(slot) = held.entry_ref(key) else {
            return Ok(None);
        };
        let freed = info(key, slot.get(), now);
        if !freed.is_held() {
            return Ok(None);
        }
        if !freed.is_withlock_lock() {
            return Err(AdminError::NotALock {
                key: key.to_owned(),
                found: "a value not in withlock's owner-token format".to_owned(),
            });
        }
        Self::keep_free(slot, free, now);
        Self::give_back_room(held);
        drop(state);
        self.inner.hub.notify(key);
        Ok(Some(freed))
    }
}

/// What `holder`, the entry of `key`, shows at `now`.
fn info(key: &str, holder: &Holder, now: Instant) -> LockInfo {
    let info = match &holder.owner {
        Some(owner) if holder.expires_at > now => {
            let left = holder.expires_at - now;
            LockInfo::held(key, OwnerToken::from_value(owner.as_str()), Some(left))
                .with_minimum_hold_left(holder.kept.then_some(left))
        }
        _ => LockInfo::free(key),
    };
    info.with_fencing_token(Some(holder.fencing_token))
}

//! A complete toy backend, as the crate docs' "writing a new backend"
//! describes: a `HashMap` behind a mutex, no release notifications, no batch
//! extension. It passes the whole suite, which also proves the driver's
//! fallbacks (retry timer instead of notifications, one lease per
//! extension call).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use lock_core::{
    async_trait, AcquireOutcome, BackendError, Capabilities, ExtendOutcome, ExtendRequest, Hold,
    Lease, LockBackend, OwnerToken, ReleaseOutcome, ReleaseWatch,
};

#[derive(Debug, Default)]
struct ToyBackend {
    keys: Mutex<HashMap<String, Slot>>,
}

/// One key: who holds it until when, and its fencing counter, which
/// outlives releases.
#[derive(Debug, Default)]
struct Slot {
    holder: Option<(OwnerToken, Instant)>,
    fence: u64,
}

impl ToyBackend {
    fn extend_one(&self, lease: &Lease, ttl: Duration) -> ExtendOutcome {
        let mut keys = self.keys.lock().unwrap();
        match keys.get_mut(lease.key()) {
            Some(Slot {
                holder: Some((owner, until)),
                ..
            }) if *until > Instant::now() => {
                if owner == lease.owner() {
                    *until = Instant::now() + ttl;
                    ExtendOutcome::Extended
                } else {
                    ExtendOutcome::Taken
                }
            }
            _ => ExtendOutcome::Expired,
        }
    }
}

#[async_trait]
impl LockBackend for ToyBackend {
    fn capabilities(&self) -> Capabilities {
        Capabilities::default()
    }

    async fn try_acquire(
        &self,
        key: &str,
        owner: &OwnerToken,
        ttl: Duration,
    ) -> Result<AcquireOutcome, BackendError> {
        let mut keys = self.keys.lock().unwrap();
        let slot = keys.entry(key.to_owned()).or_default();
        if slot
            .holder
            .as_ref()
            .is_some_and(|(_, until)| *until > Instant::now())
        {
            return Ok(AcquireOutcome::BUSY);
        }
        slot.fence += 1;
        slot.holder = Some((owner.clone(), Instant::now() + ttl));
        Ok(AcquireOutcome::Acquired {
            fencing_token: slot.fence,
        })
    }

    async fn extend(&self, lease: &Lease, ttl: Duration) -> Result<ExtendOutcome, BackendError> {
        Ok(self.extend_one(lease, ttl))
    }

    async fn extend_many(
        &self,
        requests: &[ExtendRequest],
    ) -> Vec<Result<ExtendOutcome, BackendError>> {
        requests
            .iter()
            .map(|r| Ok(self.extend_one(&r.lease, r.ttl)))
            .collect()
    }

    fn failure_domain(&self, _key: &str) -> u64 {
        0
    }

    async fn hold(&self, lease: &Lease, hold: Hold) -> Result<ExtendOutcome, BackendError> {
        Ok(self.extend_one(lease, hold.from_now))
    }

    async fn release(&self, lease: &Lease) -> Result<ReleaseOutcome, BackendError> {
        let mut keys = self.keys.lock().unwrap();
        let Some(slot) = keys.get_mut(lease.key()) else {
            return Ok(ReleaseOutcome::NotHeld);
        };
        let ours = slot
            .holder
            .as_ref()
            .is_some_and(|(owner, until)| owner == lease.owner() && *until > Instant::now());
        if !ours {
            return Ok(ReleaseOutcome::NotHeld);
        }
        slot.holder = None;
        Ok(ReleaseOutcome::Released)
    }

    async fn watch_release(&self, _key: &str) -> Result<ReleaseWatch, BackendError> {
        Ok(ReleaseWatch::never())
    }
}

// The toy has no admin functions (list, inspect, force release): declared
// so, the admin cases pass on it saying so.
lock_conformance::conformance_tests!(lock_conformance::without_admin(|| async {
    Arc::new(ToyBackend::default())
}));

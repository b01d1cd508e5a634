//! A factory whose backends declare a larger minimum ttl than the store
//! needs, so that the suite's short-ttl windows widen on a server that a
//! loaded machine can slow down (see [`with_min_ttl`]).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use lock_core::{Capabilities, DynLockBackend};

use crate::support::{AdminStore, BackendFactory};

/// The backends of `factory`, each declaring [`Capabilities::min_ttl`] of
/// at least `min_ttl`: the driver then asks the store for at least that
/// ttl, and the cases scale their waits by it ([`crate::ttl_scale`]), as
/// they do for a store whose leases have a floor (etcd).
///
/// For a networked store on a machine that may be busy: the suite's
/// 400 ms [`SHORT_TTL`](crate::SHORT_TTL) leaves an extension 270 ms to
/// arrive, which a stalled test process can miss. Every step still goes
/// to the store as it is; only the ttls asked for and the cases' windows
/// grow.
///
/// ```no_run
/// # async fn make() -> lock_memory::MemoryBackend { lock_memory::MemoryBackend::new() }
/// use std::time::Duration;
/// lock_conformance::conformance_tests!(lock_conformance::with_min_ttl(
///     Duration::from_secs(1),
///     make,
/// ));
/// ```
pub fn with_min_ttl<F: BackendFactory>(min_ttl: Duration, factory: F) -> WithMinTtl<F> {
    WithMinTtl { factory, min_ttl }
}

/// A factory made by [`with_min_ttl`].
pub struct WithMinTtl<F> {
    factory: F,
    min_ttl: Duration,
}

impl<F: BackendFactory> BackendFactory for WithMinTtl<F> {
    fn backend(&self) -> Pin<Box<dyn Future<Output = Arc<DynLockBackend>> + Send + '_>> {
        Box::pin(async move {
            let inner = self.factory.backend().await;
            Arc::new(MinTtl::new(inner, self.min_ttl)) as Arc<DynLockBackend>
        })
    }

    fn with_admin(&self) -> Pin<Box<dyn Future<Output = Option<AdminStore>> + Send + '_>> {
        Box::pin(async move {
            let store = self.factory.with_admin().await?;
            Some(AdminStore {
                backend: Arc::new(MinTtl::new(store.backend, self.min_ttl)),
                admin: store.admin,
            })
        })
    }
}

/// A backend that forwards every step and declares a larger minimum ttl.
#[derive(Debug)]
struct MinTtl {
    inner: Arc<DynLockBackend>,
    capabilities: Capabilities,
}

impl MinTtl {
    fn new(inner: Arc<DynLockBackend>, min_ttl: Duration) -> Self {
        let capabilities = inner.capabilities();
        let floor = capabilities.min_ttl.max(min_ttl);
        Self {
            capabilities: capabilities.with_min_ttl(floor),
            inner,
        }
    }
}

lock_core::forward_lock_backend!(MinTtl => inner {
    fn capabilities(&self) -> Capabilities {
        self.capabilities
    }
});

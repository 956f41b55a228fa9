//! The seam between the layer and where locks live.

use crate::error::LockError;
use crate::lock::{BoxFuture, LockGuard, LockOwner, LockRequest};

/// A store of distributed locks. [`RedisBackend`](crate::RedisBackend) is the one this
/// crate ships; the layer is written against this trait so that other stores (an
/// in-process one for tests, Redis Cluster) can be added without changing it.
///
/// The acquisition methods are hidden: guards can only be built inside this crate, which
/// keeps the release and renewal guarantees in one place.
pub trait LockBackend: Clone + Send + Sync + 'static {
    /// Starts building an acquisition of `key`.
    fn lock(&self, key: impl Into<String>) -> LockRequest<Self> {
        LockRequest::new(self.clone(), key.into())
    }

    #[doc(hidden)]
    fn acquire(
        self,
        request: LockRequest<Self>,
    ) -> BoxFuture<'static, Result<LockGuard, LockError>>;

    #[doc(hidden)]
    fn new_owner(&self) -> LockOwner;
}

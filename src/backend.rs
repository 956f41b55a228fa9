//! The seam between the layer and where locks live.

use crate::lock::LockRequest;
use crate::many::ManyLockRequest;

/// A store of locks: [`RedisBackend`](crate::RedisBackend) across instances, or
/// [`MemoryBackend`](crate::MemoryBackend) inside one process.
///
/// The layer and [`LockRequest`] hold any backend behind this trait, so no type names the
/// backend (`LockLayer<K>`), and an application can take `impl LockBackend` to run on
/// Redis in production and in memory in its tests.
///
/// The trait is sealed: only this crate's backends implement it. A guard's guarantees
/// (released on every exit path, renewed while it lives, `lost()` when the store proves
/// the lock gone) are kept by code shared with each store's internals, and that seam is
/// not yet a stable public API.
pub trait LockBackend: sealed::Sealed + Clone + Send + Sync + 'static {
    /// Starts building an acquisition of `key`.
    fn lock(&self, key: impl Into<String>) -> LockRequest {
        LockRequest::new(self.store(), key.into())
    }

    /// Starts building an acquisition of every key of `keys` at once (at most
    /// [`MAX_KEYS`](crate::MAX_KEYS)): all or none, in canonical order, under one owner
    /// (see [`ManyLockRequest`]).
    fn lock_many<I>(&self, keys: I) -> ManyLockRequest
    where
        I: IntoIterator,
        I::Item: Into<String>,
    {
        ManyLockRequest::new(self.store(), keys.into_iter().map(Into::into).collect())
    }
}

pub(crate) use self::sealed::{Backend, Sealed};

mod sealed {
    use std::sync::Arc;

    use crate::error::LockError;
    use crate::lock::{BoxFuture, LockGuard, LockOwner, LockRequest};

    /// Implemented by this crate's backends only (see [`LockBackend`](super::LockBackend)).
    pub trait Sealed {
        /// The backend's store, shared by every clone of it.
        fn store(&self) -> Arc<dyn Backend>;
    }

    /// What the layer and the lock builder need of a backend.
    pub trait Backend: Send + Sync + 'static {
        /// Runs an acquisition: validates the key, queues behind this process's other
        /// tasks for it, takes the lock (waiting if asked) and returns its guard.
        fn acquire(
            self: Arc<Self>,
            request: LockRequest,
        ) -> BoxFuture<'static, Result<LockGuard, LockError>>;

        /// A new owner: one per request.
        fn new_owner(&self) -> LockOwner;

        /// The `namespace` label of the backend's metrics.
        fn metrics(&self) -> &crate::core::telemetry::Namespace;

        /// The longest key the backend accepts, in bytes.
        fn max_key_len(&self) -> usize;
    }
}

/// A snapshot of a backend's connections and bookkeeping, returned by
/// [`RedisBackend::stats`](crate::RedisBackend::stats) and the other stores' `stats`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct BackendStats {
    /// Whether the listening connection (the Redis subscriber, PostgreSQL's `LISTEN`
    /// connection) is up.
    pub subscriber_connected: bool,
    /// How many times the listening connection has been established (1 + reconnects).
    pub subscriber_connections_made: u64,
    /// Release channels with at least one local waiter.
    pub channels_with_waiters: usize,
    /// Held locks the watchdog is renewing or watching.
    pub watched_locks: usize,
    /// Keys with a task of this backend contending for, holding or queued on them. Entries
    /// are removed when the last task leaves, so this returns to 0 when the backend is idle.
    pub local_queues: usize,
    /// Tasks queued in-process behind another task of this backend for the same key.
    pub local_waiters: usize,
}

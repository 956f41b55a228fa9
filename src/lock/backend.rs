//! The seam the lock API calls and every backend implements: [`Backend`], what the layer
//! and the lock builders need of where locks live, and [`Sealed`], which hands a backend's
//! [`Backend`] to the public `LockBackend` (in `src/backend.rs`) and keeps that trait
//! closed to other crates.

use std::sync::Arc;

use crate::error::LockError;
use crate::lock::inspect::{LockInfo, Primitive};
use crate::lock::{BoxFuture, LockGuard, LockOwner, LockRequest};
use crate::telemetry::Namespace;

/// What an acquisition of the idempotency layer came to (see
/// [`Backend::acquire_unless_recorded`]). `pub` in a private module, so that the sealed
/// [`Backend`] trait can name it.
#[derive(Debug)]
pub enum Acquired {
    /// The lock, taken in the store by an attempt that found no record of the key in the
    /// same atomic step: no record but its holder's can appear while it holds the key, so
    /// the record need not be read again.
    Checked(LockGuard),
    /// The lock, got without that check (a store that cannot make it, a hold handed over
    /// by the previous holder of this process, a re-entry): the record must be read again.
    Unchecked(LockGuard),
    /// The key's record exists: nothing was taken.
    Recorded,
}

/// Implemented by this crate's backends only (see [`LockBackend`](crate::LockBackend)).
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

    /// As [`acquire`](Self::acquire), for the idempotency layer: a store that can check
    /// the key's record as it takes a new hold takes none while it exists. The default
    /// checks nothing.
    fn acquire_unless_recorded(
        self: Arc<Self>,
        request: LockRequest,
    ) -> BoxFuture<'static, Result<Acquired, LockError>> {
        let acquiring = self.acquire(request);
        Box::pin(async move { acquiring.await.map(Acquired::Unchecked) })
    }

    /// A new owner: one per request.
    fn new_owner(&self) -> LockOwner;

    /// The `namespace` label of the backend's metrics.
    fn metrics(&self) -> &Namespace;

    /// The longest key the backend accepts, in bytes.
    fn max_key_len(&self) -> usize;

    /// A snapshot of `key`'s lock or semaphore (see `LockBackend::inspect`).
    fn inspect(
        self: Arc<Self>,
        key: String,
        of: Primitive,
    ) -> BoxFuture<'static, Result<LockInfo, LockError>>;

    /// Every lock and semaphore held now under `prefix` (see `LockBackend::list_held`).
    fn list_held(
        self: Arc<Self>,
        prefix: String,
    ) -> BoxFuture<'static, Result<Vec<LockInfo>, LockError>>;

    /// Frees `key`'s lock or semaphore, fenced, and reports what it freed (see
    /// `LockBackend::force_release`).
    fn force_release(
        self: Arc<Self>,
        key: String,
        of: Primitive,
    ) -> BoxFuture<'static, Result<LockInfo, LockError>>;
}

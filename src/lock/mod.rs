//! The lock API, with or without HTTP: [`LockRequest`] (from
//! [`LockBackend::lock`](crate::LockBackend::lock)) and the [`LockGuard`] it returns, the
//! handler's [`HeldLock`] and [`HeldLocks`], several keys at once ([`ManyLockRequest`]),
//! the operator's snapshot ([`LockInfo`]), the layer's hold [`policy`], and the defaults
//! and bounds of every acquisition and every backend's builder.
//!
//! The types are also at the crate root; the constants, the extractor's rejection
//! ([`MissingHeldLock`]) and the policies are here only.

// The request builder in `request.rs`, the guard in `guard.rs`, the held-lock handle in
// `held.rs`, several keys in `many.rs`, the hold policies in `policy.rs`, the snapshot in
// `inspect.rs`, the `Retry-After` estimate in `retry.rs`; the sealed seam every backend
// implements in `backend.rs`, and what an acquisition and a hold record in `observe.rs`.

pub(crate) mod backend;
pub(crate) mod guard;
pub(crate) mod held;
pub(crate) mod inspect;
pub(crate) mod many;
pub(crate) mod observe;
pub mod policy;
pub(crate) mod request;
pub(crate) mod retry;

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

pub(crate) use self::backend::Acquired;
pub use self::guard::LockGuard;
pub(crate) use self::guard::ReleaseHold;
pub use self::held::{HeldLock, HeldLocks, MissingHeldLock};
pub use self::inspect::{LockInfo, LockMode};
pub use self::many::{MAX_KEYS, ManyLockRequest};
pub use self::request::LockRequest;
pub(crate) use self::request::{Kind, Mode};

/// A boxed, sendable future, as returned by the backend trait.
pub(crate) type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// The default lease: how long a lock outlives a holder that stopped renewing it.
pub const DEFAULT_LEASE: Duration = Duration::from_secs(30);

/// How many tasks of one backend may queue for one key by default (see
/// [`LockRequest::max_local_waiters`]).
pub const DEFAULT_MAX_LOCAL_WAITERS: usize = 1024;

/// The longest lease or wait accepted; longer ones are shortened to it. Bounded so that
/// deadlines cannot overflow an `Instant` and a lease always fits `PEXPIRE`.
pub const MAX_DURATION: Duration = Duration::from_secs(365 * 24 * 3600);

/// Default bound on consecutive handoffs within one process under one hold in the store
/// (see `max_local_handoffs` on a backend's builder).
pub const DEFAULT_MAX_LOCAL_HANDOFFS: u32 = 32;

/// Default bound on the time one process's tasks take turns under one hold in the store
/// (see `max_local_handoff_time` on a backend's builder).
pub const DEFAULT_MAX_LOCAL_HANDOFF_TIME: Duration = Duration::from_millis(20);

/// Default upper bound on a key's length in bytes.
pub const DEFAULT_MAX_KEY_LEN: usize = 1024;

/// The identity a lock is held under: `instance-uuid:sequence`, one per request.
///
/// Two acquisitions of the same key by the same owner re-enter the lock (its count goes
/// up) instead of deadlocking. The layer gives every request its own owner and reuses it
/// for nested layers; [`LockRequest::reentrant`] reuses the owner of a [`HeldLock`].
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct LockOwner(Arc<str>);

impl LockOwner {
    pub(crate) fn new(id: String) -> Self {
        LockOwner(id.into())
    }

    /// The owner id as stored in the lock hash.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for LockOwner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

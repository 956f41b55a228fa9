//! What an operator sees of a key ([`LockInfo`]) and what the backends' `inspect` and
//! `force_release` calls are about.

use std::time::Duration;

/// Which of a key's two primitives an operator call is about: its lock (exclusive and
/// shared holds of one hash) or its semaphore, which lives apart with its own holders and
/// fencing tokens. (`pub` because the sealed `Store` trait names it; never exported.)
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Primitive {
    /// The key's lock: exclusive and shared holds.
    Lock,
    /// The key's semaphore: permits.
    Semaphore,
}

/// How a key is held, as [`LockInfo::mode`] reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum LockMode {
    /// Nobody holds it.
    Free,
    /// One owner holds the lock exclusively (possibly re-entered: see [`LockInfo::holds`]).
    Exclusive,
    /// One or more owners hold the lock shared ([`LockRequest::shared`](crate::LockRequest::shared)).
    Shared,
    /// Permits of the key's semaphore are taken ([`LockRequest::permits`](crate::LockRequest::permits));
    /// only the semaphore calls report it.
    Permits,
}

/// A snapshot of one key's lock or semaphore, for operators: who holds it in what way, for
/// how long, and where its fencing tokens stand. Returned by
/// [`LockBackend::inspect`](crate::LockBackend::inspect) and, as what was freed, by
/// [`LockBackend::force_release`](crate::LockBackend::force_release) (and their
/// `_permits` forms for the semaphore).
///
/// It never carries owner ids: an owner id is what a holder proves itself with, and a
/// snapshot may end up in logs or an admin page.
///
/// ```
/// use tower_lock::{LockBackend, LockMode, MemoryBackend};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), tower_lock::LockError> {
/// let backend = MemoryBackend::new();
/// let guard = backend.lock("order:42").try_once().await?;
/// let info = backend.inspect("order:42").await?;
/// assert_eq!(info.mode, LockMode::Exclusive);
/// assert_eq!(info.holders, 1);
/// assert_eq!(info.fencing_token, Some(guard.fencing_token()));
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct LockInfo {
    /// The key, as the application names it.
    pub key: String,
    /// How the key is held.
    pub mode: LockMode,
    /// How many owners hold it: 1 when exclusive, the shared holders, the permits taken,
    /// 0 when free.
    pub holders: usize,
    /// Holds counted with re-entries: above [`holders`](Self::holders) when a holder took
    /// the key again under its own lock (a nested layer, `LockRequest::reentrant`).
    pub holds: u32,
    /// How long the longest of the holders' leases still runs, unless renewed; `None` when
    /// free. A watchdog renews a held lease every third of it, so this says how long a
    /// holder that stopped (crashed, cut off) keeps the key.
    pub lease_remaining: Option<Duration>,
    /// The highest fencing token the store issued for the key (or set aside for holders
    /// that get the key in memory from another task of one process) that it still
    /// remembers: every holder so far had a token at most this, and the next holder gets
    /// a higher one. `None` when the store remembers none (the key has not been held for
    /// longer than its fencing counter lives); tokens still increase then.
    pub fencing_token: Option<u64>,
}

impl LockInfo {
    /// A free key with the fencing token the store remembers, if any.
    pub(crate) fn free(key: String, fencing_token: Option<u64>) -> Self {
        LockInfo {
            key,
            mode: LockMode::Free,
            holders: 0,
            holds: 0,
            lease_remaining: None,
            fencing_token,
        }
    }

    /// Whether nobody holds the key.
    pub fn is_free(&self) -> bool {
        self.mode == LockMode::Free
    }
}

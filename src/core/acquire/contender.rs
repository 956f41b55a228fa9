//! One acquisition in progress, and the waiting writer it may have registered, withdrawn
//! when it stops waiting.

use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::Duration;

use tokio::time::{Instant, timeout};

use crate::core::acquire::record::RecordCheck;
use crate::core::queue::Claim;
use crate::core::store::StoreKey;
use crate::core::{Core, Store};
use crate::error::LockError;
use crate::lock::{Kind, LockOwner};

/// One acquisition in progress.
pub(in crate::core) struct Contender<S: Store> {
    pub(in crate::core) key: Arc<S::Key>,
    /// The owner the store knows the key's hold under, when this is a re-entry by a holder that
    /// got the lock in memory from an earlier task of this process; else the claim's.
    pub(in crate::core) store_owner: Option<LockOwner>,
    pub(in crate::core) claim: Claim,
    pub(in crate::core) started: Instant,
    pub(in crate::core) deadline: Option<Instant>,
    pub(in crate::core) kind: Kind,
    /// Whether each attempt checks the key's idempotency record.
    pub(in crate::core) records: RecordCheck,
    /// Whether this exclusive acquisition is registered as a waiting writer (a store
    /// registers one that shared holders keep out; until it gets the lock, new shared
    /// holds queue behind it): [`NOT_QUEUED`], [`MAYBE_QUEUED`] or [`QUEUED`].
    pub(in crate::core) queued_writer: AtomicU8,
    pub(in crate::core) core: Arc<Core<S>>,
}

pub(in crate::core) const NOT_QUEUED: u8 = 0;
/// A waiting attempt was sent whose reply was not read (or said nothing of it): it, or a
/// run of it that a cluster client sent again, may have registered.
pub(in crate::core) const MAYBE_QUEUED: u8 = 1;
/// An attempt's reply said it registered.
pub(in crate::core) const QUEUED: u8 = 2;

impl<S: Store> Drop for Contender<S> {
    /// A writer that stops waiting (timed out, cancelled, failed) lets new shared holds
    /// in again at once, rather than when its registration runs out with its wait, and
    /// wakes those known to wait for it (when it may only have registered, its withdrawal
    /// wakes nobody: a release message to every waiter of the key for each writer that
    /// gave up would multiply the load of an overloaded key).
    fn drop(&mut self) {
        let queued = self.queued_writer.load(Ordering::Relaxed);
        if queued == NOT_QUEUED {
            return;
        }
        let owner = self.store_owner().clone();
        let withdraw = self
            .core
            .store
            .withdraw_writer(&self.key, owner, queued == QUEUED);
        self.core.runtime.spawn(withdraw);
    }
}

impl<S: Store> Contender<S> {
    /// The owner the store's calls act for (see [`store_owner`](Self::store_owner)).
    pub(in crate::core) fn store_owner(&self) -> &LockOwner {
        self.store_owner.as_ref().unwrap_or(&self.claim.owner)
    }

    /// The refusal of an acquisition that does not wait, the key held for about
    /// `retry_after` more.
    pub(in crate::core) fn refused(&self, retry_after: Option<Duration>) -> LockError {
        let key = self.key.user().to_owned();
        match self.kind {
            Kind::Permit(permits) => LockError::PermitsTaken {
                key,
                permits,
                retry_after,
            },
            Kind::Exclusive | Kind::Shared => LockError::Contended { key, retry_after },
        }
    }

    pub(in crate::core) fn timed_out(&self, retry_after: Option<Duration>) -> LockError {
        LockError::TimedOut {
            key: self.key.user().to_owned(),
            waited: self.started.elapsed(),
            retry_after,
        }
    }
}

impl<S: Store> Core<S> {
    /// The answer to a try while another task of this backend has the key: no attempt,
    /// which would jump the queue, only the holder's remaining lease for `Retry-After`.
    pub(in crate::core) async fn busy(&self, c: &Contender<S>) -> LockError {
        let remaining = self.store.remaining(&c.key);
        let retry_after = timeout(self.settings.command_timeout, remaining)
            .await
            .ok()
            .flatten();
        LockError::Contended {
            key: c.key.user().to_owned(),
            retry_after,
        }
    }
}

//! Re-entries of a key by the task that holds its slot in this process.

use std::sync::Arc;

use super::{KeyQueue, Shared};
use crate::lock::LockOwner;

/// A re-entry of a key by the task that holds its slot, counted while it is held: a hold
/// with re-entries outstanding is not handed over in memory. Dropped with the re-entry's
/// hold.
pub(crate) struct Reentry {
    shared: Arc<Shared>,
    key: Arc<str>,
    epoch: u64,
    /// Who the store knows the hold under, and the holder's token (`None`: the claimant
    /// itself, with the token the store gives).
    store_owner: Option<(LockOwner, u64)>,
}

impl Reentry {
    pub(super) fn new(shared: &Arc<Shared>, key: &Arc<str>, queue: &mut KeyQueue) -> Self {
        queue.nested += 1;
        Reentry {
            shared: shared.clone(),
            key: key.clone(),
            epoch: queue.epoch,
            store_owner: queue.store_owner.clone(),
        }
    }

    /// The owner to re-enter under in the store, when it is not the claimant (the holder
    /// got the lock in memory from an earlier task of this process).
    pub(crate) fn store_owner(&self) -> Option<&LockOwner> {
        self.store_owner.as_ref().map(|(owner, _)| owner)
    }

    /// The fencing token of a holder that got the lock in memory.
    pub(crate) fn token(&self) -> Option<u64> {
        self.store_owner.as_ref().map(|(_, token)| *token)
    }
}

impl Drop for Reentry {
    fn drop(&mut self) {
        let mut keys = self.shared.keys();
        if let Some(queue) = keys.get_mut(&self.key).filter(|q| q.epoch == self.epoch) {
            queue.nested = queue.nested.saturating_sub(1);
        }
    }
}

//! The operator calls of a [`MemoryBackend`](super::MemoryBackend): a snapshot of a key's
//! lock or semaphore, and freeing it by force.
//!
//! Freeing by force ends each holder's tenure as its lease running out would: its `lost()`
//! fires at once, the waiters it kept out are let in, and its guard's release finds
//! nothing to give back (`Lost`). Tokens come from one counter for every key, so the next
//! holder's is above every token issued.

use std::sync::Arc;

use super::hold::{HoldId, Of, Tenure};
use super::{Inner, MAX_KEY_LEN, State};
use crate::error::LockError;
use crate::key::validate;
use crate::lock::inspect::{LockInfo, LockMode, Primitive};

impl Inner {
    pub(super) fn inspect(&self, key: String, of: Primitive) -> Result<LockInfo, LockError> {
        validate(&key, MAX_KEY_LEN)?;
        Ok(self.state().snapshot(key, of))
    }

    pub(super) fn force_release(
        self: &Arc<Self>,
        key: String,
        of: Primitive,
    ) -> Result<LockInfo, LockError> {
        validate(&key, MAX_KEY_LEN)?;
        let key: Arc<str> = key.into();
        let freed = self.with_state(|state, deferred| {
            let freed = state.snapshot(key.to_string(), of);
            for id in state.holders(&key, of) {
                if let Some(tenure) = state.tenure(&id) {
                    tenure.lose();
                }
                state.end(self, &id, deferred);
            }
            freed
        });
        if !freed.is_free() {
            tracing::info!(key = %key, mode = ?freed.mode, holders = freed.holders, "lock force-released");
        }
        Ok(freed)
    }
}

impl State {
    /// Every tenure of `key`'s lock or semaphore: shared holders before the exclusive one,
    /// so that ending the latter (a writer that also holds its key shared) lets its
    /// waiters in once nothing is left.
    fn holders(&self, key: &Arc<str>, of: Primitive) -> Vec<HoldId> {
        let id = |of, owner: &crate::lock::LockOwner, tenure: &Tenure| HoldId {
            of,
            key: key.clone(),
            owner: owner.clone(),
            generation: tenure.generation,
        };
        match of {
            Primitive::Lock => self.keys.get(key).map_or_else(Vec::new, |entry| {
                let readers = entry.readers.iter().map(|(o, t)| id(Of::Shared, o, t));
                let writer = entry.writer().map(|(o, t)| id(Of::Exclusive, o, t));
                readers.chain(writer).collect()
            }),
            Primitive::Semaphore => self.semaphores.get(key).map_or_else(Vec::new, |s| {
                s.permits
                    .iter()
                    .map(|(o, t)| id(Of::Permit, o, t))
                    .collect()
            }),
        }
    }

    fn snapshot(&self, key: String, of: Primitive) -> LockInfo {
        let (mode, tenures): (_, Vec<&Tenure>) = match of {
            Primitive::Lock => match self.keys.get(key.as_str()) {
                Some(entry) => match entry.writer() {
                    Some((_, writer)) => (LockMode::Exclusive, vec![writer]),
                    None => (LockMode::Shared, entry.readers.values().collect()),
                },
                None => (LockMode::Free, Vec::new()),
            },
            Primitive::Semaphore => match self.semaphores.get(key.as_str()) {
                Some(semaphore) => (LockMode::Permits, semaphore.permits.values().collect()),
                None => (LockMode::Free, Vec::new()),
            },
        };
        // Shared holds carry the last exclusive token, which the fences keep after it.
        let remembered = match of {
            Primitive::Lock => Some(self.fences.last(&key)).filter(|&t| t > 0),
            Primitive::Semaphore => None,
        };
        let fencing_token = tenures.iter().map(|t| t.token).max().max(remembered);
        if tenures.is_empty() {
            return LockInfo::free(key, fencing_token);
        }
        LockInfo {
            key,
            mode,
            holders: tenures.len(),
            holds: tenures.iter().map(|t| t.holds()).sum(),
            lease_remaining: tenures.iter().map(|t| t.remaining()).max(),
            fencing_token,
        }
    }
}

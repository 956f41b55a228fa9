//! A key's semaphore in a [`MemoryBackend`](super::MemoryBackend): up to `n` owners at
//! once, each permit with its own owner, lease and token.
//!
//! Permit acquisitions do not take the key's queue slot (several hold at once): they wait
//! here, in arrival order. A waiter at the head that cannot have a permit keeps the ones
//! behind it waiting too, so an acquisition that asks of a smaller `n` is not overtaken
//! for ever by ones that ask of a larger `n`.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use super::hold::{HoldId, Of, Tenure};
use super::wait::{Deferred, List, Step, Ticket, Waiter};
use super::{Inner, State, Wait};
use crate::core::queue::Claim;
use crate::error::LockError;
use crate::lock::{LockGuard, LockOwner};

/// One key's semaphore.
#[derive(Default)]
pub(super) struct Semaphore {
    pub(super) permits: HashMap<LockOwner, Tenure>,
    /// Waiters by arrival, each with the `n` it asked of.
    pub(super) waiting: BTreeMap<u64, Waiter<u32>>,
}

impl Semaphore {
    pub(super) fn is_held(&self) -> bool {
        !self.permits.is_empty()
    }

    /// Whether an acquisition of one of `n` permits by `owner`, arrived at `arrival`, may
    /// have one: a re-entry, or fewer than `n` are held and nobody earlier waits.
    fn admits(&self, owner: &LockOwner, n: u32, arrival: u64) -> bool {
        self.permits.contains_key(owner)
            || (self.permits.len() < n as usize && self.waiting.range(..arrival).next().is_none())
    }

    /// How long until the first permit is freed at the latest, for `Retry-After`.
    fn retry_after(&self) -> Option<Duration> {
        self.permits.values().map(Tenure::remaining).min()
    }
}

impl Inner {
    pub(super) async fn permit(
        self: &Arc<Self>,
        key: Arc<str>,
        claim: Claim,
        n: u32,
        wait: Wait,
    ) -> Result<LockGuard, LockError> {
        let arrival = self.serial();
        let step = self.with_state(|state, _| {
            let semaphore = state.semaphores.entry(key.clone()).or_default();
            if semaphore.admits(&claim.owner, n, arrival) {
                return Ok(Step::Held(state.grant_permit(self, &key, &claim)));
            }
            let Some(deadline) = wait.deadline else {
                return Err(LockError::PermitsTaken {
                    key: key.to_string(),
                    permits: n,
                    retry_after: semaphore.retry_after(),
                });
            };
            if semaphore.waiting.len() >= wait.max_waiters {
                return Err(LockError::QueueFull {
                    key: key.to_string(),
                });
            }
            let (waiter, ticket) = Ticket::enter(self, (List::Semaphore, &key), arrival, &claim, n);
            semaphore.waiting.insert(arrival, waiter);
            Ok(Step::Wait(ticket, deadline))
        })?;
        match step {
            Step::Held(guard) => Ok(guard),
            Step::Wait(ticket, deadline) => match ticket.granted(deadline).await {
                Some(guard) => Ok(guard),
                None => {
                    let semaphores = &self.state().semaphores;
                    let retry_after = semaphores.get(&key).and_then(Semaphore::retry_after);
                    Err(wait.timed_out(&key, retry_after))
                }
            },
        }
    }
}

impl State {
    /// Takes or re-enters a permit of `key` for `claim`, which may (the caller checked).
    fn grant_permit(&mut self, inner: &Arc<Inner>, key: &Arc<str>, claim: &Claim) -> LockGuard {
        let semaphore = self.semaphores.entry(key.clone()).or_default();
        let tenure = semaphore
            .permits
            .entry(claim.owner.clone())
            .or_insert_with(|| Tenure::new(claim, inner.serial(), inner.next_token()));
        let id = HoldId {
            of: Of::Permit,
            key: key.clone(),
            owner: claim.owner.clone(),
            generation: tenure.generation,
        };
        inner.hold(id, tenure, claim)
    }

    /// Frees the permit `id` (the caller found it) and grants it to the next waiter.
    pub(super) fn end_permit(&mut self, inner: &Arc<Inner>, id: &HoldId, deferred: &mut Deferred) {
        if let Some(semaphore) = self.semaphores.get_mut(&id.key) {
            semaphore.permits.remove(&id.owner);
        }
        self.dispatch_permits(inner, &id.key, deferred);
    }

    /// Grants permits of `key` to its waiters in arrival order, up to the first that may
    /// not have one; forgets the key when nobody holds or waits for a permit.
    pub(super) fn dispatch_permits(
        &mut self,
        inner: &Arc<Inner>,
        key: &Arc<str>,
        deferred: &mut Deferred,
    ) {
        while let Some(semaphore) = self.semaphores.get_mut(key) {
            let Some((&arrival, first)) = semaphore.waiting.first_key_value() else {
                break;
            };
            if !semaphore.admits(&first.claim.owner, first.want, arrival) {
                break;
            }
            let Some((_, waiter)) = semaphore.waiting.pop_first() else {
                break;
            };
            let (claim, _, grant) = waiter.into_parts();
            let guard = self.grant_permit(inner, key, &claim);
            grant.send(guard, deferred);
        }
        let unused = self
            .semaphores
            .get(key)
            .is_some_and(|s| s.permits.is_empty() && s.waiting.is_empty());
        if unused {
            self.semaphores.remove(key);
        }
    }
}

//! A key's slot: the right to contend for it in the store and to hold it, passed from
//! task to task of the key's queue.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use super::{Claim, KeyQueue, Shared, Successor, pass_on};
use crate::lock::LockOwner;

/// The right to contend for a key in the store and, once the lock is taken, to hold it.
/// Dropping it passes it to the next queued task, or removes the key's queue.
pub(crate) struct Slot {
    pub(super) shared: Arc<Shared>,
    pub(super) key: Arc<str>,
    pub(super) epoch: u64,
    /// Whether the next task should let other instances go first: set when the lock was
    /// released for real to end a handoff streak, to the value that release left the
    /// key's fencing counter at (see [`yielded`](Self::yielded)).
    pub(super) yielded: Option<u64>,
    /// The task picked to receive the slot, taken out of the queue for a handoff.
    pub(super) successor: Option<Successor>,
    /// Whether dropping this slot passes it on (false once it went along with a
    /// handoff, or came back from a task that left).
    pub(super) passes_on: bool,
}

impl Slot {
    pub(super) fn new(shared: Arc<Shared>, key: Arc<str>, epoch: u64) -> Self {
        Slot {
            shared,
            key,
            epoch,
            yielded: None,
            successor: None,
            passes_on: true,
        }
    }

    /// Whether other tasks of this process wait for the key.
    pub(crate) fn has_waiters(&self) -> bool {
        let keys = self.shared.keys();
        keys.get(&self.key)
            .is_some_and(|q| q.epoch == self.epoch && !q.waiting.is_empty())
    }

    /// Set when this slot came from a release that ended a handoff streak: its task
    /// should wait for a release message before its first attempt, so that the other
    /// instances, which got that message, get the lock first. The value is the fencing
    /// counter that release left: once the counter is past it, another instance took the
    /// key, and the yield is over.
    pub(crate) fn yielded(&self) -> Option<u64> {
        self.yielded
    }

    /// Where the key's line ends now: every task queued from here on gets a ticket at or
    /// above it (tickets are drawn from one counter, in the order tasks queue).
    pub(crate) fn line_end(&self) -> u64 {
        self.shared.next_id.load(Ordering::Relaxed)
    }

    /// Whether the reserved successor queued at or after `line_end` (see
    /// [`line_end`](Self::line_end)): after the run that ends there began.
    pub(crate) fn successor_queued_since(&self, line_end: u64) -> bool {
        self.successor.as_ref().is_some_and(|s| s.id >= line_end)
    }

    /// Takes the next queued task out of line as the successor of this slot's hold and
    /// returns its claim. Whatever becomes of the release, the successor gets the slot.
    pub(crate) fn reserve_successor(&mut self) -> Option<&Claim> {
        if self.successor.is_none() {
            let mut keys = self.shared.keys();
            let queue = keys.get_mut(&self.key).filter(|q| q.epoch == self.epoch)?;
            let next = queue.waiting.pop_front()?;
            queue.holder = next.claim.owner.clone();
            queue.store_owner = None;
            self.successor = Some(next);
        }
        self.successor.as_ref().map(|s| &s.claim)
    }

    /// The lock went to the successor: returns it, with the slot its hold will carry.
    pub(crate) fn hand_over(mut self) -> Option<(Successor, Slot)> {
        let successor = self.successor.take()?;
        self.passes_on = false;
        let slot = Slot::new(self.shared.clone(), self.key.clone(), self.epoch);
        Some((successor, slot))
    }

    /// Hands the hold to the reserved successor, with fencing token `token`, without
    /// telling the store, which goes on knowing it under `store_owner`: returns the successor with the slot its hold will
    /// carry. Refused (the slot comes back) when there is no successor, the slot was
    /// revoked (its lock found lost), or re-entries of the hold are still held, so the
    /// hold in the store is not this task's alone.
    pub(crate) fn hand_over_in_memory(
        mut self,
        store_owner: &LockOwner,
        token: u64,
    ) -> Result<(Successor, Slot), Slot> {
        let Some(successor) = self.successor.take() else {
            return Err(self);
        };
        let mut keys = self.shared.keys();
        match keys.get_mut(&self.key).filter(|q| q.epoch == self.epoch) {
            Some(queue) if queue.nested == 0 => {
                queue.store_owner = Some((store_owner.clone(), token));
            }
            _ => {
                drop(keys);
                self.successor = Some(successor);
                return Err(self);
            }
        }
        drop(keys);
        self.passes_on = false;
        let slot = Slot::new(self.shared.clone(), self.key.clone(), self.epoch);
        Ok((successor, slot))
    }

    /// Marks a real release as the end of a handoff streak (see
    /// [`yielded`](Self::yielded)), if a successor was waiting for a handoff. A task that
    /// queued only after the release was decided contends at once. `fence`: the value the
    /// release left the key's fencing counter at.
    pub(crate) fn yield_to_others(&mut self, fence: u64) {
        self.yielded = self.successor.is_some().then_some(fence);
    }

    /// A hook for the watchdog: when the lock held with this slot is found lost, the slot
    /// moves on even though its guard is still alive.
    pub(crate) fn revoker(&self) -> impl FnOnce() + Send + 'static {
        let (shared, key, epoch) = (self.shared.clone(), self.key.clone(), self.epoch);
        move || {
            let mut keys = shared.keys();
            if let Some(queue) = keys.get_mut(&key).filter(|q| q.epoch == epoch) {
                queue.epoch = shared.next_id();
                // Re-entries of the lost hold count no more; the next holder takes the key
                // in the store under its own owner.
                queue.nested = 0;
                pass_on(&shared, &mut keys, &key, None, None);
            }
        }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        if !self.passes_on {
            return;
        }
        let successor = self.successor.take();
        let mut keys = self.shared.keys();
        match keys.get_mut(&self.key) {
            Some(queue) if queue.epoch == self.epoch => {
                pass_on(&self.shared, &mut keys, &self.key, successor, self.yielded);
            }
            // Revoked while a successor was reserved: it goes back to the front of the
            // line, or, if the line is gone, starts a new one.
            Some(queue) => {
                if let Some(successor) = successor {
                    queue.waiting.push_front(successor);
                }
            }
            None => {
                if let Some(successor) = successor {
                    let epoch = self.shared.next_id();
                    let queue = KeyQueue::new(successor.claim.owner.clone(), epoch);
                    keys.insert(self.key.clone(), queue);
                    pass_on(&self.shared, &mut keys, &self.key, Some(successor), None);
                }
            }
        }
    }
}

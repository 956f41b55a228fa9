//! The in-process queue per key, shared by every backend: one contender per key per
//! backend.
//!
//! Tasks of one backend that want the same key line up here in FIFO order, and only the
//! task holding the key's [`Slot`] talks to the store: it tries, waits if it must, and
//! then holds the lock. When its hold is released the slot passes to the next task in
//! line, either bare (the task then contends in the store) or together with the lock
//! itself when the store handed it over in the same step (a store's release may). So a
//! hot key costs one contender per process instead of one per task,
//! and no herd of local waiters races for it after every release.
//!
//! A key has an entry in the registry exactly while its slot is taken: the last task to
//! leave removes it, so keys that come and go leave nothing behind. A holder that loses
//! its lock (lease run out, key deleted) while it keeps its guard does not block the queue:
//! the watchdog revokes its slot, which moves on to the next task.
//!
//! Grants travel over a oneshot channel per waiter. A waiter that leaves (cancelled or
//! timed out) closes its channel and disposes of any grant already in it, passing the slot
//! or the lock on; a grant sent to a waiter that has left comes back to the sender, which
//! passes it to the next. Either way no wakeup is lost.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::oneshot;
use tokio::time::{Instant, sleep_until};

use crate::lock::{LockGuard, LockOwner};

mod reentry;
mod ticket;

pub(crate) use reentry::Reentry;
use ticket::Ticket;

/// Who is acquiring: what a releasing holder needs to hand the lock to them.
#[derive(Clone)]
pub(crate) struct Claim {
    pub(crate) owner: LockOwner,
    pub(crate) lease: Duration,
    pub(crate) renew: bool,
}

/// What a queued task receives when its turn comes.
pub(crate) enum Grant {
    /// The key's slot: contend for the lock in the store. Boxed to keep the channel that every
    /// queued task holds small.
    Slot(Box<Slot>),
    /// The lock itself, handed over by the previous holder in this process.
    Handoff(LockGuard),
}

/// A queued task, as seen by the holder that will pass the slot on.
pub(crate) struct Successor {
    id: u64,
    pub(crate) claim: Claim,
    grant: oneshot::Sender<Grant>,
}

impl Successor {
    /// Hands the lock over. If the task has left meanwhile, the guard comes back and is
    /// dropped here, which releases it (or hands it further down the line).
    pub(crate) fn hand_over(self, guard: LockGuard) {
        drop(self.grant.send(Grant::Handoff(guard)));
    }
}

struct KeyQueue {
    /// The owner the slot is with: its re-entries bypass the queue instead of deadlocking
    /// behind themselves.
    holder: LockOwner,
    /// The owner the store knows the hold under, when the holder got the lock in memory
    /// from an earlier task of the process (a local handoff), with the holder's fencing
    /// token: its re-entries are made under that owner and keep that token.
    store_owner: Option<(LockOwner, u64)>,
    /// Re-entries of the key by its holders that are still held: while any is, the hold in
    /// the store is not the holder's alone and cannot pass on in memory.
    nested: usize,
    waiting: VecDeque<Successor>,
    /// Identifies the current slot; a revoked or stale slot carries an older one and no
    /// longer acts on the queue. Drawn from one counter, so it is never reused.
    epoch: u64,
}

#[derive(Default)]
struct Shared {
    keys: Mutex<HashMap<Arc<str>, KeyQueue>>,
    next_id: AtomicU64,
}

impl Shared {
    fn next_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    fn keys(&self) -> MutexGuard<'_, HashMap<Arc<str>, KeyQueue>> {
        // Nothing under this lock can panic half-way through an update; a poisoned lock
        // is still consistent.
        self.keys.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The backend's registry of per-key queues.
#[derive(Clone, Default)]
pub(crate) struct Queues {
    shared: Arc<Shared>,
}

/// What [`Queues::turn`] gives a task.
pub(crate) enum Turn {
    /// Take the lock in the store, holding the key's slot.
    Contend(Slot),
    /// The slot's owner takes the key again (a nested acquisition by the same request):
    /// re-enter in the store, under the owner the [`Reentry`] names.
    Reenter(Reentry),
    /// The previous holder in this process handed the lock over.
    HandedOver(LockGuard),
    /// Another task of this process has the key, and the caller does not wait.
    Busy,
    /// As many tasks as allowed are already queued for the key.
    Full,
    /// The wait ran out in the queue.
    TimedOut,
}

/// Where a task stands in its key's line: the outcome of [`Queues::enter`].
enum Place {
    /// The key was free in this process: contend in the store, holding its slot.
    Head(Slot),
    /// The claimant already holds the slot (a nested acquisition by the same request):
    /// re-enter without queueing.
    Reentrant(Reentry),
    /// Another task holds the slot and the caller does not wait.
    Busy,
    /// The queue is at its bound: shed the request.
    Full,
    /// Queued behind other tasks; wait on the ticket.
    Queued(Ticket),
}

impl KeyQueue {
    fn new(holder: LockOwner, epoch: u64) -> Self {
        KeyQueue {
            holder,
            store_owner: None,
            nested: 0,
            waiting: VecDeque::new(),
            epoch,
        }
    }
}

impl Queues {
    /// Joins the queue of `key`. `limit` is the most tasks that may wait behind the slot's
    /// holder; `None` means the caller does not wait at all.
    fn enter(&self, key: &Arc<str>, claim: &Claim, limit: Option<usize>) -> Place {
        let mut keys = self.shared.keys();
        let Some(queue) = keys.get_mut(key) else {
            let epoch = self.shared.next_id();
            keys.insert(key.clone(), KeyQueue::new(claim.owner.clone(), epoch));
            return Place::Head(Slot::new(self.shared.clone(), key.clone(), epoch));
        };
        if queue.holder == claim.owner {
            return Place::Reentrant(Reentry::new(&self.shared, key, queue));
        }
        let Some(limit) = limit else {
            return Place::Busy;
        };
        if queue.waiting.len() >= limit {
            return Place::Full;
        }
        let id = self.shared.next_id();
        let (grant, granted) = oneshot::channel();
        queue.waiting.push_back(Successor {
            id,
            claim: claim.clone(),
            grant,
        });
        Place::Queued(Ticket {
            shared: self.shared.clone(),
            key: key.clone(),
            id,
            granted,
        })
    }

    /// Waits for the caller's turn at `key`: at once for a try (`wait: None`), else in
    /// line until `wait`'s deadline, with at most its bound of tasks queued.
    pub(crate) async fn turn(
        &self,
        key: &Arc<str>,
        claim: &Claim,
        wait: Option<(Instant, usize)>,
    ) -> Turn {
        loop {
            let limit = wait.map(|(_, limit)| limit);
            let (mut ticket, deadline) = match (self.enter(key, claim, limit), wait) {
                (Place::Head(slot), _) => return Turn::Contend(slot),
                (Place::Reentrant(reentry), _) => return Turn::Reenter(reentry),
                (Place::Full, _) => return Turn::Full,
                (Place::Busy, _) | (Place::Queued(_), None) => return Turn::Busy,
                (Place::Queued(ticket), Some((deadline, _))) => (ticket, deadline),
            };
            let grant = tokio::select! {
                grant = ticket.granted() => grant,
                _ = sleep_until(deadline) => match ticket.try_granted() {
                    Some(Grant::Handoff(guard)) => return Turn::HandedOver(guard),
                    // A slot that came just now passes on with the ticket.
                    _ => return Turn::TimedOut,
                },
            };
            match grant {
                Some(Grant::Handoff(guard)) => return Turn::HandedOver(guard),
                Some(Grant::Slot(slot)) => return Turn::Contend(*slot),
                // The grant was dropped unsent (the runtime is shutting down): queue again.
                None => continue,
            }
        }
    }

    /// A re-entry of `key` by `owner`, if `owner` holds its slot: for holds that do not
    /// queue (shared holds and permits), which the key's exclusive holder may also take.
    pub(crate) fn reentry(&self, key: &Arc<str>, owner: &LockOwner) -> Option<Reentry> {
        let mut keys = self.shared.keys();
        let queue = keys.get_mut(key).filter(|q| q.holder == *owner)?;
        Some(Reentry::new(&self.shared, key, queue))
    }

    /// Keys with a contender, holder or waiter in this process.
    pub(crate) fn keys(&self) -> usize {
        self.shared.keys().len()
    }

    /// Tasks queued behind a contender or holder of the same key.
    pub(crate) fn waiting(&self) -> usize {
        self.shared.keys().values().map(|q| q.waiting.len()).sum()
    }
}

/// The right to contend for a key in the store and, once the lock is taken, to hold it.
/// Dropping it passes it to the next queued task, or removes the key's queue.
pub(crate) struct Slot {
    shared: Arc<Shared>,
    key: Arc<str>,
    epoch: u64,
    /// Whether the next task should let other instances go first: set when the lock was
    /// released for real to end a handoff streak, to the value that release left the
    /// key's fencing counter at (see [`yielded`](Self::yielded)).
    yielded: Option<u64>,
    /// The task picked to receive the slot, taken out of the queue for a handoff.
    successor: Option<Successor>,
    /// Whether dropping this slot passes it on (false once it went along with a
    /// handoff, or came back from a task that left).
    passes_on: bool,
}

impl Slot {
    fn new(shared: Arc<Shared>, key: Arc<str>, epoch: u64) -> Self {
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

    /// Whether a successor is reserved.
    pub(crate) fn has_successor(&self) -> bool {
        self.successor.is_some()
    }

    /// Whether the reserved successor was queued before `line_end` (see
    /// [`line_end`](Self::line_end)).
    pub(crate) fn successor_queued_before(&self, line_end: u64) -> bool {
        self.successor.as_ref().is_some_and(|s| s.id < line_end)
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

/// Gives the slot of `key` (whose queue must exist) to `candidate`, else to the first
/// queued task that is still there; removes the queue when nobody is left.
fn pass_on(
    shared: &Arc<Shared>,
    keys: &mut HashMap<Arc<str>, KeyQueue>,
    key: &Arc<str>,
    mut candidate: Option<Successor>,
    yielded: Option<u64>,
) {
    loop {
        let Some(queue) = keys.get_mut(key) else {
            return;
        };
        let Some(next) = candidate.take().or_else(|| queue.waiting.pop_front()) else {
            keys.remove(key);
            return;
        };
        queue.holder = next.claim.owner.clone();
        queue.store_owner = None;
        let mut slot = Box::new(Slot::new(shared.clone(), key.clone(), queue.epoch));
        slot.yielded = yielded;
        match next.grant.send(Grant::Slot(slot)) {
            Ok(()) => return,
            // The task left: the returned slot must not pass itself on (its drop would take the registry
            // lock again) and try the next one.
            Err(grant) => {
                if let Grant::Slot(mut slot) = grant {
                    slot.passes_on = false;
                }
            }
        }
    }
}

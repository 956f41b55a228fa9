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

mod gate;
mod reentry;
mod slot;
mod ticket;

use gate::Gates;
pub(crate) use gate::Passage;

pub(crate) use reentry::Reentry;
pub(crate) use slot::Slot;
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
    /// The permit waiters' gates (see [`gate`]).
    gates: Gates,
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

    /// Tasks queued behind a contender or holder of the same key, or behind the task that
    /// waits for a permit of the same semaphore.
    pub(crate) fn waiting(&self) -> usize {
        let queued: usize = self.shared.keys().values().map(|q| q.waiting.len()).sum();
        queued + self.gates.waiting()
    }

    /// Passes the gate of the semaphore `key` by `deadline`, behind the other waiting tasks
    /// of this process (see [`gate`]); `None` when the deadline came first.
    pub(crate) async fn permit_gate(&self, key: &Arc<str>, deadline: Instant) -> Option<Passage> {
        self.gates.pass(key, deadline).await
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

//! Waiting inside a [`MemoryBackend`](super::MemoryBackend) key: shared and permit
//! acquisitions (which admit several holders, so bypass the one-contender queue) and the
//! exclusive contender waiting for shared holds to end.
//!
//! A waiter is an entry in its key's list, in arrival order. Whoever frees what it waits
//! for takes the hold on its behalf, under the same lock of the state, and sends it the
//! guard: no wakeup to race for, no polling. A waiter that leaves (timed out, cancelled)
//! removes its entry, or releases a guard that reached it meanwhile.

use std::sync::Arc;

use tokio::sync::oneshot;
use tokio::time::{Instant, sleep_until};

use super::{Inner, State};
use crate::core::queue::{Claim, Slot};
use crate::lock::LockGuard;

/// Whatever must be dropped only once the state's lock is released: slots (passing one on
/// takes the queue's lock, whose holder may release into the state) and guards whose
/// waiter had left (releasing one takes the state's lock).
#[derive(Default)]
pub(super) struct Deferred {
    pub(super) slots: Vec<Slot>,
    pub(super) guards: Vec<LockGuard>,
}

/// A waiter: `want` is nothing for a shared waiter, the key's queue slot for the exclusive
/// contender, the number of permits for a semaphore waiter.
pub(super) struct Waiter<W> {
    pub(super) claim: Claim,
    pub(super) want: W,
    grant: Grant,
}

impl<W> Waiter<W> {
    pub(super) fn into_parts(self) -> (Claim, W, Grant) {
        (self.claim, self.want, self.grant)
    }
}

impl Waiter<Option<Slot>> {
    /// Leaves for good, passing on the slot it carried.
    pub(super) fn leave(self, deferred: &mut Deferred) {
        deferred.slots.extend(self.want);
    }
}

/// Where a waiter is sent the hold taken for it.
pub(super) struct Grant(oneshot::Sender<LockGuard>);

impl Grant {
    /// Sends the waiter its guard; a waiter that has left gets it released.
    pub(super) fn send(self, guard: LockGuard, deferred: &mut Deferred) {
        if let Err(guard) = self.0.send(guard) {
            deferred.guards.push(guard);
        }
    }
}

/// Where an acquisition stands after its first look at the key.
pub(super) enum Step {
    /// It holds the key.
    Held(LockGuard),
    /// It waits in the key's list until the deadline.
    Wait(Ticket, Instant),
}

/// Where in its key a waiter waits.
#[derive(Clone, Copy)]
pub(super) enum List {
    /// The shared waiters of the read/write lock.
    Readers,
    /// The read/write lock's exclusive contenders.
    Contender,
    /// The semaphore's waiters.
    Semaphore,
}

/// A waiter's place: dropping it leaves the list (and the next waiters are looked at), or
/// releases a guard that arrived meanwhile.
pub(super) struct Ticket {
    inner: Arc<Inner>,
    list: List,
    key: Arc<str>,
    arrival: u64,
    granted: oneshot::Receiver<LockGuard>,
}

impl Ticket {
    /// A waiter for `want` at `arrival` (its place), for the caller to put into `list`,
    /// and its ticket.
    pub(super) fn enter<W>(
        inner: &Arc<Inner>,
        (list, key): (List, &Arc<str>),
        arrival: u64,
        claim: &Claim,
        want: W,
    ) -> (Waiter<W>, Ticket) {
        let (grant, granted) = oneshot::channel();
        let waiter = Waiter {
            claim: claim.clone(),
            want,
            grant: Grant(grant),
        };
        let ticket = Ticket {
            inner: inner.clone(),
            list,
            key: key.clone(),
            arrival,
            granted,
        };
        (waiter, ticket)
    }

    /// The guard of the hold taken for this waiter, or `None` if `deadline` came first.
    pub(super) async fn granted(mut self, deadline: Instant) -> Option<LockGuard> {
        tokio::select! {
            granted = &mut self.granted => granted.ok(),
            // A grant sent just now is taken rather than released.
            () = sleep_until(deadline) => self.granted.try_recv().ok(),
        }
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let inner = self.inner.clone();
        let left = inner.with_state(|state, deferred| {
            state.leave(&inner, self.list, &self.key, self.arrival, deferred)
        });
        if !left {
            // Granted after it stopped waiting: the hold is given back.
            drop(self.granted.try_recv());
        }
    }
}

impl State {
    /// Takes the waiter at `arrival` out of its list; false if it is no longer there (it
    /// was granted).
    fn leave(
        &mut self,
        inner: &Arc<Inner>,
        list: List,
        key: &Arc<str>,
        arrival: u64,
        deferred: &mut Deferred,
    ) -> bool {
        // The waiters behind it may have been kept out by it alone: they are looked at.
        match list {
            List::Readers => {
                let entry = self.keys.get_mut(key);
                if entry.and_then(|k| k.waiting.remove(&arrival)).is_none() {
                    return false;
                }
                self.dispatch_rw(inner, key, deferred);
            }
            List::Contender => {
                let entry = self.keys.get_mut(key);
                let Some(contender) = entry.and_then(|k| k.contenders.remove(&arrival)) else {
                    return false;
                };
                contender.leave(deferred);
                self.dispatch_rw(inner, key, deferred);
            }
            List::Semaphore => {
                let semaphore = self.semaphores.get_mut(key);
                if semaphore.and_then(|s| s.waiting.remove(&arrival)).is_none() {
                    return false;
                }
                self.dispatch_permits(inner, key, deferred);
            }
        }
        true
    }
}

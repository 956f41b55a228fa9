//! A key's read/write lock in a [`MemoryBackend`](super::MemoryBackend): the plain
//! (exclusive) lock and the shared holds that exclude it.
//!
//! Exclusive acquisitions queue for the key's slot as on Redis (one contender per key);
//! the task with the slot takes the lock, or waits here while shared holds remain. Shared
//! acquisitions do not take the slot (any number hold at once): they wait here, in arrival
//! order, for every exclusive acquisition that arrived before them (queued for the slot or
//! waiting here), so a stream of readers cannot starve a writer. The contender waits only
//! for the shared holds, never for waiting readers: those wait for a writer, and two
//! writers may reach the slot queue in the opposite order of their arrival, so a writer
//! that waited for them could wait for itself.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::time::Duration;

use super::hold::{HoldId, Of, Tenure};
use super::wait::{Deferred, List, Step, Ticket, Waiter};
use super::{Inner, State, Wait};
use crate::core::queue::{Claim, Slot, Turn};
use crate::error::LockError;
use crate::lock::{LockGuard, LockOwner};

/// One key's read/write lock: who holds it, who is on the way, who waits.
#[derive(Default)]
pub(super) struct RwKey {
    writer: Option<Writer>,
    pub(super) readers: HashMap<LockOwner, Tenure>,
    /// Arrivals of the exclusive acquisitions under way (queued for the slot, or waiting
    /// here): shared acquisitions that arrive after one wait for it.
    pending: BTreeSet<u64>,
    /// Shared waiters by arrival.
    pub(super) waiting: BTreeMap<u64, Waiter<()>>,
    /// The exclusive acquisition with the key's slot, waiting for the shared holds to end
    /// (the slot goes to its hold when granted), by arrival; more than one only when its
    /// owner acquires the key again meanwhile (re-entries, without a slot).
    pub(super) contenders: BTreeMap<u64, Waiter<Option<Slot>>>,
}

/// The exclusive holder.
struct Writer {
    owner: LockOwner,
    tenure: Tenure,
    /// The key's queue slot: passed to the next queued exclusive acquisition when the
    /// hold ends.
    slot: Option<Slot>,
}

impl RwKey {
    pub(super) fn is_held(&self) -> bool {
        self.writer.is_some() || !self.readers.is_empty()
    }

    /// The exclusive holder and its tenure.
    pub(super) fn writer(&self) -> Option<(&LockOwner, &Tenure)> {
        self.writer.as_ref().map(|w| (&w.owner, &w.tenure))
    }

    pub(super) fn writer_tenure(&mut self, owner: &LockOwner) -> Option<&mut Tenure> {
        let writer = self.writer.as_mut().filter(|w| w.owner == *owner)?;
        Some(&mut writer.tenure)
    }

    fn is_writer(&self, owner: &LockOwner) -> bool {
        self.writer.as_ref().is_some_and(|w| w.owner == *owner)
    }

    /// Whether `owner` holds the key in some way: its next shared acquisition is a
    /// re-entry or a downgrade, which goes ahead of every waiter (they may wait for it).
    fn holds(&self, owner: &LockOwner) -> bool {
        self.is_writer(owner) || self.readers.contains_key(owner)
    }

    /// Whether a shared acquisition by `owner` that arrived at `arrival` may hold the key:
    /// no other owner holds it exclusively, and nobody who arrived earlier is on the way
    /// to an exclusive hold or waiting.
    fn admits_reader(&self, owner: &LockOwner, arrival: u64) -> bool {
        self.holds(owner)
            || (self.writer.is_none()
                && self.pending.range(..arrival).next().is_none()
                && self.waiting.range(..arrival).next().is_none())
    }

    /// Whether an exclusive acquisition by `owner` may hold the key: a re-entry, or nobody
    /// holds it.
    fn admits_writer(&self, owner: &LockOwner) -> bool {
        match &self.writer {
            Some(writer) => writer.owner == *owner,
            None => self.readers.is_empty(),
        }
    }

    /// How long the key stays held at most, for `Retry-After`.
    pub(super) fn retry_after(&self) -> Option<Duration> {
        match &self.writer {
            Some(writer) => Some(writer.tenure.remaining()),
            None => self.readers.values().map(Tenure::remaining).max(),
        }
    }
}

/// An exclusive acquisition under way, counted in its key's `pending` until dropped.
struct Pending {
    inner: Arc<Inner>,
    key: Arc<str>,
    arrival: u64,
}

impl Drop for Pending {
    fn drop(&mut self) {
        let inner = self.inner.clone();
        inner.with_state(|state, deferred| {
            if let Some(entry) = state.keys.get_mut(&self.key) {
                entry.pending.remove(&self.arrival);
            }
            // Shared acquisitions that waited for this one alone may go now.
            state.dispatch_rw(&inner, &self.key, deferred);
        });
    }
}

impl Inner {
    pub(super) async fn exclusive(
        self: &Arc<Self>,
        key: Arc<str>,
        claim: Claim,
        wait: Wait,
    ) -> Result<LockGuard, LockError> {
        let arrival = self.serial();
        // Refused before queueing: a reader waiting for the slot, or for the readers to
        // leave, would wait for itself.
        let pending = self.with_state(|state, _| {
            let entry = state.keys.get(&key);
            if entry.is_some_and(|e| e.is_writer(&claim.owner)) {
                return Ok(None);
            }
            if entry.is_some_and(|e| e.readers.contains_key(&claim.owner)) {
                return Err(upgrade_refused(&key));
            }
            let entry = state.keys.entry(key.clone()).or_default();
            entry.pending.insert(arrival);
            Ok(Some(Pending {
                inner: self.clone(),
                key: key.clone(),
                arrival,
            }))
        })?;
        let queued = wait.deadline.map(|deadline| (deadline, wait.max_waiters));
        let result = match self.queues.turn(&key, &claim, queued).await {
            Turn::Contend(slot) => self.take(&key, &claim, Some(slot), arrival, wait).await,
            // Nothing here hands a hold over without the state knowing it: the re-entry
            // needs no counting.
            Turn::Reenter(_) => self.take(&key, &claim, None, arrival, wait).await,
            Turn::HandedOver(guard) => Ok(guard),
            Turn::Busy => Err(LockError::Contended {
                key: key.to_string(),
                retry_after: self.state().keys.get(&key).and_then(RwKey::retry_after),
            }),
            Turn::Full => Err(LockError::QueueFull {
                key: key.to_string(),
            }),
            // Queued behind a task of this process, as on Redis: the holder's lease says
            // little of when the queue ahead will have moved.
            Turn::TimedOut => Err(wait.timed_out(&key, None)),
        };
        drop(pending);
        result
    }

    /// Takes or re-enters `key` exclusively for `claim`, holding its `slot` (`None`: a
    /// re-entry), waiting for the shared holds if asked to.
    async fn take(
        self: &Arc<Self>,
        key: &Arc<str>,
        claim: &Claim,
        slot: Option<Slot>,
        arrival: u64,
        wait: Wait,
    ) -> Result<LockGuard, LockError> {
        let step = self.with_state(|state, deferred| {
            let entry = state.keys.entry(key.clone()).or_default();
            // A shared hold taken by the same owner since it queued.
            if !entry.is_writer(&claim.owner) && entry.readers.contains_key(&claim.owner) {
                deferred.slots.extend(slot);
                return Err(upgrade_refused(key));
            }
            if entry.admits_writer(&claim.owner) {
                let guard = state.grant_writer(self, key, claim, slot, deferred);
                return Ok(Step::Held(guard));
            }
            let Some(deadline) = wait.deadline else {
                let retry_after = entry.retry_after();
                deferred.slots.extend(slot);
                return Err(LockError::Contended {
                    key: key.to_string(),
                    retry_after,
                });
            };
            // Not bounded: the queue bounds the tasks waiting for the slot, and this is
            // the one task with it (or a re-entry of its owner, which then waits for it).
            let list = (List::Contender, key);
            let (waiter, ticket) = Ticket::enter(self, list, arrival, claim, slot);
            entry.contenders.insert(arrival, waiter);
            Ok(Step::Wait(ticket, deadline))
        })?;
        self.settle(step, key, wait).await
    }

    pub(super) async fn shared(
        self: &Arc<Self>,
        key: Arc<str>,
        claim: Claim,
        wait: Wait,
    ) -> Result<LockGuard, LockError> {
        let arrival = self.serial();
        let step = self.with_state(|state, _| {
            let entry = state.keys.entry(key.clone()).or_default();
            if entry.admits_reader(&claim.owner, arrival) {
                return Ok(Step::Held(state.grant_reader(self, &key, &claim)));
            }
            let Some(deadline) = wait.deadline else {
                return Err(LockError::Contended {
                    key: key.to_string(),
                    retry_after: entry.retry_after(),
                });
            };
            if entry.waiting.len() >= wait.max_waiters {
                return Err(LockError::QueueFull {
                    key: key.to_string(),
                });
            }
            let (waiter, ticket) = Ticket::enter(self, (List::Readers, &key), arrival, &claim, ());
            entry.waiting.insert(arrival, waiter);
            Ok(Step::Wait(ticket, deadline))
        })?;
        self.settle(step, &key, wait).await
    }

    /// The guard of a step: held at once, or granted before the deadline.
    async fn settle(&self, step: Step, key: &str, wait: Wait) -> Result<LockGuard, LockError> {
        match step {
            Step::Held(guard) => Ok(guard),
            Step::Wait(ticket, deadline) => match ticket.granted(deadline).await {
                Some(guard) => Ok(guard),
                None => Err(wait.timed_out(key, None)),
            },
        }
    }
}

impl State {
    /// Takes or re-enters `key` exclusively for `claim`, which may (the caller checked).
    fn grant_writer(
        &mut self,
        inner: &Arc<Inner>,
        key: &Arc<str>,
        claim: &Claim,
        mut slot: Option<Slot>,
        deferred: &mut Deferred,
    ) -> LockGuard {
        let entry = self.keys.entry(key.clone()).or_default();
        let writer = entry.writer.get_or_insert_with(|| {
            let token = inner.next_token();
            self.fences.record(key, token);
            Writer {
                owner: claim.owner.clone(),
                tenure: Tenure::new(claim, inner.serial(), token),
                slot: slot.take(),
            }
        });
        // The slot reached a queued task of this owner after another acquisition of the
        // same owner had taken the key: the hold keeps one slot, so the queue moves on
        // only when the key is freed.
        if writer.slot.is_none() {
            writer.slot = slot;
        } else {
            deferred.slots.extend(slot);
        }
        let id = HoldId {
            of: Of::Exclusive,
            key: key.clone(),
            owner: claim.owner.clone(),
            generation: writer.tenure.generation,
        };
        inner.hold(id, &mut writer.tenure, claim)
    }

    /// Takes or re-enters a shared hold of `key` for `claim`, which may (the caller
    /// checked). It carries the token of the key's last exclusive acquisition.
    fn grant_reader(&mut self, inner: &Arc<Inner>, key: &Arc<str>, claim: &Claim) -> LockGuard {
        let entry = self.keys.entry(key.clone()).or_default();
        let token = match &entry.writer {
            Some(writer) => writer.tenure.token,
            None => self.fences.last(key),
        };
        let tenure = entry
            .readers
            .entry(claim.owner.clone())
            .or_insert_with(|| Tenure::new(claim, inner.serial(), token));
        let id = HoldId {
            of: Of::Shared,
            key: key.clone(),
            owner: claim.owner.clone(),
            generation: tenure.generation,
        };
        inner.hold(id, tenure, claim)
    }

    /// Ends the exclusive or shared tenure `id` (the caller found it) and lets in whom it
    /// kept out.
    pub(super) fn end_rw(&mut self, inner: &Arc<Inner>, id: &HoldId, deferred: &mut Deferred) {
        let Some(entry) = self.keys.get_mut(&id.key) else {
            return;
        };
        if id.of == Of::Exclusive {
            if let Some(writer) = entry.writer.take() {
                // Shared holds taken within the fence's lifetime after this one see it.
                self.fences.record(&id.key, writer.tenure.token);
                deferred.slots.extend(writer.slot);
            }
        } else {
            entry.readers.remove(&id.owner);
        }
        self.dispatch_rw(inner, &id.key, deferred);
    }

    /// Grants the waiters of `key` that may hold it now: the contenders, then the shared
    /// waiters in arrival order up to the first that may not (the ones after it may not
    /// either); forgets the key when nobody holds, wants or waits for it.
    pub(super) fn dispatch_rw(
        &mut self,
        inner: &Arc<Inner>,
        key: &Arc<str>,
        deferred: &mut Deferred,
    ) {
        while let Some(entry) = self.keys.get_mut(key) {
            let Some((_, first)) = entry.contenders.first_key_value() else {
                break;
            };
            if !entry.admits_writer(&first.claim.owner) {
                break;
            }
            let Some((_, contender)) = entry.contenders.pop_first() else {
                break;
            };
            let (claim, slot, grant) = contender.into_parts();
            let guard = self.grant_writer(inner, key, &claim, slot, deferred);
            grant.send(guard, deferred);
        }
        while let Some(entry) = self.keys.get_mut(key) {
            let Some((&arrival, first)) = entry.waiting.first_key_value() else {
                break;
            };
            if !entry.admits_reader(&first.claim.owner, arrival) {
                break;
            }
            let Some((_, waiter)) = entry.waiting.pop_first() else {
                break;
            };
            let (claim, (), grant) = waiter.into_parts();
            let guard = self.grant_reader(inner, key, &claim);
            grant.send(guard, deferred);
        }
        let unused = self.keys.get(key).is_some_and(|entry| {
            !entry.is_held()
                && entry.pending.is_empty()
                && entry.waiting.is_empty()
                && entry.contenders.is_empty()
        });
        if unused {
            self.keys.remove(key);
        }
    }
}

fn upgrade_refused(key: &str) -> LockError {
    LockError::UpgradeRefused {
        key: key.to_owned(),
    }
}

//! Taking a lock in a store: the local queue first, then try -> subscribe -> try again ->
//! wait for a release message or the holder's lease -> loop.

pub(crate) mod call;
pub(crate) mod contender;
pub(crate) mod grant;

use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::Duration;

use tokio::time::{Instant, sleep_until, timeout};

use super::acquire::call::AcquireCall;
use super::acquire::contender::{Contender, NOT_QUEUED, QUEUED};
use super::acquire::grant::{found_granted, grant_taken};
use super::hold::handoff::Granted;
use super::queue::{Claim, Reentry, Slot, Turn};
use super::store::{Attempt, Attempted, Failure, StoreKey};
use super::wakeups::Wake;
use super::{Core, MIN_COMMAND_BUDGET, Store, holder};
use crate::backend::Backend;
use crate::error::LockError;
use crate::lock::{Acquired, Kind, LockRequest, Mode};

/// How many times in a row an attempt is sent again at once when a release of this
/// backend overtook it ([`Attempted::Overtaken`]).
const MAX_OVERTAKEN: u32 = 3;

/// What one attempt found, as the acquisition acts on it.
pub(super) enum Outcome {
    Acquired(Taken),
    /// Held by another owner, for about this much longer (`None`: no expiry set).
    Held(Option<Duration>),
    /// The same, and the attempt is in the store's line of waiting holders: sent at this
    /// instant, it ran at this time of the store's clock (milliseconds), which times a
    /// grant that comes later (see `grant.rs`).
    Lined(Option<Duration>, (Instant, u64)),
    /// A release granted the key to this holder, not claimed yet (see `grant.rs`).
    Granted(Taken),
    /// Free, and left to the other instances that wait for it (a yielding attempt).
    LeftToOthers,
    /// The key's idempotency record exists: nothing was taken.
    Recorded,
}

/// A hold an attempt took (or a release granted).
pub(super) struct Taken {
    pub(super) token: u64,
    /// Tokens reserved above `token` for a run of this process's holders.
    pub(super) reserved: u64,
    pub(super) sent_at: Instant,
    /// The owner held the lock already: this hold re-entered it.
    pub(super) reentry: bool,
    /// A grant not claimed yet: it lasts until then (see `grant.rs`).
    pub(super) unclaimed: Option<Instant>,
    /// Made by a grant: the idempotency record was not checked (the holder that released
    /// may have stored one).
    pub(super) granted: bool,
}

impl<S: Store> Core<S> {
    pub(super) async fn acquire_traced(
        self: Arc<Self>,
        request: LockRequest,
    ) -> Result<Acquired, LockError> {
        if request.kind == Kind::Permit(0) {
            return Err(LockError::ZeroPermits { key: request.key });
        }
        let key = Arc::new(self.store.key(request.key, request.kind)?);
        let owner = match request.owner {
            Some(owner) => owner,
            None => self.new_owner(),
        };
        let started = Instant::now();
        let deadline = match request.mode {
            Mode::TryOnce => None,
            Mode::Wait(wait) => Some(started + wait),
        };
        // A holder of the key in this process taking it again, shared or as a permit: its
        // hold goes with the one it has (re-entries take no slot).
        let reentry = match request.kind {
            Kind::Exclusive => None,
            Kind::Shared | Kind::Permit(_) => self.queues.reentry(key.lock(), &owner),
        };
        let mut c = Contender {
            key,
            store_owner: None,
            claim: Claim {
                owner,
                lease: self.store.lease(request.lease),
                renew: request.watchdog,
            },
            started,
            deadline,
            kind: request.kind,
            unless_recorded: request.unless_recorded && request.kind == Kind::Exclusive,
            queued_writer: AtomicU8::new(NOT_QUEUED),
            core: self.clone(),
        };
        // Shared holds and permits admit several holders at once: their tasks do not line up
        // behind one contender per key, each takes its hold in the store (a permit that
        // must wait waits behind the process's other waiting tasks: see `contend`).
        if c.kind != Kind::Exclusive {
            c.store_owner = reentry.as_ref().and_then(Reentry::store_owner).cloned();
            return Box::pin(self.contend(&c, None, reentry)).await;
        }
        let wait = deadline.map(|deadline| (deadline, request.max_local_waiters));
        let (slot, reentry) = match self.queues.turn(c.key.lock(), &c.claim, wait).await {
            Turn::Contend(slot) => (Some(slot), None),
            Turn::Reenter(reentry) => {
                c.store_owner = reentry.store_owner().cloned();
                (None, Some(reentry))
            }
            // Given by the previous holder, whose record, if it stored one, is there now.
            Turn::HandedOver(guard) => return Ok(Acquired::Unchecked(guard)),
            Turn::Busy => return Err(Box::pin(self.busy(&c)).await),
            Turn::Full => {
                return Err(LockError::QueueFull {
                    key: c.key.user().to_owned(),
                });
            }
            Turn::TimedOut => return Err(c.timed_out(None)),
        };
        // Boxed, so that the many tasks waiting in a queue do not each carry the space of
        // the store's round trips that only the one contender makes.
        Box::pin(self.contend(&c, slot, reentry)).await
    }

    /// Takes the lock in the store: try -> subscribe -> try again -> wait for a release or for
    /// the holder's lease -> loop. Holding `slot`, this is the only task of the backend
    /// doing so for the key; the slot goes into the guard.
    async fn contend(
        self: &Arc<Self>,
        c: &Contender<S>,
        slot: Option<Slot>,
        reentry: Option<Reentry>,
    ) -> Result<Acquired, LockError> {
        // Tokens are reserved for a run of holders in memory when other tasks of this
        // process wait for the key.
        let reserve = || match &slot {
            Some(slot) if slot.has_waiters() => self.reserve(),
            _ => 0,
        };
        let mut pttl = None;
        // A slot passed on by a release that ended this process's run skips the first try
        // (see below): the other instances, woken by that release, go first.
        let yielded = slot.as_ref().and_then(Slot::yielded);
        // The last attempt that put this acquisition in the store's line (see `grant.rs`).
        let mut lined = None;
        if yielded.is_none() {
            match self.attempt_as(c, &reentry, (reserve(), None)).await? {
                Outcome::Acquired(taken) | Outcome::Granted(taken) => {
                    return Ok(self.taken(c, taken, slot, reentry));
                }
                Outcome::Held(p) => pttl = p,
                Outcome::Lined(p, seen) => (pttl, lined) = (p, Some(seen)),
                Outcome::LeftToOthers => {}
                Outcome::Recorded => return Ok(Acquired::Recorded),
            }
        }
        let Some(deadline) = c.deadline else {
            let key = c.key.user().to_owned();
            return Err(match c.kind {
                Kind::Permit(permits) => LockError::PermitsTaken {
                    key,
                    permits,
                    retry_after: pttl,
                },
                Kind::Exclusive | Kind::Shared => LockError::Contended {
                    key,
                    retry_after: pttl,
                },
            });
        };
        // A permit waits behind the process's other waiting tasks for the same semaphore:
        // one of them at a time waits in the store (see `queue::gate`).
        let _passage = match c.kind {
            Kind::Permit(_) if !self.store.lines_up_permit_waiters() => {
                match self.queues.permit_gate(c.key.lock(), deadline).await {
                    Some(passage) => Some(passage),
                    None => return Err(c.timed_out(pttl)),
                }
            }
            Kind::Permit(_) | Kind::Exclusive | Kind::Shared => None,
        };
        // Subscribe, then try again before sleeping: a release published between the
        // failed attempt and the subscription would otherwise be missed (Redisson #5761).
        // The waiter starts with a permit when its channel is already subscribed, and gets
        // one when the subscription is confirmed, so the next attempt follows either way.
        // An exclusive acquisition that waits in the store's line may be granted the key by
        // a release (see `grant.rs`).
        let waiter = match (c.kind, &reentry) {
            (Kind::Exclusive, None) => self.store.subscribe_as(&c.key, c.store_owner()),
            _ => self.store.subscribe(&c.key),
        };
        // The release that ended this process's run woke the other instances: until one of
        // them takes the key (this task finds it held, or the store finds the fencing
        // counter moved past the value that release left), or for at most a run's time
        // (they may have given up), this task does not take the key while the store sees
        // another instance wait for it.
        let mut yield_until = yielded.map(|fence| {
            let until = (Instant::now() + self.settings.max_local_handoff_time).min(deadline);
            (until, fence)
        });
        let mut wake_by = pttl.map_or(deadline, |p| (Instant::now() + p).min(deadline));
        loop {
            let mut nap = wake_by;
            if let Some((until, _)) = yield_until.filter(|(until, _)| Instant::now() < *until) {
                nap = nap.min(until);
            }
            let woken = tokio::select! {
                wake = waiter.woken() => wake,
                _ = sleep_until(nap) => Wake::Try,
            };
            match woken {
                // The key is this acquisition's once claimed, unless the grant came too late
                // to use or ran out before the claim.
                Wake::Granted(grant) => {
                    if let Some(taken) = lined.and_then(|seen| grant_taken(c, grant, seen)) {
                        if let Some(taken) = self.claimed(c, taken).await? {
                            drop(waiter);
                            return Ok(self.taken(c, taken, slot, reentry));
                        }
                    }
                }
                // Another holder was granted the key: nothing to try before its grant
                // would run out unclaimed.
                Wake::Recheck(at) => {
                    wake_by = wake_by.min(at);
                    continue;
                }
                Wake::Try => {}
            }
            let yielding = yield_until
                .filter(|(until, _)| Instant::now() < *until)
                .map(|(_, fence)| fence);
            lined = None;
            match self.attempt_as(c, &reentry, (reserve(), yielding)).await? {
                Outcome::Acquired(taken) | Outcome::Granted(taken) => {
                    drop(waiter);
                    return Ok(self.taken(c, taken, slot, reentry));
                }
                // Another instance took the key: this task's yield is done.
                Outcome::Held(p) => {
                    pttl = p;
                    yield_until = None;
                }
                Outcome::Lined(p, seen) => {
                    (pttl, lined) = (p, Some(seen));
                    yield_until = None;
                }
                Outcome::LeftToOthers => pttl = None,
                Outcome::Recorded => return Ok(Acquired::Recorded),
            }
            wake_by = pttl.map_or(deadline, |p| (Instant::now() + p).min(deadline));
            if Instant::now() >= deadline {
                return Err(c.timed_out(pttl));
            }
        }
    }

    /// The guard of a hold `c` took; checked when the attempt that took it as a new hold
    /// checked the key's record.
    fn taken(
        self: &Arc<Self>,
        c: &Contender<S>,
        taken: Taken,
        slot: Option<Slot>,
        reentry: Option<Reentry>,
    ) -> Acquired {
        // (A grant did not check the record: the holder that released may have stored one.)
        let checked = c.unless_recorded && !taken.reentry && reentry.is_none() && !taken.granted;
        // A re-entry by a holder that got the lock in memory keeps that holder's token.
        let granted = Granted {
            token: reentry
                .as_ref()
                .and_then(Reentry::token)
                .unwrap_or(taken.token),
            reserved: taken.reserved,
            sent_at: taken.sent_at,
            continues: None,
        };
        let claim = (c.claim.clone(), c.kind);
        let guard = self
            .guard(c.key.clone(), claim, granted, slot, reentry)
            .reentry(taken.reentry);
        if checked {
            Acquired::Checked(guard)
        } else {
            Acquired::Unchecked(guard)
        }
    }

    /// Makes one attempt.
    /// `reserve`: tokens to reserve for a run in memory; `yielding`: the key is left to
    /// other instances that wait for it until its fencing counter passes this value (see
    /// [`Attempt::yielding`]).
    pub(super) async fn attempt(
        self: &Arc<Self>,
        c: &Contender<S>,
        (reserve, yielding): (u64, Option<u64>),
    ) -> Result<Outcome, LockError> {
        let command_timeout = self.settings.command_timeout;
        let budget = match c.deadline {
            Some(deadline) => command_timeout.min(
                deadline
                    .saturating_duration_since(Instant::now())
                    .max(MIN_COMMAND_BUDGET),
            ),
            None => command_timeout,
        };
        let mut overtaken = 0;
        let (reply, sent_at) = loop {
            let attempt = Attempt {
                holder: holder(c.kind, c.store_owner()),
                owner: c.store_owner().clone(),
                kind: c.kind,
                lease: c.claim.lease,
                waits: c
                    .deadline
                    .map(|deadline| deadline.saturating_duration_since(Instant::now())),
                reserve,
                yielding,
                record: c.unless_recorded,
                serial: self.owners.serial(),
            };
            let sent_at = Instant::now();
            let reply = match timeout(budget, AcquireCall::start(self, c, attempt)).await {
                Ok(reply) => reply,
                Err(elapsed) => return Err(LockError::backend("acquire", elapsed)),
            };
            // Overtaken by a release of this backend sent after it: sent again at once under
            // a new serial, which that release cannot overtake. Each refusal takes a new
            // release of this backend's own, so a few tries settle it; past them the key is
            // reported held with nothing left to wait for.
            if matches!(reply, Ok(Attempted::Overtaken)) && overtaken < MAX_OVERTAKEN {
                overtaken += 1;
                continue;
            }
            break (reply, sent_at);
        };
        match reply {
            Ok(Attempted::Acquired { token, count }) => {
                // The store took the writer out of the waiting ones.
                c.queued_writer.store(NOT_QUEUED, Ordering::Relaxed);
                Ok(Outcome::Acquired(Taken {
                    token,
                    // A re-entry keeps the token and reserves nothing.
                    reserved: if count > 1 {
                        token
                    } else {
                        token.saturating_add(reserve)
                    },
                    sent_at,
                    reentry: count > 1,
                    unclaimed: None,
                    granted: false,
                }))
            }
            Ok(Attempted::Lined { left, at }) => {
                c.queued_writer.store(QUEUED, Ordering::Relaxed);
                Ok(Outcome::Lined(left, (sent_at, at)))
            }
            Ok(Attempted::Granted {
                token,
                left,
                reserved,
            }) => Ok(match found_granted(c, (token, reserved), left, sent_at) {
                Some(taken) => Outcome::Granted(taken),
                None => Outcome::Held(Some(left)),
            }),
            Ok(Attempted::Held { left, queued }) => {
                // Kept out by shared holders, and now queued ahead of new ones.
                if queued {
                    c.queued_writer.store(QUEUED, Ordering::Relaxed);
                }
                Ok(Outcome::Held(left))
            }
            Ok(Attempted::LeftToOthers) => Ok(Outcome::LeftToOthers),
            Ok(Attempted::Overtaken) => {
                c.queued_writer.store(NOT_QUEUED, Ordering::Relaxed);
                Ok(Outcome::Held(Some(Duration::ZERO)))
            }
            Ok(Attempted::Recorded) => {
                // The store took the attempt out of the waiting ones.
                c.queued_writer.store(NOT_QUEUED, Ordering::Relaxed);
                Ok(Outcome::Recorded)
            }
            Ok(Attempted::UpgradeRefused) => Err(LockError::UpgradeRefused {
                key: c.key.user().to_owned(),
            }),
            Err(e) if e.is_foreign() => {
                // The refusal names no cause; the operator who must remove the value needs it.
                tracing::warn!(key = c.key.user(), error = %e, "the store holds a value that is not a lock");
                Err(LockError::NotALock {
                    key: c.key.user().to_owned(),
                })
            }
            Err(e) => Err(LockError::backend("acquire", e)),
        }
    }
}

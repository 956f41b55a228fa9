//! Taking a lock in a store: the local queue first, then try -> subscribe -> try again ->
//! wait for a release message or the holder's lease -> loop.
//!
//! [`contend`](Core::contend) runs those steps, each a component of its own: the attempt
//! (`attempt.rs`, its cancel-safe call in `call.rs`), where the acquisition stands between
//! attempts and how it waits (`wait.rs`: the permit gate, the waiter, the nap), the yield
//! after a run of this process's holders ended (`yielding.rs`), keys a release granted
//! (`grant.rs`, for a store with a line of waiting holders), and the idempotency record
//! check (`record.rs`).

mod attempt;
pub(crate) mod call;
pub(crate) mod contender;
pub(crate) mod grant;
mod record;
mod wait;
mod yielding;

use std::sync::Arc;
use std::sync::atomic::AtomicU8;
use std::time::Duration;

use tokio::time::Instant;

use super::acquire::contender::{Contender, NOT_QUEUED};
use super::acquire::record::RecordCheck;
use super::acquire::wait::{Ended, Standing, nap};
use super::acquire::yielding::Yielding;
use super::hold::handoff::Granted;
use super::queue::{Claim, Reentry, Slot, Turn};
use super::store::StoreKey;
use super::wakeups::Wake;
use super::{Core, Store};
use crate::error::LockError;
use crate::lock::backend::Backend;
use crate::lock::{Acquired, Kind, LockRequest, Mode};

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
            records: RecordCheck::of(request.unless_recorded, request.kind),
            queued_writer: AtomicU8::new(NOT_QUEUED),
            core: self.clone(),
        };
        // Shared holds and permits admit several holders at once: their tasks do not line up
        // behind one contender per key, each takes its hold in the store (a permit that
        // must wait waits behind the process's other waiting tasks: see `wait.rs`).
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
        let mut standing = Standing::default();
        // A slot passed on by a release that ended this process's run skips the first try:
        // the other instances, woken by that release, go first (see `yielding.rs`).
        let yielded = slot.as_ref().and_then(Slot::yielded);
        if yielded.is_none() {
            let outcome = self.attempt_as(c, &reentry, (reserve(), None)).await?;
            if let Some(ended) = standing.after(outcome) {
                return Ok(self.ended(c, ended, slot, reentry));
            }
        }
        let Some(deadline) = c.deadline else {
            return Err(c.refused(standing.pttl));
        };
        let _passage = self.permit_passage(c, deadline, standing.pttl).await?;
        let waiter = self.waiter(c, &reentry);
        let run_time = self.settings.max_local_handoff_time;
        standing.yielding = Yielding::after(yielded, run_time, deadline);
        let mut wake_by = standing.wake_by(deadline);
        loop {
            match nap(&waiter, wake_by, standing.yielding).await {
                // The key is this acquisition's once claimed, unless the grant came too late
                // to use or ran out before the claim.
                Wake::Granted(grant) => {
                    if let Some(taken) = self.take_grant(c, grant, standing.lined).await? {
                        drop(waiter);
                        return Ok(self.ended(c, Ended::Taken(taken), slot, reentry));
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
            let args = (reserve(), standing.yielding.fence());
            let outcome = self.attempt_as(c, &reentry, args).await?;
            if let Some(ended) = standing.after(outcome) {
                drop(waiter);
                return Ok(self.ended(c, ended, slot, reentry));
            }
            wake_by = standing.wake_by(deadline);
            if Instant::now() >= deadline {
                return Err(c.timed_out(standing.pttl));
            }
        }
    }

    /// What the acquisition `c` hands back when it `ended`: the guard of its hold, or the
    /// key's record.
    fn ended(
        self: &Arc<Self>,
        c: &Contender<S>,
        ended: Ended,
        slot: Option<Slot>,
        reentry: Option<Reentry>,
    ) -> Acquired {
        let taken = match ended {
            Ended::Taken(taken) => taken,
            Ended::Recorded => return Acquired::Recorded,
        };
        let reentered = reentry.is_some();
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
        c.records.result(guard, &taken, reentered)
    }
}

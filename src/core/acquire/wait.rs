//! Waiting between attempts: where an acquisition stands after its last attempt, the
//! permit gate, the waiter registered before the next attempt, and the nap until a wake-up
//! or the holder's lease (never a polling loop).

use std::time::Duration;

use tokio::time::{Instant, sleep_until};

use crate::core::acquire::contender::Contender;
use crate::core::acquire::yielding::Yielding;
use crate::core::acquire::{Outcome, Taken};
use crate::core::queue::{Passage, Reentry};
use crate::core::store::{PermitWaiters, StoreKey};
use crate::core::wakeups::{Waiter, Wake};
use crate::core::{Core, Store};
use crate::error::LockError;
use crate::lock::Kind;

/// How an acquisition ended.
pub(super) enum Ended {
    /// With a hold (or a grant made one).
    Taken(Taken),
    /// The key's idempotency record exists: nothing was taken.
    Recorded,
}

/// Where a waiting acquisition stands after its last attempt.
#[derive(Default)]
pub(super) struct Standing {
    /// About how long the holder keeps the key (`None`: not known).
    pub(super) pttl: Option<Duration>,
    /// The last attempt that put the acquisition in the store's line: when it was sent,
    /// and when it ran on the store's clock (see `grant.rs`).
    pub(super) lined: Option<(Instant, u64)>,
    /// The yield to the other instances (see `yielding.rs`).
    pub(super) yielding: Yielding,
}

impl Standing {
    /// Takes in what an attempt found: how the acquisition ends, or `None` while it waits.
    pub(super) fn after(&mut self, outcome: Outcome) -> Option<Ended> {
        self.lined = None;
        match outcome {
            Outcome::Acquired(taken) | Outcome::Granted(taken) => return Some(Ended::Taken(taken)),
            Outcome::Recorded => return Some(Ended::Recorded),
            // Another instance took the key: this task's yield is done.
            Outcome::Held(pttl) => {
                self.pttl = pttl;
                self.yielding.end();
            }
            Outcome::Lined(pttl, seen) => {
                (self.pttl, self.lined) = (pttl, Some(seen));
                self.yielding.end();
            }
            Outcome::LeftToOthers => self.pttl = None,
        }
        None
    }

    /// When to try again if nothing wakes the acquisition first: when the holder's lease
    /// ends, by `deadline`.
    pub(super) fn wake_by(&self, deadline: Instant) -> Instant {
        self.pttl
            .map_or(deadline, |p| (Instant::now() + p).min(deadline))
    }
}

impl<S: Store> Core<S> {
    /// A permit waits behind the process's other waiting tasks for the same semaphore: one
    /// of them at a time waits in the store (see `queue::gate`), unless the store lines
    /// them up itself ([`PermitWaiters::InStore`]). `None`: no gate to pass.
    pub(super) async fn permit_passage(
        &self,
        c: &Contender<S>,
        deadline: Instant,
        pttl: Option<Duration>,
    ) -> Result<Option<Passage>, LockError> {
        let gated = self.capabilities.permit_waiters == PermitWaiters::Gated;
        if !(gated && matches!(c.kind, Kind::Permit(_))) {
            return Ok(None);
        }
        match self.queues.permit_gate(c.key.lock(), deadline).await {
            Some(passage) => Ok(Some(passage)),
            None => Err(c.timed_out(pttl)),
        }
    }

    /// The waiter of `c`, registered before its next attempt: a release published between
    /// the failed attempt and the subscription would otherwise be missed (Redisson #5761).
    /// The waiter starts with a permit when its channel is already subscribed, and gets
    /// one when the subscription is confirmed, so the next attempt follows either way. An
    /// exclusive acquisition that waits in the store's line may be granted the key by a
    /// release (see `grant.rs`).
    pub(super) fn waiter(&self, c: &Contender<S>, reentry: &Option<Reentry>) -> Waiter {
        match (c.kind, reentry, self.store.grants()) {
            (Kind::Exclusive, None, Some(grants)) => {
                grants.subscribe_in_line(&c.key, c.store_owner())
            }
            _ => self.store.subscribe(&c.key),
        }
    }
}

/// Waits for a wake-up of `waiter`, or until `wake_by` (or the yield's end, if sooner):
/// then the acquisition tries again.
pub(super) async fn nap(waiter: &Waiter, wake_by: Instant, yielding: Yielding) -> Wake {
    tokio::select! {
        wake = waiter.woken() => wake,
        _ = sleep_until(yielding.nap(wake_by)) => Wake::Try,
    }
}

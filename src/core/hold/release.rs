//! The guard of a hold and its release on every exit path: awaited by `release()`, else
//! in the background (drop, panic, cancellation), never outlived by renewal.

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::core::hold::Hold;
use crate::core::hold::handoff::{Granted, Run};
use crate::core::queue::{Claim, Reentry, Slot};
use crate::core::store::{LostHolds, StoreKey};
use crate::core::watchdog::OnLost;
use crate::core::{Core, Store, holder};
use crate::error::LockError;
use crate::lock::{BoxFuture, HeldLock, Kind, LockGuard, ReleaseHold};

impl<S: Store> Core<S> {
    /// Builds the guard of a hold that the store confirmed and starts watching its lease.
    /// `reentry` is set for a re-entry of the key by its holder in this process.
    pub(crate) fn guard(
        self: &Arc<Self>,
        key: Arc<S::Key>,
        (claim, kind): (Claim, Kind),
        granted: Granted,
        slot: Option<Slot>,
        reentry: Option<Reentry>,
    ) -> LockGuard {
        let on_lost = slot.as_ref().map(|slot| Box::new(slot.revoker()) as OnLost);
        let store_owner = reentry
            .as_ref()
            .and_then(Reentry::store_owner)
            .unwrap_or(&claim.owner);
        let mut hold = Hold::new(
            self.clone(),
            key,
            (holder(kind, store_owner), kind),
            claim.lease,
            slot,
            Some(granted.token),
        );
        let line_end = hold.slot.as_ref().map_or(0, Slot::line_end);
        hold.run = Run::new(granted, line_end);
        hold.reentry = reentry;
        let (lost, generation) = self.watchdog.register(
            hold.key.lock().clone(),
            hold.holder.clone(),
            claim.lease,
            claim.renew,
            granted.sent_at,
            on_lost,
        );
        let renew = claim.renew;
        let held = HeldLock::new(
            hold.key.user().to_owned(),
            claim.owner,
            granted.token,
            lost.clone(),
        )
        .into_shared(kind == Kind::Shared);
        LockGuard::new(
            held,
            Box::new(WatchedHold {
                hold,
                generation,
                renew,
                lost,
            }),
        )
    }
}

/// A hold registered with the watchdog: releasing deregisters it first, so renewal never
/// outlives the unlock (Redisson #7272).
pub(in crate::core) struct WatchedHold<S: Store> {
    pub(in crate::core) hold: Hold<S>,
    pub(in crate::core) generation: u64,
    /// Whether this hold asked for renewal (see `LockRequest::without_watchdog`).
    pub(in crate::core) renew: bool,
    /// Fired by the watchdog when the lock was found lost.
    pub(in crate::core) lost: CancellationToken,
}

impl<S: Store> WatchedHold<S> {
    /// Stops renewal; returns the hold if a release is still owed to the store. A hold known
    /// lost is owed nothing: its owner may hold the key again under a new hold, which a
    /// release of the old one would take away (unless the store may still keep it: then
    /// its release, of its own token only, runs in the background).
    fn stop(self) -> Result<Hold<S>, LockError> {
        let hold = self.hold;
        hold.core
            .watchdog
            .unregister(hold.key.lock(), &hold.holder, self.generation, self.renew);
        if self.lost.is_cancelled() {
            let key = hold.key.user().to_owned();
            // A store whose holds may outlive their holder's deadline is still owed the
            // release of this hold, and of this hold only.
            if hold.core.capabilities.lost_holds == LostHolds::MayRemain && hold.token.is_some() {
                let mut hold = hold;
                hold.only_own_token = true;
                hold.finish_in_background();
            }
            return Err(LockError::Lost { key });
        }
        Ok(hold)
    }
}

impl<S: Store> ReleaseHold for WatchedHold<S> {
    fn release(self: Box<Self>) -> BoxFuture<'static, Result<(), LockError>> {
        let Err(this) = self.hand_over_in_memory() else {
            return Box::pin(std::future::ready(Ok(())));
        };
        let hold = match this.stop() {
            Ok(hold) => hold,
            Err(lost) => return Box::pin(std::future::ready(Err(lost))),
        };
        // The caller awaits this one: retry briefly, then report. What is still owed then
        // (or when the caller stops waiting) is finished in the background, so a release
        // that could not reach the store (paused, restarting) happens once it can, instead of
        // leaving the lock to its lease.
        let retry_for = hold.core.settings.command_timeout.saturating_mul(2);
        Box::pin(PendingRelease(Some(hold)).settle(retry_for))
    }

    fn release_in_background(self: Box<Self>) {
        let Err(this) = self.hand_over_in_memory() else {
            return;
        };
        if let Ok(hold) = this.stop() {
            hold.finish_in_background();
        }
    }
}

/// A release still owed to the store: dropped unsettled, it is finished in the background.
struct PendingRelease<S: Store>(Option<Hold<S>>);

impl<S: Store> PendingRelease<S> {
    async fn settle(mut self, retry_for: Duration) -> Result<(), LockError> {
        let result = match &mut self.0 {
            Some(hold) => hold.release_retrying(retry_for).await,
            None => Ok(()),
        };
        // Only a backend failure leaves the release undone; `Lost` means nothing is owed.
        // Dropping the hold passes its slot (if it did not go with a handoff) on.
        if !matches!(result, Err(LockError::Backend(_))) {
            self.0 = None;
        }
        result
    }
}

impl<S: Store> Drop for PendingRelease<S> {
    fn drop(&mut self) {
        if let Some(mut hold) = self.0.take() {
            // Dropped while its call was in flight, the release may have run: the retry
            // must recognise a handoff or a release already done.
            hold.may_have_run = true;
            hold.finish_in_background();
        }
    }
}

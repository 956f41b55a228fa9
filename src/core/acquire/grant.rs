//! Keys granted by a release: a store that keeps waiting holders in line (Redis) may hand
//! a freed key to the head of the line in the release's own call, and tell it in the
//! release's message. The waiting acquisition then holds the key without another call.
//!
//! A grant lasts a short grant lease unless its holder claims it: the watchdog's first
//! renewal, sent at once, does (see `watchdog/`), and finds the hold lost if the grant ran
//! out first. Until then the hold is confirmed by nothing this process sent, so its lease
//! must be timed from something that happened before the grant: the acquisition's last
//! attempt that put it in the line ran at a known time of the store's clock, after it was
//! sent, and the grant ran after that attempt (it took the holder from the line), so it
//! ran no sooner than the attempt's send time plus the store's clock difference between
//! the two. A grant whose message comes too late by that measure (a process that was
//! paused, or partitioned away, and hears of it later) is not used: the acquisition tries
//! again, and the store says whether the grant is still there and for how long.
//!
//! An acquisition that missed the message finds the grant in the store on its next attempt
//! ([`Attempted::Granted`](crate::core::store::Attempted)), timed from that attempt. A re-entry
//! of a granted hold before its claim claims it first, then re-enters as usual. An
//! acquisition that gives up while granted frees the grant in the store as it withdraws
//! from the line.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio::time::{Instant, timeout};

use crate::core::acquire::contender::{Contender, NOT_QUEUED};
use crate::core::acquire::{Outcome, Taken};
use crate::core::queue::Reentry;
use crate::core::store::StoreKey;
use crate::core::wakeups::Grant;
use crate::core::watchdog::Due;
use crate::core::{Core, Store, holder};
use crate::error::LockError;

/// The hold a grant by message makes for `c`, whose last attempt that put it in the line
/// was `sent` at this instant and ran at `ran` on the store's clock; `None` when the grant
/// may be out of date (see the module's doc): the acquisition tries again instead.
pub(in crate::core) fn grant_taken<S: Store>(
    c: &Contender<S>,
    grant: Grant,
    (sent, ran): (Instant, u64),
) -> Option<Taken> {
    // Made before that attempt ran, the grant is one the attempt would have reported
    // (or one that is gone since): only a later one is timed from it.
    let after = grant.at.checked_sub(ran).filter(|ms| *ms > 0)?;
    let ends = sent + Duration::from_millis(after) + grant.lease;
    // Too little of it left to be worth the risk of a hold that ends as it begins.
    if ends <= Instant::now() + grant.lease / 4 {
        return None;
    }
    c.queued_writer.store(NOT_QUEUED, Ordering::Relaxed);
    Some(Taken {
        token: grant.token,
        reserved: grant.token.saturating_add(grant.reserved),
        // The run of this process's holders under it starts now.
        sent_at: Instant::now(),
        reentry: false,
        unclaimed: Some(ends),
    })
}

/// The hold an attempt sent at `sent_at` made of a grant it found in the store (its token
/// and the tokens reserved above it), with `left` of it to run; `None` when its reply came
/// too late to use it (the process was paused): the grant is waited out, as a lease.
pub(in crate::core) fn found_granted<S: Store>(
    c: &Contender<S>,
    (token, reserved): (u64, u64),
    left: Duration,
    sent_at: Instant,
) -> Option<Taken> {
    // Out of the line: the release that granted it took it out.
    c.queued_writer.store(NOT_QUEUED, Ordering::Relaxed);
    let ends = sent_at + left;
    if ends <= Instant::now() + left / 4 {
        return None;
    }
    Some(Taken {
        token,
        reserved: token.saturating_add(reserved),
        sent_at,
        reentry: false,
        // It ran no sooner than it was sent, and found the grant that long.
        unclaimed: Some(ends),
    })
}

impl<S: Store> Core<S> {
    /// One attempt for `c`. A re-entry that finds its outer hold granted and not claimed
    /// yet (the watchdog's claim still in flight) claims it, then re-enters.
    pub(in crate::core) async fn attempt_as(
        self: &Arc<Self>,
        c: &Contender<S>,
        reentry: &Option<Reentry>,
        args: (u64, Option<u64>),
    ) -> Result<Outcome, LockError> {
        let outcome = self.attempt(c, args).await?;
        if reentry.is_none() || !matches!(outcome, Outcome::Granted(_)) {
            return Ok(outcome);
        }
        let due = Due::claim(
            (c.key.lock().clone(), holder(c.kind, c.store_owner())),
            c.claim.lease,
        );
        match timeout(self.settings.command_timeout, self.store.renew(&[due])).await {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => return Err(LockError::backend("acquire", e)),
            Err(elapsed) => return Err(LockError::backend("acquire", elapsed)),
        }
        // Claimed (or run out meanwhile): the attempt now re-enters or finds the key as
        // it is; a grant still unclaimed then is waited out as a holder's lease.
        match self.attempt(c, args).await? {
            Outcome::Granted(taken) => Ok(Outcome::Held(Some(
                taken
                    .unclaimed
                    .map_or(Duration::ZERO, |end| end - Instant::now().min(end)),
            ))),
            outcome => Ok(outcome),
        }
    }
}

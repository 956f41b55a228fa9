//! Keys granted by a release: a store that keeps waiting holders in line (Redis) may hand
//! a freed key to the head of the line in the release's own call, and tell it in the
//! release's message (it declares [`Grants`](crate::core::store::Grants); its line's
//! answers are [`InLine`]). Nothing here runs for a store without a line. The waiting acquisition then claims it (a renewal for the hold's
//! full lease) and holds the key once the claim is confirmed ([`Core::claimed`]).
//!
//! A grant lasts a short grant lease unless its holder claims it. Until then the hold is
//! confirmed by nothing this process sent, so whether it is still worth claiming is timed
//! from something that happened before the grant: the acquisition's last
//! attempt that put it in the line ran at a known time of the store's clock, after it was
//! sent, and the grant ran after that attempt (it took the holder from the line), so it
//! ran no sooner than the attempt's send time plus the store's clock difference between
//! the two. A grant whose message comes too late by that measure (a process that was
//! paused, or partitioned away, and hears of it later) is not used: the acquisition tries
//! again, and the store says whether the grant is still there and for how long.
//!
//! An acquisition that missed the message finds the grant in the store on its next attempt
//! ([`InLine::Granted`]), timed from that attempt. A re-entry
//! of a granted hold before its claim claims it first, then re-enters as usual. An
//! acquisition that gives up while granted frees the grant in the store as it withdraws
//! from the line; one that stops while its claim is on its way (cancelled, or out of
//! time) releases the hold the claim made, once its reply comes ([`ClaimCall`]).

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio::time::{Instant, timeout};

use crate::core::acquire::call::ClaimCall;
use crate::core::acquire::contender::{Contender, NOT_QUEUED, QUEUED};
use crate::core::acquire::{Outcome, Taken};
use crate::core::queue::Reentry;
use crate::core::store::InLine;
use crate::core::wakeups::Grant;
use crate::core::{Core, Store};
use crate::error::LockError;

/// What an answer of the store's line to an attempt of `c` sent at `sent_at` means to it.
pub(in crate::core) fn in_line<S: Store>(
    c: &Contender<S>,
    answer: InLine,
    sent_at: Instant,
) -> Outcome {
    match answer {
        InLine::Waiting { left, at } => {
            c.queued_writer.store(QUEUED, Ordering::Relaxed);
            Outcome::Lined(left, (sent_at, at))
        }
        InLine::Granted {
            token,
            left,
            reserved,
        } => match found_granted(c, (token, reserved), left, sent_at) {
            Some(taken) => Outcome::Granted(taken),
            None => Outcome::Held(Some(left)),
        },
    }
}

/// The hold a grant by message makes for `c`, whose last attempt that put it in the line
/// was `sent` at this instant and ran at `ran` on the store's clock; `None` when the grant
/// may be out of date (see the module's doc): the acquisition tries again instead.
fn grant_taken<S: Store>(
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
        granted: true,
    })
}

/// The hold an attempt sent at `sent_at` made of a grant it found in the store (its token
/// and the tokens reserved above it), with `left` of it to run; `None` when its reply came
/// too late to use it (the process was paused): the grant is waited out, as a lease.
fn found_granted<S: Store>(
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
        granted: true,
    })
}

impl<S: Store> Core<S> {
    /// The hold that `grant`, told by a release's message, makes for `c` once claimed;
    /// `lined`: the last attempt of `c` that put it in the line. `None` when the grant
    /// came too late to use, or ran out before the claim: the acquisition tries again.
    pub(in crate::core) async fn take_grant(
        self: &Arc<Self>,
        c: &Contender<S>,
        grant: Grant,
        lined: Option<(Instant, u64)>,
    ) -> Result<Option<Taken>, LockError> {
        match lined.and_then(|seen| grant_taken(c, grant, seen)) {
            Some(taken) => self.claimed(c, taken).await,
            None => Ok(None),
        }
    }

    /// The hold a grant made for `c`, once claimed: a hold's holder runs only under a
    /// lease this process confirmed. A grant alone lasts its short grant lease, and a
    /// process paused past it between the grant and the claim would find its handler
    /// running while another instance holds the key (seen in the Jepsen test: an instance
    /// frozen 0.3-1.5 s right after a grant, 530-565 ms of overlap). `None` when the grant
    /// ran out first: the acquisition tries again.
    pub(in crate::core) async fn claimed(
        self: &Arc<Self>,
        c: &Contender<S>,
        mut taken: Taken,
    ) -> Result<Option<Taken>, LockError> {
        let sent_at = Instant::now();
        if !self.claim(c, taken.token).await? {
            return Ok(None);
        }
        // A hold as any other now: its lease runs from the claim.
        taken.sent_at = sent_at;
        taken.unclaimed = None;
        Ok(Some(taken))
    }

    /// Claims the grant of `c`'s holder (under `token`) in the store; whether it was still
    /// there. Cancelled or timed out, the claim gives back what it made (see [`ClaimCall`]).
    async fn claim(self: &Arc<Self>, c: &Contender<S>, token: u64) -> Result<bool, LockError> {
        let call = ClaimCall::start(self, c, token);
        match timeout(self.settings.command_timeout, call).await {
            Ok(Ok(claimed)) => Ok(claimed),
            Ok(Err(e)) => Err(LockError::backend("acquire", e)),
            Err(elapsed) => Err(LockError::backend("acquire", elapsed)),
        }
    }

    /// One attempt for `c`. A re-entry that finds its outer hold granted and not claimed
    /// yet (the watchdog's claim still in flight) claims it, then re-enters.
    pub(in crate::core) async fn attempt_as(
        self: &Arc<Self>,
        c: &Contender<S>,
        reentry: &Option<Reentry>,
        args: (u64, Option<u64>),
    ) -> Result<Outcome, LockError> {
        let outcome = self.attempt(c, args).await?;
        let taken = match outcome {
            Outcome::Granted(taken) => taken,
            outcome => return Ok(outcome),
        };
        if reentry.is_none() {
            return Ok(match self.claimed(c, taken).await? {
                Some(taken) => Outcome::Granted(taken),
                // Ran out before the claim: the key is as the next attempt finds it.
                None => Outcome::Held(Some(Duration::ZERO)),
            });
        }
        self.claim(c, taken.token).await?;
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

//! One attempt of an acquisition: the call (within the acquisition's budget, sent again
//! when a release of this backend overtook it), and what its answer means to the
//! acquisition.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio::time::{Instant, timeout};

use crate::core::acquire::call::AcquireCall;
use crate::core::acquire::contender::{Contender, NOT_QUEUED, QUEUED};
use crate::core::acquire::grant::in_line;
use crate::core::acquire::{Outcome, Taken};
use crate::core::store::{Attempt, Attempted, Calls, Failure, StoreKey};
use crate::core::{Core, MIN_COMMAND_BUDGET, Store, holder};
use crate::error::LockError;

/// How many times in a row an attempt is sent again at once when a release of this
/// backend overtook it ([`Attempted::Overtaken`]).
const MAX_OVERTAKEN: u32 = 3;

/// An attempt's reply, and when it was sent.
type Reply<S> = (Result<Attempted, <S as Store>::Error>, Instant);

impl<S: Store> Core<S> {
    /// Makes one attempt.
    /// `reserve`: tokens to reserve for a run in memory; `yielding`: the key is left to
    /// other instances that wait for it until its fencing counter passes this value (see
    /// [`Attempt::yielding`]).
    pub(super) async fn attempt(
        self: &Arc<Self>,
        c: &Contender<S>,
        (reserve, yielding): (u64, Option<u64>),
    ) -> Result<Outcome, LockError> {
        let (reply, sent_at) = self.call(c, (reserve, yielding)).await?;
        self.outcome(c, reply, sent_at, reserve)
    }

    /// Sends the attempt, within the command timeout and what is left of the wait (never
    /// less than [`MIN_COMMAND_BUDGET`]). Overtaken by a release of this backend sent after
    /// it, it is sent again at once under a new serial, which that release cannot overtake
    /// (only a store whose calls may run twice refuses one). Each refusal takes a new
    /// release of this backend's own, so a few tries settle it; past them the key is
    /// reported held with nothing left to wait for.
    async fn call(
        self: &Arc<Self>,
        c: &Contender<S>,
        (reserve, yielding): (u64, Option<u64>),
    ) -> Result<Reply<S>, LockError> {
        let command_timeout = self.settings.command_timeout;
        let budget = c.deadline.map_or(command_timeout, |deadline| {
            let left = deadline.saturating_duration_since(Instant::now());
            command_timeout.min(left.max(MIN_COMMAND_BUDGET))
        });
        let resends = match self.capabilities.calls {
            Calls::MayRunTwice => MAX_OVERTAKEN,
            Calls::RunOnce => 0,
        };
        let mut overtaken = 0;
        loop {
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
                record: c.records.asked(),
                serial: self.owners.serial(),
            };
            let sent_at = Instant::now();
            let reply = match timeout(budget, AcquireCall::start(self, c, attempt)).await {
                Ok(reply) => reply,
                Err(elapsed) => return Err(LockError::backend("acquire", elapsed)),
            };
            if matches!(reply, Ok(Attempted::Overtaken)) && overtaken < resends {
                overtaken += 1;
                continue;
            }
            return Ok((reply, sent_at));
        }
    }

    /// What the answer to an attempt sent at `sent_at` with `reserve` means to `c`.
    fn outcome(
        &self,
        c: &Contender<S>,
        reply: Result<Attempted, S::Error>,
        sent_at: Instant,
        reserve: u64,
    ) -> Result<Outcome, LockError> {
        let queued = |queued| c.queued_writer.store(queued, Ordering::Relaxed);
        match reply {
            Ok(Attempted::Acquired { token, count }) => {
                // The store took the writer out of the waiting ones.
                queued(NOT_QUEUED);
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
            Ok(Attempted::Held { left, queued: kept }) => {
                // Kept out by shared holders, and now queued ahead of new ones.
                if kept {
                    queued(QUEUED);
                }
                Ok(Outcome::Held(left))
            }
            Ok(Attempted::LeftToOthers) => Ok(Outcome::LeftToOthers),
            Ok(Attempted::Line(answer)) => Ok(in_line(c, answer, sent_at)),
            Ok(Attempted::Overtaken) => {
                queued(NOT_QUEUED);
                Ok(Outcome::Held(Some(Duration::ZERO)))
            }
            Ok(Attempted::Recorded) => {
                // The store took the attempt out of the waiting ones.
                queued(NOT_QUEUED);
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

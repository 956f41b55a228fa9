//! What every hold of a [`MemoryBackend`](super::MemoryBackend) shares, whatever its
//! primitive: the lease bookkeeping of one owner's holds ([`Tenure`]), their release, and
//! the timer that expires them when nobody renews them.

use std::collections::HashMap;
use std::sync::{Arc, Weak};
use std::time::Duration;

use tokio::time::{Instant, sleep_until};
use tokio_util::sync::CancellationToken;

use super::{Inner, State};
use crate::core::queue::Claim;
use crate::error::LockError;
use crate::lock::{BoxFuture, HeldLock, LockGuard, LockOwner, ReleaseHold};

/// How long the token of a key's last exclusive acquisition is kept for its shared holds
/// after that acquisition ended, as Redis keeps its fencing counter by default.
const FENCE_TTL: Duration = Duration::from_secs(600);

/// The primitive a hold belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Of {
    Exclusive,
    Shared,
    Permit,
}

/// Names one tenure: a stale guard or timer (of an earlier generation) cannot touch a
/// later one of the same owner and key.
#[derive(Clone)]
pub(super) struct HoldId {
    pub(super) of: Of,
    pub(super) key: Arc<str>,
    pub(super) owner: LockOwner,
    pub(super) generation: u64,
}

/// One owner's holds of one key's lock, shared hold or permit.
pub(super) struct Tenure {
    /// Holds of the owner (re-entries included).
    holds: u32,
    /// Holds that asked for renewal: while there is one, the tenure does not expire.
    renewing: u32,
    /// When the tenure expires once no renewing hold is left.
    expires: Instant,
    lease: Duration,
    pub(super) generation: u64,
    pub(super) token: u64,
    lost: CancellationToken,
}

impl Tenure {
    pub(super) fn new(claim: &Claim, generation: u64, token: u64) -> Self {
        Tenure {
            holds: 0,
            renewing: 0,
            expires: Instant::now() + claim.lease,
            lease: claim.lease,
            generation,
            token,
            lost: CancellationToken::new(),
        }
    }

    /// Holds of the owner, re-entries included.
    pub(super) fn holds(&self) -> u32 {
        self.holds
    }

    /// Fires the holder's `lost()`: its tenure is ended by force.
    pub(super) fn lose(&self) {
        self.lost.cancel();
    }

    /// How long the tenure lasts at most, for `Retry-After`.
    pub(super) fn remaining(&self) -> Duration {
        if self.renewing > 0 {
            self.lease
        } else {
            self.expires.saturating_duration_since(Instant::now())
        }
    }
}

impl State {
    /// The tenure `id` names, if it still exists.
    pub(super) fn tenure(&mut self, id: &HoldId) -> Option<&mut Tenure> {
        let tenure = match id.of {
            Of::Exclusive => self.keys.get_mut(&id.key)?.writer_tenure(&id.owner)?,
            Of::Shared => self.keys.get_mut(&id.key)?.readers.get_mut(&id.owner)?,
            Of::Permit => self
                .semaphores
                .get_mut(&id.key)?
                .permits
                .get_mut(&id.owner)?,
        };
        (tenure.generation == id.generation).then_some(tenure)
    }

    /// Ends the tenure `id` (its last hold released, its lease run out, or freed by an
    /// operator) and lets the waiters it kept out in.
    pub(super) fn end(&mut self, inner: &Arc<Inner>, id: &HoldId, deferred: &mut super::Deferred) {
        match id.of {
            Of::Exclusive | Of::Shared => self.end_rw(inner, id, deferred),
            Of::Permit => self.end_permit(inner, id, deferred),
        }
    }
}

impl Inner {
    /// One more hold of `claim` on `tenure` (new or re-entered), as its guard.
    pub(super) fn hold(
        self: &Arc<Self>,
        id: HoldId,
        tenure: &mut Tenure,
        claim: &Claim,
    ) -> LockGuard {
        tenure.holds += 1;
        tenure.expires = tenure.expires.max(Instant::now() + claim.lease);
        tenure.renewing += u32::from(claim.renew);
        let held = HeldLock::new(
            id.key.to_string(),
            claim.owner.clone(),
            tenure.token,
            tenure.lost.clone(),
        )
        .into_shared(id.of == Of::Shared);
        let reentry = tenure.holds > 1;
        if tenure.renewing == 0 {
            self.expire_when_due(id.clone());
        }
        let hold = MemoryHold {
            inner: self.clone(),
            id,
            lease: claim.lease,
            renew: claim.renew,
        };
        LockGuard::new(held, Box::new(hold)).reentry(reentry)
    }

    /// Starts a timer that ends the tenure `id` when its lease runs out with no renewing
    /// hold left. The timer re-arms while the deadline moves on, and holds no reference
    /// that would keep the backend alive.
    fn expire_when_due(self: &Arc<Self>, id: HoldId) {
        let inner = Arc::downgrade(self);
        self.runtime.spawn(async move {
            while let Some(due) = next_expiry(&inner, &id) {
                sleep_until(due).await;
            }
        });
    }
}

/// What the expiry timer of one tenure waits for next: `None` when there is nothing left
/// to wait for (the tenure is gone, renewed, or expired just now).
fn next_expiry(inner: &Weak<Inner>, id: &HoldId) -> Option<Instant> {
    let inner = inner.upgrade()?;
    inner.with_state(|state, deferred| {
        let tenure = state.tenure(id)?;
        if tenure.renewing > 0 {
            return None;
        }
        if tenure.expires > Instant::now() {
            return Some(tenure.expires);
        }
        tenure.lost.cancel();
        state.end(&inner, id, deferred);
        None
    })
}

/// One hold of a [`MemoryBackend`](super::MemoryBackend) lock, shared hold or permit.
struct MemoryHold {
    inner: Arc<Inner>,
    id: HoldId,
    lease: Duration,
    renew: bool,
}

impl MemoryHold {
    fn give_back(&self) -> Result<(), LockError> {
        let inner = &self.inner;
        let rearm = inner.with_state(|state, deferred| {
            let tenure = state.tenure(&self.id)?;
            tenure.holds = tenure.holds.saturating_sub(1);
            if self.renew {
                tenure.renewing = tenure.renewing.saturating_sub(1);
                // The last renewal left the tenure one lease to live.
                tenure.expires = tenure.expires.max(Instant::now() + self.lease);
            }
            if tenure.holds == 0 {
                state.end(inner, &self.id, deferred);
                return Some(false);
            }
            Some(tenure.renewing == 0 && self.renew)
        });
        match rearm {
            None => Err(LockError::Lost {
                key: self.id.key.to_string(),
            }),
            Some(rearm) => {
                if rearm {
                    inner.expire_when_due(self.id.clone());
                }
                Ok(())
            }
        }
    }
}

impl ReleaseHold for MemoryHold {
    fn release(self: Box<Self>) -> BoxFuture<'static, Result<(), LockError>> {
        Box::pin(std::future::ready(self.give_back()))
    }

    fn release_in_background(self: Box<Self>) {
        let _ = self.give_back();
    }
}

/// The token of each key's last exclusive acquisition, kept [`FENCE_TTL`] after it ended
/// so that shared holds taken then still carry it, and then forgotten: memory stays bounded
/// by the keys written lately, as Redis's fencing counters are.
pub(super) struct Fences {
    last: HashMap<Arc<str>, (u64, Instant)>,
    /// The size at which stale entries are swept next (amortised over the inserts).
    sweep_at: usize,
}

impl Default for Fences {
    fn default() -> Self {
        Fences {
            last: HashMap::new(),
            sweep_at: 1024,
        }
    }
}

impl Fences {
    /// Records `token` as `key`'s last exclusive token, fresh as of now.
    pub(super) fn record(&mut self, key: &Arc<str>, token: u64) {
        let now = Instant::now();
        self.last.insert(key.clone(), (token, now));
        if self.last.len() >= self.sweep_at {
            self.last
                .retain(|_, (_, at)| now.duration_since(*at) < FENCE_TTL);
            self.sweep_at = (self.last.len() * 2).max(1024);
        }
    }

    /// `key`'s last exclusive token, or 0 when there was none lately.
    pub(super) fn last(&self, key: &str) -> u64 {
        self.last
            .get(key)
            .filter(|(_, at)| at.elapsed() < FENCE_TTL)
            .map_or(0, |(token, _)| *token)
    }
}

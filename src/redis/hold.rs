//! Holds of a Redis lock and their release: retried, idempotent, finished in the
//! background when nobody waits for it, and never outlived by renewal.

use std::sync::Arc;
use std::time::Duration;

use redis::ScriptInvocation;
use tokio::time::{Instant, sleep, timeout};
use tokio_util::sync::CancellationToken;

use super::handoff::{Granted, Run};
use super::keys::LockKey;
use super::pool::{CommandError, Conn};
use super::release_call::ReleaseCall;
use super::watchdog::OnLost;
use super::{Inner, UnexpectedReply};
use crate::error::LockError;
use crate::lock::{BoxFuture, HeldLock, Kind, LockGuard, LockOwner, ReleaseHold};
use crate::queue::{Claim, Reentry, Slot};

/// The hash field a hold of `kind` by `owner` is kept under, and registered with the
/// watchdog as: the owner id itself, or `r:` and the id for a shared hold, which lives in
/// the same hash as the owner's exclusive hold (see shared_acquire.lua).
pub(super) fn holder(kind: Kind, owner: &LockOwner) -> LockOwner {
    match kind {
        Kind::Shared => LockOwner::new(format!("r:{}", owner.as_str())),
        Kind::Exclusive | Kind::Permit(_) => owner.clone(),
    }
}

impl Inner {
    /// Builds the guard of a hold that Redis confirmed and starts watching its lease.
    /// `reentry` is set for a re-entry of the key by its holder in this process.
    pub(super) fn guard(
        self: &Arc<Self>,
        key: Arc<LockKey>,
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
        let mut hold = RedisHold::new(
            self.clone(),
            key,
            (holder(kind, store_owner), kind),
            claim.lease,
            slot,
            Some(granted.token),
        );
        hold.run = Run::new(granted);
        hold.reentry = reentry;
        let (lost, generation) = self.watchdog.register(
            hold.key.lock.clone(),
            hold.owner.clone(),
            claim.lease,
            claim.renew,
            granted.sent_at,
            on_lost,
        );
        let renew = claim.renew;
        let held = HeldLock::new(
            hold.key.user.clone(),
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

/// One hold of one lock, and everything needed to give it back.
pub(super) struct RedisHold {
    pub(super) inner: Arc<Inner>,
    pub(super) key: Arc<LockKey>,
    /// The hash field the hold is kept under (see [`holder`]).
    pub(super) owner: LockOwner,
    pub(super) kind: Kind,
    /// Distinguishes this hold from the owner's other holds of the key (see release.lua).
    release_id: String,
    pub(super) lease: Duration,
    /// The key's slot in this backend's queue, when this hold took it (re-entries and
    /// clean-ups do not): releasing passes it, and possibly the lock, to the next task.
    pub(super) slot: Option<Slot>,
    /// Whether a release script of this hold may have run without its reply reaching us.
    may_have_run: bool,
    /// The hold's fencing token, when known: a final release is remembered with it, so that
    /// after a failover the backend can tell this hold, kept by mistake on the new master,
    /// from a newer one (see `replay.rs`). Handoffs in memory keep it: it is the token
    /// Redis knows the hold by.
    pub(super) token: Option<u64>,
    /// The run of holders of this process under this hold.
    pub(super) run: Run,
    /// Set for a re-entry of the key by its holder in this process: counted until dropped.
    pub(super) reentry: Option<Reentry>,
}

impl RedisHold {
    pub(super) fn new(
        inner: Arc<Inner>,
        key: Arc<LockKey>,
        (owner, kind): (LockOwner, Kind),
        lease: Duration,
        slot: Option<Slot>,
        token: Option<u64>,
    ) -> Self {
        let seq = inner.owners.serial();
        RedisHold {
            release_id: format!("{}#{seq}", owner.as_str()),
            inner,
            key,
            owner,
            kind,
            lease,
            slot,
            may_have_run: false,
            run: Run::new(Granted {
                token: token.unwrap_or(0),
                reserved: 0,
                sent_at: Instant::now(),
                continues: None,
            }),
            token,
            reentry: None,
        }
    }

    /// Whether an earlier run of this hold's release script may have freed or handed over
    /// the lock. Always on a cluster: its client sends a call again by itself when the
    /// connection drops before the reply, without telling us, so a final release that
    /// finds the lock gone may be the second run of one that freed it. (A lease that ran
    /// out just before the release is then not reported as `Lost`; the watchdog reports
    /// the losses it finds while the lock is held.)
    fn may_have_run(&self) -> bool {
        self.may_have_run || self.inner.scripts.sharded
    }

    /// The release script for this hold, handing the lock to `successor` if given.
    fn invocation(&self, successor: Option<&Claim>, streak_spent: bool) -> ScriptInvocation<'_> {
        ReleaseCall {
            key: &self.key,
            owner: &self.owner,
            kind: self.kind,
            release_id: &self.release_id,
            lease: self.lease,
            successor,
            streak_spent,
            may_have_run: self.may_have_run(),
            token: None,
            issued: (Some(self.run.last) != self.token).then_some(self.run.last),
            reserve: self.inner.reserve(),
        }
        .invocation(&self.inner.scripts, self.inner.fence_ttl)
    }

    /// Undoes an acquire script whose outcome is unknown. The release goes first on the
    /// connection the acquire script was sent on, so Redis runs it after that script even
    /// if both are still queued (Redis paused); a plain retry on another connection could
    /// find nothing to release, stop, and let the late acquisition stand.
    pub(super) async fn undo(mut self, mut conn: Conn) {
        let invocation = self.invocation(None, false);
        let sent = timeout(
            self.inner.command_timeout,
            conn.invoke::<Vec<i64>>(&invocation),
        );
        // Any reply settles it; without one, the queued release still runs in order.
        if matches!(sent.await, Ok(Ok(_))) {
            return;
        }
        let retry_for = self.lease;
        let _ = self.release_retrying(retry_for).await;
    }

    /// Releases in a spawned task, retrying for up to a lease: after that Redis has freed
    /// the lock by itself.
    pub(super) fn finish_in_background(mut self) {
        let runtime = self.inner.runtime.clone();
        runtime.spawn(async move {
            let lease = self.lease;
            match self.release_retrying(lease).await {
                Ok(()) | Err(LockError::Lost { .. }) => {}
                Err(error) => {
                    let key = &self.key.user;
                    tracing::warn!(
                        %key,
                        error = &error as &(dyn std::error::Error + 'static),
                        "background lock release failed; the lease will free it"
                    );
                }
            }
        });
    }

    /// Runs the release script, retrying transport failures for up to `retry_for`.
    /// A retry is safe: the script recognises a hold it already released or handed over.
    ///
    /// When a task of this backend is queued for the key, the script hands the lock to it
    /// instead of freeing it, unless this process's run of handoffs is used up while other
    /// instances wait. Either way the queued task gets the slot when the hold is dropped.
    pub(super) async fn release_retrying(&mut self, retry_for: Duration) -> Result<(), LockError> {
        let inner = self.inner.clone();
        let successor = self.reserve_successor();
        let streak_spent = self.run_spent();
        let give_up = Instant::now() + retry_for;
        let mut backoff = Duration::from_millis(20);
        let mut changes = inner.pool.topology().changes();
        loop {
            let invocation = self.invocation(successor.as_ref(), streak_spent);
            let sent_at = Instant::now();
            let generation = inner.pool.topology().generation();
            let reply = timeout(
                inner.command_timeout,
                inner.pool.invoke::<Vec<i64>>(&invocation),
            )
            .await;
            let error = match reply {
                Ok(Ok(reply)) => {
                    return self.released(&reply, (sent_at, generation), streak_spent);
                }
                // The key was overwritten with another type: the lock is gone.
                Ok(Err(e)) if e.is_wrong_type() => {
                    return Err(LockError::Lost {
                        key: self.key.user.clone(),
                    });
                }
                Ok(Err(e)) => {
                    let retry = e.is_ambiguous()
                        || e.is_topology_change()
                        || e.is_read_only()
                        || matches!(e, CommandError::Connect(_));
                    self.may_have_run |= e.is_ambiguous();
                    if !retry {
                        return Err(LockError::backend("release", e));
                    }
                    LockError::backend("release", e)
                }
                Err(elapsed) => {
                    self.may_have_run = true;
                    LockError::backend("release", elapsed)
                }
            };
            if Instant::now() + backoff >= give_up {
                return Err(error);
            }
            // A failover announced meanwhile (Sentinel) is worth a retry at once.
            tokio::select! {
                _ = sleep(backoff) => {}
                _ = changes.next() => {}
            }
            backoff = (backoff * 2).min(Duration::from_secs(1));
        }
    }

    /// Picks the queued task this release hands the lock to, if any (idempotent).
    pub(super) fn reserve_successor(&mut self) -> Option<Claim> {
        if self.inner.max_local_handoffs == 0 {
            return None;
        }
        self.slot.as_mut()?.reserve_successor().cloned()
    }

    /// Whether the run of this process's holders under this hold has had its quantum: as
    /// many handoffs as allowed, or as long. Its release then lets other instances in if
    /// they wait.
    pub(super) fn run_spent(&self) -> bool {
        self.run.handoffs >= self.inner.max_local_handoffs
            || self.run.started.elapsed() >= self.inner.max_local_handoff_time
    }

    /// Acts on the release script's reply (see release.lua). The slot, unless it went
    /// along with the lock, is passed on when the hold is dropped.
    fn released(
        &mut self,
        reply: &[i64],
        sent: (Instant, u64),
        run_spent: bool,
    ) -> Result<(), LockError> {
        let (sent_at, generation) = sent;
        // Replays after a failover cover exclusive holds (see replay.rs).
        if let ([2] | [3, _], Some(replays), Some(token), Kind::Exclusive) =
            (reply, &self.inner.replays, self.token, self.kind)
        {
            replays.record(&self.key, token, self.lease, generation);
        }
        match reply {
            [3, token] => {
                let token = u64::try_from(*token)
                    .map_err(|_| LockError::backend("release", UnexpectedReply("release")))?;
                if let Some((successor, slot)) = self.slot.take().and_then(Slot::hand_over) {
                    // A handoff through Redis that did not end the run goes on with it, so
                    // that the run's quantum bounds every kind of handoff.
                    let granted = Granted {
                        token,
                        reserved: token.saturating_add(self.inner.reserve()),
                        sent_at,
                        continues: (!run_spent)
                            .then(|| (self.run.started, self.run.handoffs.saturating_add(1))),
                    };
                    let guard = self.inner.guard(
                        self.key.clone(),
                        (successor.claim.clone(), Kind::Exclusive),
                        granted,
                        Some(slot),
                        None,
                    );
                    successor.hand_over(guard);
                }
                Ok(())
            }
            [2] => {
                if let Some(slot) = self.slot.as_mut() {
                    slot.yield_to_others();
                }
                Ok(())
            }
            [1] => Ok(()),
            // Not held: lost, unless an earlier attempt whose reply was lost did it.
            [0] if self.may_have_run() => Ok(()),
            [0] => Err(LockError::Lost {
                key: self.key.user.clone(),
            }),
            _ => Err(LockError::backend("release", UnexpectedReply("release"))),
        }
    }
}

/// A hold registered with the watchdog: releasing deregisters it first, so renewal never
/// outlives the unlock (Redisson #7272).
pub(super) struct WatchedHold {
    pub(super) hold: RedisHold,
    pub(super) generation: u64,
    /// Whether this hold asked for renewal (see `LockRequest::without_watchdog`).
    pub(super) renew: bool,
    /// Fired by the watchdog when the lock was found lost.
    pub(super) lost: CancellationToken,
}

impl WatchedHold {
    /// Stops renewal; returns the hold if a release is still owed to Redis. A hold known
    /// lost is owed nothing: its owner may hold the key again under a new hold, which a
    /// release of the old one would take away.
    fn stop(self) -> Result<RedisHold, LockError> {
        let hold = self.hold;
        hold.inner
            .watchdog
            .unregister(&hold.key.lock, &hold.owner, self.generation, self.renew);
        if self.lost.is_cancelled() {
            return Err(LockError::Lost {
                key: hold.key.user.clone(),
            });
        }
        Ok(hold)
    }
}

impl ReleaseHold for WatchedHold {
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
        // that could not reach Redis (paused, restarting) happens once it can, instead of
        // leaving the lock to its lease.
        let retry_for = hold.inner.command_timeout.saturating_mul(2);
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

/// A release still owed to Redis: dropped unsettled, it is finished in the background.
struct PendingRelease(Option<RedisHold>);

impl PendingRelease {
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

impl Drop for PendingRelease {
    fn drop(&mut self) {
        if let Some(mut hold) = self.0.take() {
            // Dropped while its script was in flight, the release may have run: the retry
            // must recognise a handoff or a release already done.
            hold.may_have_run = true;
            hold.finish_in_background();
        }
    }
}

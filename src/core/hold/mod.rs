//! One hold in the store, and how it is given back: retried, idempotent, and recognised
//! by the store when a retry follows a lost reply.

pub(crate) mod handoff;
pub(crate) mod release;
#[cfg(any(feature = "etcd", feature = "zookeeper"))]
pub(crate) mod value;

use std::sync::Arc;
use std::time::Duration;

use futures_util::FutureExt;

use tokio::time::{Instant, sleep, timeout};

use super::hold::handoff::{Granted, Run};
use super::kit::backoff::Backoff;
use super::queue::{Claim, Reentry, Slot};
use super::store::{Answers, Calls, Failure, LostHolds, Release, Released, StoreKey};
use super::{Core, Store};
use crate::error::LockError;
use crate::lock::{Kind, LockOwner};

/// How long a release is retried "until the backend shuts down" (see
/// [`Hold::release_left_over`]): the shutdown ends it first.
const UNTIL_SHUTDOWN: Duration = Duration::from_secs(365 * 24 * 3600);

/// One hold of one lock, and everything needed to give it back.
pub(super) struct Hold<S: Store> {
    pub(super) core: Arc<Core<S>>,
    pub(super) key: Arc<S::Key>,
    /// The identity the hold is kept under (see [`holder`](super::holder)).
    pub(super) holder: LockOwner,
    pub(super) kind: Kind,
    /// Distinguishes this hold from the holder's other holds of the key (its re-entries),
    /// so that the store recognises a retry of this release.
    release_id: String,
    pub(super) lease: Duration,
    /// The key's slot in this backend's queue, when this hold took it (re-entries and
    /// clean-ups do not): releasing passes it, and possibly the lock, to the next task.
    pub(super) slot: Option<Slot>,
    /// Whether a release call of this hold may have run without its reply reaching us.
    pub(super) may_have_run: bool,
    /// The hold's fencing token, when known: a final release is remembered with it, so that
    /// after a failover the backend can tell this hold, kept by mistake on the new master,
    /// from a newer one (see `Store::released`). Handoffs in memory keep it: it is the
    /// token the store knows the hold by.
    pub(super) token: Option<u64>,
    /// The run of holders of this process under this hold.
    pub(super) run: Run,
    /// Set for a re-entry of the key by its holder in this process: counted until dropped.
    pub(super) reentry: Option<Reentry>,
    /// Release only the hold of [`token`](Self::token): a hold found lost that the store
    /// may still keep (see [`LostHolds::MayRemain`](super::store::LostHolds::MayRemain)), whose owner may hold the key anew.
    pub(super) only_own_token: bool,
}

impl<S: Store> Hold<S> {
    pub(super) fn new(
        core: Arc<Core<S>>,
        key: Arc<S::Key>,
        (holder, kind): (LockOwner, Kind),
        lease: Duration,
        slot: Option<Slot>,
        token: Option<u64>,
    ) -> Self {
        let seq = core.owners.serial();
        Hold {
            release_id: format!("{}#{seq}", holder.as_str()),
            core,
            key,
            holder,
            kind,
            lease,
            slot,
            may_have_run: false,
            run: Run::new(
                Granted {
                    token: token.unwrap_or(0),
                    reserved: 0,
                    sent_at: Instant::now(),
                    continues: None,
                },
                0,
            ),
            token,
            reentry: None,
            only_own_token: false,
        }
    }

    /// Whether an earlier call of this hold's release may have freed or handed over the
    /// lock. Always with a store that runs calls twice on its own (a cluster client that
    /// sends a call again when the connection drops before the reply, without telling us):
    /// a final release that finds the lock gone may be the second run of one that freed
    /// it. (A lease that ran out just before the release is then not reported as `Lost`;
    /// the watchdog reports the losses it finds while the lock is held.)
    fn may_have_run(&self) -> bool {
        self.may_have_run || self.core.capabilities.calls == Calls::MayRunTwice
    }

    /// The release of this hold, handing the lock to `successor` if given.
    fn release<'a>(&'a self, successor: Option<&'a Claim>, run_spent: bool) -> Release<'a> {
        Release {
            holder: &self.holder,
            kind: self.kind,
            release_id: &self.release_id,
            lease: self.lease,
            successor,
            run_spent,
            may_have_run: self.may_have_run(),
            only_token: self.token.filter(|_| self.only_own_token),
            issued: self.issued(),
            reserve: self.core.reserve(),
            serial: self.core.owners.serial(),
        }
    }

    /// The last token issued in memory under this hold, if holders of this process got it
    /// there after the one that took it in the store.
    fn issued(&self) -> Option<u64> {
        (Some(self.run.last) != self.token).then_some(self.run.last)
    }

    /// Undoes an attempt whose outcome is unknown. The release goes behind the attempt on
    /// what it went out on, so the store runs it after the attempt even if both are still
    /// queued (the store paused); a plain retry on another connection could find nothing
    /// to release, stop, and let the late acquisition stand.
    pub(super) async fn undo(mut self, sent: S::Sent) {
        let release = self.release(None, false);
        let sent = self.core.store.release_after(&self.key, &release, sent);
        // Any reply settles it; without one, the queued release still runs in order.
        if matches!(
            timeout(self.core.settings.command_timeout, sent).await,
            Ok(true)
        ) {
            return;
        }
        let _ = self.release_left_over().await;
    }

    /// Releases a hold that its caller left (a guard dropped, an acquisition nobody
    /// claimed), retrying for a lease, after which the store frees the lock by itself,
    /// or, for a hold that outlives its lease there ([`LostHolds::MayRemain`]), until the
    /// backend shuts down.
    pub(in crate::core) async fn release_left_over(&mut self) -> Result<(), LockError> {
        let retry_for = match self.core.capabilities.lost_holds {
            LostHolds::Gone => self.lease,
            LostHolds::MayRemain => UNTIL_SHUTDOWN,
        };
        self.release_retrying(retry_for).await
    }

    /// Releases in a spawned task, retrying for up to a lease: after that the store has
    /// freed the lock by itself. A hold that outlives its lease in the store (one of the
    /// keys of an etcd lease or ZooKeeper session that lives on for the backend's other
    /// holds) is tried until it is released or the backend shuts down: given up, it would
    /// keep its lock as long as the backend.
    pub(super) fn finish_in_background(mut self) {
        let runtime = self.core.runtime.clone();
        let at_once = self.core.capabilities.answers == Answers::AtOnce;
        let mut finishing = Box::pin(async move {
            match self.release_left_over().await {
                Ok(()) | Err(LockError::Lost { .. }) => {}
                Err(error) => {
                    let key = self.key.user();
                    tracing::warn!(
                        %key,
                        error = &error as &(dyn std::error::Error + 'static),
                        "background lock release failed; the lease will free it"
                    );
                }
            }
        });
        // A store that answers at once is done here, with or without a runtime.
        if at_once && (&mut finishing).now_or_never().is_some() {
            return;
        }
        runtime.spawn(finishing);
    }

    /// Releases, retrying failures that may pass for up to `retry_for`. A retry is safe:
    /// the store recognises a hold it already released or handed over.
    ///
    /// When a task of this backend is queued for the key, the store hands the lock to it
    /// instead of freeing it, unless this process's run of handoffs is used up while other
    /// instances wait. Either way the queued task gets the slot when the hold is dropped.
    pub(super) async fn release_retrying(&mut self, retry_for: Duration) -> Result<(), LockError> {
        let core = self.core.clone();
        let successor = self.reserve_successor();
        let run_spent = self.run_spent();
        let give_up = Instant::now() + retry_for;
        let mut backoff = Backoff::up_to(Duration::from_secs(1));
        let mut takeovers = core.store.takeovers();
        loop {
            let sent_at = Instant::now();
            let generation = takeovers.generation();
            let release = self.release(successor.as_ref(), run_spent);
            let call = core.store.release(&self.key, &release);
            // A store that answers at once needs no timer (none runs outside a runtime).
            let reply = match core.capabilities.answers {
                Answers::AtOnce => Ok(call.await),
                Answers::Later => timeout(core.settings.command_timeout, call).await,
            };
            let error = match reply {
                Ok(Ok(reply)) => {
                    return self.released(reply, (sent_at, generation), run_spent);
                }
                // The key was overwritten with something else: the lock is gone.
                Ok(Err(e)) if e.is_foreign() => {
                    return Err(LockError::Lost {
                        key: self.key.user().to_owned(),
                    });
                }
                Ok(Err(e)) => {
                    let retry = e.may_have_run() || e.is_transient();
                    self.may_have_run |= e.may_have_run();
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
            if Instant::now() + backoff.peek() >= give_up {
                return Err(error);
            }
            // A failover announced meanwhile (Sentinel) is worth a retry at once.
            tokio::select! {
                _ = sleep(backoff.next()) => {}
                _ = takeovers.next() => {}
                () = core.shutdown.cancelled() => return Err(error),
            }
        }
    }

    /// Picks the queued task this release hands the lock to, if any (idempotent).
    pub(super) fn reserve_successor(&mut self) -> Option<Claim> {
        if self.core.settings.max_local_handoffs == 0 {
            return None;
        }
        self.slot.as_mut()?.reserve_successor().cloned()
    }

    /// Whether the run of this process's holders under this hold is over: the reserved
    /// successor queued after the run began (every task queued before it had its turn), or
    /// as many handoffs as allowed, or as long. Its release then lets other instances in if
    /// they wait.
    pub(super) fn run_spent(&self) -> bool {
        let settings = &self.core.settings;
        let served_its_line = self
            .slot
            .as_ref()
            .is_some_and(|slot| slot.successor_queued_since(self.run.line_end));
        served_its_line
            || self.run.handoffs >= settings.max_local_handoffs
            || self.run.started.elapsed() >= settings.max_local_handoff_time
    }

    /// Acts on what the release did. The slot, unless it went along with the lock, is
    /// passed on when the hold is dropped.
    fn released(
        &mut self,
        released: Released,
        (sent_at, generation): (Instant, u64),
        run_spent: bool,
    ) -> Result<(), LockError> {
        if let (Released::Freed | Released::HandedOver(_), Some(token)) = (released, self.token) {
            self.core.store.released(
                &self.key,
                (&self.holder, self.kind),
                token,
                self.lease,
                generation,
            );
        }
        match released {
            Released::HandedOver(token) => {
                if let Some((successor, slot)) = self.slot.take().and_then(Slot::hand_over) {
                    // A handoff through the store that did not end the run goes on with it,
                    // so that the run's quantum bounds every kind of handoff.
                    let granted = Granted {
                        token,
                        reserved: token.saturating_add(self.core.reserve()),
                        sent_at,
                        continues: (!run_spent).then(|| Run {
                            handoffs: self.run.handoffs.saturating_add(1),
                            ..self.run
                        }),
                    };
                    let guard = self.core.guard(
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
            Released::Freed => {
                // The counter stays at the run's reserved block, or goes back to the last
                // token issued in memory (see `release`).
                let fence = self.issued().unwrap_or(self.run.reserved);
                if let Some(slot) = self.slot.as_mut() {
                    slot.yield_to_others(fence);
                }
                Ok(())
            }
            Released::Remains => Ok(()),
            // Not held: lost, unless an earlier call whose reply was lost did it.
            Released::NotHeld if self.may_have_run() => Ok(()),
            Released::NotHeld => Err(LockError::Lost {
                key: self.key.user().to_owned(),
            }),
        }
    }
}

//! One attempt's store call, and a grant's claim, and what happens to their replies when
//! nobody waits for them.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use tokio::time::Instant;

use crate::core::acquire::contender::{Contender, MAYBE_QUEUED, NOT_QUEUED};
use crate::core::hold::Hold;
use crate::core::store::{Attempt, Attempted, Failure, Sent, StoreKey};
use crate::core::watchdog::Due;
use crate::core::{Core, Store, holder};
use crate::lock::{BoxFuture, Kind, LockOwner};

/// One attempt, awaited inline by the acquisition.
///
/// Its reply may find nobody to read it: the acquisition can be cancelled (client gone,
/// an outer timeout) or run out of budget while the store runs the call, or right after
/// the reply arrived. Dropped unfinished, the call is detached into a task that reads the
/// reply and gives back exactly the hold it took, re-entries included, so no lock is left
/// held without a guard for a whole lease.
///
/// A reply that comes when the hold it took has less than a quarter of its lease left
/// (counted, as every hold's, from when the attempt was sent) is not used either: the
/// process was paused, or the store held the call, and the key may have been freed and
/// taken by another holder meanwhile (an etcd lease lapsed while the process was frozen,
/// say). Its hold is given back and the attempt reports the key held, so that the
/// acquisition tries again; a holder never starts past, or at the edge of, its deadline.
pub(in crate::core) struct AcquireCall<S: Store> {
    call: Option<BoxFuture<'static, Sent<S>>>,
    unclaimed: Unclaimed<S>,
    sent_at: Instant,
}

/// What is needed to give back an acquisition nobody claimed.
struct Unclaimed<S: Store> {
    core: Arc<Core<S>>,
    key: Arc<S::Key>,
    /// The identity the hold is kept under (see [`holder`](crate::core::holder)).
    holder: LockOwner,
    lease: Duration,
    kind: Kind,
    /// The owner of the waiting writer the call may register (an exclusive attempt that
    /// waits), withdrawn once a reply nobody waited for is in.
    writer: Option<LockOwner>,
}

impl<S: Store> Clone for Unclaimed<S> {
    fn clone(&self) -> Self {
        Unclaimed {
            core: self.core.clone(),
            key: self.key.clone(),
            holder: self.holder.clone(),
            lease: self.lease,
            kind: self.kind,
            writer: self.writer.clone(),
        }
    }
}

impl<S: Store> AcquireCall<S> {
    pub(in crate::core) fn start(core: &Arc<Core<S>>, c: &Contender<S>, attempt: Attempt) -> Self {
        let waiting_writer = c.kind == Kind::Exclusive && attempt.waits.is_some();
        if waiting_writer {
            // Until a reply says otherwise, this attempt may register as a waiting writer.
            let _ = c.queued_writer.compare_exchange(
                NOT_QUEUED,
                MAYBE_QUEUED,
                Ordering::Relaxed,
                Ordering::Relaxed,
            );
        }
        let unclaimed = Unclaimed {
            core: core.clone(),
            key: c.key.clone(),
            holder: attempt.holder.clone(),
            lease: attempt.lease,
            kind: attempt.kind,
            writer: waiting_writer.then(|| attempt.owner.clone()),
        };
        AcquireCall {
            call: Some(core.store.attempt(&c.key, attempt)),
            unclaimed,
            sent_at: Instant::now(),
        }
    }
}

impl<S: Store> Future for AcquireCall<S> {
    type Output = Result<Attempted, S::Error>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let Some(call) = self.call.as_mut() else {
            unreachable!("an attempt's call is polled after it completed");
        };
        let (reply, sent) = ready!(call.as_mut().poll(cx));
        self.call = None;
        if let Ok(Attempted::Acquired { token, .. }) = &reply {
            let lease = self.unclaimed.lease;
            if Instant::now() + lease / 4 >= self.sent_at + lease {
                let (unclaimed, token) = (self.unclaimed.clone(), *token);
                self.unclaimed.core.runtime.spawn(async move {
                    let _ = unclaimed.hold(Some(token)).release_left_over().await;
                });
                return Poll::Ready(Ok(Attempted::Held {
                    left: Some(Duration::ZERO),
                    queued: false,
                }));
            }
        }
        // No reply (or one that cannot be read): the call may have taken a hold. Its
        // attempt fails, but what it may have taken is given back.
        if let (Err(e), Some(sent)) = (&reply, sent)
            && e.may_have_run()
        {
            let unclaimed = self.unclaimed.clone();
            self.unclaimed.core.runtime.spawn(unclaimed.undo(sent));
        }
        Poll::Ready(reply)
    }
}

impl<S: Store> Drop for AcquireCall<S> {
    fn drop(&mut self) {
        if let Some(call) = self.call.take() {
            let unclaimed = self.unclaimed.clone();
            self.unclaimed
                .core
                .runtime
                .spawn(async move { unclaimed.give_back(call.await).await });
        }
    }
}

/// The claim of a grant (see `grant.rs`), awaited inline by the acquisition.
///
/// As an attempt's call, it may find nobody to read its reply: the acquisition cancelled
/// while the claim was on its way (an outer timeout, the client gone), or its own command
/// timeout. Dropped unfinished, the claim is detached into a task that reads the reply and,
/// when the claim made the grant a hold, releases it: a grant claimed for nobody would
/// otherwise keep the key, with no guard, for a whole lease.
pub(in crate::core) struct ClaimCall<S: Store> {
    call: Option<BoxFuture<'static, Result<bool, S::Error>>>,
    unclaimed: Unclaimed<S>,
    /// The grant's token.
    token: u64,
}

impl<S: Store> ClaimCall<S> {
    /// Claims the grant of `token` to `c` in the store, for `c`'s lease.
    pub(in crate::core) fn start(core: &Arc<Core<S>>, c: &Contender<S>, token: u64) -> Self {
        let holder = holder(c.kind, c.store_owner());
        let due = Due::claim((c.key.lock().clone(), holder.clone()), c.claim.lease);
        let store = core.clone();
        let call = Box::pin(async move {
            let renewed = store.store.renew(std::slice::from_ref(&due)).await?;
            Ok(renewed.first().copied().unwrap_or(false))
        });
        ClaimCall {
            call: Some(call),
            unclaimed: Unclaimed {
                core: core.clone(),
                key: c.key.clone(),
                holder,
                lease: c.claim.lease,
                kind: c.kind,
                writer: None,
            },
            token,
        }
    }
}

impl<S: Store> Future for ClaimCall<S> {
    type Output = Result<bool, S::Error>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let Some(call) = self.call.as_mut() else {
            unreachable!("a claim is polled after it completed");
        };
        let claimed = ready!(call.as_mut().poll(cx));
        self.call = None;
        Poll::Ready(claimed)
    }
}

impl<S: Store> Drop for ClaimCall<S> {
    fn drop(&mut self) {
        if let Some(call) = self.call.take() {
            let (unclaimed, token) = (self.unclaimed.clone(), self.token);
            self.unclaimed.core.runtime.spawn(async move {
                // Not claimed (the grant ran out, or was withdrawn) or no reply: the grant
                // is gone, or goes with its short lease.
                if let Ok(true) = call.await {
                    let _ = unclaimed.hold(Some(token)).release_left_over().await;
                }
            });
        }
    }
}

impl<S: Store> Unclaimed<S> {
    /// The hold the call took, under `token` if its reply said.
    fn hold(&self, token: Option<u64>) -> Hold<S> {
        Hold::new(
            self.core.clone(),
            self.key.clone(),
            (self.holder.clone(), self.kind),
            self.lease,
            None,
            token,
        )
    }

    /// Gives back what a call nobody waited for took: its hold, and the waiting writer it
    /// registered. The acquisition withdrew its writer when it ended, before this reply
    /// came: a writer the call registered after that would keep its place in line, ahead
    /// of every later holder, for as long as the store keeps it (a ZooKeeper node of a
    /// session that lives on).
    async fn give_back(self, (reply, sent): Sent<S>) {
        let queued = match (reply, sent) {
            // Acquired (or re-entered) for an attempt that is gone: release that one hold.
            (Ok(Attempted::Acquired { token, .. }), _) => {
                let _ = self.hold(Some(token)).release_left_over().await;
                return;
            }
            (Ok(Attempted::Held { queued, .. }), _) => queued,
            (Err(e), Some(sent)) if e.may_have_run() => {
                self.clone().undo(sent).await;
                false
            }
            _ => false,
        };
        if let Some(owner) = self.writer {
            // Those known to wait behind it are woken (see `Contender`'s drop).
            self.core
                .store
                .withdraw_writer(&self.key, owner, queued)
                .await;
        }
    }

    /// Undoes a call that may have run without its reply reaching us, behind it on what it
    /// went out on. Not when the holder holds the key already (a re-entry): a release the
    /// call did not need would take the outer hold away.
    async fn undo(self, sent: S::Sent) {
        if !self.core.watchdog.is_held(self.key.lock(), &self.holder) {
            self.hold(None).undo(sent).await;
        }
    }
}

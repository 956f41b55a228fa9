//! One acquire script call, and what happens to its reply when nobody waits for it.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use super::Inner;
use super::acquire::Contender;
use super::hold::RedisHold;
use super::keys::LockKey;
use super::pool::{CommandError, Conn};
use super::watchdog::millis;
use crate::lock::{BoxFuture, Kind, LockOwner};

/// What an acquire script call came back with, and the connection it went out on (none
/// when no connection could be had, so nothing was sent).
type Sent = (Result<Vec<i64>, CommandError>, Option<Conn>);

/// One run of the acquire script, awaited inline by its attempt.
///
/// Its reply may find nobody to read it: the attempt can be cancelled (client gone, an
/// outer timeout) or run out of budget while Redis runs the script, or right after the
/// reply arrived. Dropped unfinished, the call is detached into a task that reads the
/// reply and gives back exactly the hold it took, re-entries included, so no lock is left
/// held without a guard for a whole lease.
pub(super) struct AcquireCall {
    call: Option<BoxFuture<'static, Sent>>,
    unclaimed: Unclaimed,
}

/// What is needed to give back an acquisition nobody claimed.
#[derive(Clone)]
struct Unclaimed {
    inner: Arc<Inner>,
    key: Arc<LockKey>,
    /// The hash field the hold is kept under (see [`holder`](super::hold::holder)).
    owner: LockOwner,
    lease: Duration,
    kind: Kind,
}

impl AcquireCall {
    /// `reserve`: fencing tokens to reserve above a new hold's own; `yielding`: leave a
    /// free key to other instances subscribed to it (see acquire.lua).
    pub(super) fn start(
        inner: &Arc<Inner>,
        c: &Contender,
        (reserve, yielding): (u64, bool),
    ) -> Self {
        let unclaimed = Unclaimed {
            inner: inner.clone(),
            key: c.key.clone(),
            owner: super::hold::holder(c.kind, c.store_owner()),
            lease: c.claim.lease,
            kind: c.kind,
        };
        // What the scripts need to know of the contender besides its claim.
        let real_owner = c.store_owner().clone();
        let writer_wait = c.deadline.map_or(0, |deadline| {
            millis(deadline.saturating_duration_since(tokio::time::Instant::now())).max(1)
        });
        if c.kind == Kind::Exclusive && writer_wait > 0 {
            // Until a reply says otherwise, this attempt may register as a waiting writer.
            let _ = c.queued_writer.compare_exchange(
                super::acquire::NOT_QUEUED,
                super::acquire::MAYBE_QUEUED,
                std::sync::atomic::Ordering::Relaxed,
                std::sync::atomic::Ordering::Relaxed,
            );
        }
        let call = {
            let unclaimed = unclaimed.clone();
            async move {
                let Unclaimed {
                    inner,
                    key,
                    owner,
                    lease,
                    kind,
                } = &unclaimed;
                let mut conn = match inner.pool.connection().await {
                    Ok(conn) => conn,
                    Err(e) => return (Err(e), None),
                };
                // One id per run of the script that this crate sends: a copy that the
                // cluster client sends again after a lost reply carries the same id, and
                // takes no second hold (see acquire.lua).
                let attempt = format!("{}@{}", owner.as_str(), inner.owners.serial());
                let guard = inner.restart_guard.map_or(0, millis);
                let scripts = &inner.scripts;
                let invocation = match *kind {
                    Kind::Exclusive => {
                        let mut invocation = scripts.acquire.key(&*key.lock);
                        invocation
                            .key(&key.fence)
                            .key(key.writers())
                            .arg(owner.as_str())
                            .arg(millis(*lease))
                            .arg(millis(inner.fence_ttl))
                            .arg(guard)
                            .arg(attempt)
                            .arg(writer_wait);
                        if reserve > 0 || yielding {
                            invocation.arg(reserve);
                        }
                        if yielding {
                            invocation
                                .arg(1)
                                .arg(&key.channel)
                                .arg(u8::from(scripts.sharded));
                        }
                        invocation
                    }
                    Kind::Shared => {
                        let mut invocation = scripts.shared_acquire.key(&*key.lock);
                        invocation
                            .key(&key.fence)
                            .key(key.writers())
                            .arg(owner.as_str())
                            .arg(millis(*lease))
                            .arg(guard)
                            .arg(attempt)
                            .arg(real_owner.as_str());
                        invocation
                    }
                    Kind::Permit(permits) => {
                        let mut invocation = scripts.permit_acquire.key(&*key.lock);
                        invocation
                            .key(&key.fence)
                            .arg(owner.as_str())
                            .arg(millis(*lease))
                            .arg(millis(inner.fence_ttl))
                            .arg(guard)
                            .arg(attempt)
                            .arg(permits);
                        invocation
                    }
                };
                let reply = conn.invoke::<Vec<i64>>(&invocation).await;
                match (&reply, inner.sync_replicas) {
                    (Ok(taken), Some(sync)) if is_hold(taken) => {
                        if let Err(e) = sync.wait(&mut conn, &key.lock).await {
                            // Not known to be on enough replicas: given back before the
                            // attempt fails, on the same connection, so it runs first.
                            unclaimed.hold(None).undo(conn).await;
                            return (Err(e), None);
                        }
                        (reply, Some(conn))
                    }
                    _ => (reply, Some(conn)),
                }
            }
        };
        AcquireCall {
            call: Some(Box::pin(call)),
            unclaimed,
        }
    }
}

impl Future for AcquireCall {
    type Output = Result<Vec<i64>, CommandError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let Some(call) = self.call.as_mut() else {
            return Poll::Ready(Err(CommandError::Shutdown));
        };
        let (reply, conn) = ready!(call.as_mut().poll(cx));
        self.call = None;
        match (&reply, conn) {
            // No reply: the script may still run. Its attempt fails, but what it may take
            // is given back.
            (Err(e), Some(conn)) if e.is_ambiguous() => {
                let unclaimed = self.unclaimed.clone();
                self.unclaimed.inner.runtime.spawn(unclaimed.undo(conn));
            }
            // Taken, but the reply cannot be read as a hold (a proxy or server that
            // mangles replies): the attempt fails, so the hold it took is given back.
            (Ok(taken), _) if taken.first() == Some(&1) && !is_hold(taken) => {
                let (unclaimed, taken) = (self.unclaimed.clone(), taken.clone());
                let release = unclaimed.give_back((Ok(taken), None));
                self.unclaimed.inner.runtime.spawn(release);
            }
            _ => {}
        }
        Poll::Ready(reply)
    }
}

/// Whether an acquire reply that starts with 1 is the one the attempt reads as a hold:
/// `[1, token, count]` with a token that is not negative.
fn is_hold(reply: &[i64]) -> bool {
    matches!(reply, [1, token, _count] if *token >= 0)
}

impl Drop for AcquireCall {
    fn drop(&mut self) {
        if let Some(call) = self.call.take() {
            let unclaimed = self.unclaimed.clone();
            self.unclaimed
                .inner
                .runtime
                .spawn(async move { unclaimed.give_back(call.await).await });
        }
    }
}

impl Unclaimed {
    /// The hold the call took, under `token` if its reply said.
    fn hold(&self, token: Option<u64>) -> RedisHold {
        RedisHold::new(
            self.inner.clone(),
            self.key.clone(),
            (self.owner.clone(), self.kind),
            self.lease,
            None,
            token,
        )
    }

    /// Gives back what a call nobody waited for took.
    async fn give_back(self, (reply, conn): Sent) {
        match (reply, conn) {
            // Acquired (or re-entered) for an attempt that is gone: release that one hold.
            (Ok(reply), _) if reply.first() == Some(&1) => {
                let token = reply.get(1).and_then(|t| u64::try_from(*t).ok());
                let _ = self.hold(token).release_retrying(self.lease).await;
            }
            (Err(e), Some(conn)) if e.is_ambiguous() => self.undo(conn).await,
            _ => {}
        }
    }

    /// Undoes a script that may have run without its reply reaching us, on the connection
    /// it was sent on, so Redis runs the undo after it. Not when the owner holds the key
    /// already (a re-entry): a release the script did not need would take the outer hold
    /// away.
    async fn undo(self, conn: Conn) {
        if !self.inner.watchdog.is_held(&self.key.lock, &self.owner) {
            self.hold(None).undo(conn).await;
        }
    }
}

//! A quorum of independent Redis masters (RedLock, see `RedisBackend::quorum`): every call
//! of the core goes to each master's own store (`RedisStore`, the single-server code and
//! scripts), and counts when a majority of the masters agree.
//!
//! - `attempt.rs`: an acquisition on every master at once, granted on a majority within
//!   the lease's validity, partial holds given back at once; `fencing.rs`: the grant's
//!   token, written back to the granting majority.
//! - here: release on every master, renewal confirmed by a majority, a waiter woken by a
//!   release on any master; `operator.rs`: inspect and force-release.

mod attempt;
pub(crate) mod error;
mod fencing;
mod operator;

use std::sync::Arc;
use std::time::Duration;

use futures_util::future::join_all;
use tokio::time::timeout;

use self::error::{MasterFailure, QuorumError};
use super::connection::pool::{CommandError, Conn};
use super::keys::LockKey;
use super::store::RedisStore;
use crate::core::store::{Attempt, Release, Released, Sent, Store};
use crate::core::wakeups::Waiter;
use crate::core::watchdog::Due;
use crate::error::{KeyError, LockError};
use crate::lock::inspect::{LockInfo, Primitive};
use crate::lock::{BoxFuture, Kind, LockOwner};

/// Locks on a quorum of independent Redis masters.
pub(crate) struct QuorumStore {
    /// One store per master, in the order of the URLs (at least three).
    pub(crate) masters: Vec<Arc<RedisStore>>,
    /// The first of them (whose subscriber's state `RedisBackend::stats` shows), whose
    /// settings (namespace, key length, guard, fence TTL) every master shares.
    pub(crate) lead: Arc<RedisStore>,
    /// How long one master may take to answer one call before the quorum decides without
    /// it (half the command timeout: an acquisition makes two calls in a row).
    pub(crate) master_timeout: Duration,
}

impl QuorumStore {
    /// How many masters make a majority.
    pub(crate) fn majority(&self) -> usize {
        self.masters.len() / 2 + 1
    }

    /// Runs `call` on every master at once, each bounded by the time for one master: the
    /// answers, in the masters' order.
    async fn each<'a, T, F>(
        &'a self,
        call: impl Fn(&'a Arc<RedisStore>) -> F,
    ) -> Vec<Result<T, MasterFailure>>
    where
        F: Future<Output = Result<T, CommandError>> + 'a,
    {
        join_all(self.masters.iter().map(|master| {
            let call = call(master);
            async move {
                match timeout(self.master_timeout, call).await {
                    Ok(Ok(answer)) => Ok(answer),
                    Ok(Err(e)) => Err(MasterFailure::Failed(e)),
                    Err(_) => Err(MasterFailure::TimedOut),
                }
            }
        }))
        .await
    }

    /// The answers, when a majority of the masters gave one.
    fn of_majority<T>(
        &self,
        replies: Vec<Result<T, MasterFailure>>,
    ) -> Result<Vec<T>, QuorumError> {
        let mut answers = Vec::with_capacity(replies.len());
        let mut failures = Vec::new();
        for reply in replies {
            match reply {
                Ok(answer) => answers.push(answer),
                Err(failure) => failures.push(failure),
            }
        }
        if answers.len() >= self.majority() && !failures.iter().any(MasterFailure::is_foreign) {
            Ok(answers)
        } else {
            Err(QuorumError::no_majority(
                answers.len(),
                self.masters.len(),
                failures,
            ))
        }
    }
}

impl Store for QuorumStore {
    type Key = LockKey;
    type Error = QuorumError;
    /// What each master's attempt went out on, by the master's index.
    type Sent = Vec<(usize, Conn)>;

    fn key(&self, user: String, kind: Kind) -> Result<LockKey, KeyError> {
        // Every master names a key alike.
        self.lead.key(user, kind)
    }

    fn attempt(
        self: &Arc<Self>,
        key: &Arc<LockKey>,
        attempt: Attempt,
    ) -> BoxFuture<'static, Sent<Self>> {
        Box::pin(self.clone().attempt_all(key.clone(), attempt))
    }

    fn release<'a>(
        &'a self,
        key: &'a LockKey,
        release: &'a Release<'a>,
    ) -> BoxFuture<'a, Result<Released, QuorumError>> {
        Box::pin(async move {
            let replies = self.each(|master| master.release(key, release)).await;
            // Released on every master that answered (a retry is recognised by the others):
            // an outer hold that remains anywhere remains.
            let released = self.of_majority(replies)?;
            Ok(if released.contains(&Released::Remains) {
                Released::Remains
            } else if released.contains(&Released::Freed) {
                Released::Freed
            } else {
                Released::NotHeld
            })
        })
    }

    fn release_after<'a>(
        &'a self,
        key: &'a LockKey,
        release: &'a Release<'a>,
        sent: Vec<(usize, Conn)>,
    ) -> BoxFuture<'a, bool> {
        Box::pin(async move {
            let settled = join_all(sent.into_iter().filter_map(|(i, conn)| {
                let master = self.masters.get(i)?;
                Some(master.release_after(key, release, conn))
            }))
            .await;
            settled.into_iter().all(|answered| answered)
        })
    }

    fn renew<'a>(&'a self, batch: &'a [Due]) -> BoxFuture<'a, Result<Vec<bool>, QuorumError>> {
        Box::pin(async move {
            let replies = self.each(|master| master.renew(batch)).await;
            let renewed = self.of_majority(replies)?;
            // Held where a majority of all the masters still hold it.
            Ok((0..batch.len())
                .map(|i| {
                    let holding = renewed.iter().filter(|r| r.get(i) == Some(&true)).count();
                    holding >= self.majority()
                })
                .collect())
        })
    }

    fn subscribe(&self, key: &LockKey) -> Waiter {
        // A release on any master may free the key on a majority; every master's subscriber
        // wakes all its waiters when it reconnects.
        let rest = self.masters.iter().skip(1).map(|m| m.subscribe(key));
        Waiter::any(self.lead.subscribe(key), rest)
    }

    fn remaining(self: &Arc<Self>, key: &Arc<LockKey>) -> BoxFuture<'static, Option<Duration>> {
        let (store, key) = (self.clone(), key.clone());
        Box::pin(async move {
            let left = store
                .each(|master| {
                    let left = master.remaining(&key);
                    async move { Ok(left.await) }
                })
                .await;
            left.into_iter().filter_map(|l| l.ok().flatten()).max()
        })
    }

    fn withdraw_writer(
        self: &Arc<Self>,
        key: &Arc<LockKey>,
        holder: LockOwner,
        wake: bool,
    ) -> BoxFuture<'static, ()> {
        let withdrawn = self
            .masters
            .iter()
            .map(|master| master.withdraw_writer(key, holder.clone(), wake));
        let withdrawn = join_all(withdrawn.collect::<Vec<_>>());
        Box::pin(async move {
            withdrawn.await;
        })
    }

    fn lease(&self, lease: Duration) -> Duration {
        // Every master has the same restart guard.
        self.lead.lease(lease)
    }

    fn inspect(
        self: &Arc<Self>,
        user: String,
        of: Primitive,
    ) -> BoxFuture<'static, Result<LockInfo, LockError>> {
        Box::pin(self.clone().snapshot(user, of, false))
    }

    fn force_release(
        self: &Arc<Self>,
        user: String,
        of: Primitive,
    ) -> BoxFuture<'static, Result<LockInfo, LockError>> {
        Box::pin(self.clone().snapshot(user, of, true))
    }
}

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
mod records;

use std::collections::HashMap;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use futures_util::future::join_all;
use tokio::time::timeout;

use self::error::{MasterFailure, QuorumError};
use super::connection::pool::{CommandError, Conn};
use super::keys::LockKey;
use super::store::RedisStore;
use crate::core::store::{
    Attempt, Capabilities, HeldPage, Records, Release, Released, Sent, Store,
};
use crate::core::wakeups::Waiter;
use crate::core::watchdog::Due;
use crate::error::LockError;
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
    /// How many masters must keep each permit hold for its renewal to count (see
    /// [`QuorumStore::needed`]): set at its grant, dropped at its release.
    pub(crate) permits: Mutex<HashMap<(Arc<str>, LockOwner), usize>>,
    /// Whether each master (by index) passed the build's checks: one down at build takes
    /// part in acquisitions only once it answers and passes them (see the builder).
    pub(crate) checked: Vec<Arc<AtomicBool>>,
}

impl QuorumStore {
    /// How many masters make a majority.
    pub(crate) fn majority(&self) -> usize {
        majority(self.masters.len())
    }

    /// How many of the `N` masters must grant (and keep) a hold of `kind`. A majority for
    /// a lock or a shared hold: any two majorities share a master, which refuses one of
    /// two writers. Not for a semaphore of `n` permits, whose masters each admit `n`
    /// holders: `n + 1` holders granted by `q` masters each take `(n + 1) * q` places of
    /// the `N * n` there are, so `q` must exceed `N * n / (n + 1)` (seen with a majority:
    /// four holders inside a semaphore of three on five masters).
    pub(crate) fn needed(&self, kind: Kind) -> usize {
        needed(self.masters.len(), kind)
    }

    fn permits(&self) -> MutexGuard<'_, HashMap<(Arc<str>, LockOwner), usize>> {
        // Inserts and removes cannot panic half-way: a poisoned map is consistent.
        self.permits.lock().unwrap_or_else(|e| e.into_inner())
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

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            records: Records::InAttempt,
            // Its masters are single servers, whose calls run once.
            ..Capabilities::default()
        }
    }

    fn key(&self, user: String, kind: Kind) -> Result<LockKey, LockError> {
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
            if matches!(release.kind, Kind::Permit(_)) && !released.contains(&Released::Remains) {
                self.permits()
                    .remove(&(key.lock.clone(), release.holder.clone()));
            }
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
            // Held where as many masters as its grant needed still hold it.
            let permits = self.permits();
            Ok(batch
                .iter()
                .enumerate()
                .map(|(i, due)| {
                    let holding = renewed.iter().filter(|r| r.get(i) == Some(&true)).count();
                    let need = permits.get(&due.key).copied();
                    holding >= need.unwrap_or_else(|| self.majority())
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

    fn held_page(
        self: &Arc<Self>,
        prefix: Arc<str>,
        from: Option<String>,
    ) -> BoxFuture<'static, Result<HeldPage, LockError>> {
        let store = self.clone();
        Box::pin(async move { store.list_page(&prefix, from).await })
    }

    fn force_release(
        self: &Arc<Self>,
        user: String,
        of: Primitive,
    ) -> BoxFuture<'static, Result<LockInfo, LockError>> {
        Box::pin(self.clone().snapshot(user, of, true))
    }
}

/// How many of `masters` make a majority.
pub(crate) fn majority(masters: usize) -> usize {
    masters / 2 + 1
}

/// See [`QuorumStore::needed`].
fn needed(masters: usize, kind: Kind) -> usize {
    match kind {
        Kind::Permit(n) => {
            let n = usize::try_from(n.max(1)).unwrap_or(usize::MAX);
            (masters.saturating_mul(n) / n.saturating_add(1) + 1).min(masters)
        }
        Kind::Exclusive | Kind::Shared => majority(masters),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lock_needs_a_majority_and_a_semaphore_more_as_its_permits_grow() {
        assert_eq!(needed(5, Kind::Exclusive), 3);
        assert_eq!(needed(5, Kind::Shared), 3);
        assert_eq!(needed(5, Kind::Permit(1)), 3);
        assert_eq!(needed(5, Kind::Permit(3)), 4);
        assert_eq!(needed(5, Kind::Permit(100)), 5);
        assert_eq!(needed(3, Kind::Permit(2)), 3);
    }

    #[test]
    fn no_n_plus_one_permit_holders_fit_on_the_masters_places() {
        for masters in 3..=9 {
            for n in 1..=12u32 {
                let q = needed(masters, Kind::Permit(n));
                let n = n as usize;
                assert!(q <= masters);
                // n + 1 holders on q masters each need more places than N masters of n.
                assert!((n + 1) * q > masters * n, "N={masters} n={n} q={q}");
            }
        }
    }
}

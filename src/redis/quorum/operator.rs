//! The operator's calls on a quorum: a snapshot of a key as a majority of the masters hold
//! it, freeing it by force on every master, and the keys held under a prefix.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use futures_util::future::join_all;
use tokio::time::timeout;

use super::QuorumStore;
use super::error::{MasterFailure, QuorumError};
use crate::core::store::{HeldPage, Store};
use crate::error::LockError;
use crate::lock::Kind;
use crate::lock::inspect::{LockInfo, Primitive};

impl QuorumStore {
    /// `user`'s lock or semaphore as a majority of the masters hold it, after freeing it on
    /// every master when `force` (each master fences above its own tokens, announces the
    /// release on its admin channel and wakes its waiters).
    pub(super) async fn snapshot(
        self: Arc<Self>,
        user: String,
        of: Primitive,
        force: bool,
    ) -> Result<LockInfo, LockError> {
        let kind = match of {
            Primitive::Lock => Kind::Exclusive,
            Primitive::Semaphore => Kind::Permit(1),
        };
        // A key no lock may have is refused as an acquisition's is, before any call.
        self.key(user.clone(), kind)?;
        let context = if force { "force release" } else { "inspect" };
        let calls = self.masters.iter().map(|master| {
            let (master, user) = (master.clone(), user.clone());
            let call = async move {
                if force {
                    master.free_by_force(user, of).await
                } else {
                    master.snapshot(user, of).await
                }
            };
            timeout(self.master_timeout, call)
        });
        let infos: Vec<LockInfo> = join_all(calls)
            .await
            .into_iter()
            .filter_map(|reply| reply.ok()?.ok())
            .collect();
        let need = self.majority();
        if infos.len() < need {
            let error = QuorumError::no_majority(infos.len(), self.masters.len(), []);
            return Err(LockError::backend(context, error));
        }
        let token = infos.iter().filter_map(|i| i.fencing_token).max();
        let mut held: Vec<LockInfo> = infos.into_iter().filter(|i| !i.is_free()).collect();
        if held.len() < need {
            return Ok(LockInfo::free(user, token));
        }
        // The lease a majority still has.
        held.sort_by_key(|i| std::cmp::Reverse(i.lease_remaining));
        let mut info = held.swap_remove(need - 1);
        info.fencing_token = token;
        Ok(info)
    }

    /// One page of the keys under `prefix` that may be held (see `Store::held_page`): the
    /// masters' names, read master after master. A key held by the quorum is held on a
    /// majority, so reading every master but fewer than a majority of them meets each
    /// such key; a listing that could not read that many fails. The cursor is the master
    /// being read, how many could not be read, and that master's cursor
    /// (`2 1 17`).
    pub(super) async fn list_page(
        &self,
        prefix: &str,
        from: Option<String>,
    ) -> Result<HeldPage, LockError> {
        let (mut master, mut missed, mut inner) = match from.as_deref().map(cursor) {
            Some(Some(cursor)) => cursor,
            Some(None) => return Err(LockError::backend("list_held", BadCursor)),
            None => (0, 0, None),
        };
        let masters = self.masters.len();
        while let Some(store) = self.masters.get(master) {
            let read = if self.checked[master].load(Ordering::Acquire) {
                match timeout(self.master_timeout, store.list_page(prefix, inner.take())).await {
                    Ok(Ok(page)) => Ok(page),
                    Ok(Err(e)) => Err(MasterFailure::Failed(e)),
                    Err(_) => Err(MasterFailure::TimedOut),
                }
            } else {
                Err(MasterFailure::Unchecked)
            };
            match read {
                Ok(page) => {
                    let next = match page.next {
                        Some(next) => Some(format!("{master} {missed} {next}")),
                        None if master + 1 < masters => Some(format!("{} {missed}", master + 1)),
                        None => None,
                    };
                    return Ok(HeldPage {
                        keys: page.keys,
                        next,
                    });
                }
                Err(failure) => {
                    missed += 1;
                    if missed >= self.majority() {
                        let error = QuorumError::no_majority(masters - missed, masters, [failure]);
                        return Err(LockError::backend("list_held", error));
                    }
                    master += 1;
                }
            }
        }
        Ok(HeldPage::default())
    }
}

/// The master, the masters missed and that master's cursor, of a quorum listing's cursor.
fn cursor(from: &str) -> Option<(usize, usize, Option<String>)> {
    let mut parts = from.splitn(3, ' ');
    let master = parts.next()?.parse().ok()?;
    let missed = parts.next()?.parse().ok()?;
    Some((master, missed, parts.next().map(str::to_owned)))
}

/// A listing's cursor that no page of this backend gave.
#[derive(Debug)]
struct BadCursor;

impl std::fmt::Display for BadCursor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a listing's cursor that no page gave")
    }
}

impl std::error::Error for BadCursor {}

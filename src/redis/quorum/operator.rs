//! The operator's calls on a quorum: a snapshot of a key as a majority of the masters hold
//! it, and freeing it by force on every master.

use std::sync::Arc;

use futures_util::future::join_all;
use tokio::time::timeout;

use super::QuorumStore;
use super::error::QuorumError;
use crate::core::store::Store;
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
}

//! The key an acquisition leaves waiting in line (a writer's behind readers, a permit
//! waiter's), taken out when the acquisition ends without the hold.
//!
//! It goes when the acquisition's names are dropped (`EtcdKey`), which is after every call
//! of the acquisition returned: an attempt detached from a caller that went away still
//! holds them, so a key that attempt puts in line is taken out too, never left to keep
//! others waiting for as long as the backend's lease lives.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use etcd_client::{Compare, CompareOp, Txn, TxnOp};

use super::behind::Behind;
use super::members::Members;
use crate::core::kit::backoff::Backoff;
use crate::core::wakeups::Wakeups;

/// The longest pause before a failed withdrawal is sent again (the store kit's backoff
/// doubles up to it).
const MAX_WITHDRAW_BACKOFF: Duration = Duration::from_secs(1);

/// What an acquisition needs to take its key out of line, and that key.
pub(crate) struct Line {
    members: Arc<Members>,
    pub(crate) behind: Arc<Behind>,
    pub(crate) wakeups: Wakeups,
    /// The key left in line, and its value then (it is deleted only if unchanged).
    left: Mutex<Option<(String, String)>>,
}

impl std::fmt::Debug for Line {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Line").finish_non_exhaustive()
    }
}

impl Line {
    pub(crate) fn new(members: Arc<Members>, behind: Arc<Behind>, wakeups: Wakeups) -> Self {
        Line {
            members,
            behind,
            wakeups,
            left: Mutex::new(None),
        }
    }

    /// An attempt left `key`, holding `value`, waiting in line.
    pub(crate) fn left(&self, key: String, value: String) {
        *self.left.lock().unwrap_or_else(PoisonError::into_inner) = Some((key, value));
    }

    /// An attempt took the hold: nothing of it waits in line any more.
    pub(crate) fn taken(&self) {
        self.left
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
    }

    /// The acquisition ended: its key in line, if any, is deleted (which wakes whoever
    /// waits behind it) in a task of the runtime it is dropped on, sent again until etcd
    /// answers; without a runtime, it goes with the lease.
    pub(crate) fn leave(&mut self) {
        let left = self.left.get_mut().unwrap_or_else(PoisonError::into_inner);
        let Some((key, value)) = left.take() else {
            return;
        };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let members = self.members.clone();
        runtime.spawn(async move {
            // Sent again until etcd answers: the key lives under the backend's lease, which
            // lives as long as the backend, and until it goes everyone behind it waits (an
            // election, a lost connection). Either answer settles it: deleted, or changed
            // since (taken over as a hold, or gone with its lease).
            let mut backoff = Backoff::up_to(MAX_WITHDRAW_BACKOFF);
            loop {
                let withdraw = Txn::new()
                    .when([Compare::value(key.clone(), CompareOp::Equal, value.clone())])
                    .and_then([TxnOp::delete(key.clone(), None)]);
                match members.txn(withdraw).await {
                    Ok(_) => return,
                    Err(e) => {
                        tracing::debug!(%key, error = %e, "etcd: a key waiting in line was not withdrawn; again");
                    }
                }
                tokio::time::sleep(backoff.next()).await;
            }
        });
    }
}

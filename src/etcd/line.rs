//! The key an acquisition leaves waiting in line (a writer's behind readers, a permit
//! waiter's), taken out when the acquisition ends without the hold; and the holder it
//! goes by, with whether a write of it was lost (see `orphans.rs`).
//!
//! It goes when the acquisition's names are dropped (`EtcdKey`), which is after every call
//! of the acquisition returned: an attempt detached from a caller that went away still
//! holds them, so a key that attempt puts in line is taken out too, never left to keep
//! others waiting for as long as the backend's lease lives.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::Duration;

use etcd_client::{Compare, CompareOp, Txn, TxnOp};

use super::behind::Behind;
use super::members::Members;
use super::orphans::Orphans;
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
    orphans: Arc<Orphans>,
    /// The holder the acquisition goes by, from its first attempt.
    holder: OnceLock<String>,
    /// A write of it may have run unanswered.
    lost: AtomicBool,
}

impl std::fmt::Debug for Line {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Line").finish_non_exhaustive()
    }
}

impl Line {
    pub(crate) fn new(
        members: Arc<Members>,
        (behind, wakeups): (Arc<Behind>, Wakeups),
        orphans: Arc<Orphans>,
    ) -> Self {
        Line {
            members,
            behind,
            wakeups,
            left: Mutex::new(None),
            orphans,
            holder: OnceLock::new(),
            lost: AtomicBool::new(false),
        }
    }

    /// An attempt of the acquisition of `name` by `holder` is sent.
    pub(crate) fn attempts(&self, name: &Arc<str>, holder: &str) {
        if self.holder.get().is_none() && self.holder.set(holder.to_owned()).is_ok() {
            self.orphans.began(name, holder);
        }
    }

    /// A write of the acquisition was sent and its answer never came: it may run later.
    pub(crate) fn lost_write(&self) {
        self.lost.store(true, Ordering::Relaxed);
    }

    /// The acquisition of `name`, and its hold if it took one, are over.
    pub(crate) fn ended(&mut self, name: &Arc<str>) {
        if let Some(holder) = self.holder.take() {
            self.orphans.ended(name, holder, *self.lost.get_mut());
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

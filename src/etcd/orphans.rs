//! Keys that a write of an acquisition put after the acquisition was over.
//!
//! A write whose answer never came (its member was cut off, paused, or lost its leader
//! while it held the write) may still be applied later: a member that took it forwards it
//! to the leader once it has one, and etcd commits it then, seconds after the acquisition
//! moved on to another member, took the lock another way or gave up, and returned. Its
//! compares cannot tell: a take that lands while the lock happens to be free puts a hold,
//! a line-up that lands while the key it waits behind is still there puts a key in line.
//! Either key lives under the backend's lease, which lives as long as the backend, and
//! until it goes every acquisition of every instance waits behind it (seen in the Jepsen
//! test after a leader was cut off: one lock served nothing for the rest of the run).
//!
//! So an acquisition that lost the answer of a write says so when it ends (after its hold,
//! if it took one, was released), and for [`HORIZON`] after that the backend looks, every
//! [`TICK`], for a key of the lock that names its holder; one found while no acquisition
//! or hold of this backend goes by that holder is deleted, compared on its revision,
//! which wakes whoever waits behind it. Nothing runs while no write was lost.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use etcd_client::{Compare, CompareOp, KeyValue, Txn, TxnOp};
use tokio::sync::Notify;
use tokio::time::{Instant, sleep};
use tokio_util::sync::CancellationToken;

use super::keys::holders;
use super::members::Members;
use super::store::{found, holder_of, in_order};

/// How long after its acquisition ended a lost write is looked for: far past etcd's own
/// request timeout (7 s with its defaults), after which a member no longer holds a write
/// it was sent, and past any election.
pub(crate) const HORIZON: Duration = Duration::from_secs(60);

/// How often the keys of the lost writes are looked for: a key found is deleted at most
/// this long after it was put.
pub(crate) const TICK: Duration = Duration::from_millis(250);

/// A lock whose `holder` lost the answer of a write, looked at until `until`.
struct Suspect {
    name: Arc<str>,
    holder: String,
    until: Instant,
}

/// The backend's acquisitions by lock and holder, and the lost writes of those that ended.
#[derive(Default)]
pub(crate) struct Orphans {
    /// (lock, holder) -> the acquisitions (or holds) of this backend going by them now: a
    /// re-entry goes by the holder of the hold it enters.
    live: Mutex<HashMap<(Arc<str>, String), usize>>,
    suspects: Mutex<Vec<Suspect>>,
    /// Raised when a suspect is added.
    added: Notify,
}

fn locked<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Orphans {
    /// An acquisition of `name` by `holder` began.
    pub(crate) fn began(&self, name: &Arc<str>, holder: &str) {
        *locked(&self.live)
            .entry((name.clone(), holder.to_owned()))
            .or_default() += 1;
    }

    /// That acquisition, and its hold if it took one, ended; `lost`: a write of it may
    /// have run unanswered.
    pub(crate) fn ended(&self, name: &Arc<str>, holder: String, lost: bool) {
        let id = (name.clone(), holder);
        {
            let mut live = locked(&self.live);
            if let Some(count) = live.get_mut(&id) {
                *count -= 1;
                if *count == 0 {
                    live.remove(&id);
                }
            }
        }
        if lost {
            let (name, holder) = id;
            let until = Instant::now() + HORIZON;
            locked(&self.suspects).push(Suspect {
                name,
                holder,
                until,
            });
            self.added.notify_one();
        }
    }

    fn is_live(&self, name: &Arc<str>, holder: &str) -> bool {
        locked(&self.live).contains_key(&(name.clone(), holder.to_owned()))
    }

    /// The suspects still looked for (those past their horizon are dropped).
    fn current(&self) -> Vec<(Arc<str>, String)> {
        let now = Instant::now();
        let mut suspects = locked(&self.suspects);
        suspects.retain(|s| s.until > now);
        suspects
            .iter()
            .map(|s| (s.name.clone(), s.holder.clone()))
            .collect()
    }

    /// Whether `kv`, a key of the lock `name`, was put by a write of an acquisition of
    /// `holder` that is over.
    fn orphaned(&self, name: &Arc<str>, holder: &str, kv: &KeyValue) -> bool {
        holder_of(kv).as_deref() == Some(holder) && !self.is_live(name, holder)
    }
}

/// Looks for the keys of lost writes while there are any (see the module docs), until
/// `shutdown`.
pub(crate) async fn sweep_until_shutdown(
    orphans: Arc<Orphans>,
    members: Arc<Members>,
    shutdown: CancellationToken,
) {
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = orphans.added.notified() => {}
        }
        loop {
            let suspects = orphans.current();
            if suspects.is_empty() {
                break;
            }
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = sleep(TICK) => {}
            }
            for (name, holder) in suspects {
                if !orphans.is_live(&name, &holder) {
                    sweep(&orphans, &members, &name, &holder).await;
                }
            }
        }
    }
}

/// Deletes the keys of the lock `name` that `holder`'s lost writes put.
async fn sweep(orphans: &Orphans, members: &Members, name: &Arc<str>, holder: &str) {
    let (start, end) = holders(name);
    let read = Txn::new().and_then([TxnOp::get(start, Some(in_order(&end)))]);
    let keys = match members.read(read).await {
        Ok(reply) => found(reply.op_responses()),
        Err(error) => {
            tracing::debug!(%error, lock = %name, "etcd: could not look for keys of lost writes");
            return;
        }
    };
    for kv in keys.iter().flatten() {
        if !orphans.orphaned(name, holder, kv) {
            continue;
        }
        let delete = Txn::new()
            .when([Compare::mod_revision(
                kv.key(),
                CompareOp::Equal,
                kv.mod_revision(),
            )])
            .and_then([TxnOp::delete(kv.key(), None)]);
        match members.txn(delete).await {
            Ok(reply) if reply.succeeded() => tracing::info!(
                lock = %name,
                key = %String::from_utf8_lossy(kv.key()),
                "etcd: deleted a key that a write put after its acquisition ended"
            ),
            Ok(_) => {}
            Err(error) => {
                tracing::debug!(%error, lock = %name, "etcd: could not delete the key of a lost write");
            }
        }
    }
}

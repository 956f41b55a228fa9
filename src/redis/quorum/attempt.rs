//! One acquisition attempt on a quorum: the same script on every master at once, under one
//! holder; granted when a majority granted within the lease's validity (the Redlock
//! algorithm), otherwise every partial hold is given back at once.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use tokio::task::JoinHandle;
use tokio::time::{sleep, timeout_at};

use super::QuorumStore;
use super::error::{MasterFailure, QuorumError};
use crate::core::store::{Attempt, Attempted, Failure, InLine, Sent, Store};
use crate::lock::Kind;
use crate::redis::connection::pool::Conn;
use crate::redis::keys::LockKey;
use crate::redis::store::RedisStore;

/// The clock-drift allowance of a lease (the Redlock paper's): 1% of it plus 2 ms, taken off
/// its validity, as the masters' clocks may run apart by that much while it lasts.
pub(crate) fn drift(lease: Duration) -> Duration {
    lease / 100 + Duration::from_millis(2)
}

/// What the masters answered to one attempt, sorted.
#[derive(Default)]
struct Tally {
    /// (master, token, count) of each grant.
    granted: Vec<(usize, u64, u64)>,
    /// How long each master that refused said the key stays held there.
    held: Vec<Option<Duration>>,
    queued: bool,
    left_to_others: bool,
    upgrade_refused: bool,
    /// A master has the key's idempotency record.
    recorded: bool,
    failures: Vec<MasterFailure>,
    /// What each master's call went out on, by the master's index.
    conns: Vec<(usize, Conn)>,
    /// Masters that did not answer in time: their calls go on, and are given back.
    late: Vec<(usize, JoinHandle<Sent<RedisStore>>)>,
}

impl QuorumStore {
    /// See the module docs.
    pub(super) async fn attempt_all(
        self: Arc<Self>,
        key: Arc<LockKey>,
        attempt: Attempt,
    ) -> Sent<Self> {
        let sent_at = Instant::now();
        let mut tally = self.tally(&key, &attempt).await;
        let need = self.needed(attempt.kind);
        let refused = tally.upgrade_refused || tally.recorded;
        if tally.granted.len() >= need && !refused {
            // Calls still under way may grant too: a hold on more masters than a majority is
            // released and renewed with the others.
            drop(tally.late);
            return match self.grant(&key, &attempt, &tally.granted, sent_at).await {
                Ok(attempted) => {
                    if tally.queued {
                        // Registered as a waiting writer where shared holders kept it out:
                        // it waits no more, and must not keep new shared holds out there.
                        self.withdraw_writer(&key, attempt.holder.clone(), false)
                            .await;
                    }
                    (Ok(attempted), None)
                }
                Err(e) => {
                    let undone = self.undo_all(&key, &attempt, tally.conns).await;
                    (Err(e), Some(undone))
                }
            };
        }
        let split = !tally.granted.is_empty();
        let answered = tally.granted.len() + tally.held.len() + usize::from(tally.left_to_others);
        let answered = answered + usize::from(tally.upgrade_refused);
        let late = std::mem::take(&mut tally.late);
        self.undo_late(&key, &attempt, late);
        let undone = self.undo_all(&key, &attempt, tally.conns).await;
        // Records are stored on a majority, which shares a master with any majority that
        // could grant: one master's record is the key's, whatever the others granted.
        if tally.recorded {
            if attempt.waits.is_some() {
                // The masters that did not find the record may keep this acquisition as a
                // waiting writer (registered by this attempt or an earlier one): it waits no
                // more.
                self.withdraw_writer(&key, attempt.holder.clone(), false)
                    .await;
            }
            return (Ok(Attempted::Recorded), Some(undone));
        }
        if tally.upgrade_refused {
            return (Ok(Attempted::UpgradeRefused), Some(undone));
        }
        if answered < need {
            let error = QuorumError::no_majority(answered, self.masters.len(), tally.failures);
            return (Err(error), Some(undone));
        }
        if split {
            // Contenders that split the masters between them all give back and try again
            // when woken by each other's release: a random delay first, so that one of them
            // goes first (Redlock's retry after a random delay).
            sleep(split_backoff()).await;
        }
        let attempted = if tally.left_to_others {
            Attempted::LeftToOthers
        } else {
            Attempted::Held {
                left: free_on_majority(tally.held, need - tally.granted.len()),
                queued: tally.queued,
            }
        };
        (Ok(attempted), Some(undone))
    }

    /// The attempt on every master, each within the time for one master.
    async fn tally(&self, key: &Arc<LockKey>, attempt: &Attempt) -> Tally {
        let checked = |i: usize| {
            self.checked
                .get(i)
                .is_some_and(|c| c.load(Ordering::Acquire))
        };
        let calls: Vec<_> = (self.masters.iter().enumerate())
            .map(|(i, master)| checked(i).then(|| tokio::spawn(master.attempt(key, copy(attempt)))))
            .collect();
        let deadline = tokio::time::Instant::now() + self.master_timeout;
        let mut tally = Tally::default();
        for (i, call) in calls.into_iter().enumerate() {
            let Some(mut call) = call else {
                tally.failures.push(MasterFailure::Unchecked);
                continue;
            };
            let (reply, conn) = match timeout_at(deadline, &mut call).await {
                Ok(Ok(sent)) => sent,
                // The call's task panicked or was cancelled: nothing to give back.
                Ok(Err(_)) => continue,
                Err(_) => {
                    tally.failures.push(MasterFailure::TimedOut);
                    tally.late.push((i, call));
                    continue;
                }
            };
            let may_have_run = match reply {
                Ok(Attempted::Acquired { token, count }) => {
                    tally.granted.push((i, token, count));
                    true
                }
                Ok(Attempted::Held { left, queued }) => {
                    tally.held.push(left);
                    tally.queued |= queued;
                    false
                }
                Ok(Attempted::LeftToOthers) => {
                    tally.left_to_others = true;
                    false
                }
                Ok(Attempted::UpgradeRefused) => {
                    tally.upgrade_refused = true;
                    false
                }
                Ok(Attempted::Recorded) => {
                    tally.recorded = true;
                    false
                }
                // Only a cluster's scripts refuse an overtaken attempt, and a quorum's
                // masters are single servers: counted as held, to be tried again.
                Ok(Attempted::Overtaken) => {
                    tally.held.push(Some(Duration::ZERO));
                    false
                }
                // A quorum's masters keep no line and make no grants (see `store.rs`).
                Ok(Attempted::Line(InLine::Waiting { left, .. })) => {
                    tally.held.push(left);
                    tally.queued = true;
                    false
                }
                Ok(Attempted::Line(InLine::Granted { left, .. })) => {
                    tally.held.push(Some(left));
                    false
                }
                Err(e) => {
                    let may_have_run = e.may_have_run();
                    tally.failures.push(MasterFailure::Failed(e));
                    may_have_run
                }
            };
            if let (true, Some(conn)) = (may_have_run, conn) {
                tally.conns.push((i, conn));
            }
        }
        tally
    }

    /// The grant a majority gave: its token (written back for a new hold) and count, if
    /// it came within the lease's validity.
    async fn grant(
        &self,
        key: &LockKey,
        attempt: &Attempt,
        granted: &[(usize, u64, u64)],
        sent_at: Instant,
    ) -> Result<Attempted, QuorumError> {
        let (token, count) = token_and_count(granted, self.needed(attempt.kind));
        let mut answered_at = Instant::now();
        if count == 1 && attempt.kind != Kind::Shared {
            let masters: Vec<usize> = granted.iter().map(|g| g.0).collect();
            let holder = (&attempt.holder, attempt.kind);
            let (confirmed, at) = self.write_back(key, holder, token, &masters).await;
            if !confirmed {
                return Err(QuorumError::no_majority(0, self.masters.len(), []));
            }
            answered_at = at;
        }
        let lease = self.lease(attempt.lease);
        let elapsed = answered_at.duration_since(sent_at);
        let validity = lease.saturating_sub(drift(lease));
        if elapsed >= validity {
            return Err(QuorumError::TooSlow { elapsed, validity });
        }
        if count == 1 && matches!(attempt.kind, Kind::Permit(_)) {
            let need = self.needed(attempt.kind);
            self.permits()
                .insert((key.lock.clone(), attempt.holder.clone()), need);
        }
        Ok(Attempted::Acquired { token, count })
    }

    /// Gives back what the attempt may have taken on each of `conns`, on the same
    /// connection; returns those where that failed (the core undoes them behind).
    async fn undo_all(
        &self,
        key: &LockKey,
        attempt: &Attempt,
        conns: Vec<(usize, Conn)>,
    ) -> Vec<(usize, Conn)> {
        let undos = conns.into_iter().filter_map(|(i, conn)| {
            let master = self.masters.get(i)?;
            Some(async move { master.undo(key, attempt, conn).await.err().map(|c| (i, c)) })
        });
        futures_util::future::join_all(undos)
            .await
            .into_iter()
            .flatten()
            .collect()
    }

    /// Gives back, once they answer, what the calls that answered too late took.
    fn undo_late(
        self: &Arc<Self>,
        key: &Arc<LockKey>,
        attempt: &Attempt,
        late: Vec<(usize, JoinHandle<Sent<RedisStore>>)>,
    ) {
        for (i, call) in late {
            let Some(master) = self.masters.get(i).cloned() else {
                continue;
            };
            let (key, attempt) = (key.clone(), copy(attempt));
            tokio::spawn(async move {
                if let Ok((reply, Some(conn))) = call.await {
                    if matches!(reply, Ok(Attempted::Acquired { .. })) || reply.is_err() {
                        // Not settled, or a hold nobody takes: it runs out with its lease
                        // if this fails too.
                        let _ = master.undo(&key, &attempt, conn).await;
                    }
                }
            });
        }
    }
}

/// The token and re-entry count of a grant by `granted` (master, token, count), of which a
/// hold needs `need`. A re-entry of a hold the quorum granted is counted as one on as many
/// masters as that grant needed, and keeps the outer hold's token, which they share. A
/// count above one on fewer masters is not a re-entry: an earlier attempt of this holder
/// took the key there and was never granted (it reached them late, after the holder had
/// moved on, and was not given back yet); the grant is a new hold, whose token must be
/// above every earlier grant's, as only the highest of the whole majority's is. (Taken as
/// a re-entry, its token, issued by those masters before another holder's grant came and
/// went, was below that grant's.)
fn token_and_count(granted: &[(usize, u64, u64)], need: usize) -> (u64, u64) {
    let reentered: Vec<_> = granted.iter().filter(|g| g.2 > 1).collect();
    if reentered.len() >= need {
        let token = reentered.iter().map(|g| g.1).max().unwrap_or_default();
        let count = reentered.iter().map(|g| g.2).max().unwrap_or(1);
        (token, count)
    } else {
        (granted.iter().map(|g| g.1).max().unwrap_or_default(), 1)
    }
}

/// When a majority of the masters will be free: when the `more`-th of those holding the
/// key lets it go (`None`: not known).
fn free_on_majority(mut held: Vec<Option<Duration>>, more: usize) -> Option<Duration> {
    // Unknown ends last.
    held.sort_by_key(|left| left.map_or((1, Duration::ZERO), |l| (0, l)));
    held.get(more.checked_sub(1)?).copied().flatten()
}

/// A random delay of up to 10 ms.
fn split_backoff() -> Duration {
    let random = uuid::Uuid::new_v4().as_u128();
    Duration::from_micros(u64::try_from(random % 10_000).unwrap_or(0))
}

/// The same attempt, for another master.
fn copy(attempt: &Attempt) -> Attempt {
    Attempt {
        holder: attempt.holder.clone(),
        owner: attempt.owner.clone(),
        kind: attempt.kind,
        lease: attempt.lease,
        waits: attempt.waits,
        reserve: attempt.reserve,
        yielding: attempt.yielding,
        record: attempt.record,
        serial: attempt.serial,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_count_above_one_on_a_minority_is_a_new_hold_with_the_highest_token() {
        // Two masters kept a copy of an attempt that came late (token 402), another holder
        // was granted 498 by the other three and released; now all five grant.
        let granted = [
            (0, 402, 2),
            (1, 402, 2),
            (2, 499, 1),
            (3, 500, 1),
            (4, 501, 1),
        ];
        assert_eq!(token_and_count(&granted, 3), (501, 1));
    }

    #[test]
    fn a_re_entry_on_a_majority_keeps_the_outer_token() {
        let granted = [(0, 7, 2), (1, 7, 2), (2, 7, 3), (3, 9, 1)];
        assert_eq!(token_and_count(&granted, 3), (7, 3));
        let fresh = [(0, 7, 1), (1, 8, 1), (2, 6, 1)];
        assert_eq!(token_and_count(&fresh, 3), (8, 1));
    }
}

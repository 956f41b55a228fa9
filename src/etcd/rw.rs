//! The read/write lock's attempts, as etcd's recipe orders them: every key of the lock's
//! directory ordered by create revision and marked a writer's (a hold, or a writer that
//! waits) or a reader's, and whose turn it is decided by the store kit's rule (`turn.rs`):
//! a writer is let in when its key is the lowest, a reader when no writer's key is there (a
//! writer that waits keeps new readers out: writers are not starved). A writer that waits
//! is woken when the key just before its own goes, a reader when the last writer's does;
//! nobody else is (see `behind.rs`).
//!
//! Only a writer that shared holders (or other waiting writers) keep out puts a key to
//! wait with; one that an exclusive holder keeps out waits behind that hold with nothing
//! in etcd, as do readers (see the module docs of `etcd`).

use std::sync::atomic::{AtomicBool, Ordering};

use etcd_client::{Compare, CompareOp, KeyValue, PutOptions, Txn, TxnOp};

use super::error::EtcdError;
use super::keys::{Entry, EtcdKey, fence_key, hold_key, holder_key, holders, writers};
use super::store::{EtcdStore, Round, found, holder_of, in_order, line_of, revision, token};
use crate::core::hold::value::HoldValue;
use crate::core::kit::turn::{Turn, turn};
use crate::core::store::{Attempt, Attempted, Failure};
use crate::lock::Kind;

/// The answer of an attempt that is kept out, `queued` if its key waits in line.
fn held(queued: bool) -> Round {
    Some(Attempted::Held { left: None, queued })
}

/// What the first transaction of an attempt came to.
enum Read {
    /// Taken at once, with this token.
    Taken(u64),
    /// Not taken: the lock's keys, in order, as read at the revision `read_at` (and, for a
    /// shared attempt, the last writer's token).
    Keys {
        keys: Vec<KeyValue>,
        read_at: i64,
        written: u64,
    },
}

/// The write that puts `holder`'s key `key` with a fresh hold value, on the lease `lease`.
fn put_hold(key: &str, holder: &str, lease: i64) -> TxnOp {
    let on_lease = PutOptions::new().with_lease(lease);
    TxnOp::put(key, HoldValue::new(holder).encode(), Some(on_lease))
}

/// What an exclusive attempt needs to settle a write of its own whose answer never came
/// (its member went away): etcd is linearizable, so the next round, on the next member,
/// reads what the write did. A hold key of the holder changed above `seen`, the highest
/// revision answered before the attempt's first write, was put or re-entered by it (only
/// one exclusive attempt per process and lock is ever out, and no other call writes that
/// key): it is the attempt's hold, not one to re-enter again.
struct Settle {
    seen: i64,
    /// A write of the attempt was lost (the attempt goes on for its rounds, within the
    /// command timeout: a leader's election loses every write for a second or so).
    lost: AtomicBool,
}

impl EtcdStore {
    /// The writes that take the lock `name` exclusively for `holder` as `hold` on the lease
    /// `lease`: the hold, and the fence record whose mod revision is then the hold's token.
    fn take_ops(name: &str, hold: &str, holder: &str, lease: i64) -> [TxnOp; 2] {
        let on_lease = Some(PutOptions::new().with_lease(lease));
        [
            put_hold(hold, holder, lease),
            TxnOp::put(fence_key(name), "", on_lease),
        ]
    }

    /// One exclusive attempt: puts this backend's hold if the lock has no key at all, in
    /// one transaction; else reads the lock's keys, re-enters the holder's own hold, or
    /// lets in (or puts) the holder's key waiting in line: a waiting exclusive
    /// acquisition always waits in line, behind the key just before its own, so that
    /// waiting instances take the lock in the order they came (etcd's recipe).
    pub(super) async fn attempt_exclusive(
        &self,
        key: &EtcdKey,
        attempt: &Attempt,
    ) -> Result<Attempted, EtcdError> {
        // The highest revision answered before the attempt's first write: what the
        // attempt's own writes put or changed has a higher one (see `Settle`).
        let settle = Settle {
            seen: self.members.seen(),
            lost: AtomicBool::new(false),
        };
        let settle = &settle;
        self.in_rounds(move |lease| async move {
            let round = async {
                match self.take_if_free(key, attempt, lease).await? {
                    None => Ok(None),
                    Some(Read::Taken(token)) => Ok(Some(Attempted::Acquired { token, count: 1 })),
                    Some(Read::Keys { keys, read_at, .. }) => {
                        self.exclusive_behind(key, attempt, lease, (&keys, read_at), settle)
                            .await
                    }
                }
            };
            match round.await {
                // A write whose answer never came (its member went away): the next round,
                // on the next member, finds what it did.
                Err(e) if e.may_have_run() => {
                    settle.lost.store(true, Ordering::Relaxed);
                    key.lost_write();
                    Ok(None)
                }
                round => round,
            }
        })
        .await
    }

    /// Puts this backend's hold if the lock has no key at all, else reads its keys.
    async fn take_if_free(
        &self,
        key: &EtcdKey,
        attempt: &Attempt,
        lease: i64,
    ) -> Result<Option<Read>, EtcdError> {
        let (holder, name) = (attempt.holder.as_str(), &*key.name);
        let (start, end) = holders(name);
        let take = Txn::new()
            .when([Compare::version(start.clone(), CompareOp::Equal, 0).with_range(end.clone())])
            .and_then(Self::take_ops(name, &hold_key(name, lease), holder, lease))
            .or_else([TxnOp::get(start, Some(in_order(&end)))]);
        let Some(reply) = self.txn_on(lease, take).await? else {
            return Ok(None);
        };
        let read_at = revision(&reply)?;
        if reply.succeeded() {
            // The hold is the transaction's first write: its create revision.
            return Ok(Some(Read::Taken(token(read_at)?)));
        }
        let keys = found(reply.op_responses()).into_iter().flatten().collect();
        Ok(Some(Read::Keys {
            keys,
            read_at,
            written: 0,
        }))
    }

    /// An exclusive attempt that found the lock's `keys` (read at `read_at`): re-enters the
    /// holder's own hold, takes its turn in line, or waits, in line or behind the hold.
    async fn exclusive_behind(
        &self,
        key: &EtcdKey,
        attempt: &Attempt,
        lease: i64,
        (keys, read_at): (&[KeyValue], i64),
        settle: &Settle,
    ) -> Result<Round, EtcdError> {
        let (holder, name) = (attempt.holder.as_str(), &*key.name);
        if keys.is_empty() {
            // Freed between the compare and the read: go again.
            return Ok(None);
        }
        let waiting = holder_key(name, Entry::Queued, lease, holder);
        let queued = keys.iter().position(|kv| kv.key() == waiting.as_bytes());
        let line = line_of(keys);
        let turn = turn(&line, queued.map(|at| &line[at].order), Kind::Exclusive);
        // The key it waits behind, in line (a hold that came from the line is younger than
        // the keys waiting before it took its turn, so this is the key just before its
        // own; the first in line, which only a race leaves behind a younger hold, watches
        // its own key).
        let ahead = match &turn {
            Turn::Waits { behind } => behind[0],
            Turn::Holds => queued.unwrap_or(0),
        };
        let keeps_out = attempt.waits.is_none_or(|w| w.is_zero());
        if let Some(hold) = keys
            .iter()
            .find(|kv| Entry::of(kv.key()) == Some(Entry::Hold))
        {
            if hold.key() == hold_key(name, lease).as_bytes() {
                let value = HoldValue::parse(hold.value()).ok_or(EtcdError::Foreign)?;
                if value.holder == holder {
                    if settle.lost.load(Ordering::Relaxed) && hold.mod_revision() > settle.seen {
                        // Put (a take, a turn) or re-entered by this attempt's lost write.
                        if queued.is_some() {
                            key.out_of_line();
                        }
                        return Ok(Some(Attempted::Acquired {
                            token: token(hold.create_revision())?,
                            count: value.count,
                        }));
                    }
                    return self.reenter_hold(hold, value).await;
                }
            }
            if queued.is_some() {
                self.wait_behind(key, attempt, &keys[ahead], read_at);
                return Ok(held(true));
            }
            if keeps_out {
                self.wait_behind(key, attempt, hold, read_at);
                return Ok(held(false));
            }
            // It waits: in line below, so that waiting instances take the lock in the
            // order they came.
        }
        let reader = format!("r:{holder}");
        if keys.iter().any(|kv| {
            Entry::of(kv.key()) == Some(Entry::Reader) && holder_of(kv) == Some(reader.clone())
        }) {
            return Ok(Some(Attempted::UpgradeRefused));
        }
        match queued {
            Some(at) if turn == Turn::Holds => self.take_turn(key, attempt, lease, &keys[at]).await,
            Some(_) => {
                self.wait_behind(key, attempt, &keys[ahead], read_at);
                Ok(held(true))
            }
            None if keeps_out => Ok(held(false)),
            None => {
                self.line_up(key, attempt, lease, (&keys[ahead], read_at))
                    .await
            }
        }
    }

    /// Re-enters the exclusive hold `hold` of `value`'s holder: its token is the hold's
    /// create revision.
    async fn reenter_hold(&self, hold: &KeyValue, value: HoldValue) -> Result<Round, EtcdError> {
        Ok(match self.reenter(hold, value).await? {
            Some(count) => Some(Attempted::Acquired {
                token: token(hold.create_revision())?,
                count,
            }),
            None => None,
        })
    }

    /// The holder's key `waited`, first in line, takes its turn, if every key is still
    /// younger: the hold goes beside its waiting key, which stays until the release (the
    /// readers behind it wake then).
    async fn take_turn(
        &self,
        key: &EtcdKey,
        attempt: &Attempt,
        lease: i64,
        waited: &KeyValue,
    ) -> Result<Round, EtcdError> {
        let (holder, name) = (attempt.holder.as_str(), &*key.name);
        let (start, end) = holders(name);
        let turn = Txn::new()
            .when([
                Compare::mod_revision(waited.key(), CompareOp::Equal, waited.mod_revision()),
                Compare::create_revision(start, CompareOp::Greater, waited.create_revision() - 1)
                    .with_range(end),
            ])
            .and_then(Self::take_ops(name, &hold_key(name, lease), holder, lease));
        let Some(reply) = self.txn_on(lease, turn).await? else {
            return Ok(None);
        };
        if !reply.succeeded() {
            return Ok(None);
        }
        // Its waiting key is the hold's now: it goes with the release.
        key.out_of_line();
        Ok(Some(Attempted::Acquired {
            token: token(revision(&reply)?)?,
            count: 1,
        }))
    }

    /// Kept out by a holder, shared holders or waiting writers: puts the holder's key in
    /// line behind them, to wait behind `last`, the youngest key read at `read_at`.
    async fn line_up(
        &self,
        key: &EtcdKey,
        attempt: &Attempt,
        lease: i64,
        (last, read_at): (&KeyValue, i64),
    ) -> Result<Round, EtcdError> {
        let holder = attempt.holder.as_str();
        let waiting = holder_key(&key.name, Entry::Queued, lease, holder);
        // Taken out when the acquisition ends, known before it is sent: the reply may not
        // come.
        let value = HoldValue::new(holder).encode();
        key.left_in_line(waiting.clone(), value);
        // Only while `last` is there (keys put behind it since do not matter): a write
        // whose answer never came may still be applied seconds later (held by a member
        // that was paused, say), when this acquisition may have taken the lock another way
        // and given it back; its key would then wait in line, under the backend's lease,
        // with nobody to take its turn, and everyone behind it would wait for good.
        let line_up = Txn::new()
            .when([
                Compare::version(waiting.clone(), CompareOp::Equal, 0),
                Compare::create_revision(last.key(), CompareOp::Equal, last.create_revision()),
            ])
            .and_then([put_hold(&waiting, holder, lease)]);
        let Some(reply) = self.txn_on(lease, line_up).await? else {
            return Ok(None);
        };
        if !reply.succeeded() {
            return Ok(None);
        }
        self.wait_behind(key, attempt, last, read_at);
        Ok(held(true))
    }

    /// One shared attempt: puts the holder's shared key if no writer's key is there, and
    /// reads the fence record (the last writer's token), in one transaction; else reads the
    /// lock's keys and re-enters the holder's own shared hold, or lets a writer take a
    /// shared hold of its own key (a downgrade).
    pub(super) async fn attempt_shared(
        &self,
        key: &EtcdKey,
        attempt: &Attempt,
    ) -> Result<Attempted, EtcdError> {
        self.in_rounds(move |lease| async move {
            let mine = holder_key(&key.name, Entry::Reader, lease, attempt.holder.as_str());
            match self.share_if_no_writer(key, attempt, lease, &mine).await? {
                None => Ok(None),
                Some(Read::Taken(token)) => Ok(Some(Attempted::Acquired { token, count: 1 })),
                Some(Read::Keys {
                    keys,
                    read_at,
                    written,
                }) => {
                    let read = (&keys[..], read_at, written);
                    self.shared_behind(key, attempt, (lease, &mine), read).await
                }
            }
        })
        .await
    }

    /// Puts the holder's shared key `mine` if no writer's key is there, else reads the
    /// lock's keys; and reads the last writer's token (none before the first, or once its
    /// lease ended).
    async fn share_if_no_writer(
        &self,
        key: &EtcdKey,
        attempt: &Attempt,
        lease: i64,
        mine: &str,
    ) -> Result<Option<Read>, EtcdError> {
        let name = &*key.name;
        let ((start, end), (writers_start, writers_end)) = (holders(name), writers(name));
        let fence = || TxnOp::get(fence_key(name), None);
        let take = Txn::new()
            .when([
                Compare::version(writers_start, CompareOp::Equal, 0).with_range(writers_end),
                Compare::version(mine, CompareOp::Equal, 0),
            ])
            .and_then([put_hold(mine, attempt.holder.as_str(), lease), fence()])
            .or_else([TxnOp::get(start, Some(in_order(&end))), fence()]);
        let Some(reply) = self.txn_on(lease, take).await? else {
            return Ok(None);
        };
        let read_at = revision(&reply)?;
        let succeeded = reply.succeeded();
        let mut reads = found(reply.op_responses());
        let written = |fences: Option<&Vec<KeyValue>>| {
            fences
                .and_then(|f| f.first())
                .map_or(Ok(0), |f| token(f.mod_revision()))
        };
        if succeeded {
            return Ok(Some(Read::Taken(written(reads.first())?)));
        }
        let written = written(reads.get(1))?;
        let keys = if reads.is_empty() {
            Vec::new()
        } else {
            reads.swap_remove(0)
        };
        Ok(Some(Read::Keys {
            keys,
            read_at,
            written,
        }))
    }

    /// A shared attempt that found writers' keys among the lock's `keys` (read at
    /// `read_at`, the last writer's token `written`): re-enters the holder's own shared
    /// hold `mine`, downgrades its owner's exclusive hold, or waits behind the last writer.
    async fn shared_behind(
        &self,
        key: &EtcdKey,
        attempt: &Attempt,
        (lease, mine): (i64, &str),
        (keys, read_at, written): (&[KeyValue], i64, u64),
    ) -> Result<Round, EtcdError> {
        if let Some(held) = keys.iter().find(|kv| kv.key() == mine.as_bytes()) {
            let value = HoldValue::parse(held.value()).ok_or(EtcdError::Foreign)?;
            let count = self.reenter(held, value).await?;
            return Ok(count.map(|count| Attempted::Acquired {
                token: written,
                count,
            }));
        }
        let hold = keys
            .iter()
            .find(|kv| Entry::of(kv.key()) == Some(Entry::Hold));
        if let Some(hold) = hold.filter(|h| holder_of(h).as_deref() == Some(attempt.owner.as_str()))
        {
            return self.downgrade(attempt, (lease, mine), hold).await;
        }
        match turn(&line_of(keys), None, Kind::Shared) {
            Turn::Waits { behind } => {
                self.wait_behind(key, attempt, &keys[behind[0]], read_at);
                Ok(held(false))
            }
            // The writers left between the compare and the read: go again.
            Turn::Holds => Ok(None),
        }
    }

    /// The writer itself takes a shared hold `mine` beside its exclusive `hold`: its shared
    /// hold outlives the exclusive one, and carries its token.
    async fn downgrade(
        &self,
        attempt: &Attempt,
        (lease, mine): (i64, &str),
        hold: &KeyValue,
    ) -> Result<Round, EtcdError> {
        let downgrade = Txn::new()
            .when([
                Compare::mod_revision(hold.key(), CompareOp::Equal, hold.mod_revision()),
                Compare::version(mine, CompareOp::Equal, 0),
            ])
            .and_then([put_hold(mine, attempt.holder.as_str(), lease)]);
        let Some(reply) = self.txn_on(lease, downgrade).await? else {
            return Ok(None);
        };
        if !reply.succeeded() {
            return Ok(None);
        }
        Ok(Some(Attempted::Acquired {
            token: token(hold.create_revision())?,
            count: 1,
        }))
    }
}

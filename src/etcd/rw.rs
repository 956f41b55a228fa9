//! The read/write lock's attempts, as etcd's recipe orders them: every key of the lock's
//! directory ordered by create revision and marked a writer's (a hold, or a writer that
//! waits) or a reader's. A writer is let in when its key is the lowest, a reader when no
//! writer's key is there (a writer that waits keeps new readers out: writers are not
//! starved). A writer that waits is woken when the key just before its own goes, a reader
//! when the last writer's does; nobody else is (see `behind.rs`).
//!
//! Only a writer that shared holders (or other waiting writers) keep out puts a key to
//! wait with; one that an exclusive holder keeps out waits behind that hold with nothing
//! in etcd, as do readers (see the module docs of `etcd`).

use etcd_client::{Compare, CompareOp, KeyValue, PutOptions, Txn, TxnOp};

use super::error::EtcdError;
use super::keys::{Entry, EtcdKey, fence_key, hold_key, holder_key, holders, writers};
use super::store::{EtcdStore, ROUNDS, found, holder_of, in_order, revision, token};
use crate::core::hold::value::HoldValue;
use crate::core::store::{Attempt, Attempted};

impl EtcdStore {
    /// The writes that take the lock `name` exclusively for `holder` as `hold` on the lease
    /// `lease`: the hold, and the fence record whose mod revision is then the hold's token.
    fn take_ops(name: &str, hold: &str, holder: &str, lease: i64) -> [TxnOp; 2] {
        let on_lease = || Some(PutOptions::new().with_lease(lease));
        [
            TxnOp::put(hold, HoldValue::new(holder).encode(), on_lease()),
            TxnOp::put(fence_key(name), "", on_lease()),
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
        let (holder, name) = (attempt.holder.as_str(), &*key.name);
        let (start, end) = holders(name);
        let held = Attempted::Held {
            left: None,
            queued: false,
        };
        for _ in 0..ROUNDS {
            let lease = self.lease.for_hold().await?;
            let mine = hold_key(name, lease);
            let take =
                Txn::new()
                    .when([Compare::version(start.clone(), CompareOp::Equal, 0)
                        .with_range(end.clone())])
                    .and_then(Self::take_ops(name, &mine, holder, lease))
                    .or_else([TxnOp::get(start.clone(), Some(in_order(&end)))]);
            let Some(reply) = self.txn_on(lease, take).await? else {
                continue;
            };
            let read_at = revision(&reply)?;
            if reply.succeeded() {
                // The hold is the transaction's first write: its create revision.
                return Ok(Attempted::Acquired {
                    token: token(read_at)?,
                    count: 1,
                });
            }
            let keys: Vec<KeyValue> = found(reply.op_responses()).into_iter().flatten().collect();
            let Some(first) = keys.first() else {
                // Freed between the compare and the read: go again.
                continue;
            };
            let waiting = holder_key(name, Entry::Queued, lease, holder);
            let queued = keys.iter().position(|kv| kv.key() == waiting.as_bytes());
            let behind = |at: usize| &keys[at.saturating_sub(1)];
            if let Some(hold) = keys
                .iter()
                .find(|kv| Entry::of(kv.key()) == Some(Entry::Hold))
            {
                if hold.key() == mine.as_bytes() {
                    let value = HoldValue::parse(hold.value()).ok_or(EtcdError::Foreign)?;
                    if value.holder == holder {
                        match self.reenter(hold, value).await? {
                            Some(count) => {
                                let token = token(hold.create_revision())?;
                                return Ok(Attempted::Acquired { token, count });
                            }
                            None => continue,
                        }
                    }
                }
                if let Some(at) = queued {
                    // In line: behind the key just before its own (a hold that came from
                    // the line is younger than the keys waiting before it took its turn).
                    self.wait_behind(key, attempt, behind(at), read_at);
                    return Ok(Attempted::Held {
                        left: None,
                        queued: true,
                    });
                }
                if attempt.waits.is_none_or(|w| w.is_zero()) {
                    self.wait_behind(key, attempt, hold, read_at);
                    return Ok(held);
                }
                // It waits: in line below, so that waiting instances take the lock in the
                // order they came.
            }
            let reader = format!("r:{holder}");
            if keys.iter().any(|kv| {
                Entry::of(kv.key()) == Some(Entry::Reader) && holder_of(kv) == Some(reader.clone())
            }) {
                return Ok(Attempted::UpgradeRefused);
            }
            if let Some(at) = queued {
                let waited = &keys[at];
                if waited.create_revision() != first.create_revision() {
                    self.wait_behind(key, attempt, behind(at), read_at);
                    return Ok(Attempted::Held {
                        left: None,
                        queued: true,
                    });
                }
                // Its turn, if every key is still younger: the hold goes beside its waiting
                // key, which stays until the release (the readers behind it wake then).
                let turn = Txn::new()
                    .when([
                        Compare::mod_revision(
                            waiting.clone(),
                            CompareOp::Equal,
                            waited.mod_revision(),
                        ),
                        Compare::create_revision(
                            start.clone(),
                            CompareOp::Greater,
                            waited.create_revision() - 1,
                        )
                        .with_range(end.clone()),
                    ])
                    .and_then(Self::take_ops(name, &mine, holder, lease));
                let Some(reply) = self.txn_on(lease, turn).await? else {
                    continue;
                };
                if reply.succeeded() {
                    // Its waiting key is the hold's now: it goes with the release.
                    key.out_of_line();
                    return Ok(Attempted::Acquired {
                        token: token(revision(&reply)?)?,
                        count: 1,
                    });
                }
                continue;
            }
            if attempt.waits.is_none_or(|w| w.is_zero()) {
                return Ok(held);
            }
            // Kept out by a holder, shared holders or waiting writers: in line behind them
            // (taken out when the acquisition ends, known before it is sent: the reply may
            // not come).
            let value = HoldValue::new(holder).encode();
            key.left_in_line(waiting.clone(), value.clone());
            let line_up = Txn::new()
                .when([Compare::version(waiting.clone(), CompareOp::Equal, 0)])
                .and_then([TxnOp::put(
                    waiting,
                    value,
                    Some(PutOptions::new().with_lease(lease)),
                )]);
            let Some(reply) = self.txn_on(lease, line_up).await? else {
                continue;
            };
            if !reply.succeeded() {
                continue;
            }
            // Every key read came before its own: it waits behind the youngest.
            let last = keys.last().unwrap_or(first);
            self.wait_behind(key, attempt, last, read_at);
            return Ok(Attempted::Held {
                left: None,
                queued: true,
            });
        }
        Err(EtcdError::Contended)
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
        let (holder, name) = (attempt.holder.as_str(), &*key.name);
        let ((start, end), (writers_start, writers_end)) = (holders(name), writers(name));
        let fence = || TxnOp::get(fence_key(name), None);
        // The last writer's token: none before the first (or once its lease ended).
        let written = |fences: Option<&Vec<KeyValue>>| {
            fences
                .and_then(|f| f.first())
                .map_or(Ok(0), |f| token(f.mod_revision()))
        };
        for _ in 0..ROUNDS {
            let lease = self.lease.for_hold().await?;
            let mine = holder_key(name, Entry::Reader, lease, holder);
            let put = || {
                let on_lease = PutOptions::new().with_lease(lease);
                TxnOp::put(
                    mine.clone(),
                    HoldValue::new(holder).encode(),
                    Some(on_lease),
                )
            };
            let fresh = || Compare::version(mine.clone(), CompareOp::Equal, 0);
            let take = Txn::new()
                .when([
                    Compare::version(writers_start.clone(), CompareOp::Equal, 0)
                        .with_range(writers_end.clone()),
                    fresh(),
                ])
                .and_then([put(), fence()])
                .or_else([TxnOp::get(start.clone(), Some(in_order(&end))), fence()]);
            let Some(reply) = self.txn_on(lease, take).await? else {
                continue;
            };
            let read_at = revision(&reply)?;
            let succeeded = reply.succeeded();
            let mut reads = found(reply.op_responses());
            if succeeded {
                let token = written(reads.first())?;
                return Ok(Attempted::Acquired { token, count: 1 });
            }
            let last_written = written(reads.get(1))?;
            let keys = if reads.is_empty() {
                Vec::new()
            } else {
                reads.swap_remove(0)
            };
            if let Some(held) = keys.iter().find(|kv| kv.key() == mine.as_bytes()) {
                let value = HoldValue::parse(held.value()).ok_or(EtcdError::Foreign)?;
                match self.reenter(held, value).await? {
                    Some(count) => {
                        let token = last_written;
                        return Ok(Attempted::Acquired { token, count });
                    }
                    None => continue,
                }
            }
            let hold = keys
                .iter()
                .find(|kv| Entry::of(kv.key()) == Some(Entry::Hold));
            if let Some(hold) =
                hold.filter(|h| holder_of(h).as_deref() == Some(attempt.owner.as_str()))
            {
                // The writer itself: its shared hold outlives the exclusive one.
                let downgrade = Txn::new()
                    .when([
                        Compare::mod_revision(
                            hold.key().to_vec(),
                            CompareOp::Equal,
                            hold.mod_revision(),
                        ),
                        fresh(),
                    ])
                    .and_then([put()]);
                let Some(reply) = self.txn_on(lease, downgrade).await? else {
                    continue;
                };
                if reply.succeeded() {
                    let token = token(hold.create_revision())?;
                    return Ok(Attempted::Acquired { token, count: 1 });
                }
                continue;
            }
            let writer = keys
                .iter()
                .rev()
                .find(|kv| Entry::of(kv.key()).is_some_and(Entry::is_writer));
            let Some(writer) = writer else {
                // The writers left between the compare and the read: go again.
                continue;
            };
            self.wait_behind(key, attempt, writer, read_at);
            return Ok(Attempted::Held {
                left: None,
                queued: false,
            });
        }
        Err(EtcdError::Contended)
    }
}

//! A semaphore's attempts, as etcd's recipe orders them: every permit (and every holder
//! waiting for one) a key in the semaphore's directory, ordered by create revision; a
//! holder is let in while fewer than `n` keys came before its own (`n` is the caller's,
//! read at every attempt, as on the other stores). A holder that waits keeps its key, with
//! a count of 0, and its place in line; a permit's deletion wakes the first of each
//! backend's waiters in line (see `behind.rs`).

use etcd_client::{Compare, CompareOp, GetOptions, PutOptions, SortOrder, SortTarget, Txn, TxnOp};

use super::error::EtcdError;
use super::keys::{Entry, EtcdKey, holder_key, permits};
use super::store::{EtcdStore, ROUNDS, found, revision, token};
use crate::core::hold::value::HoldValue;
use crate::core::store::{Attempt, Attempted};

impl EtcdStore {
    /// One attempt at one of `n` permits: puts the holder's key and reads the `n` oldest
    /// keys, in one transaction (or reads its key if it has one): in when its key is among
    /// them. Out, it keeps its key to wait in line (count 0), or takes it back.
    pub(super) async fn attempt_permit(
        &self,
        key: &EtcdKey,
        attempt: &Attempt,
        n: u32,
    ) -> Result<Attempted, EtcdError> {
        let (holder, name) = (attempt.holder.as_str(), &*key.name);
        let (start, end) = permits(name);
        // An acquisition that may still wait keeps its place in line.
        let waits = attempt.waits.is_some_and(|w| !w.is_zero());
        let oldest = || {
            let options = GetOptions::new()
                .with_range(end.clone())
                .with_sort(SortTarget::Create, SortOrder::Ascend)
                .with_limit(i64::from(n));
            TxnOp::get(start.clone(), Some(options))
        };
        for _ in 0..ROUNDS {
            let lease = self.lease.for_hold().await?;
            let mine = holder_key(name, Entry::Permit, lease, holder);
            let on_lease = || Some(PutOptions::new().with_lease(lease));
            let take = Txn::new()
                .when([Compare::version(mine.clone(), CompareOp::Equal, 0)])
                .and_then([
                    TxnOp::put(mine.clone(), HoldValue::new(holder).encode(), on_lease()),
                    oldest(),
                ])
                .or_else([TxnOp::get(mine.clone(), None), oldest()]);
            let Some(reply) = self.txn_on(lease, take).await? else {
                continue;
            };
            let read_at = revision(&reply)?;
            let succeeded = reply.succeeded();
            let mut reads = found(reply.op_responses()).into_iter();
            let (own, first_n) = if succeeded {
                (None, reads.next().unwrap_or_default())
            } else {
                let own = reads.next().and_then(|kvs| kvs.into_iter().next());
                (own, reads.next().unwrap_or_default())
            };
            let within = first_n.iter().any(|kv| kv.key() == mine.as_bytes());
            let in_line = Attempted::Held {
                left: None,
                queued: waits,
            };
            let Some(own) = own else {
                if !succeeded {
                    // Given back between the compare and the read: go again.
                    continue;
                }
                if within {
                    // Its key is the transaction's put: its create revision.
                    let token = token(read_at)?;
                    return Ok(Attempted::Acquired { token, count: 1 });
                }
                // All taken: in line (count 0), or the key taken back.
                let mut waiting = HoldValue::new(holder);
                waiting.count = 0;
                let op = if waits {
                    // Taken out when the acquisition ends (known before it is sent).
                    key.left_in_line(mine.clone(), waiting.encode());
                    TxnOp::put(mine.clone(), waiting.encode(), on_lease())
                } else {
                    TxnOp::delete(mine.clone(), None)
                };
                let settle = Txn::new()
                    .when([Compare::create_revision(
                        mine.clone(),
                        CompareOp::Equal,
                        read_at,
                    )])
                    .and_then([op]);
                if self.txn_on(lease, settle).await?.is_none() {
                    // Its lease is gone, and the key with it.
                    continue;
                }
                if waits {
                    self.wait_for_permit(key, read_at, read_at);
                }
                return Ok(in_line);
            };
            let mut value = HoldValue::parse(own.value()).ok_or(EtcdError::Foreign)?;
            if value.count > 0 {
                match self.reenter(&own, value).await? {
                    Some(count) => {
                        let token = token(own.create_revision())?;
                        return Ok(Attempted::Acquired { token, count });
                    }
                    None => continue,
                }
            }
            if !within {
                if waits {
                    self.wait_for_permit(key, own.create_revision(), read_at);
                }
                return Ok(in_line);
            }
            // Its turn in line: the waiting key becomes the permit.
            value.count = 1;
            let turn = Txn::new()
                .when([Compare::mod_revision(
                    mine.clone(),
                    CompareOp::Equal,
                    own.mod_revision(),
                )])
                .and_then([TxnOp::put(mine.clone(), value.encode(), on_lease())]);
            let Some(reply) = self.txn_on(lease, turn).await? else {
                continue;
            };
            if reply.succeeded() {
                key.out_of_line();
                let token = token(own.create_revision())?;
                return Ok(Attempted::Acquired { token, count: 1 });
            }
        }
        Err(EtcdError::Contended)
    }

    /// The acquisition, whose key in line was created at `place`, waits for a permit of its
    /// semaphore, all taken at `read_at`.
    fn wait_for_permit(&self, key: &EtcdKey, place: i64, read_at: i64) {
        let wakeups = self.listener.wakeups();
        let behind = self.listener.behind();
        behind.permit(wakeups, &key.channel, (&key.name, place), read_at);
    }
}

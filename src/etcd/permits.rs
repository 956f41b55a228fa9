//! A semaphore's attempts, as etcd's recipe orders them: every permit (and every holder
//! waiting for one) a key in the semaphore's directory, ordered by create revision; a
//! holder is let in while fewer than `n` keys came before its own (the store kit's rule,
//! `turn.rs`; `n` is the caller's, read at every attempt, as on the other stores). A
//! holder that waits keeps its key, with a count of 0, and its place in line; a permit's
//! deletion wakes the first of each backend's waiters in line (see `behind.rs`).

use etcd_client::{
    Compare, CompareOp, GetOptions, KeyValue, PutOptions, SortOrder, SortTarget, Txn, TxnOp,
};

use super::error::EtcdError;
use super::keys::{Entry, EtcdKey, holder_key, permits};
use super::store::{EtcdStore, Round, found, line_of, revision, token};
use crate::core::hold::value::HoldValue;
use crate::core::kit::turn::{Turn, turn};
use crate::core::store::{Attempt, Attempted};
use crate::lock::Kind;

/// What the first transaction of a permit attempt read, at the revision `read_at`.
struct Read {
    read_at: i64,
    /// It put the holder's key (which was not there).
    put: bool,
    /// The holder's key, if it was there already.
    own: Option<KeyValue>,
    /// Whether the holder's key is among the `n` oldest.
    within: bool,
}

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
        self.in_rounds(move |lease| async move {
            let mine = holder_key(&key.name, Entry::Permit, lease, attempt.holder.as_str());
            let Some(read) = self.put_and_read(key, attempt, (lease, &mine), n).await? else {
                return Ok(None);
            };
            match &read.own {
                Some(own) => {
                    self.own_permit(key, attempt, (lease, &mine), own, &read)
                        .await
                }
                None if read.put => self.new_permit(key, attempt, (lease, &mine), &read).await,
                // Given back between the compare and the read: go again.
                None => Ok(None),
            }
        })
        .await
    }

    /// Puts the holder's key `mine` if it is not there (else reads it), and reads the `n`
    /// oldest keys of the semaphore, in one transaction.
    async fn put_and_read(
        &self,
        key: &EtcdKey,
        attempt: &Attempt,
        (lease, mine): (i64, &str),
        n: u32,
    ) -> Result<Option<Read>, EtcdError> {
        let (start, end) = permits(&key.name);
        let oldest = || {
            let options = GetOptions::new()
                .with_range(end.clone())
                .with_sort(SortTarget::Create, SortOrder::Ascend)
                .with_limit(i64::from(n));
            TxnOp::get(start.clone(), Some(options))
        };
        let on_lease = Some(PutOptions::new().with_lease(lease));
        let value = HoldValue::new(attempt.holder.as_str()).encode();
        let take = Txn::new()
            .when([Compare::version(mine, CompareOp::Equal, 0)])
            .and_then([TxnOp::put(mine, value, on_lease), oldest()])
            .or_else([TxnOp::get(mine, None), oldest()]);
        let Some(reply) = self.txn_on(lease, take).await? else {
            return Ok(None);
        };
        let read_at = revision(&reply)?;
        let put = reply.succeeded();
        let mut reads = found(reply.op_responses()).into_iter();
        let own = if put {
            None
        } else {
            reads.next().and_then(|kvs| kvs.into_iter().next())
        };
        let first_n = reads.next().unwrap_or_default();
        // Its key is the transaction's put (created at its revision), or the one it read.
        let place = own.as_ref().map_or(read_at, KeyValue::create_revision);
        let within = turn(&line_of(&first_n), Some(&place), Kind::Permit(n)) == Turn::Holds;
        Ok(Some(Read {
            read_at,
            put,
            own,
            within,
        }))
    }

    /// The holder's key `mine` was put by this attempt: a permit if it is within, else in
    /// line (count 0) if the acquisition waits, or taken back.
    async fn new_permit(
        &self,
        key: &EtcdKey,
        attempt: &Attempt,
        (lease, mine): (i64, &str),
        read: &Read,
    ) -> Result<Round, EtcdError> {
        let read_at = read.read_at;
        if read.within {
            // Its key is the transaction's put: its create revision.
            let token = token(read_at)?;
            return Ok(Some(Attempted::Acquired { token, count: 1 }));
        }
        // All taken: in line (count 0), or the key taken back.
        let waits = waits(attempt);
        let mut waiting = HoldValue::new(attempt.holder.as_str());
        waiting.count = 0;
        let op = if waits {
            // Taken out when the acquisition ends (known before it is sent).
            key.left_in_line(mine.to_owned(), waiting.encode());
            TxnOp::put(
                mine,
                waiting.encode(),
                Some(PutOptions::new().with_lease(lease)),
            )
        } else {
            TxnOp::delete(mine, None)
        };
        let settle = Txn::new()
            .when([Compare::create_revision(mine, CompareOp::Equal, read_at)])
            .and_then([op]);
        if self.txn_on(lease, settle).await?.is_none() {
            // Its lease is gone, and the key with it.
            return Ok(None);
        }
        if waits {
            self.wait_for_permit(key, read_at, read_at);
        }
        Ok(in_line(waits))
    }

    /// The holder's key `own` was there: a permit re-entered, or a key in line that is in
    /// now (it becomes the permit), or waits on.
    async fn own_permit(
        &self,
        key: &EtcdKey,
        attempt: &Attempt,
        (lease, mine): (i64, &str),
        own: &KeyValue,
        read: &Read,
    ) -> Result<Round, EtcdError> {
        let mut value = HoldValue::parse(own.value()).ok_or(EtcdError::Foreign)?;
        if value.count > 0 {
            let Some(count) = self.reenter(own, value).await? else {
                return Ok(None);
            };
            let token = token(own.create_revision())?;
            return Ok(Some(Attempted::Acquired { token, count }));
        }
        let waits = waits(attempt);
        if !read.within {
            if waits {
                self.wait_for_permit(key, own.create_revision(), read.read_at);
            }
            return Ok(in_line(waits));
        }
        // Its turn in line: the waiting key becomes the permit.
        value.count = 1;
        let on_lease = Some(PutOptions::new().with_lease(lease));
        let turn = Txn::new()
            .when([Compare::mod_revision(
                mine,
                CompareOp::Equal,
                own.mod_revision(),
            )])
            .and_then([TxnOp::put(mine, value.encode(), on_lease)]);
        let Some(reply) = self.txn_on(lease, turn).await? else {
            return Ok(None);
        };
        if !reply.succeeded() {
            return Ok(None);
        }
        key.out_of_line();
        let token = token(own.create_revision())?;
        Ok(Some(Attempted::Acquired { token, count: 1 }))
    }

    /// The acquisition, whose key in line was created at `place`, waits for a permit of its
    /// semaphore, all taken at `read_at`.
    fn wait_for_permit(&self, key: &EtcdKey, place: i64, read_at: i64) {
        let wakeups = self.listener.wakeups();
        let behind = self.listener.behind();
        behind.permit(wakeups, &key.channel, (&key.name, place), read_at);
    }
}

/// An acquisition that may still wait keeps its place in line.
fn waits(attempt: &Attempt) -> bool {
    attempt.waits.is_some_and(|w| !w.is_zero())
}

/// The answer of an attempt kept out: in line if it waits.
fn in_line(waits: bool) -> Round {
    Some(Attempted::Held {
        left: None,
        queued: waits,
    })
}

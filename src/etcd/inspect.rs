//! Operators' calls on the etcd store: a snapshot of a lock or a semaphore, freeing it
//! whatever holds it, and a page of the keys held under a prefix.

use etcd_client::{GetOptions, KeyValue, Txn, TxnOp};

use super::error::EtcdError;
use super::keys::{Entry, EtcdKey, fence_key, hold_of, holders, permits, under};
use super::store::{EtcdStore, found, in_order, token};
use crate::core::hold::value::HoldValue;
use crate::core::store::{HeldPage, StoreKey};
use crate::error::LockError;
use crate::lock::inspect::{LockInfo, LockMode, Primitive};

/// The keys one page of a listing reads: a range read of this many keys, without their
/// values, is a reply of some tens of KiB with keys of the default length.
const HELD_PAGE: i64 = 500;

impl EtcdStore {
    /// A snapshot of `user`'s lock (or semaphore); with `free`, its holds deleted (waiting
    /// writers and permits still in line stay: they still wait). One read, and one
    /// transaction to free.
    pub(super) async fn snapshot(
        &self,
        user: String,
        of: Primitive,
        free: bool,
    ) -> Result<LockInfo, LockError> {
        let context = if free { "force_release" } else { "inspect" };
        let fail = |e: EtcdError| LockError::backend(context, e);
        let semaphore = of == Primitive::Semaphore;
        let key = EtcdKey::new(&self.namespace, user, self.max_key_len, semaphore, 0)?;
        let (start, end) = if semaphore {
            permits(&key.name)
        } else {
            holders(&key.name)
        };
        let read = Txn::new().and_then([
            TxnOp::get(start, Some(in_order(&end))),
            TxnOp::get(fence_key(&key.name), None),
        ]);
        let reply = self.members.read(read).await.map_err(|e| fail(e.into()))?;
        let mut reads = found(reply.op_responses()).into_iter();
        let (keys, fence) = (reads.next().unwrap_or_default(), reads.next());
        // Holds only: not the keys that wait in line.
        let held: Vec<(&KeyValue, u64)> = keys
            .iter()
            .filter_map(|kv| {
                let entry = Entry::of(kv.key())?;
                let count = HoldValue::parse(kv.value()).map_or(1, |v| v.count);
                (entry != Entry::Queued && count > 0).then_some((kv, count))
            })
            .collect();
        // The last writer's token (a semaphore has no fence record).
        let written = fence
            .and_then(|f| f.into_iter().next())
            .map_or(0, |f| f.mod_revision());
        let exclusive = held
            .iter()
            .find(|(kv, _)| Entry::of(kv.key()) == Some(Entry::Hold));
        let (mode, counted, fencing_token) = match exclusive {
            _ if held.is_empty() => {
                let last = token(written).ok().filter(|&t| t > 0);
                return Ok(LockInfo::free(key.user().to_owned(), last));
            }
            Some(&(hold, count)) => (LockMode::Exclusive, vec![count], hold.create_revision()),
            None if semaphore => {
                let newest = held.iter().map(|(kv, _)| kv.create_revision()).max();
                let counts = held.iter().map(|&(_, c)| c).collect();
                (LockMode::Permits, counts, newest.unwrap_or(0))
            }
            None => (
                LockMode::Shared,
                held.iter().map(|&(_, c)| c).collect(),
                written,
            ),
        };
        if free {
            let deletes: Vec<TxnOp> = held
                .iter()
                .map(|(kv, _)| TxnOp::delete(kv.key().to_vec(), None))
                .collect();
            let freeing = Txn::new().and_then(deletes);
            self.members
                .txn(freeing)
                .await
                .map_err(|e| fail(e.into()))?;
        }
        let to_u32 = |n: u64| u32::try_from(n).unwrap_or(u32::MAX);
        Ok(LockInfo {
            key: key.user().to_owned(),
            mode,
            holders: counted.len(),
            holds: to_u32(counted.iter().sum()),
            // At most the TTL: its holders renew it every third of that.
            lease_remaining: Some(self.lease.ttl()),
            fencing_token: token(fencing_token).ok().filter(|&t| t > 0),
        })
    }

    /// One page of the locks and semaphores held under `prefix` (see `Store::held_page`):
    /// one range read, on the member in use (the next one if it cannot answer), of at
    /// most [`HELD_PAGE`] of the namespace's keys under the prefix, keys only, from `from`
    /// (just after the last key the page before read) on. Each lock and semaphore a hold
    /// key of the page names comes once. Fences, idempotency records, writers waiting in
    /// line and keys this crate never writes are left out. `next` is just after the page's last key, `None` once
    /// etcd has no more keys in the range.
    pub(super) async fn held_keys(
        &self,
        prefix: &str,
        from: Option<String>,
    ) -> Result<HeldPage, LockError> {
        let fail = |e: EtcdError| LockError::backend("list_held", e);
        let (start, end) = under(&self.namespace, prefix);
        let page = GetOptions::new()
            .with_range(end)
            .with_limit(HELD_PAGE)
            .with_keys_only();
        let mut reply = self
            .members
            .get(from.unwrap_or(start), Some(page))
            .await
            .map_err(|e| fail(e.into()))?;
        let read = reply.take_kvs();
        let next = match (reply.more(), read.last()) {
            (false, _) => None,
            (true, Some(last)) => {
                // Every name this crate writes is UTF-8; another program's key that is
                // not cannot be a cursor.
                let mut after =
                    String::from_utf8(last.key().to_vec()).map_err(|_| fail(EtcdError::Foreign))?;
                after.push('\0');
                Some(after)
            }
            (true, None) => return Err(fail(EtcdError::Unexpected("more keys, but none read"))),
        };
        let mut keys: Vec<(String, Primitive)> = read
            .iter()
            .filter_map(|kv| hold_of(&self.namespace, kv.key()))
            .collect();
        // A directory's keys are next to each other: its holds come in one run.
        keys.dedup();
        Ok(HeldPage { keys, next })
    }
}

//! Operators' calls on the etcd store: a snapshot of a lock or a semaphore, and freeing it
//! whatever holds it.

use etcd_client::{KeyValue, Txn, TxnOp};

use super::error::EtcdError;
use super::keys::{Entry, EtcdKey, fence_key, holders, permits};
use super::store::{EtcdStore, found, in_order, token};
use crate::core::hold::value::HoldValue;
use crate::core::store::StoreKey;
use crate::error::LockError;
use crate::lock::inspect::{LockInfo, LockMode, Primitive};

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
}

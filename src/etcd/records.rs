//! Idempotency records in etcd: a key `namespace:{key}/d` in the lock's directory (below
//! every holder's letter, see `keys.rs`), on a lease of its own whose TTL is the record's
//! retention, so that etcd deletes it; written in one transaction whose compare is the hold
//! that ran the handler: its key and its create revision, the fencing token.
//!
//! A lease per record, rather than one per retention shared by the records of a time
//! bucket, keeps a record's life its retention (rounded up to whole seconds) on etcd's
//! clock, at the price of a grant per stored record: records are written once per
//! completed request, and a store refused (or failed) revokes its lease at once.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use etcd_client::{Compare, CompareOp, PutOptions, Txn, TxnOp};
use tokio::time::timeout;

use super::EtcdBackend;
use super::error::EtcdError;
use super::keys::{EtcdKey, hold_key, record_key};
use super::store::EtcdStore;
use crate::error::LockError;
use crate::idempotency::{IdempotencyBackend, RECORD_CONTEXT, Records, RecordsOf, bounded};
use crate::lock::{BoxFuture, HeldLock};

/// The longest TTL etcd grants a lease (its `MaxLeaseTTL`, 9,000,000,000 s).
const MAX_LEASE_TTL_SECS: i64 = 9_000_000_000;

impl RecordsOf for EtcdBackend {
    fn records(&self) -> Arc<dyn Records> {
        Arc::new(self.clone())
    }
}

impl IdempotencyBackend for EtcdBackend {}

impl Records for EtcdBackend {
    fn fetch(&self, key: String) -> BoxFuture<'static, Result<Option<Bytes>, LockError>> {
        let (store, bound) = (
            self.inner.store.clone(),
            self.inner.settings.command_timeout,
        );
        Box::pin(async move {
            let name = store.lock_name(key)?;
            let get = async { store.members.get(record_key(&name), None).await };
            let mut reply = bounded(bound, async { get.await.map_err(EtcdError::from) }).await?;
            let record = reply.take_kvs().into_iter().next();
            Ok(record.map(|kv| Bytes::from(kv.into_key_value().1)))
        })
    }

    fn remaining(&self, key: String) -> BoxFuture<'static, Result<Option<Duration>, LockError>> {
        let (store, bound) = (
            self.inner.store.clone(),
            self.inner.settings.command_timeout,
        );
        Box::pin(async move {
            let name = store.lock_name(key)?;
            // The record's lease says how long it lives, in whole seconds (etcd rounds a
            // lease's TTL up): its key, then that lease.
            let ttl = async {
                let mut reply = store.members.get(record_key(&name), None).await?;
                let Some(record) = reply.take_kvs().into_iter().next() else {
                    return Ok::<_, etcd_client::Error>(None);
                };
                let lease = store.members.time_to_live(record.lease()).await?;
                Ok(u64::try_from(lease.ttl()).ok().map(Duration::from_secs))
            };
            bounded(bound, async { ttl.await.map_err(EtcdError::from) }).await
        })
    }

    fn store(
        &self,
        key: String,
        held: HeldLock,
        record: Bytes,
        retention: Duration,
    ) -> BoxFuture<'static, Result<bool, LockError>> {
        let (store, bound) = (
            self.inner.store.clone(),
            self.inner.settings.command_timeout,
        );
        Box::pin(async move {
            let name = store.lock_name(key)?;
            store
                .store_record(&name, held.fencing_token(), record, retention, bound)
                .await
        })
    }
}

impl EtcdStore {
    /// The directory of `user`'s (exclusive) lock.
    fn lock_name(&self, user: String) -> Result<Arc<str>, LockError> {
        let key = EtcdKey::new(&self.namespace, user, self.max_key_len, false, 0)?;
        Ok(key.name.clone())
    }

    /// Stores `record` in the lock `name` for `retention` if this backend's hold with the
    /// token `token` is still there; each call bounded by `bound`.
    async fn store_record(
        &self,
        name: &str,
        token: u64,
        record: Bytes,
        retention: Duration,
        bound: Duration,
    ) -> Result<bool, LockError> {
        let fail = |e: EtcdError| LockError::backend(RECORD_CONTEXT, e);
        let late = |e| LockError::backend(RECORD_CONTEXT, e);
        let bytes = record.len();
        let grant = self.members.grant(ttl_secs(retention));
        let lease = bounded(bound, async { grant.await.map_err(EtcdError::from) })
            .await?
            .id();
        // A hold lives under the lease its backend has now: one under an earlier lease was
        // lost with it. A token no revision can equal compares unequal.
        let hold = hold_key(name, self.lease.id());
        let revision = i64::try_from(token).unwrap_or(i64::MAX);
        let put = TxnOp::put(
            record_key(name),
            Vec::from(record),
            Some(PutOptions::new().with_lease(lease)),
        );
        let txn = Txn::new()
            .when([Compare::create_revision(hold, CompareOp::Equal, revision)])
            .and_then([put]);
        let stored = match timeout(bound, self.members.txn(txn)).await {
            Ok(Ok(reply)) if reply.succeeded() => return Ok(true),
            Ok(Ok(_)) => Ok(false),
            Ok(Err(e)) => {
                let e = EtcdError::from(e);
                Err(fail(if e.is_too_large() {
                    EtcdError::RecordTooLarge(bytes)
                } else {
                    e
                }))
            }
            Err(e) => Err(late(e)),
        };
        // Nothing went on the lease, or (a call whose answer never came) maybe the record:
        // revoking it deletes that too, so a failed store leaves nothing.
        match timeout(bound, self.members.revoke(lease)).await {
            Ok(Ok(_)) => {}
            Ok(Err(error)) => tracing::debug!(%error, "could not revoke an unused record lease"),
            Err(_) => tracing::debug!("revoking an unused record lease timed out"),
        }
        stored
    }
}

/// A retention as a lease's TTL: whole seconds, rounded up, within what etcd grants (which
/// raises a TTL below its minimum, a few seconds, to that).
fn ttl_secs(retention: Duration) -> i64 {
    let secs = retention
        .as_secs()
        .saturating_add(u64::from(retention.subsec_nanos() > 0));
    i64::try_from(secs)
        .unwrap_or(i64::MAX)
        .clamp(1, MAX_LEASE_TTL_SECS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retentions_round_up_to_whole_seconds_within_etcds_bounds() {
        assert_eq!(ttl_secs(Duration::from_millis(1)), 1);
        assert_eq!(ttl_secs(Duration::from_secs(2)), 2);
        assert_eq!(ttl_secs(Duration::from_millis(2001)), 3);
        assert_eq!(ttl_secs(Duration::MAX), MAX_LEASE_TTL_SECS);
    }
}

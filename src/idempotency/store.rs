//! The seam between the idempotency layer and a store of records: two calls a backend
//! answers beside its locks.
//!
//! The layer takes the key's lock through the backend's ordinary acquisition (the core's
//! queue, watchdog and release on every exit path), so a store adds only the record:
//!
//! - [`fetch`](Records::fetch): the record stored for a key, if any. Read before the lock
//!   is taken (a completed key is replayed without touching its lock, so retries of a
//!   finished request never contend) and again once it is held (the first request may
//!   have finished between the two), unless the store checked it as it took the hold
//!   (its capabilities say `records: InAttempt`: Redis's acquisition script takes no new
//!   hold while the record exists, and the layer replays it instead).
//! - [`store`](Records::store): writes the record, with its retention, only if the hold
//!   that ran the handler still holds the key, in one atomic step: a lock lost while the
//!   handler ran stores nothing. The hold is then released as any other.
//!
//! Storing strictly before releasing is what makes the two reads enough (or the read and
//! the check): whoever takes the lock after the first holder released it finds the
//! record.

use std::sync::Arc;

use crate::backend::LockBackend;
use crate::error::LockError;

/// A backend that keeps idempotency records beside its locks, for
/// [`IdempotencyLayer`](crate::IdempotencyLayer): [`RedisBackend`](crate::RedisBackend)
/// (the record in the lock's hash slot, expired by Redis; on a quorum, on every master),
/// [`MemoryBackend`](crate::MemoryBackend), and, with their features, `PostgresBackend`
/// and `MySqlBackend` (a row of the lock table's `_records` table per key, its expiry on
/// the server's clock, deleted by the backend's janitor once expired) and `EtcdBackend` (a
/// key in the lock's directory on a lease of its own, deleted by etcd after the retention,
/// rounded up to whole seconds; a record over etcd's request limit, 1.5 MiB by default,
/// is not stored) and `ZooKeeperBackend` (a persistent node beside the locks, expired on
/// the ensemble's clock and deleted by the backend's janitor; a record over
/// `jute.maxbuffer`, 1 MiB by default, is not stored).
///
/// Sealed, as [`LockBackend`] is.
pub trait IdempotencyBackend: LockBackend + sealed::Sealed {
    /// A job that runs at most once per period across every instance on this store (see
    /// [`JobRequest`](crate::JobRequest)): `.at_most_once_per(period).run(work)`. Its
    /// completions are kept as records are, on the store's clock.
    fn job(&self, name: impl Into<String>) -> crate::JobRequest {
        crate::JobRequest::new(self.store(), self.records(), name.into())
    }
}

pub(crate) use self::sealed::{Records, Sealed as RecordsOf};

/// What a failed call to a store of records is reported as.
pub(crate) const CONTEXT: &str = "idempotency record";

/// `call` to a store of records, bounded by `bound` (the backend's command timeout): its
/// failure, or its timeout, as a backend error of the record.
pub(crate) async fn bounded<T, E>(
    bound: std::time::Duration,
    call: impl Future<Output = Result<T, E>>,
) -> Result<T, LockError>
where
    E: std::error::Error + Send + Sync + 'static,
{
    tokio::time::timeout(bound, call)
        .await
        .map_err(|e| LockError::backend(CONTEXT, e))?
        .map_err(|e| LockError::backend(CONTEXT, e))
}

mod sealed {
    use std::time::Duration;

    use bytes::Bytes;

    use crate::error::LockError;
    use crate::lock::{BoxFuture, HeldLock};

    /// Implemented by this crate's backends only (see
    /// [`IdempotencyBackend`](super::IdempotencyBackend)).
    pub trait Sealed {
        /// The backend's records, shared by every clone of it.
        fn records(&self) -> std::sync::Arc<dyn Records>;
    }

    /// A store of idempotency records (see the module docs for what each call
    /// guarantees). Keys are the lock keys the layer takes, already validated by it.
    pub trait Records: Send + Sync + 'static {
        /// The record stored for `key`'s lock, if any (an expired one is none).
        fn fetch(&self, key: String) -> BoxFuture<'static, Result<Option<Bytes>, LockError>>;

        /// How long `key`'s record still lives, on the store's clock (its retention left),
        /// or `None` without one: when a job run at most once per period may run again.
        fn remaining(&self, key: String)
        -> BoxFuture<'static, Result<Option<Duration>, LockError>>;

        /// Stores `record` for `key` for `retention` if `held`, the hold on `key`'s lock
        /// that ran the handler, still holds it; returns whether it stored it.
        fn store(
            &self,
            key: String,
            held: HeldLock,
            record: Bytes,
            retention: Duration,
        ) -> BoxFuture<'static, Result<bool, LockError>>;
    }
}

/// The records of `backend`.
pub(crate) fn records_of(backend: &impl IdempotencyBackend) -> Arc<dyn Records> {
    backend.records()
}

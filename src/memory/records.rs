//! Idempotency records in a [`MemoryBackend`](super::MemoryBackend): beside the locks,
//! under the same mutex, so that a record is stored only while its writer holds the key.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tokio::time::Instant;

use super::MemoryBackend;
use super::store::{MemoryKey, MemoryStore};
use crate::error::LockError;
use crate::idempotency::{IdempotencyBackend, Records, RecordsOf};
use crate::lock::{BoxFuture, HeldLock};

/// The records of one backend, each dropped once its retention ran out: expired ones go
/// as later ones are stored or read, so nothing outlives its retention by more than the
/// next call.
#[derive(Default)]
pub(super) struct Stored {
    records: HashMap<String, (Instant, Bytes)>,
    /// When each record expires, earliest first.
    expiries: BinaryHeap<Reverse<(Instant, String)>>,
}

impl Stored {
    fn prune(&mut self, now: Instant) {
        while let Some(Reverse((at, _))) = self.expiries.peek()
            && *at <= now
        {
            let Some(Reverse((at, key))) = self.expiries.pop() else {
                break;
            };
            // A record stored again since has a later expiry of its own.
            if self
                .records
                .get(&key)
                .is_some_and(|(until, _)| *until == at)
            {
                self.records.remove(&key);
            }
        }
    }

    /// How many records are kept, once the expired ones are dropped.
    pub(super) fn live(&mut self) -> usize {
        self.prune(Instant::now());
        self.records.len()
    }
}

impl RecordsOf for MemoryBackend {
    fn records(&self) -> Arc<dyn Records> {
        self.core.store.clone()
    }
}

impl IdempotencyBackend for MemoryBackend {}

impl Records for MemoryStore {
    fn fetch(&self, key: String) -> BoxFuture<'static, Result<Option<Bytes>, LockError>> {
        let mut map = self.map();
        let records = &mut map.records;
        records.prune(Instant::now());
        let found = records.records.get(&key).map(|(_, record)| record.clone());
        Box::pin(std::future::ready(Ok(found)))
    }

    fn remaining(&self, key: String) -> BoxFuture<'static, Result<Option<Duration>, LockError>> {
        let now = Instant::now();
        let mut map = self.map();
        let records = &mut map.records;
        records.prune(now);
        let left = records.records.get(&key).map(|(until, _)| *until - now);
        Box::pin(std::future::ready(Ok(left)))
    }

    fn store(
        &self,
        key: String,
        held: HeldLock,
        record: Bytes,
        retention: Duration,
    ) -> BoxFuture<'static, Result<bool, LockError>> {
        // Held under the hold's token, or a lower one: the hold it was passed on from in
        // memory (any other hold since has a higher token).
        let mut map = self.map();
        let holds = map.holds(&MemoryKey::lock_name(&key), held.fencing_token());
        if holds {
            let now = Instant::now();
            let records = &mut map.records;
            records.prune(now);
            let until = now + retention;
            records.expiries.push(Reverse((until, key.clone())));
            records.records.insert(key, (until, record));
        }
        Box::pin(std::future::ready(Ok(holds)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_record_is_stored_only_while_its_writer_holds_the_key() {
        let backend = MemoryBackend::new();
        let records = backend.records();
        let guard = backend.lock("k").try_once().await.unwrap();
        let held = guard.held().clone();
        let record = Bytes::from_static(b"r");
        let day = Duration::from_secs(86_400);
        backend.force_release("k").await.unwrap();
        let store = records.store("k".into(), held.clone(), record.clone(), day);
        assert!(!store.await.unwrap(), "the lock was lost: nothing stored");
        // Another holder of the key is not the writer either.
        let other = backend.lock("k").try_once().await.unwrap();
        let store = records.store("k".into(), held, record.clone(), day);
        assert!(!store.await.unwrap());
        assert_eq!(records.fetch("k".into()).await.unwrap(), None);
        let store = records.store("k".into(), other.held().clone(), record.clone(), day);
        assert!(store.await.unwrap());
        assert_eq!(records.fetch("k".into()).await.unwrap(), Some(record));
        drop(guard);
    }
}

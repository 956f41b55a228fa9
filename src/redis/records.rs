//! Idempotency records in Redis: a string `namespace:{key}:record` beside the key's lock
//! hash, in its hash slot, expired by Redis after its retention.

use std::sync::{Arc, LazyLock};
use std::time::Duration;

use bytes::Bytes;
use redis::Script;

use super::keys::LockKey;
use super::{RedisBackend, UnexpectedReply};
use crate::error::LockError;
use crate::idempotency::{IdempotencyBackend, RECORD_CONTEXT, Records, RecordsOf, bounded};
use crate::lock::{BoxFuture, HeldLock};

/// Stores a record while its writer holds the key (see record_store.lua).
static STORE: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("scripts/writes/record_store.lua")));

impl RecordsOf for RedisBackend {
    fn records(&self) -> Arc<dyn Records> {
        Arc::new(self.clone())
    }
}

impl IdempotencyBackend for RedisBackend {}

impl RedisBackend {
    fn lock_key(&self, key: String) -> Result<LockKey, LockError> {
        let store = self.lead();
        Ok(LockKey::new(&store.namespace, key, store.max_key_len)?)
    }
}

impl Records for RedisBackend {
    fn fetch(&self, key: String) -> BoxFuture<'static, Result<Option<Bytes>, LockError>> {
        let backend = self.clone();
        Box::pin(async move {
            let store = backend.lead();
            let mut get = redis::cmd("GET");
            get.arg(record_key(&backend.lock_key(key)?));
            let reply = bounded(
                store.command_timeout,
                store.pool.query::<Option<Vec<u8>>>(&get),
            )
            .await?;
            Ok(reply.map(Bytes::from))
        })
    }

    fn store(
        &self,
        key: String,
        held: HeldLock,
        record: Bytes,
        retention: Duration,
    ) -> BoxFuture<'static, Result<bool, LockError>> {
        let backend = self.clone();
        Box::pin(async move {
            let store = backend.lead();
            let key = backend.lock_key(key)?;
            let mut invocation = STORE.key(&*key.lock);
            invocation
                .key(record_key(&key))
                .arg(held.fencing_token())
                .arg(
                    u64::try_from(retention.as_millis())
                        .unwrap_or(u64::MAX)
                        .max(1),
                )
                .arg(record.as_ref());
            let reply =
                bounded(store.command_timeout, store.pool.invoke::<i64>(&invocation)).await?;
            match reply {
                1 => Ok(true),
                0 => Ok(false),
                _ => Err(LockError::backend(
                    RECORD_CONTEXT,
                    UnexpectedReply("record_store"),
                )),
            }
        })
    }
}

fn record_key(key: &LockKey) -> String {
    format!("{}:record", key.lock)
}

//! Idempotency records in Redis: a string `namespace:{key}:record` beside the key's lock
//! hash, in its hash slot, expired by Redis after its retention. On a quorum every master
//! keeps one (see `quorum/records.rs`).

use std::sync::{Arc, LazyLock};
use std::time::Duration;

use bytes::Bytes;
use redis::Script;

use super::connection::pool::CommandError;
use super::keys::LockKey;
use super::store::RedisStore;
use super::{Inner, RedisBackend, UnexpectedReply};
use crate::error::LockError;
use crate::idempotency::{IdempotencyBackend, Records, RecordsOf, bounded};
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
            let key = backend.lock_key(key)?;
            match &backend.inner {
                Inner::Single(core) => {
                    let store = &core.store;
                    bounded(store.command_timeout, store.record(&key)).await
                }
                Inner::Quorum(core) => core.store.record(&key).await,
            }
        })
    }

    fn remaining(&self, key: String) -> BoxFuture<'static, Result<Option<Duration>, LockError>> {
        let backend = self.clone();
        Box::pin(async move {
            let key = backend.lock_key(key)?;
            match &backend.inner {
                Inner::Single(core) => {
                    let store = &core.store;
                    bounded(store.command_timeout, store.record_ttl(&key)).await
                }
                Inner::Quorum(core) => core.store.record_ttl(&key).await,
            }
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
            let key = backend.lock_key(key)?;
            let written = Written {
                token: held.fencing_token(),
                retention,
                record,
            };
            match &backend.inner {
                Inner::Single(core) => {
                    let store = &core.store;
                    bounded(store.command_timeout, store.store_record(&key, &written)).await
                }
                Inner::Quorum(core) => core.store.store_record(&key, &written).await,
            }
        })
    }
}

/// A record to store, under the hold of `token`.
pub(crate) struct Written {
    pub(crate) token: u64,
    pub(crate) retention: Duration,
    pub(crate) record: Bytes,
}

impl RedisStore {
    /// The record of `key` on this server, if any.
    pub(crate) async fn record(&self, key: &LockKey) -> Result<Option<Bytes>, CommandError> {
        let mut get = redis::cmd("GET");
        get.arg(key.record());
        let reply = self.pool.query::<Option<Vec<u8>>>(&get).await?;
        Ok(reply.map(Bytes::from))
    }

    /// How long the record of `key` still lives on this server (`PTTL`), if it has one.
    pub(crate) async fn record_ttl(&self, key: &LockKey) -> Result<Option<Duration>, CommandError> {
        let mut pttl = redis::cmd("PTTL");
        pttl.arg(key.record());
        let millis = self.pool.query::<i64>(&pttl).await?;
        // -2: no record; -1 (no expiry) is never written.
        Ok(u64::try_from(millis).ok().map(Duration::from_millis))
    }

    /// Stores `written` on this server if the hold of its token still holds `key` here
    /// (see record_store.lua); returns whether it stored it.
    pub(crate) async fn store_record(
        &self,
        key: &LockKey,
        written: &Written,
    ) -> Result<bool, CommandError> {
        let mut invocation = STORE.key(&*key.lock);
        invocation
            .key(key.record())
            .arg(written.token)
            .arg(
                u64::try_from(written.retention.as_millis())
                    .unwrap_or(u64::MAX)
                    .max(1),
            )
            .arg(written.record.as_ref());
        match self.pool.invoke::<i64>(&invocation).await? {
            1 => Ok(true),
            0 => Ok(false),
            _ => Err(CommandError::Unexpected(UnexpectedReply("record_store"))),
        }
    }
}

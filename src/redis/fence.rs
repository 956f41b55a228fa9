//! [`FencedStore`]: the other half of fencing, a value that refuses stale writers.
//!
//! A lock alone cannot stop a holder that was paused (GC, SIGSTOP, a slow disk) past its
//! lease from writing after someone else took the lock over. The store it writes to must
//! check the [fencing token](crate::HeldLock::fencing_token): this one keeps the token of
//! the last accepted write next to the value and accepts only higher tokens, atomically in
//! one Lua script. It lives in the lock's Redis, under the lock's hash tag.
//!
//! ```no_run
//! use tower_lock::{FencedStore, FencedWrite, RedisBackend};
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let backend = RedisBackend::connect("redis://127.0.0.1:6379").await?;
//! let store = FencedStore::new(backend.clone());
//! let guard = backend.lock("stock:42").try_once().await?;
//! match store.write("stock:42", guard.fencing_token(), "7").await? {
//!     FencedWrite::Written => {}
//!     FencedWrite::Stale { .. } => { /* the lock was taken over: this write must not happen */ }
//! }
//! # Ok(())
//! # }
//! ```

use redis::Value;
use tokio::time::timeout;

use super::keys::LockKey;
use super::{RedisBackend, UnexpectedReply};
use crate::error::LockError;

/// A set of string values, one per lock key, each written only by holders with a newer
/// fencing token than the last writer. Cheap to clone.
#[derive(Debug, Clone)]
pub struct FencedStore {
    backend: RedisBackend,
}

/// The outcome of [`FencedStore::write`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use = "a stale write was refused and the caller must not act as if it happened"]
pub enum FencedWrite {
    /// The value was stored.
    Written,
    /// Refused: a holder with this (equal or higher) token wrote first.
    Stale {
        /// The token of the last accepted write.
        stored_token: u64,
    },
}

/// A value read from a [`FencedStore`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FencedValue {
    /// The token of the write that stored it.
    pub token: u64,
    /// The value.
    pub value: String,
}

impl FencedStore {
    /// A store in `backend`'s Redis and namespace.
    pub fn new(backend: RedisBackend) -> Self {
        FencedStore { backend }
    }

    /// Stores `value` for `key` if `token` is higher than the token of every write accepted
    /// for `key` so far. Pass the fencing token of the lock held on `key`.
    ///
    /// An `Err` from Redis (a timeout, a dropped connection) leaves it unknown whether the
    /// write happened; [`read`](Self::read) tells, by the stored token.
    pub async fn write(
        &self,
        key: &str,
        token: u64,
        value: &str,
    ) -> Result<FencedWrite, LockError> {
        let inner = &self.backend.inner.store;
        let redis_key = self.redis_key(key)?;
        let mut invocation = inner.scripts.fence.key(&redis_key);
        invocation.arg(token).arg(value);
        let reply = timeout(
            inner.command_timeout,
            inner.pool.invoke::<Vec<u64>>(&invocation),
        )
        .await
        .map_err(|e| LockError::backend("fenced write", e))?
        .map_err(|e| LockError::backend("fenced write", e))?;
        match reply.as_slice() {
            [1, _] => Ok(FencedWrite::Written),
            [0, stored_token] => Ok(FencedWrite::Stale {
                stored_token: *stored_token,
            }),
            _ => Err(LockError::backend("fenced write", UnexpectedReply("fence"))),
        }
    }

    /// The value last written for `key`, with its token; `None` if it was never written.
    pub async fn read(&self, key: &str) -> Result<Option<FencedValue>, LockError> {
        let inner = &self.backend.inner.store;
        let mut cmd = redis::cmd("HMGET");
        cmd.arg(self.redis_key(key)?).arg("token").arg("value");
        let reply = timeout(inner.command_timeout, inner.pool.query::<Vec<Value>>(&cmd))
            .await
            .map_err(|e| LockError::backend("fenced read", e))?
            .map_err(|e| LockError::backend("fenced read", e))?;
        let unexpected = || LockError::backend("fenced read", UnexpectedReply("HMGET"));
        match reply.as_slice() {
            [Value::Nil, Value::Nil] => Ok(None),
            [Value::BulkString(token), Value::BulkString(value)] => Ok(Some(FencedValue {
                token: std::str::from_utf8(token)
                    .ok()
                    .and_then(|t| t.parse().ok())
                    .ok_or_else(unexpected)?,
                value: String::from_utf8(value.clone()).map_err(|_| unexpected())?,
            })),
            _ => Err(unexpected()),
        }
    }

    fn redis_key(&self, key: &str) -> Result<String, LockError> {
        let inner = &self.backend.inner.store;
        let key = LockKey::new(&inner.namespace, key.to_owned(), inner.max_key_len)?;
        Ok(format!("{}:fenced", key.lock))
    }
}

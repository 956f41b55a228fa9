//! [`FencedStore`]: the other half of fencing, a value that refuses stale writers.
//!
//! A lock alone cannot stop a holder that was paused (GC, SIGSTOP, a slow disk) past its
//! lease from writing after someone else took the lock over. The store it writes to must
//! check the [fencing token](crate::HeldLock::fencing_token): this one keeps the token of
//! the last accepted write next to the value and accepts only higher tokens, atomically in
//! one Lua script. It lives in the lock's Redis, under the lock's hash tag.
//!
//! ```no_run
//! use tower_lock::RedisBackend;
//! use tower_lock::redis::{FencedStore, FencedWrite};
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

use futures_util::future::join_all;
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
    ///
    /// On a [quorum](RedisBackend::quorum) the value is written on every master, and the
    /// write counts when a majority accepted it: a later write with a newer token that a
    /// majority accepted leaves a stale writer at most a minority, so it is refused.
    pub async fn write(
        &self,
        key: &str,
        token: u64,
        value: &str,
    ) -> Result<FencedWrite, LockError> {
        let redis_key = self.redis_key(key)?;
        let replies = join_all(self.backend.stores().iter().map(|store| {
            let mut invocation = store.scripts.fence.key(&redis_key);
            invocation.arg(token).arg(value);
            async move {
                let reply = timeout(
                    store.command_timeout,
                    store.pool.invoke::<Vec<u64>>(&invocation),
                )
                .await
                .map_err(|e| LockError::backend("fenced write", e))?
                .map_err(|e| LockError::backend("fenced write", e))?;
                match reply.as_slice() {
                    [1, _] => Ok(None),
                    [0, stored_token] => Ok(Some(*stored_token)),
                    _ => Err(LockError::backend("fenced write", UnexpectedReply("fence"))),
                }
            }
        }))
        .await;
        let stale = majority_of(replies)?;
        let written = stale.iter().filter(|s| s.is_none()).count();
        Ok(match stale.into_iter().flatten().max() {
            Some(stored_token) if written < majority(self.backend.stores().len()) => {
                FencedWrite::Stale { stored_token }
            }
            _ => FencedWrite::Written,
        })
    }

    /// The value last written for `key`, with its token; `None` if it was never written.
    /// On a quorum, the newest a majority of the masters answered with.
    pub async fn read(&self, key: &str) -> Result<Option<FencedValue>, LockError> {
        let redis_key = self.redis_key(key)?;
        let replies = join_all(self.backend.stores().iter().map(|store| {
            let mut cmd = redis::cmd("HMGET");
            cmd.arg(&redis_key).arg("token").arg("value");
            async move {
                let reply = timeout(store.command_timeout, store.pool.query::<Vec<Value>>(&cmd))
                    .await
                    .map_err(|e| LockError::backend("fenced read", e))?
                    .map_err(|e| LockError::backend("fenced read", e))?;
                parse_value(&reply)
            }
        }))
        .await;
        let values = majority_of(replies)?;
        Ok(values.into_iter().flatten().max_by_key(|v| v.token))
    }

    fn redis_key(&self, key: &str) -> Result<String, LockError> {
        let max_key_len = self.backend.stores().first().map_or(0, |s| s.max_key_len);
        let key = LockKey::new(self.backend.namespace(), key.to_owned(), max_key_len)?;
        Ok(format!("{}:fenced", key.lock))
    }
}

/// A stored value as `HMGET token value` returns it.
fn parse_value(reply: &[Value]) -> Result<Option<FencedValue>, LockError> {
    let unexpected = || LockError::backend("fenced read", UnexpectedReply("HMGET"));
    match reply {
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

/// How many of `n` make a majority.
fn majority(n: usize) -> usize {
    n / 2 + 1
}

/// The answers, when a majority of the servers gave one; the first error otherwise.
fn majority_of<T>(replies: Vec<Result<T, LockError>>) -> Result<Vec<T>, LockError> {
    let n = replies.len();
    let mut answers = Vec::with_capacity(n);
    let mut error = None;
    for reply in replies {
        match reply {
            Ok(answer) => answers.push(answer),
            Err(e) => error = error.or(Some(e)),
        }
    }
    match error {
        Some(e) if answers.len() < majority(n) => Err(e),
        _ => Ok(answers),
    }
}

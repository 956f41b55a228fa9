#![doc = include_str!("../README.md")]
#![deny(missing_docs, unsafe_code)]
#![warn(rust_2018_idioms, missing_debug_implementations)]

// Every public item has one path: the crate root, except `response`'s, which only that
// module exports.
mod backend;
mod body;
mod error;
mod extract;
mod future;
mod held;
mod key;
mod layer;
mod lock;
mod redis;
pub mod response;
mod service;

pub use crate::backend::LockBackend;
pub use crate::error::{BackendError, KeyError, LockError};
pub use crate::extract::{Header, PathParam, QueryParam};
pub use crate::future::ResponseFuture;
pub use crate::held::{HeldLocks, MissingHeldLock};
pub use crate::key::{KeyExtractor, KeyOutcome, OptionalKey};
pub use crate::layer::{DEFAULT_WAIT, LockLayer, OnLockLost};
pub use crate::lock::{
    DEFAULT_LEASE, DEFAULT_MAX_LOCAL_WAITERS, HeldLock, LockGuard, LockOwner, LockRequest,
    MAX_DURATION,
};
pub use crate::redis::{
    BackendStats, DEFAULT_MAX_KEY_LEN, DEFAULT_MAX_LOCAL_HANDOFFS, FencedStore, FencedValue,
    FencedWrite, RedisBackend, RedisBackendBuilder,
};
pub use crate::service::LockService;

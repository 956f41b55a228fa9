#![doc = include_str!("../README.md")]
#![deny(missing_docs, unsafe_code)]
#![warn(rust_2018_idioms, missing_debug_implementations)]

mod backend;
mod body;
mod error;
pub mod extract;
mod future;
mod held;
pub mod key;
mod layer;
pub mod lock;
pub mod redis;
pub mod response;
mod service;

pub use crate::backend::LockBackend;
pub use crate::error::{BackendError, KeyError, LockError};
pub use crate::extract::{Header, PathParam, QueryParam};
pub use crate::future::ResponseFuture;
pub use crate::held::{HeldLocks, MissingHeldLock};
pub use crate::key::KeyExtractor;
pub use crate::layer::{DEFAULT_WAIT, LockLayer, OnLockLost};
pub use crate::lock::{HeldLock, LockGuard, LockOwner, LockRequest};
pub use crate::redis::{
    BackendStats, FencedStore, FencedValue, FencedWrite, RedisBackend, RedisBackendBuilder,
};
pub use crate::service::LockService;

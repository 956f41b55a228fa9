//! [`MemoryBackend`]: the lock semantics of the crate inside one process.
//!
//! Every task of a process that shares one `MemoryBackend` (clones share it) sees the same
//! locks, with the guarantees of every other store, kept by the same core: one owner per
//! request and re-entry by that owner, leases that expire when nobody renews them (and then
//! fire [`HeldLock::lost`]), the local queue and its handoffs, waiting without polling,
//! strictly increasing fencing tokens, shared holds and semaphores
//! ([`LockRequest::shared`], [`LockRequest::permits`]), and the same errors. For tests and
//! examples that should run without a server, and for services that run as a single
//! instance.
//!
//! Only the map the locks live in is this module's (`map.rs`, its calls in `store.rs`):
//! an application that tests with a `MemoryBackend` runs the core that serves it in
//! production.
//!
//! ```
//! use std::time::Duration;
//! use tower_lock::{LockError, MemoryBackend};
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), LockError> {
//! let backend = MemoryBackend::new();
//! let guard = backend.lock("order:42").try_once().await?;
//! assert!(matches!(
//!     backend.lock("order:42").try_once().await,
//!     Err(LockError::Contended { .. })
//! ));
//! guard.release().await?;
//! let again = backend.lock("order:42").wait(Duration::from_secs(1)).await?;
//! # drop(again);
//! # Ok(())
//! # }
//! ```

mod map;
mod records;
mod store;

use std::fmt;
use std::sync::Arc;

use self::store::MemoryStore;
use crate::backend::LockBackend;
use crate::core::runtime::Spawner;
use crate::core::wakeups::Wakeups;
use crate::core::{Core, Parts, Settings};
use crate::lock::backend::{Backend, Sealed};
use crate::lock::{
    DEFAULT_MAX_KEY_LEN, DEFAULT_MAX_LOCAL_HANDOFF_TIME, DEFAULT_MAX_LOCAL_HANDOFFS,
};
use crate::telemetry::Namespace;

/// How long one call of the map may take: it never waits, so this only bounds the core's
/// budget for a call.
const COMMAND_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(1);

/// Locks held in this process's memory. Cheap to clone; clones share the locks.
///
/// Nothing is shared with other processes: use it where one process is all there is
/// (tests, examples, a single-instance service), and [`RedisBackend`](crate::RedisBackend)
/// where several instances must exclude each other.
#[derive(Clone)]
pub struct MemoryBackend {
    core: Arc<Core<MemoryStore>>,
}

impl MemoryBackend {
    /// An empty store. Needs no runtime: its tasks start on the first one that uses it.
    pub fn new() -> Self {
        crate::telemetry::describe_metrics();
        let settings = Settings {
            command_timeout: COMMAND_TIMEOUT,
            max_local_handoffs: DEFAULT_MAX_LOCAL_HANDOFFS,
            max_local_handoff_time: DEFAULT_MAX_LOCAL_HANDOFF_TIME,
            max_key_len: DEFAULT_MAX_KEY_LEN,
        };
        let runtime = Spawner::default();
        runtime.remember_current();
        let parts = Parts::on(settings, Namespace::new("memory"), runtime);
        let metrics = parts.metrics.clone();
        let store = MemoryStore::new(
            Wakeups::new(metrics),
            parts.watchdog.clone(),
            parts.recheck.clone(),
            settings.max_key_len,
        );
        MemoryBackend {
            core: Core::new(store, parts),
        }
    }

    crate::core::lock_backend_methods! {
        /// A snapshot of `key`'s lock (see [`LockBackend::inspect`]).
        fn inspect;
        /// Frees `key`'s lock whatever holds it; its holders see `lost()` at once (see
        /// [`LockBackend::force_release`]).
        fn force_release;
    }

    /// How many keys are held right now: locked, held shared, or with a permit taken
    /// (a key whose lock and semaphore are both held counts twice).
    pub fn held(&self) -> usize {
        self.core.store.map().held()
    }

    /// How many idempotency records are kept right now (see
    /// [`IdempotencyLayer`](crate::IdempotencyLayer)): none outlives its retention.
    pub fn idempotency_records(&self) -> usize {
        self.core.store.map().records.live()
    }
}

impl Default for MemoryBackend {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Debug for MemoryBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryBackend")
            .field("instance", &self.core.owners.instance())
            .field("held", &self.held())
            .finish()
    }
}

impl Sealed for MemoryBackend {
    fn store(&self) -> Arc<dyn Backend> {
        self.core.clone()
    }
}

impl LockBackend for MemoryBackend {}

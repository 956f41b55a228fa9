//! [`MemoryBackend`]: the lock semantics of the crate inside one process.
//!
//! Every task of a process that shares one `MemoryBackend` (clones share it) sees the same
//! locks, with the guarantees of the Redis backend: one owner per request and re-entry by
//! that owner, leases that expire when nobody renews them (and then fire
//! [`HeldLock::lost`]), FIFO waiting without polling, strictly increasing fencing tokens,
//! shared holds and semaphores ([`LockRequest::shared`], [`LockRequest::permits`]), and
//! the same errors. For tests and examples that should run without Redis, and for
//! services that run as a single instance.
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

mod hold;
mod inspect;
mod records;
mod rw;
mod semaphore;
mod wait;

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio::time::Instant;

use self::hold::Fences;
use self::rw::RwKey;
use self::semaphore::Semaphore;
use self::wait::Deferred;
use crate::backend::{Backend, LockBackend, Sealed};
use crate::core::queue::{Claim, Queues};
use crate::core::runtime::Spawner;
use crate::core::telemetry::Namespace;
use crate::core::telemetry::observe::{Observe, OwnerIds};
use crate::error::LockError;
use crate::key::validate;
use crate::lock::inspect::{LockInfo, Primitive};
use crate::lock::{BoxFuture, Kind, LockGuard, LockOwner, LockRequest, Mode};

/// Default upper bound on a key's length in bytes, as for the Redis backend.
const MAX_KEY_LEN: usize = 1024;

/// Locks held in this process's memory. Cheap to clone; clones share the locks.
///
/// Nothing is shared with other processes: use it where one process is all there is
/// (tests, examples, a single-instance service), and [`RedisBackend`](crate::RedisBackend)
/// where several instances must exclude each other.
#[derive(Clone)]
pub struct MemoryBackend {
    inner: Arc<Inner>,
}

struct Inner {
    owners: OwnerIds,
    /// Exclusive acquisitions queue here, one contender per key, as on Redis; shared and
    /// permit acquisitions, which admit several holders, wait in the key's own state.
    queues: Queues,
    state: Mutex<State>,
    /// One counter for every key: a token is above every earlier token of its key, and
    /// no per-key state outlives a release. It starts at the clock in microseconds, as
    /// Redis tokens never fall below, so a restarted process does not hand out tokens a
    /// fenced store has already seen.
    tokens: AtomicU64,
    /// Where expiry timers run, also when a guard is dropped outside any runtime.
    runtime: Spawner,
    /// Generations of holds and arrival numbers of acquisitions: never reused.
    serials: AtomicU64,
    /// The `namespace` label of the metrics: `memory`.
    metrics: Namespace,
}

/// Everything held or waited for, behind one mutex.
#[derive(Default)]
struct State {
    /// Each key's read/write lock (the plain lock is its exclusive side).
    keys: HashMap<Arc<str>, RwKey>,
    /// Each key's semaphore, a primitive of its own.
    semaphores: HashMap<Arc<str>, Semaphore>,
    /// The last exclusive token of recently written keys, for their shared holds.
    fences: Fences,
    /// Idempotency records, beside the locks they were stored under.
    records: records::Stored,
}

/// How an acquisition may wait: until `deadline` (`None`: not at all), with at most
/// `max_waiters` others queued for the key.
#[derive(Clone, Copy)]
struct Wait {
    started: Instant,
    deadline: Option<Instant>,
    max_waiters: usize,
}

impl Wait {
    fn timed_out(&self, key: &str, retry_after: Option<Duration>) -> LockError {
        LockError::TimedOut {
            key: key.to_owned(),
            waited: self.started.elapsed(),
            retry_after,
        }
    }
}

impl MemoryBackend {
    /// An empty store.
    pub fn new() -> Self {
        crate::core::telemetry::describe_metrics();
        MemoryBackend {
            inner: Arc::new(Inner {
                owners: OwnerIds::new(),
                queues: Queues::default(),
                state: Mutex::default(),
                tokens: AtomicU64::new(clock_micros()),
                runtime: Spawner::default(),
                serials: AtomicU64::new(0),
                metrics: Namespace::new("memory"),
            }),
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
        let state = self.inner.state();
        let locks = state.keys.values().filter(|k| k.is_held()).count();
        let semaphores = state.semaphores.values().filter(|s| s.is_held()).count();
        locks + semaphores
    }

    /// How many idempotency records are kept right now (see
    /// [`IdempotencyLayer`](crate::IdempotencyLayer)): none outlives its retention.
    pub fn idempotency_records(&self) -> usize {
        self.inner.state().records.live()
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
            .field("instance", &self.inner.owners.instance())
            .field("held", &self.held())
            .finish()
    }
}

impl Sealed for MemoryBackend {
    fn store(&self) -> Arc<dyn Backend> {
        self.inner.clone()
    }
}

impl LockBackend for MemoryBackend {}

impl Backend for Inner {
    fn acquire(
        self: Arc<Self>,
        request: LockRequest,
    ) -> BoxFuture<'static, Result<LockGuard, LockError>> {
        let observe = Observe::new(&request, MAX_KEY_LEN, &self.metrics);
        Box::pin(observe.run(move || self.acquire_traced(request)))
    }

    fn new_owner(&self) -> LockOwner {
        self.owners.next()
    }

    fn metrics(&self) -> &Namespace {
        &self.metrics
    }

    fn max_key_len(&self) -> usize {
        MAX_KEY_LEN
    }

    fn inspect(
        self: Arc<Self>,
        key: String,
        of: Primitive,
    ) -> BoxFuture<'static, Result<LockInfo, LockError>> {
        // Lazy, as futures are: nothing happens until it is awaited.
        Box::pin(async move { Inner::inspect(&self, key, of) })
    }

    fn force_release(
        self: Arc<Self>,
        key: String,
        of: Primitive,
    ) -> BoxFuture<'static, Result<LockInfo, LockError>> {
        Box::pin(async move { Inner::force_release(&self, key, of) })
    }
}

impl Inner {
    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        // Nothing under this lock can panic half-way through an update.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Runs `update` on the state, then drops what it deferred (slots to pass on, guards
    /// to release) once the state's lock is released: both may take it again.
    fn with_state<T>(self: &Arc<Self>, update: impl FnOnce(&mut State, &mut Deferred) -> T) -> T {
        let mut deferred = Deferred::default();
        let result = update(&mut self.state(), &mut deferred);
        drop(deferred);
        result
    }

    fn serial(&self) -> u64 {
        self.serials.fetch_add(1, Ordering::Relaxed)
    }

    fn next_token(&self) -> u64 {
        self.tokens.fetch_add(1, Ordering::Relaxed)
    }

    async fn acquire_traced(self: Arc<Self>, request: LockRequest) -> Result<LockGuard, LockError> {
        validate(&request.key, MAX_KEY_LEN)?;
        self.runtime.remember_current();
        let key: Arc<str> = request.key.into();
        let claim = Claim {
            owner: request.owner.unwrap_or_else(|| self.owners.next()),
            lease: request.lease,
            renew: request.watchdog,
        };
        let started = Instant::now();
        let wait = Wait {
            started,
            deadline: match request.mode {
                Mode::TryOnce => None,
                Mode::Wait(wait) => Some(started + wait),
            },
            max_waiters: request.max_local_waiters,
        };
        match request.kind {
            Kind::Exclusive => self.exclusive(key, claim, wait).await,
            Kind::Shared => self.shared(key, claim, wait).await,
            Kind::Permit(0) => Err(LockError::ZeroPermits {
                key: key.to_string(),
            }),
            Kind::Permit(n) => self.permit(key, claim, n, wait).await,
        }
    }
}

/// Microseconds since the Unix epoch (1 if the clock reads earlier).
fn clock_micros() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(1, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
}

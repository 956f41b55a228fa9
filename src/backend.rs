//! The seam between the layer and where locks live.

use std::sync::atomic::{AtomicU64, Ordering};

use tokio::time::Instant;
use tracing::Instrument;

use crate::error::LockError;
use crate::lock::{LockGuard, LockOwner, LockRequest, Mode};

/// A store of locks: [`RedisBackend`](crate::RedisBackend) across instances, or
/// [`MemoryBackend`](crate::MemoryBackend) inside one process.
///
/// The layer and [`LockRequest`] hold any backend behind this trait, so no type names the
/// backend (`LockLayer<K>`), and an application can take `impl LockBackend` to run on
/// Redis in production and in memory in its tests.
///
/// The trait is sealed: only this crate's backends implement it. A guard's guarantees
/// (released on every exit path, renewed while it lives, `lost()` when the store proves
/// the lock gone) are kept by code shared with each store's internals, and that seam is
/// not yet a stable public API.
pub trait LockBackend: sealed::Sealed + Clone + Send + Sync + 'static {
    /// Starts building an acquisition of `key`.
    fn lock(&self, key: impl Into<String>) -> LockRequest {
        LockRequest::new(self.store(), key.into())
    }
}

pub(crate) use self::sealed::{Sealed, Store};

mod sealed {
    use std::sync::Arc;

    use crate::error::LockError;
    use crate::lock::{BoxFuture, LockGuard, LockOwner, LockRequest};

    /// Implemented by this crate's backends only (see [`LockBackend`](super::LockBackend)).
    pub trait Sealed {
        /// The backend's store, shared by every clone of it.
        fn store(&self) -> Arc<dyn Store>;
    }

    /// What the layer and the lock builder need of a backend.
    pub trait Store: Send + Sync + 'static {
        /// Runs an acquisition: validates the key, queues behind this process's other
        /// tasks for it, takes the lock (waiting if asked) and returns its guard.
        fn acquire(
            self: Arc<Self>,
            request: LockRequest,
        ) -> BoxFuture<'static, Result<LockGuard, LockError>>;

        /// A new owner: one per request.
        fn new_owner(&self) -> LockOwner;
    }
}

/// The `lock.acquire` span every backend opens per acquisition.
pub(crate) fn acquire_span(key: &str, max_key_len: usize, mode: Mode) -> tracing::Span {
    // A rejected key may be huge or hold control characters: never log it raw.
    let shown = if key.len() <= max_key_len {
        key
    } else {
        "<oversized key>"
    };
    tracing::info_span!(
        "lock.acquire",
        key = ?shown,
        mode = match mode { Mode::TryOnce => "try_once", Mode::Wait(_) => "wait" },
        waited_ms = tracing::field::Empty,
        outcome = tracing::field::Empty,
        token = tracing::field::Empty,
    )
}

/// Runs the acquisition `acquire` makes in `span`, and records how long it waited, its
/// outcome and its token.
///
/// Takes a closure rather than the future: a future passed in would be stored twice in
/// this one's state (once as captured, once as awaited), and every task queued for a key
/// carries this state.
pub(crate) fn traced<F, Fut>(
    span: tracing::Span,
    acquire: F,
) -> impl Future<Output = Result<LockGuard, LockError>> + Send + 'static
where
    F: FnOnce() -> Fut + Send + 'static,
    Fut: Future<Output = Result<LockGuard, LockError>> + Send + 'static,
{
    async move {
        let started = Instant::now();
        let result = acquire().await;
        let span = tracing::Span::current();
        span.record(
            "waited_ms",
            u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX),
        );
        match &result {
            Ok(guard) => {
                span.record("outcome", "acquired");
                span.record("token", guard.fencing_token());
            }
            Err(e) => {
                span.record("outcome", outcome(e));
            }
        }
        tracing::debug!("lock acquisition finished");
        result
    }
    .instrument(span)
}

fn outcome(error: &LockError) -> &'static str {
    match error {
        LockError::Contended { .. } => "contended",
        LockError::TimedOut { .. } => "timed_out",
        LockError::QueueFull { .. } => "queue_full",
        LockError::InvalidKey(_) => "invalid_key",
        LockError::Lost { .. } => "lost",
        LockError::NotALock { .. } => "not_a_lock",
        LockError::Backend(_) => "backend_error",
    }
}

/// Owner ids of one backend: `instance-uuid:sequence`, a fresh one per request.
pub(crate) struct OwnerIds {
    instance: String,
    sequence: AtomicU64,
}

impl OwnerIds {
    pub(crate) fn new() -> Self {
        OwnerIds {
            instance: uuid::Uuid::new_v4().simple().to_string(),
            sequence: AtomicU64::new(0),
        }
    }

    /// A new owner, never handed out before by any backend.
    pub(crate) fn next(&self) -> LockOwner {
        let seq = self.sequence.fetch_add(1, Ordering::Relaxed);
        LockOwner::new(format!("{}:{seq}", self.instance))
    }

    /// A number never returned before by this backend, to tell holds of one owner apart.
    pub(crate) fn serial(&self) -> u64 {
        self.sequence.fetch_add(1, Ordering::Relaxed)
    }

    /// The instance part of every owner id.
    pub(crate) fn instance(&self) -> &str {
        &self.instance
    }
}

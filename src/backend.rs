//! Where locks live, as an application sees it: [`LockBackend`], built on the lock API's
//! sealed seam (`lock/backend.rs`), and [`BackendStats`].

use crate::error::LockError;
use crate::lock::LockRequest;
use crate::lock::backend::Sealed;
use crate::lock::inspect::{LockInfo, Primitive};
use crate::lock::many::ManyLockRequest;

/// Where locks live: implemented by the backend of every store (see the
/// [list of stores](crate#stores)).
///
/// The layer and [`LockRequest`] hold any backend behind this trait, so no type names the
/// backend (`LockLayer<K>`), and an application can take `impl LockBackend` to run on
/// Redis in production and in memory in its tests.
///
/// The trait is sealed: only this crate's backends implement it. A guard's guarantees
/// (released on every exit path, renewed while it lives, `lost()` when the store proves
/// the lock gone) are kept by code shared with each store's internals, and that seam is
/// not yet a stable public API.
pub trait LockBackend: Sealed + Clone + Send + Sync + 'static {
    /// Starts building an acquisition of `key`.
    fn lock(&self, key: impl Into<String>) -> LockRequest {
        LockRequest::new(self.store(), key.into())
    }

    /// Starts building an acquisition of every key of `keys` at once (at most
    /// [`MAX_KEYS`](crate::lock::MAX_KEYS)): all or none, in canonical order, under one owner
    /// (see [`ManyLockRequest`]).
    fn lock_many<I>(&self, keys: I) -> ManyLockRequest
    where
        I: IntoIterator,
        I::Item: Into<String>,
    {
        ManyLockRequest::new(self.store(), keys.into_iter().map(Into::into).collect())
    }

    /// A campaign for the leadership of `name` among every instance on this store (see
    /// [`LeaderRequest`](crate::LeaderRequest)): `.run(work)` runs `work` while this
    /// instance leads, `.acquire()` waits to lead.
    fn leader(&self, name: impl Into<String>) -> crate::LeaderRequest {
        crate::LeaderRequest::new(self.store(), name.into())
    }

    /// A snapshot of `key`'s lock: free, held exclusively (with its re-entries) or shared
    /// (by how many), the longest remaining lease and the fencing token reached; never
    /// owner ids (see [`LockInfo`]). For operators and admin pages: it takes nothing and
    /// changes nothing. A key that no lock may have (empty, too long) is refused as
    /// [`lock`](Self::lock) refuses it ([`LockError::InvalidKey`]).
    ///
    /// The key's semaphore is a primitive of its own: see
    /// [`inspect_permits`](Self::inspect_permits).
    fn inspect(
        &self,
        key: impl Into<String>,
    ) -> impl Future<Output = Result<LockInfo, LockError>> + Send + 'static {
        self.store().inspect(key.into(), Primitive::Lock)
    }

    /// A snapshot of `key`'s semaphore: [`LockMode::Permits`](crate::LockMode::Permits)
    /// with the permits taken, or free (see [`inspect`](Self::inspect)).
    fn inspect_permits(
        &self,
        key: impl Into<String>,
    ) -> impl Future<Output = Result<LockInfo, LockError>> + Send + 'static {
        self.store().inspect(key.into(), Primitive::Semaphore)
    }

    /// Every lock and semaphore held now whose key starts with `prefix`, as
    /// [`inspect`](Self::inspect) and [`inspect_permits`](Self::inspect_permits) see each
    /// (a key whose lock and semaphore are both held comes twice, its lock first), sorted
    /// by key. For operators and admin pages: it takes nothing and changes nothing.
    ///
    /// - **Exact.** The prefix is matched as the key's first bytes, whatever characters
    ///   either holds (a `*`, `%`, `_` or `{` is itself, not a pattern); the empty prefix
    ///   lists every held key of the backend's namespace.
    /// - **In pages.** The store is read page by page (Redis `SCAN`, never `KEYS`; a range
    ///   of rows, keys or children elsewhere), each page a call bounded by the command
    ///   timeout, so a large keyspace never holds the store up; the keys a page names
    ///   are then inspected, a few at a time.
    /// - **Now, not at one instant.** Each key is read when its page comes: a key held for
    ///   the whole listing is in it, one taken or freed meanwhile may or may not be.
    ///
    /// ```
    /// use tower_lock::{LockBackend, MemoryBackend};
    ///
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), tower_lock::LockError> {
    /// let backend = MemoryBackend::new();
    /// let _a = backend.lock("order:1").try_once().await?;
    /// let _b = backend.lock("order:2").try_once().await?;
    /// let _c = backend.lock("stock:7").try_once().await?;
    /// let held = backend.list_held("order:").await?;
    /// let keys: Vec<&str> = held.iter().map(|info| info.key.as_str()).collect();
    /// assert_eq!(keys, ["order:1", "order:2"]);
    /// # Ok(())
    /// # }
    /// ```
    fn list_held(
        &self,
        prefix: impl Into<String>,
    ) -> impl Future<Output = Result<Vec<LockInfo>, LockError>> + Send + 'static {
        self.store().list_held(prefix.into())
    }

    /// Frees `key`'s lock whatever holds it, an exclusive holder with its re-entries or
    /// every shared holder: an operator's way out when a holder hangs with its lock kept
    /// alive by its watchdog. Returns what it freed (free when nothing was held).
    ///
    /// - **Fenced.** The next holder's fencing token is above every token issued for the
    ///   key so far, including those a process set aside for its own tasks taking turns
    ///   in memory. A store that checks tokens refuses the old holder's late writes.
    /// - **Waiters are woken**, as by a release, and take the key in their usual order.
    /// - **The old holder sees [`HeldLock::lost`](crate::HeldLock::lost)** (by default the
    ///   layer then drops its handler and answers 503), and its release returns
    ///   [`LockError::Lost`] without touching the next holder. On a
    ///   [`MemoryBackend`](crate::MemoryBackend) at once. On a
    ///   [`RedisBackend`](crate::RedisBackend) within a round trip or two wherever the
    ///   backend holding it has its subscriber connected: the force-release announces
    ///   itself on the namespace's admin channel, which every backend subscribes to, and
    ///   each re-checks every lock it holds at once; otherwise (the subscriber is
    ///   reconnecting, or the ACL user may not subscribe to that channel) at its next
    ///   renewal, a third of its lease after the last one. On a `PostgresBackend` the
    ///   same way through its listening connection: the force-release's statement sends
    ///   `NOTIFY` on the namespace's admin channel, which every backend `LISTEN`s to, and
    ///   each re-checks every lock it holds once the statement commits; while that
    ///   connection is reconnecting, at the holder's next renewal.
    ///
    /// Until it learns of it, the old holder goes on as if it held the key, and a process
    /// passing the key between its own tasks in memory may pass it on once more: their
    /// tokens are all below the next holder's, which is what fencing is for.
    ///
    /// The key's semaphore is a primitive of its own: see
    /// [`force_release_permits`](Self::force_release_permits). Refuses bad keys as
    /// [`lock`](Self::lock) does.
    fn force_release(
        &self,
        key: impl Into<String>,
    ) -> impl Future<Output = Result<LockInfo, LockError>> + Send + 'static {
        self.store().force_release(key.into(), Primitive::Lock)
    }

    /// Frees every permit of `key`'s semaphore, as [`force_release`](Self::force_release)
    /// frees its lock (fenced, waiters woken, the holders see `lost()`). Returns what it
    /// freed.
    fn force_release_permits(
        &self,
        key: impl Into<String>,
    ) -> impl Future<Output = Result<LockInfo, LockError>> + Send + 'static {
        self.store().force_release(key.into(), Primitive::Semaphore)
    }
}

/// A snapshot of a backend's connections and bookkeeping, returned by
/// [`RedisBackend::stats`](crate::RedisBackend::stats) and the other stores' `stats`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct BackendStats {
    /// Whether the listening connection (the Redis subscriber, PostgreSQL's `LISTEN`
    /// connection) is up.
    pub subscriber_connected: bool,
    /// How many times the listening connection has been established (1 + reconnects).
    pub subscriber_connections_made: u64,
    /// Release channels with at least one local waiter.
    pub channels_with_waiters: usize,
    /// Held locks the watchdog is renewing or watching.
    pub watched_locks: usize,
    /// Keys with a task of this backend contending for, holding or queued on them. Entries
    /// are removed when the last task leaves, so this returns to 0 when the backend is idle.
    pub local_queues: usize,
    /// Tasks queued in-process behind another task of this backend for the same key.
    pub local_waiters: usize,
}

//! [`LockRequest`]: an acquisition being configured, how it waits ([`Mode`]) and the kind
//! of hold it asks for ([`Kind`]).

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use crate::error::LockError;
use crate::lock::backend::{Acquired, Backend};
use crate::lock::retry::RetryAfter;
use crate::lock::{
    BoxFuture, DEFAULT_LEASE, DEFAULT_MAX_LOCAL_WAITERS, HeldLock, LockGuard, LockOwner,
    MAX_DURATION,
};
use crate::telemetry::Route;

/// How an acquisition waits when the lock is held.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    TryOnce,
    Wait(Duration),
}

impl Mode {
    /// A wait of at most [`MAX_DURATION`], so that its deadline cannot overflow.
    pub(crate) fn clamped(self) -> Self {
        match self {
            Mode::Wait(wait) => Mode::Wait(wait.min(MAX_DURATION)),
            Mode::TryOnce => Mode::TryOnce,
        }
    }
}

/// The kind of hold an acquisition asks for. `pub` in a private module, so that the sealed
/// [`HoldPolicy`](crate::lock::policy::HoldPolicy) can name it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// The lock itself: one owner at a time (the default).
    Exclusive,
    /// A shared (read) hold of the key's read/write lock: any number at once, none while
    /// an owner holds the key exclusively.
    Shared,
    /// One of this many permits of the key's semaphore.
    Permit(u32),
}

impl Kind {
    /// The `mode` label of an acquisition and its hold: a read/write route's shared reads
    /// and exclusive writes wait and hold for different times, so they are separate series.
    pub(crate) fn label(self) -> &'static str {
        match self {
            Kind::Exclusive => "exclusive",
            Kind::Shared => "shared",
            Kind::Permit(_) => "permit",
        }
    }
}

/// A lock acquisition being configured; finish it with [`try_once`](Self::try_once) or
/// [`wait`](Self::wait). Created by [`LockBackend::lock`](crate::LockBackend::lock).
///
/// ```no_run
/// use std::time::Duration;
/// use tower_lock::{LockError, RedisBackend};
///
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let backend = RedisBackend::connect("redis://127.0.0.1:6379").await?;
///
/// // Wait up to a second for the lock, then give up with `LockError::TimedOut`.
/// let guard = backend.lock("order:42").wait(Duration::from_secs(1)).await?;
/// let token = guard.fencing_token(); // pass it to the store you write to
/// guard.release().await?;
///
/// // Or do not wait at all: `LockError::Contended` if someone holds it.
/// match backend.lock("order:42").try_once().await {
///     Ok(guard) => drop(guard), // dropping releases in a background task
///     Err(LockError::Contended { retry_after, .. }) => println!("busy for {retry_after:?}"),
///     Err(other) => return Err(other.into()),
/// }
/// # Ok(())
/// # }
/// ```
#[must_use = "a lock request does nothing until `try_once` or `wait` is awaited"]
pub struct LockRequest {
    pub(crate) store: Arc<dyn Backend>,
    pub(crate) key: String,
    pub(crate) owner: Option<LockOwner>,
    pub(crate) lease: Duration,
    pub(crate) watchdog: bool,
    pub(crate) mode: Mode,
    pub(crate) max_local_waiters: usize,
    pub(crate) kind: Kind,
    /// The `route` label of the acquisition's metrics.
    pub(crate) route: Route,
    /// What a refusal for contention says about when to try again.
    pub(crate) retry: RetryAfter,
    /// Take no new hold while the key's idempotency record exists, if the store can check
    /// it as it takes the hold (see [`Acquired`]).
    pub(crate) unless_recorded: bool,
}

impl LockRequest {
    pub(crate) fn new(store: Arc<dyn Backend>, key: String) -> Self {
        LockRequest {
            store,
            key,
            owner: None,
            lease: DEFAULT_LEASE,
            watchdog: true,
            mode: Mode::TryOnce,
            max_local_waiters: DEFAULT_MAX_LOCAL_WAITERS,
            kind: Kind::Exclusive,
            route: Route::default(),
            retry: RetryAfter::Lease,
            unless_recorded: false,
        }
    }

    /// Sets the lease (default 30 s, at most [`MAX_DURATION`]). While the guard lives the watchdog renews it every
    /// lease/3; if the holder dies, the lock frees itself at most one lease later.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = lease.clamp(Duration::from_millis(3), MAX_DURATION);
        self
    }

    /// Turns renewal off: the lock expires one lease after it was taken even if the guard
    /// is still alive, and [`HeldLock::lost`] fires then. For work that must never hold a
    /// lock past a deadline.
    pub fn without_watchdog(mut self) -> Self {
        self.watchdog = false;
        self
    }

    /// Bounds the tasks of this backend queued for the key (default 1024). Tasks of one
    /// backend waiting for the same key queue in-process and only the first talks to
    /// Redis; a request that would be queued past this bound fails at once with
    /// [`LockError::QueueFull`] (503 from the layer), shedding load instead of piling up.
    pub fn max_local_waiters(mut self, max: usize) -> Self {
        self.max_local_waiters = max;
        self
    }

    /// Takes a shared (read) hold of the key's read/write lock instead of the exclusive
    /// one. Any number of owners hold a key shared at once; an exclusive acquisition (the
    /// default, the writer) waits until none does and excludes them while it holds the
    /// key. A writer that waits is not starved: shared acquisitions that arrive after it
    /// queue behind it.
    ///
    /// Shared holds are reentrant per owner like the lock, and a writer may take a shared
    /// hold of a key it holds exclusively (a downgrade: the shared hold outlives the
    /// exclusive one when that is released first). The opposite is refused with
    /// [`LockError::UpgradeRefused`]: two readers upgrading would wait for each other
    /// forever. A shared hold carries the fencing token of the key's last exclusive
    /// acquisition ([`HeldLock::is_shared`] tells the two apart).
    pub fn shared(mut self) -> Self {
        self.kind = Kind::Shared;
        self
    }

    /// Takes one of `n` permits of the key's semaphore instead of the lock: up to `n`
    /// owners hold the key at once. Each permit has its own owner and lease, renewed by
    /// the watchdog and freed on release or when its lease runs out, so a crashed holder
    /// never keeps a permit longer than one lease. When all are taken, `try_once` fails
    /// with [`LockError::PermitsTaken`] and `wait` waits for a permit to be freed (woken
    /// by its release message).
    ///
    /// `n` is read at every acquisition, not stored with the semaphore: an acquisition
    /// succeeds when fewer than its own `n` permits are held. Lowering `n` for a key in
    /// use revokes no permit (holders keep theirs; new acquisitions wait until fewer than
    /// the new `n` are held); raising it admits more at once. A semaphore is a separate
    /// primitive from the key's lock: `lock(key)` and `lock(key).permits(n)` do not
    /// exclude each other. `n == 0` fails with [`LockError::ZeroPermits`], taking
    /// nothing. Each permit gets its own fencing token.
    pub fn permits(mut self, n: u32) -> Self {
        self.kind = Kind::Permit(n);
        self
    }

    /// Acquires as the owner of `held`, so taking a key that `held`'s owner already holds
    /// re-enters it instead of deadlocking (the count goes up; the fencing token stays).
    pub fn reentrant(mut self, held: &HeldLock) -> Self {
        self.owner = Some(held.owner().clone());
        self
    }

    pub(crate) fn kind(mut self, kind: Kind) -> Self {
        self.kind = kind;
        self
    }

    pub(crate) fn owner(mut self, owner: LockOwner) -> Self {
        self.owner = Some(owner);
        self
    }

    /// The `route` label of this acquisition's metrics (default empty), as
    /// [`LockLayer::metrics_label`](crate::LockLayer::metrics_label) sets it for a layer.
    /// Keep it to a fixed set of names: every value is its own time series. Does nothing
    /// without the `metrics` feature.
    pub fn metrics_label(mut self, label: impl Into<std::borrow::Cow<'static, str>>) -> Self {
        self.route = Route::new(label.into());
        self
    }

    pub(crate) fn route(mut self, route: Route) -> Self {
        self.route = route;
        self
    }

    /// Sets the `retry_after` of a refusal for contention ([`LockError::Contended`],
    /// [`PermitsTaken`](LockError::PermitsTaken), [`TimedOut`](LockError::TimedOut)) to
    /// `retry_after`, for a caller that knows how long its holders' work takes. Without
    /// it the refusal carries the holder's remaining lease as the store reported it, an
    /// upper bound on when the lock frees if its holder stops renewing, but not when a
    /// holder that finishes its work releases it.
    pub fn retry_after(mut self, retry_after: Duration) -> Self {
        self.retry = RetryAfter::Fixed(retry_after);
        self
    }

    pub(crate) fn retry(mut self, retry: RetryAfter) -> Self {
        self.retry = retry;
        self
    }

    /// Tries once; `Err(LockError::Contended)` if another owner holds the lock.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future before it completes takes no lock: an attempt already sent
    /// to the backend is undone in the background if it succeeded, and nothing is held
    /// for the caller.
    // Not an `async fn`: the backend's future already owns the request, and a task
    // parked in a queue should not carry a second copy of it.
    pub fn try_once(self) -> impl Future<Output = Result<LockGuard, LockError>> + Send + 'static {
        self.mode(Mode::TryOnce).into_future()
    }

    /// Waits up to `timeout` (at most [`MAX_DURATION`]) for the lock, woken by release
    /// messages rather than by polling; `Err(LockError::TimedOut)` if it is still held then.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future (an outer timeout, a client gone) gives up its place in the
    /// key's queue and takes no lock: an attempt already sent
    /// to the backend is undone in the background if it succeeded. Waiting again starts
    /// at the back of the queue.
    pub fn wait(
        self,
        timeout: Duration,
    ) -> impl Future<Output = Result<LockGuard, LockError>> + Send + 'static {
        self.mode(Mode::Wait(timeout)).into_future()
    }

    pub(crate) fn mode(mut self, mode: Mode) -> Self {
        self.mode = mode.clamped();
        self
    }

    /// The same settings for `key`, under `owner` (one key of a multi-key acquisition).
    pub(crate) fn for_key(&self, key: String, owner: LockOwner) -> Self {
        LockRequest {
            store: self.store.clone(),
            key,
            owner: Some(owner),
            lease: self.lease,
            watchdog: self.watchdog,
            mode: self.mode,
            max_local_waiters: self.max_local_waiters,
            kind: self.kind,
            route: self.route.clone(),
            retry: self.retry.clone(),
            unless_recorded: false,
        }
    }

    pub(crate) fn into_future(self) -> BoxFuture<'static, Result<LockGuard, LockError>> {
        Arc::clone(&self.store).acquire(self)
    }

    /// The idempotency layer's acquisition (see [`Acquired`]): waits as `mode` says.
    pub(crate) fn unless_recorded(
        mut self,
        mode: Mode,
    ) -> BoxFuture<'static, Result<Acquired, LockError>> {
        self.unless_recorded = true;
        Arc::clone(&self.store).acquire_unless_recorded(self.mode(mode))
    }
}

impl fmt::Debug for LockRequest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LockRequest")
            .field("key", &self.key)
            .field("owner", &self.owner)
            .field("lease", &self.lease)
            .field("watchdog", &self.watchdog)
            .field("mode", &self.mode)
            .field("max_local_waiters", &self.max_local_waiters)
            .field("kind", &self.kind)
            .field("retry_after", &self.retry)
            .finish_non_exhaustive()
    }
}

//! Multi-key locks: every key or none, taken in one canonical order under one owner.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use futures_util::future::join_all;
use tokio::time::Instant;

use crate::error::{KeyError, LockError};
use crate::key::validate;
use crate::lock::backend::Backend;
use crate::lock::retry::RetryAfter;
use crate::lock::{
    BoxFuture, HeldLock, Kind, LockGuard, LockOwner, LockRequest, MAX_DURATION, Mode, ReleaseHold,
};
use crate::telemetry::Route;

/// The most different keys one [`lock_many`](crate::LockBackend::lock_many) takes. Each
/// key is one acquisition (one round trip when free), taken one after another.
pub const MAX_KEYS: usize = 16;

/// An acquisition of several keys at once, being configured; finish it with
/// [`try_once`](Self::try_once) or [`wait`](Self::wait). Created by
/// [`LockBackend::lock_many`](crate::LockBackend::lock_many).
///
/// The keys are taken one by one in canonical (byte) order, whatever order they were
/// given in, so two requests locking `{a, b}` and `{b, a}` never deadlock: whoever has
/// `a` gets `b` next. All of them or none: if one cannot be had (held and not waited for,
/// or the wait ran out), the keys already taken are released before the error returns.
/// They are held under one owner, each with its own fencing token
/// ([`HeldLock::keys`]), renewed together and released together. A key given twice (a
/// transfer from an account to itself) is taken once.
///
/// The order holds within one acquisition: keys already held by the same owner (an outer
/// layer, [`reentrant`](Self::reentrant)) that sort after one of `keys` were taken out of
/// order, and can deadlock with another request until a wait runs out. Take all of a
/// request's keys in one acquisition.
///
/// On Redis Cluster the keys may hash to different slots: each is a lock of its own on
/// its own shard, so the acquisition costs one round trip per key (per shard), in
/// sequence, and a wait is a wait on each held key in turn.
///
/// ```no_run
/// use std::time::Duration;
/// use tower_lock::{LockBackend, RedisBackend};
///
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let backend = RedisBackend::connect("redis://127.0.0.1:6379").await?;
/// // A transfer from B to A locks both accounts, in the same order as one from A to B.
/// let guard = backend
///     .lock_many(["account:B", "account:A"])
///     .wait(Duration::from_secs(2))
///     .await?;
/// for (key, token) in guard.held().keys() {
///     println!("{key} under token {token}");
/// }
/// guard.release().await?;
/// # Ok(())
/// # }
/// ```
#[must_use = "a lock request does nothing until `try_once` or `wait` is awaited"]
pub struct ManyLockRequest {
    keys: Vec<String>,
    /// The settings every key is taken with (its key unused).
    each: LockRequest,
}

impl ManyLockRequest {
    pub(crate) fn new(store: Arc<dyn Backend>, keys: Vec<String>) -> Self {
        ManyLockRequest {
            keys,
            each: LockRequest::new(store, String::new()),
        }
    }

    fn each(mut self, set: impl FnOnce(LockRequest) -> LockRequest) -> Self {
        self.each = set(self.each);
        self
    }

    /// Sets the lease of every key (see [`LockRequest::lease`]).
    pub fn lease(self, lease: Duration) -> Self {
        self.each(|each| each.lease(lease))
    }

    /// Turns renewal off for every key (see [`LockRequest::without_watchdog`]).
    pub fn without_watchdog(self) -> Self {
        self.each(LockRequest::without_watchdog)
    }

    /// Bounds the tasks queued for each key (see [`LockRequest::max_local_waiters`]).
    pub fn max_local_waiters(self, max: usize) -> Self {
        self.each(|each| each.max_local_waiters(max))
    }

    /// Takes a shared hold of every key's read/write lock instead of the exclusive one
    /// (see [`LockRequest::shared`]).
    pub fn shared(self) -> Self {
        self.each(LockRequest::shared)
    }

    /// Sets the `retry_after` of a refusal for contention (see
    /// [`LockRequest::retry_after`]).
    pub fn retry_after(self, retry_after: Duration) -> Self {
        self.each(|each| each.retry_after(retry_after))
    }

    /// Acquires as the owner of `held`, re-entering the keys it already holds.
    pub fn reentrant(self, held: &HeldLock) -> Self {
        self.each(|each| each.reentrant(held))
    }

    /// The `route` label of the acquisitions' metrics (see
    /// [`LockRequest::metrics_label`]).
    pub fn metrics_label(self, label: impl Into<std::borrow::Cow<'static, str>>) -> Self {
        self.each(|each| each.metrics_label(label))
    }

    pub(crate) fn owner(self, owner: LockOwner) -> Self {
        self.each(|each| each.owner(owner))
    }

    /// The kind of hold every key is taken with (the layer's policy decides it).
    pub(crate) fn kind(self, kind: Kind) -> Self {
        self.each(|each| each.kind(kind))
    }

    pub(crate) fn route(self, route: Route) -> Self {
        self.each(|each| each.route(route))
    }

    pub(crate) fn retry(self, retry: RetryAfter) -> Self {
        self.each(|each| each.retry(retry))
    }

    /// Tries each key once; `Err(LockError::Contended)` naming the first key another owner
    /// holds, with nothing held.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future releases (in the background) the keys it took.
    pub fn try_once(self) -> impl Future<Output = Result<LockGuard, LockError>> + Send + 'static {
        self.into_future(Mode::TryOnce)
    }

    /// Waits up to `timeout` in all for every key; `Err(LockError::TimedOut)` naming the
    /// key still held then, with nothing held.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future releases (in the background) the keys it took.
    pub fn wait(
        self,
        timeout: Duration,
    ) -> impl Future<Output = Result<LockGuard, LockError>> + Send + 'static {
        self.into_future(Mode::Wait(timeout.min(MAX_DURATION)))
    }

    pub(crate) fn into_future(
        self,
        mode: Mode,
    ) -> BoxFuture<'static, Result<LockGuard, LockError>> {
        Box::pin(self.acquire(mode.clamped()))
    }

    async fn acquire(self, mode: Mode) -> Result<LockGuard, LockError> {
        let ManyLockRequest { keys, each } = self;
        let keys = canonical(keys, each.store.max_key_len()).map_err(LockError::InvalidKey)?;
        let owner = each.owner.clone().unwrap_or_else(|| each.store.new_owner());
        let started = Instant::now();
        let deadline = match mode {
            Mode::Wait(wait) => Some(started.checked_add(wait).unwrap_or(started + MAX_DURATION)),
            Mode::TryOnce => None,
        };
        let mut taken: Vec<LockGuard> = Vec::with_capacity(keys.len());
        for key in keys {
            let mode = match deadline {
                Some(deadline) => Mode::Wait(deadline.saturating_duration_since(Instant::now())),
                None => Mode::TryOnce,
            };
            let request = each.for_key(key, owner.clone()).mode(mode);
            match request.into_future().await {
                Ok(mut guard) => {
                    // Timed below as one hold, once every key is held: a key given back
                    // (another was held) or a wait given up is no hold of the work.
                    guard.time_hold(None);
                    taken.push(guard);
                }
                Err(error) => {
                    // None of them, and the keys taken are free again when this returns.
                    join_all(taken.into_iter().map(LockGuard::release)).await;
                    return Err(match error {
                        LockError::TimedOut {
                            key, retry_after, ..
                        } => LockError::TimedOut {
                            key,
                            waited: started.elapsed(),
                            retry_after,
                        },
                        other => other,
                    });
                }
            }
        }
        let mut guard = combine(owner, taken);
        guard.time_hold(each.retry.clock());
        Ok(guard)
    }
}

impl fmt::Debug for ManyLockRequest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ManyLockRequest")
            .field("keys", &self.keys)
            .field("owner", &self.each.owner)
            .field("lease", &self.each.lease)
            .field("watchdog", &self.each.watchdog)
            .field("kind", &self.each.kind)
            .finish_non_exhaustive()
    }
}

/// The keys sorted and each taken once, after checking that there are some, not too
/// many, and each one a key the backend takes (`max_len`): a refusal takes nothing.
///
/// A key given twice is one lock, held and released once: a transfer from an account to
/// itself locks the account, rather than failing or re-entering its own hold.
pub(crate) fn canonical(mut keys: Vec<String>, max_len: usize) -> Result<Vec<String>, KeyError> {
    if keys.is_empty() {
        return Err(KeyError::NoKeys);
    }
    for key in &keys {
        validate(key, max_len)?;
    }
    keys.sort_unstable();
    keys.dedup();
    if keys.len() > MAX_KEYS {
        return Err(KeyError::TooManyKeys {
            count: keys.len(),
            max: MAX_KEYS,
        });
    }
    Ok(keys)
}

/// One guard for the keys of `taken` (in canonical order): lost when any of them is (its
/// `HeldLock` asks and polls every key's own signal).
fn combine(owner: LockOwner, mut taken: Vec<LockGuard>) -> LockGuard {
    if taken.len() == 1 {
        if let Some(only) = taken.pop() {
            return only;
        }
    }
    let mut tokens = taken.iter().flat_map(|g| g.held().lost_tokens());
    let first = tokens.next().unwrap_or_default();
    let parts = tokens.collect();
    let mut keys = taken
        .iter()
        .map(|g| (g.key().to_owned(), g.fencing_token()));
    let (key, token) = keys.next().unwrap_or_default();
    // Every key is taken the same way, so one shared key means all are.
    let shared = taken.iter().all(|g| g.held().is_shared());
    let held = HeldLock::new_many(key, token, keys.collect(), owner, (first, parts));
    LockGuard::new(held.into_shared(shared), Box::new(Holds { guards: taken }))
}

/// The holds of a multi-key lock, released together.
struct Holds {
    guards: Vec<LockGuard>,
}

impl ReleaseHold for Holds {
    fn release(self: Box<Self>) -> BoxFuture<'static, Result<(), LockError>> {
        let Holds { guards } = *self;
        Box::pin(async move {
            let outcomes = join_all(guards.into_iter().map(LockGuard::release)).await;
            // A lost key says the most: the others were released.
            let lost = outcomes
                .iter()
                .position(|o| matches!(o, Err(LockError::Lost { .. })));
            let first_error = lost.or_else(|| outcomes.iter().position(Result::is_err));
            match first_error {
                Some(i) => outcomes.into_iter().nth(i).unwrap_or(Ok(())),
                None => Ok(()),
            }
        })
    }

    fn release_in_background(self: Box<Self>) {
        // Each guard releases itself in the background as it drops.
    }
}

//! [`MemoryBackend`]: the lock semantics of the crate inside one process.
//!
//! Every task of a process that shares one `MemoryBackend` (clones share it) sees the same
//! locks, with the guarantees of the Redis backend: one owner per request and re-entry by
//! that owner, leases that expire when nobody renews them (and then fire
//! [`HeldLock::lost`]), FIFO waiting without polling, strictly increasing fencing tokens,
//! and the same errors. For tests and examples that should run without Redis, and for
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

use std::collections::HashMap;
use std::collections::hash_map::Entry as MapEntry;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio::time::{Instant, sleep_until};
use tokio_util::sync::CancellationToken;

use crate::backend::{LockBackend, Observe, OwnerIds, Sealed, Store};
use crate::error::LockError;
use crate::key::validate;
use crate::lock::{BoxFuture, HeldLock, LockGuard, LockOwner, LockRequest, Mode, ReleaseHold};
use crate::queue::{Claim, Queues, Slot, Turn};
use crate::spawner::Spawner;
use crate::telemetry::Namespace;

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
    queues: Queues,
    locks: Mutex<HashMap<Arc<str>, Lock>>,
    /// One counter for every key: a token is above every earlier token of its key, and
    /// no per-key state outlives a release. It starts at the clock in microseconds, as
    /// Redis tokens never fall below, so a restarted process does not hand out tokens a
    /// fenced store has already seen.
    tokens: AtomicU64,
    /// Where expiry timers run, also when a guard is dropped outside any runtime.
    runtime: Spawner,
    generations: AtomicU64,
    /// The `namespace` label of the metrics: `memory`.
    metrics: Namespace,
}

/// One held key.
struct Lock {
    owner: LockOwner,
    /// Holds of `owner` on this key (re-entries included).
    holds: u32,
    /// Holds that asked for renewal: while there is one, the lock does not expire.
    renewing: u32,
    /// When the lock expires once no renewing hold is left.
    expires: Instant,
    lease: Duration,
    /// Tells this lock from a later one of the same key, so a stale guard or timer
    /// cannot touch it.
    generation: u64,
    token: u64,
    lost: CancellationToken,
    /// The key's queue slot: passed to the next waiting task when the lock is freed.
    slot: Option<Slot>,
}

impl MemoryBackend {
    /// An empty store.
    pub fn new() -> Self {
        crate::telemetry::describe_metrics();
        MemoryBackend {
            inner: Arc::new(Inner {
                owners: OwnerIds::new(),
                queues: Queues::default(),
                locks: Mutex::new(HashMap::new()),
                tokens: AtomicU64::new(clock_micros()),
                runtime: Spawner::default(),
                generations: AtomicU64::new(0),
                metrics: Namespace::new("memory"),
            }),
        }
    }

    /// Starts building an acquisition of `key` (see [`LockRequest`]).
    pub fn lock(&self, key: impl Into<String>) -> LockRequest {
        LockBackend::lock(self, key)
    }

    /// Starts building an acquisition of every key of `keys` at once, all or none (see
    /// [`ManyLockRequest`](crate::ManyLockRequest)).
    pub fn lock_many<I>(&self, keys: I) -> crate::ManyLockRequest
    where
        I: IntoIterator,
        I::Item: Into<String>,
    {
        LockBackend::lock_many(self, keys)
    }

    /// How many keys are held right now.
    pub fn held(&self) -> usize {
        self.inner.locks().len()
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
    fn store(&self) -> Arc<dyn Store> {
        self.inner.clone()
    }
}

impl LockBackend for MemoryBackend {}

impl Store for Inner {
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
}

impl Inner {
    fn locks(&self) -> MutexGuard<'_, HashMap<Arc<str>, Lock>> {
        // Nothing under this lock can panic half-way through an update.
        self.locks.lock().unwrap_or_else(|e| e.into_inner())
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
        let deadline = match request.mode {
            Mode::TryOnce => None,
            Mode::Wait(wait) => Some(started + wait),
        };
        let wait = deadline.map(|deadline| (deadline, request.max_local_waiters));
        match self.queues.turn(&key, &claim, wait).await {
            Turn::Contend(slot) => self.take(&key, &claim, slot),
            Turn::HandedOver(guard) => Ok(guard),
            Turn::Busy => Err(LockError::Contended {
                key: key.to_string(),
                retry_after: self.remaining(&key),
            }),
            Turn::Full => Err(LockError::QueueFull {
                key: key.to_string(),
            }),
            // Queued behind a task of this process, as on Redis: the holder's lease says
            // little of when the queue ahead will have moved.
            Turn::TimedOut => Err(LockError::TimedOut {
                key: key.to_string(),
                waited: started.elapsed(),
                retry_after: None,
            }),
        }
    }

    /// How long the holder of `key` keeps it at most, for `Retry-After`.
    fn remaining(&self, key: &str) -> Option<Duration> {
        let locks = self.locks();
        let lock = locks.get(key)?;
        Some(if lock.renewing > 0 {
            lock.lease
        } else {
            lock.expires.saturating_duration_since(Instant::now())
        })
    }

    /// Takes or re-enters `key` for `claim`. With a slot the key is free in this process,
    /// so the only lock left in the map is one that expired (its guard still alive).
    fn take(
        self: &Arc<Self>,
        key: &Arc<str>,
        claim: &Claim,
        slot: Option<Slot>,
    ) -> Result<LockGuard, LockError> {
        let now = Instant::now();
        let mut locks = self.locks();
        let lock = match locks.entry(key.clone()) {
            MapEntry::Occupied(entry) if entry.get().owner == claim.owner => {
                let lock = entry.into_mut();
                lock.holds += 1;
                lock.expires = lock.expires.max(now + claim.lease);
                // The slot reached a queued task of this owner after another acquisition
                // of the same owner had taken the key: the lock keeps the slot, so the
                // queue moves on only when the key is freed.
                if lock.slot.is_none() {
                    lock.slot = slot;
                }
                lock
            }
            MapEntry::Occupied(entry) => {
                let lock = entry.into_mut();
                if lock.slot.is_none() {
                    lock.slot = slot;
                }
                return Err(LockError::Contended {
                    key: key.to_string(),
                    retry_after: Some(lock.lease),
                });
            }
            MapEntry::Vacant(entry) => entry.insert(Lock {
                owner: claim.owner.clone(),
                holds: 1,
                renewing: 0,
                expires: now + claim.lease,
                lease: claim.lease,
                generation: self.generations.fetch_add(1, Ordering::Relaxed),
                token: self.tokens.fetch_add(1, Ordering::Relaxed),
                lost: CancellationToken::new(),
                slot,
            }),
        };
        lock.renewing += u32::from(claim.renew);
        let held = HeldLock::new(
            key.to_string(),
            claim.owner.clone(),
            lock.token,
            lock.lost.clone(),
        );
        let hold = MemoryHold {
            inner: self.clone(),
            key: key.clone(),
            generation: lock.generation,
            lease: claim.lease,
            renew: claim.renew,
        };
        let reentry = lock.holds > 1;
        if lock.renewing == 0 {
            self.expire_when_due(key.clone(), lock.generation);
        }
        drop(locks);
        Ok(LockGuard::new(held, Box::new(hold)).reentry(reentry))
    }

    /// Starts a timer that frees the lock `generation` of `key` when its lease runs out
    /// with no renewing hold left. The timer re-arms while the deadline moves on, and
    /// holds no reference that would keep the backend alive.
    fn expire_when_due(self: &Arc<Self>, key: Arc<str>, generation: u64) {
        let inner = Arc::downgrade(self);
        self.runtime.spawn(async move {
            loop {
                let Some(due) = next_expiry(&inner, &key, generation) else {
                    return;
                };
                sleep_until(due).await;
            }
        });
    }

    /// Removes `key`'s lock if it is `generation`; its slot is returned to be dropped
    /// (passed on) after the map's lock is released.
    fn free(locks: &mut HashMap<Arc<str>, Lock>, key: &Arc<str>, generation: u64) -> Option<Slot> {
        let lock = locks.remove(key)?;
        if lock.generation != generation {
            locks.insert(key.clone(), lock);
            return None;
        }
        lock.slot
    }
}

/// Microseconds since the Unix epoch (1 if the clock reads earlier).
fn clock_micros() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(1, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
}

/// What the expiry timer of one lock waits for next: `None` when there is nothing left
/// to wait for (the lock is gone, renewed, or was freed just now).
fn next_expiry(inner: &Weak<Inner>, key: &Arc<str>, generation: u64) -> Option<Instant> {
    let inner = inner.upgrade()?;
    let mut locks = inner.locks();
    let lock = locks.get(key).filter(|l| l.generation == generation)?;
    if lock.renewing > 0 {
        return None;
    }
    if lock.expires > Instant::now() {
        return Some(lock.expires);
    }
    lock.lost.cancel();
    let slot = Inner::free(&mut locks, key, generation);
    drop(locks);
    drop(slot);
    None
}

/// One hold of a [`MemoryBackend`] lock.
struct MemoryHold {
    inner: Arc<Inner>,
    key: Arc<str>,
    generation: u64,
    lease: Duration,
    renew: bool,
}

impl MemoryHold {
    fn give_back(&self) -> Result<(), LockError> {
        let mut locks = self.inner.locks();
        let lost = || LockError::Lost {
            key: self.key.to_string(),
        };
        let Some(lock) = locks
            .get_mut(&self.key)
            .filter(|l| l.generation == self.generation)
        else {
            return Err(lost());
        };
        lock.holds = lock.holds.saturating_sub(1);
        if self.renew {
            lock.renewing = lock.renewing.saturating_sub(1);
            // The last renewal left the lock one lease to live.
            lock.expires = lock.expires.max(Instant::now() + self.lease);
        }
        let (holds, renewing) = (lock.holds, lock.renewing);
        let slot = if holds == 0 {
            Inner::free(&mut locks, &self.key, self.generation)
        } else {
            None
        };
        drop(locks);
        drop(slot);
        if holds > 0 && renewing == 0 && self.renew {
            self.inner
                .expire_when_due(self.key.clone(), self.generation);
        }
        Ok(())
    }
}

impl ReleaseHold for MemoryHold {
    fn release(self: Box<Self>) -> BoxFuture<'static, Result<(), LockError>> {
        Box::pin(std::future::ready(self.give_back()))
    }

    fn release_in_background(self: Box<Self>) {
        let _ = self.give_back();
    }
}

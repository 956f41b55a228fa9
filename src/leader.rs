//! One leader per name among the instances of a service (the scheduler, the outbox relay,
//! the cache warmer): [`LeaderRequest`], made by `backend.leader(name)`, and the
//! [`Leadership`] it gives.
//!
//! A leadership is the lock of the key `leader:<name>`, taken on the backend's store with
//! the lock's every guarantee: waited for by wake-ups (a candidate learns that the leader
//! resigned as a waiter learns of a release), renewed by the watchdog while this instance
//! leads, lost when renewal proves it gone or its lease has run out while the store was
//! unreachable (the watchdog stops before the lease ends, so the old leader knows it has
//! lost before another can lead), and fenced: its [`fencing_token`](Leadership::fencing_token)
//! is the epoch, strictly above every earlier leader's of the name. Operators see it as
//! that key (`inspect("leader:outbox-relay")`, `list_held("leader:")`) and can depose a
//! leader with `force_release`.
//!
//! ```
//! use std::time::Duration;
//! use tower_lock::{Leadership, LockBackend, MemoryBackend};
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), tower_lock::LockError> {
//! let backend = MemoryBackend::new(); // any store: RedisBackend, PostgresBackend, ...
//! let relay = backend
//!     .leader("outbox-relay")
//!     .lease(Duration::from_secs(15))
//!     .run(|leadership: Leadership| async move {
//!         // Runs while this instance leads; dropped as soon as it does not.
//!         let epoch = leadership.fencing_token(); // guards the leader's writes
//!         # let _ = epoch;
//!     });
//! # let _ = tokio::time::timeout(Duration::from_millis(10), relay).await;
//! # Ok(())
//! # }
//! ```

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::{CancellationToken, DropGuard};

use crate::core::kit::backoff::{Backoff, INITIAL_BACKOFF};
use crate::error::LockError;
use crate::lock::backend::Backend;
use crate::lock::{DEFAULT_LEASE, LockGuard, LockRequest, MAX_DURATION};

/// What the key of a leadership starts with: `leader:<name>`.
pub const LEADER_PREFIX: &str = "leader:";

/// The longest wait between two campaigns of an instance that cannot reach the store.
const MAX_CAMPAIGN_BACKOFF: Duration = Duration::from_secs(5);

/// A campaign for the leadership of one name, made by `backend.leader(name)`: set its lease,
/// then [`run`](Self::run) work while this instance leads or [`acquire`](Self::acquire)
/// the leadership once.
#[must_use = "a campaign does nothing until it is run or acquired"]
pub struct LeaderRequest {
    store: Arc<dyn Backend>,
    name: String,
    lease: Duration,
}

impl LeaderRequest {
    pub(crate) fn new(store: Arc<dyn Backend>, name: String) -> Self {
        LeaderRequest {
            store,
            name,
            lease: DEFAULT_LEASE,
        }
    }

    /// One campaign's acquisition: the lock of the leadership's key, waited for without
    /// end.
    fn campaign(&self) -> impl Future<Output = Result<LockGuard, LockError>> + Send + 'static {
        let key = format!("{LEADER_PREFIX}{}", self.name);
        LockRequest::new(self.store.clone(), key)
            .lease(self.lease)
            .metrics_label("leader")
            .wait(MAX_DURATION)
    }

    /// The leadership's lease (default [`DEFAULT_LEASE`], 30 s), renewed every third of it
    /// while this instance leads: a leader that stops (killed, paused, cut off from the
    /// store) is replaced about one lease later, and learns it has lost before then.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }

    /// Waits until this instance leads (woken when the leader resigns or its lease runs
    /// out, never by polling) and returns the [`Leadership`]; dropping it resigns.
    ///
    /// The wait has no end of its own (put a timeout around it for one): a store that
    /// cannot be reached is tried again with backoff, logged once per outage. It fails
    /// only for what waiting cannot fix: a name no key may have
    /// ([`LockError::InvalidKey`]), or a key that holds foreign data.
    pub async fn acquire(&self) -> Result<Leadership, LockError> {
        let mut backoff = Backoff::up_to(MAX_CAMPAIGN_BACKOFF);
        let mut outage = false;
        loop {
            match self.campaign().await {
                Ok(guard) => {
                    if outage {
                        tracing::info!(leader = %self.name, "leader campaign reaches the store again");
                    }
                    return Ok(Leadership::new(self.name.clone(), guard));
                }
                Err(error) if !campaigns_again(&error) => return Err(error),
                Err(error) => {
                    if !outage {
                        tracing::warn!(
                            leader = %self.name,
                            error = %error,
                            "leader campaign failed; trying again with backoff"
                        );
                        outage = true;
                    }
                    tokio::time::sleep(backoff.next()).await;
                }
            }
        }
    }

    /// Runs `work` each time this instance leads: campaigns ([`acquire`](Self::acquire)),
    /// runs `work(leadership)` while it leads, and drops `work`'s future as soon as the
    /// leadership is lost (its work stops at its next `.await`). When `work` returns, this
    /// instance resigns. In both cases it campaigns again, 20 ms after a resignation and
    /// after a backoff doubling up to a third of the lease after a loss, until the
    /// returned future is dropped, which resigns at once.
    ///
    /// The future ends only with an error waiting cannot fix (see
    /// [`acquire`](Self::acquire)). At most one instance runs `work` for a name at any
    /// time, under the guarantees of the store's locks (see the guide): with fencing as
    /// the net for the writes of a leader paused past its lease.
    pub async fn run<F, Fut>(self, mut work: F) -> Result<(), LockError>
    where
        F: FnMut(Leadership) -> Fut,
        Fut: Future<Output = ()>,
    {
        let mut backoff = Backoff::up_to(self.lease / 3);
        loop {
            let mut leadership = self.acquire().await?;
            let lost = leadership.guard.held().clone();
            let resigned = CancellationToken::new();
            leadership.resigned = Some(resigned.clone().drop_guard());
            tokio::select! {
                () = work(leadership) => {}
                () = lost.lost() => {}
                // `work` dropped its leadership before returning: it no longer leads.
                () = resigned.cancelled() => {}
            }
            if !lost.is_lost() {
                // Resigned: campaign again after a pause that lets the other candidates
                // in, so that work that returns at once does not spin on the store.
                backoff.reset();
                tokio::time::sleep(INITIAL_BACKOFF).await;
            } else {
                tracing::warn!(
                    leader = %self.name,
                    epoch = lost.fencing_token(),
                    "leadership lost; its work was stopped"
                );
                tokio::time::sleep(backoff.next()).await;
            }
        }
    }
}

impl fmt::Debug for LeaderRequest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LeaderRequest")
            .field("name", &self.name)
            .field("lease", &self.lease)
            .finish_non_exhaustive()
    }
}

/// Whether a failed campaign is worth another: everything but a name that is no key or a
/// key that holds foreign data.
fn campaigns_again(error: &LockError) -> bool {
    !matches!(
        error,
        LockError::InvalidKey(_)
            | LockError::NotALock { .. }
            | LockError::Unsupported { .. }
            | LockError::UpgradeRefused { .. }
            | LockError::ZeroPermits { .. }
    )
}

/// This instance leads a name, for as long as this value lives and [`is_lost`](Self::is_lost)
/// is false: the leadership's lock, renewed by the watchdog. Dropping it resigns (the lock
/// is released in a spawned task); [`resign`](Self::resign) awaits it.
#[must_use = "dropping a leadership resigns at once"]
pub struct Leadership {
    name: String,
    guard: LockGuard,
    /// Tells [`LeaderRequest::run`] when the work dropped its leadership early.
    resigned: Option<DropGuard>,
}

impl Leadership {
    fn new(name: String, guard: LockGuard) -> Self {
        Leadership {
            name,
            guard,
            resigned: None,
        }
    }

    /// The name led.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The epoch of this leadership: strictly above every earlier leader's of this name,
    /// on every instance. Send it with the leader's writes to a store that refuses a lower
    /// one (see the fencing guide), so that a leader paused past its lease cannot write
    /// after its successor.
    pub fn fencing_token(&self) -> u64 {
        self.guard.fencing_token()
    }

    /// Completes when the leadership is lost (see [`is_lost`](Self::is_lost)).
    pub fn lost(&self) -> impl Future<Output = ()> + Send + 'static {
        self.guard.lost()
    }

    /// Whether the leadership is lost: renewal proved the lock gone, or its lease ran out
    /// while the store could not be reached. Another instance may lead now.
    pub fn is_lost(&self) -> bool {
        self.guard.is_lost()
    }

    /// Resigns, awaiting the release: the next candidate is woken as it returns.
    /// `Err(LockError::Lost)` if the leadership had been lost already.
    pub async fn resign(self) -> Result<(), LockError> {
        self.guard.release().await
    }
}

impl fmt::Debug for Leadership {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Leadership")
            .field("name", &self.name)
            .field("epoch", &self.fencing_token())
            .field("lost", &self.is_lost())
            .finish()
    }
}

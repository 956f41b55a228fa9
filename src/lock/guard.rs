//! [`LockGuard`]: proof of holding a lock, released on every exit path.

use std::fmt;
use std::future::Future;

use crate::error::LockError;
use crate::lock::BoxFuture;
use crate::lock::held::HeldLock;
use crate::lock::observe::end_hold;
use crate::lock::retry::HoldClock;
use crate::telemetry;

/// How a backend gives up one hold.
pub(crate) trait ReleaseHold: Send + Sync + 'static {
    /// Releases and reports the outcome; `Err(LockError::Lost)` if the lock had already
    /// been lost.
    fn release(self: Box<Self>) -> BoxFuture<'static, Result<(), LockError>>;
    /// Releases in a spawned task; used on drop, so it must not block or need an await.
    fn release_in_background(self: Box<Self>);
}

/// Proof of holding a lock. Releasing happens on [`release`](Self::release) or, if the
/// guard is dropped (cancellation, panic, early return), in a spawned task.
#[must_use = "the lock is released as soon as the guard is dropped"]
pub struct LockGuard {
    held: HeldLock,
    hold: Option<Box<dyn ReleaseHold>>,
    /// The owner held the key already: this hold re-entered it.
    reentry: bool,
    /// Counts the hold in the metrics until it ends.
    counted: Option<telemetry::Hold>,
    /// Times the hold for its layer's `Retry-After`.
    clock: Option<HoldClock>,
}

impl LockGuard {
    pub(crate) fn new(held: HeldLock, hold: Box<dyn ReleaseHold>) -> Self {
        LockGuard {
            held,
            hold: Some(hold),
            reentry: false,
            counted: None,
            clock: None,
        }
    }

    pub(crate) fn reentry(mut self, reentry: bool) -> Self {
        self.reentry = reentry;
        self
    }

    pub(crate) fn is_reentry(&self) -> bool {
        self.reentry
    }

    /// Counts this hold in the metrics until it is released.
    pub(crate) fn count_hold(&mut self, hold: telemetry::Hold) {
        self.counted = Some(hold);
    }

    /// Times this hold until it is released (`None`: not at all).
    pub(crate) fn time_hold(&mut self, clock: Option<HoldClock>) {
        self.clock = clock;
    }

    /// Ends the hold's clock; a lost hold was cut short, so it says nothing of what the
    /// work takes.
    fn stop_clock(&mut self) {
        if let Some(clock) = self.clock.take().filter(|_| !self.held.is_lost()) {
            clock.end();
        }
    }

    /// The held lock's handle, to keep or to pass to
    /// [`LockRequest::reentrant`](crate::LockRequest::reentrant).
    pub fn held(&self) -> &HeldLock {
        &self.held
    }

    /// The key as the application gave it.
    pub fn key(&self) -> &str {
        self.held.key()
    }

    /// See [`HeldLock::fencing_token`].
    pub fn fencing_token(&self) -> u64 {
        self.held.fencing_token()
    }

    /// See [`HeldLock::lost`].
    pub fn lost(&self) -> impl Future<Output = ()> + Send + 'static {
        self.held.lost()
    }

    /// See [`HeldLock::is_lost`].
    pub fn is_lost(&self) -> bool {
        self.held.is_lost()
    }

    /// Releases the lock and waits for Redis to confirm. A re-entered lock stays held by
    /// its outer holds. Returns `Err(LockError::Lost)` if the lock had been lost meanwhile
    /// (nothing of a new owner's is touched). Transport failures are retried; a release is
    /// idempotent, so a retry after a lost reply never releases twice. If Redis cannot be
    /// reached in time this returns `Err(LockError::Backend)` and keeps retrying in the
    /// background (as it does when this future is dropped), for up to one lease.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future does not keep the lock: the release goes on in a spawned task
    /// (as when the guard itself is dropped); only its outcome is lost.
    pub async fn release(self) -> Result<(), LockError> {
        match self.into_release() {
            Some(release) => release.await,
            None => Ok(()),
        }
    }

    /// The backend's release future itself (`None` if already released), so the layer's
    /// futures hold it without boxing it again.
    pub(crate) fn into_release(mut self) -> Option<BoxFuture<'static, Result<(), LockError>>> {
        let release = self.hold.take()?.release();
        self.stop_clock();
        Some(match self.counted.take() {
            Some(counted) => end_hold(counted, release, &self.held),
            None => release,
        })
    }
}

impl Drop for LockGuard {
    fn drop(&mut self) {
        if let Some(hold) = self.hold.take() {
            hold.release_in_background();
        }
        self.stop_clock();
        if let Some(counted) = self.counted.take() {
            counted.end(self.held.is_lost());
        }
    }
}

impl fmt::Debug for LockGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LockGuard")
            .field("held", &self.held)
            .finish()
    }
}

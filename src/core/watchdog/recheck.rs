//! The re-check of every held lock, raised on each sign that a store may have lost data.
//!
//! A store that can forget locks while their holders still run (a Redis restarted without
//! persistence, a failover to a replica the lock had not reached, a listening connection
//! that came back after an outage) raises this signal; the watchdog then renews (or, for
//! holds without renewal, checks) every held lock at once, so that a holder whose lock is
//! gone sees `HeldLock::lost` within about one round trip of the sign instead of at its
//! next renewal, up to lease/3 later (8 s measured on Redis with the default lease).

use std::sync::Arc;

use tokio::sync::Notify;

/// Raised on every sign that the store may have lost data; the watchdog listens.
#[derive(Clone, Default)]
pub(crate) struct Recheck(Arc<Notify>);

impl Recheck {
    /// Asks the watchdog to re-check every held lock now.
    pub(crate) fn raise(&self, reason: &'static str) {
        tracing::debug!(reason, "re-checking every held lock");
        // Keeps one permit, so a sign seen while the watchdog is busy is not lost.
        self.0.notify_one();
    }

    /// Resolves when a sign was seen since the last call returned.
    pub(crate) async fn raised(&self) {
        self.0.notified().await;
    }
}

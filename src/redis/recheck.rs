//! Signs that Redis may have lost data, and the re-check of every held lock they start.
//!
//! A Redis restarted without persistence (or one that failed over to a replica the lock
//! had not reached) forgets locks while their holders still run, and a waiter on another
//! instance gets in at once; the holder used to learn it only at its next renewal, up to
//! lease/3 later (8 s measured with the default lease). Each sign of such an event raises
//! the signal: the subscriber connection was (re)opened (after a restart it reconnects
//! within its backoff, and a half-open one is found by its ping), a command connection was
//! opened after a transport failure, or the server's `run_id` changed (a restart or a
//! failover). The watchdog then renews (or, for holds without renewal, checks) every held
//! lock at once, so `HeldLock::lost` fires within about one subscriber ping of the event.

use std::sync::{Arc, Mutex};

use tokio::sync::Notify;

/// Raised on every sign that the server may have lost data; the watchdog listens.
#[derive(Clone, Default)]
pub(crate) struct Recheck(Arc<Shared>);

#[derive(Default)]
struct Shared {
    /// Keeps one permit, so a sign seen while the watchdog is busy is not lost.
    raised: Notify,
    /// The `run_id` of the server the last command connection was opened to.
    run_id: Mutex<Option<String>>,
}

impl Recheck {
    /// Asks the watchdog to re-check every held lock now.
    pub(crate) fn raise(&self, reason: &'static str) {
        tracing::debug!(reason, "re-checking every held lock");
        self.0.raised.notify_one();
    }

    /// Remembers the `run_id` a new connection reported; a different one than before means
    /// another server process (restarted, or a replica promoted) answers now.
    pub(crate) fn saw_run_id(&self, run_id: &str) {
        let mut last = self.0.run_id.lock().unwrap_or_else(|e| e.into_inner());
        let changed = last.as_deref().is_some_and(|last| last != run_id);
        if last.as_deref() != Some(run_id) {
            *last = Some(run_id.to_owned());
        }
        drop(last);
        if changed {
            self.raise("the server's run_id changed (restarted or failed over)");
        }
    }

    /// Resolves when a sign was seen since the last call returned.
    pub(crate) async fn raised(&self) {
        self.0.raised.notified().await;
    }
}

/// The `run_id` line of an `INFO server` reply.
pub(crate) fn run_id(info: &str) -> Option<&str> {
    info.lines()
        .find_map(|line| line.strip_prefix("run_id:"))
        .map(str::trim)
}

//! Signs that Redis may have lost data: the server's `run_id`, and the other signs that
//! raise the core's re-check of every held lock (`core/recheck.rs`).
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

use redis::RedisError;

use super::connection::pool::is_transport;
use super::connection::topology::AnyConn;
use crate::core::watchdog::recheck::Recheck;

/// What the backend knows of the Redis server process it talks to; raises the core's
/// re-check of held locks when that may have changed.
#[derive(Clone)]
pub(crate) struct ServerIdentity {
    recheck: Recheck,
    /// The `run_id` of the server the last command connection was opened to.
    run_id: Arc<Mutex<Option<String>>>,
}

impl ServerIdentity {
    pub(crate) fn new(recheck: Recheck) -> Self {
        ServerIdentity {
            recheck,
            run_id: Arc::default(),
        }
    }

    /// Asks for every held lock to be re-checked now.
    pub(crate) fn recheck(&self, reason: &'static str) {
        self.recheck.raise(reason);
    }

    /// Remembers the `run_id` a new connection reported; a different one than before means
    /// another server process (restarted, or a replica promoted) answers now.
    pub(crate) fn saw_run_id(&self, run_id: &str) {
        let mut last = self.run_id.lock().unwrap_or_else(|e| e.into_inner());
        let changed = last.as_deref().is_some_and(|last| last != run_id);
        if last.as_deref() != Some(run_id) {
            *last = Some(run_id.to_owned());
        }
        drop(last);
        if changed {
            self.recheck("the server's run_id changed (restarted or failed over)");
        }
    }

    /// Reads the server's `run_id` on a new connection (see [`saw_run_id`](Self::saw_run_id)).
    /// A user not allowed to run `INFO` only loses this sign; a transport failure fails the
    /// connection.
    pub(crate) async fn read_run_id(&self, conn: &mut AnyConn) -> Result<(), RedisError> {
        let mut info = redis::cmd("INFO");
        info.arg("server");
        match info.query_async::<String>(conn).await {
            Ok(info) => {
                if let Some(id) = run_id(&info) {
                    self.saw_run_id(id);
                }
                Ok(())
            }
            Err(e) if is_transport(&e) => Err(e),
            Err(_) => Ok(()),
        }
    }
}

/// The `run_id` line of an `INFO server` reply.
fn run_id(info: &str) -> Option<&str> {
    info.lines()
        .find_map(|line| line.strip_prefix("run_id:"))
        .map(str::trim)
}

#[cfg(test)]
mod tests {
    use futures_util::FutureExt;

    use super::*;

    #[test]
    fn only_a_changed_run_id_raises() {
        let recheck = Recheck::default();
        let server = ServerIdentity::new(recheck.clone());
        server.saw_run_id("first");
        server.saw_run_id("first");
        assert!(recheck.raised().now_or_never().is_none(), "same server");
        server.saw_run_id("second");
        assert!(recheck.raised().now_or_never().is_some(), "another server");
        assert_eq!(
            run_id("redis_mode:standalone\r\nrun_id:abc \r\n"),
            Some("abc")
        );
    }
}

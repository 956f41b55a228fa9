//! The namespace's admin channel, on the subscriber side: a force-release (`inspect.rs`)
//! is announced there, and the message makes the watchdog re-check every held lock at once
//! (`core/recheck.rs`), so the holder of a lock freed by force sees `lost()` within a round trip
//! or two rather than at its next renewal (a third of its lease later).
//!
//! Every backend's subscriber subscribes to it while connected, beside the release channels
//! of its waiters; it is not one of them (not in the registry, not counted in the stats or
//! metrics). A refusal (an ACL user whose channel rights do not cover it) is logged once and
//! costs only that promptness: the subscriber goes on serving the release channels.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use redis::aio::PubSubSink;
use redis::cluster_async::ClusterConnection;
use tokio::time::{Instant, timeout};

use super::run_id::ServerIdentity;

pub(super) struct AdminChannel {
    name: String,
    server: ServerIdentity,
    refusal_logged: AtomicBool,
    /// On a cluster: whether the channel is to be subscribed (again) on its shard, and
    /// not before when (its shard did not answer).
    sharded: Mutex<(bool, Option<Instant>)>,
}

impl AdminChannel {
    pub(super) fn new(name: String, server: ServerIdentity) -> Self {
        AdminChannel {
            name,
            server,
            refusal_logged: AtomicBool::new(false),
            sharded: Mutex::new((true, None)),
        }
    }

    /// Subscribes on a single server's subscriber connection. `Err` when the connection
    /// failed (it is replaced); a refusal is logged and the connection kept.
    pub(super) async fn subscribe(
        &self,
        sink: &mut PubSubSink,
        command_timeout: Duration,
    ) -> Result<(), String> {
        match timeout(command_timeout, sink.subscribe(&self.name)).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) if e.code() == Some("NOPERM") => {
                self.refused(&e);
                Ok(())
            }
            Ok(Err(e)) => Err(format!("subscribe failed: {e}")),
            Err(_) => Err("subscribe timed out".to_owned()),
        }
    }

    /// Subscribes on the shard that owns the channel, when that is still to be done and
    /// due; a shard that does not answer is asked again `retry` later.
    pub(super) async fn ssubscribe(
        &self,
        conn: &ClusterConnection,
        command_timeout: Duration,
        retry: Duration,
    ) {
        let due = {
            let (wanted, not_before) = *self.sharded();
            wanted && not_before.is_none_or(|at| at <= Instant::now())
        };
        if !due {
            return;
        }
        let mut conn = conn.clone();
        let outcome = timeout(command_timeout, conn.ssubscribe(&self.name)).await;
        let mut sharded = self.sharded();
        *sharded = match outcome {
            Ok(Ok(())) => (false, None),
            Ok(Err(e)) if e.code() == Some("NOPERM") => {
                self.refused(&e);
                (false, None)
            }
            _ => (true, Some(Instant::now() + retry)),
        };
    }

    /// The cluster ended the subscription (a node was lost, the slot moved), or a new
    /// connection has none yet: it is made again at the next reconcile.
    pub(super) fn resubscribe(&self) {
        *self.sharded() = (true, None);
    }

    pub(super) fn is(&self, channel: &str) -> bool {
        channel == self.name
    }

    /// A force-release was announced: every held lock is re-checked.
    pub(super) fn announced(&self) {
        self.server
            .recheck("a lock of the namespace was force-released");
    }

    fn sharded(&self) -> std::sync::MutexGuard<'_, (bool, Option<Instant>)> {
        // Plain data, updated in one assignment: a poisoned lock is still consistent.
        self.sharded.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn refused(&self, error: &redis::RedisError) {
        if !self.refusal_logged.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                %error,
                channel = %self.name,
                "the lock subscriber may not subscribe to the namespace's admin channel: the \
                 holder of a force-released lock sees lost() only at its next renewal"
            );
        }
    }
}

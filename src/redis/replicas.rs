//! Replica acknowledgement of an acquisition (`RedisBackendBuilder::sync_replicas`):
//! `WAIT n timeout` on the connection that ran the acquire script, so that it covers that
//! script's writes.

use std::fmt;
use std::time::Duration;

use super::connection::pool::{CommandError, Conn};
use super::scripts::millis;

/// How many replicas must acknowledge an acquisition, and how long they get.
#[derive(Debug, Clone, Copy)]
pub(crate) struct SyncReplicas {
    pub(crate) replicas: u32,
    pub(crate) timeout: Duration,
}

impl SyncReplicas {
    /// Waits until `replicas` replicas of the server that holds `lock` have every write
    /// sent on `conn` so far (the acquisition just made), or the timeout passed. On a
    /// cluster only `lock`'s shard is asked: one shard failing over must not fail (or slow)
    /// the acquisitions of the others.
    pub(crate) async fn wait(&self, conn: &mut Conn, lock: &str) -> Result<(), CommandError> {
        let mut wait = redis::cmd("WAIT");
        wait.arg(self.replicas).arg(millis(self.timeout));
        let acked = conn.query_at::<i64>(lock, &wait).await?;
        if acked >= i64::from(self.replicas) {
            return Ok(());
        }
        Err(CommandError::Unreplicated(Unreplicated {
            acked,
            wanted: self.replicas,
            timeout: self.timeout,
        }))
    }
}

/// An acquisition that too few replicas acknowledged in time (it was given back).
#[derive(Debug)]
pub(crate) struct Unreplicated {
    acked: i64,
    wanted: u32,
    timeout: Duration,
}

impl fmt::Display for Unreplicated {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "acquired but acknowledged by {} of {} replicas within {:?}",
            self.acked, self.wanted, self.timeout
        )
    }
}

impl std::error::Error for Unreplicated {}

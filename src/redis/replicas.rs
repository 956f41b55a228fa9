//! Replica acknowledgement (`RedisBackendBuilder::sync_replicas`) of every write that
//! grants or extends a hold: an acquisition, a renewal, a release that hands the key to
//! the next task. `WAIT n timeout` runs on the connection that ran the script, so that it
//! covers that script's writes.
//!
//! What each does when too few replicas acknowledge: an acquisition is given back and
//! fails; a renewal counts as failed, so the watchdog retries it and the hold is lost once
//! its last acknowledged lease has run out (a failover to a replica could end it there); a
//! handoff is undone (the successor's new hold released), so the key is freed and the
//! successor goes to the store as any waiter.

use std::fmt;
use std::time::Duration;

use redis::{FromRedisValue, ScriptInvocation};
use tokio::time::timeout;

use super::connection::pool::{CommandError, Conn, Pool};
use super::keys::LockKey;
use super::replies::parse_release;
use super::scripts::millis;
use super::store::RedisStore;
use crate::core::store::{Calls, Release, Released};
use crate::lock::Kind;

/// How many replicas must acknowledge a write that grants or extends a hold, and how long
/// they get.
#[derive(Debug, Clone, Copy)]
pub(crate) struct SyncReplicas {
    pub(crate) replicas: u32,
    pub(crate) timeout: Duration,
}

impl SyncReplicas {
    /// Waits until `replicas` replicas of the server that holds `lock` have every write
    /// sent on `conn` so far (the `write` just made), or the timeout passed. On a cluster
    /// only `lock`'s shard is asked: one shard failing over must not fail (or slow) the
    /// holds of the others.
    pub(crate) async fn wait(
        &self,
        conn: &mut Conn,
        lock: &str,
        write: Write,
    ) -> Result<(), CommandError> {
        let mut wait = redis::cmd("WAIT");
        wait.arg(self.replicas).arg(millis(self.timeout));
        let acked = conn.query_at::<i64>(lock, &wait).await?;
        if acked >= i64::from(self.replicas) {
            return Ok(());
        }
        Err(CommandError::Unreplicated(Unreplicated {
            write,
            acked,
            wanted: self.replicas,
            timeout: self.timeout,
        }))
    }
}

impl SyncReplicas {
    /// Runs `invocation` (a `write` of `lock`'s holds) and waits for its acknowledgement.
    pub(crate) async fn invoke<T: FromRedisValue>(
        &self,
        pool: &Pool,
        invocation: &ScriptInvocation<'_>,
        lock: &str,
        write: Write,
    ) -> Result<T, CommandError> {
        let mut conn = pool.connection().await?;
        let reply = conn.invoke(invocation).await?;
        self.wait(&mut conn, lock, write).await?;
        Ok(reply)
    }
}

impl RedisStore {
    /// Runs `release`, which names a successor; a handoff it made that too few replicas
    /// acknowledge is undone on the same connection (the successor's new hold released,
    /// which frees the key and wakes its waiters) and reported as a release that freed it.
    /// When the undo fails, the error is returned: the core sends the release again, which
    /// finds the handoff made and waits for it once more.
    pub(super) async fn hand_over_acknowledged(
        &self,
        key: &LockKey,
        release: &Release<'_>,
        sync: SyncReplicas,
    ) -> Result<Released, CommandError> {
        let mut conn = self.pool.connection().await?;
        let invocation = self
            .release_call(key, release)
            .invocation(&self.scripts, self.fence_ttl);
        let released = parse_release(&conn.invoke::<Vec<i64>>(&invocation).await?)?;
        let (Released::HandedOver(token), Some(successor)) = (released, release.successor) else {
            return Ok(released);
        };
        let Err(unacknowledged) = sync.wait(&mut conn, &key.lock, Write::Handoff).await else {
            return Ok(released);
        };
        let release_id = format!("{}#handoff{token}", successor.owner.as_str());
        let undo = Release {
            holder: &successor.owner,
            kind: Kind::Exclusive,
            release_id: &release_id,
            lease: successor.lease,
            successor: None,
            run_spent: false,
            may_have_run: self.calls() == Calls::MayRunTwice,
            only_token: Some(token),
            issued: None,
            reserve: 0,
            serial: release.serial,
        };
        let invocation = self
            .release_call(key, &undo)
            .invocation(&self.scripts, self.fence_ttl);
        match timeout(self.command_timeout, conn.invoke::<Vec<i64>>(&invocation)).await {
            Ok(Ok(reply)) if matches!(parse_release(&reply), Ok(Released::Freed)) => {
                tracing::warn!(
                    key = %key.lock,
                    error = &unacknowledged as &(dyn std::error::Error + 'static),
                    "handoff undone: the key goes back to the store"
                );
                Ok(Released::Freed)
            }
            _ => Err(unacknowledged),
        }
    }
}

/// The write [`SyncReplicas::wait`] waits for.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Write {
    Acquisition,
    Renewal,
    Handoff,
}

/// A write that too few replicas acknowledged in time (see the module's doc for what
/// became of it).
#[derive(Debug)]
pub(crate) struct Unreplicated {
    write: Write,
    acked: i64,
    wanted: u32,
    timeout: Duration,
}

impl fmt::Display for Unreplicated {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let done = match self.write {
            Write::Acquisition => "acquired",
            Write::Renewal => "renewed",
            Write::Handoff => "handed over",
        };
        write!(
            f,
            "{done} but acknowledged by {} of {} replicas within {:?}",
            self.acked, self.wanted, self.timeout
        )
    }
}

impl std::error::Error for Unreplicated {}

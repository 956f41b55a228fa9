//! The Redis store: the core's primitive calls as Lua scripts (see `scripts/`), sent
//! through the command pool, with waiters woken by the subscriber.

use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use tokio::time::timeout;

use super::UnexpectedReply;
use super::connection::cluster;
use super::connection::pool::{CommandError, Conn, Pool};
use super::keys::LockKey;
use super::pubsub::Subscriber;
use super::replay::Replays;
use super::replicas::{SyncReplicas, Write};
use super::replies::{GuardSaid, parse_attempt, parse_release};
use super::scripts::{Scripts, millis};
use crate::core::store::{
    Attempt, Attempted, Calls, Capabilities, Failure, Grants, HeldPage, Records, Release, Released,
    Sent, Store, StoreKey, Takeovers,
};
use crate::core::wakeups::Waiter;
use crate::core::watchdog::Due;
use crate::error::LockError;
use crate::lock::inspect::{LockInfo, Primitive};
use crate::lock::{BoxFuture, Kind, LockOwner};

/// Locks in one Redis deployment (a server, a Sentinel group's master, a cluster).
pub(crate) struct RedisStore {
    pub(crate) pool: Pool,
    pub(crate) scripts: Arc<Scripts>,
    pub(crate) subscriber: Subscriber,
    /// Recent releases, sent again after a Sentinel failover; `None` on other topologies.
    pub(crate) replays: Option<Replays>,
    pub(crate) namespace: String,
    pub(crate) max_key_len: usize,
    pub(crate) command_timeout: Duration,
    pub(crate) fence_ttl: Duration,
    /// How long the head of a key's line of waiting holders has to take its turn after a
    /// release (see line.lua); `None`: no line (a quorum's masters).
    pub(crate) turn_grace: Option<Duration>,
    /// How long a release's grant of a freed key to the head of its line lasts unclaimed
    /// (see release.lua); `None`: releases grant nothing (no line, or acquisitions that
    /// must reach replicas first).
    pub(crate) grant_lease: Option<Duration>,
    /// The longest lease the restart guard outwaits after a restart; `None`: no guard.
    pub(crate) restart_guard: Option<Duration>,
    /// What the guard said so far (see [`GuardSaid`]).
    pub(crate) guard_said: GuardSaid,
    /// Replicas that must acknowledge an acquisition; `None`: none.
    pub(crate) sync_replicas: Option<SyncReplicas>,
    /// This backend's instance id, on a cluster only: its releases are recorded beside each
    /// lock, so that a copy of an earlier attempt that the cluster client sends again late
    /// takes nothing (see acquire.lua); `None` elsewhere, whose clients send nothing again.
    pub(crate) resent_guard: Option<Arc<str>>,
    /// Numbers this backend's force-releases, so that a copy of one that the cluster client
    /// sends again late frees nothing (see force_release.lua).
    pub(crate) force_serials: AtomicU64,
}

impl StoreKey for LockKey {
    fn user(&self) -> &str {
        &self.user
    }

    fn lock(&self) -> &Arc<str> {
        &self.lock
    }
}

impl Failure for CommandError {
    fn may_have_run(&self) -> bool {
        // An acquisition too few replicas acknowledged was taken on the master; a reply
        // that cannot be read came from a script that ran.
        self.is_ambiguous()
            || matches!(
                self,
                CommandError::Unreplicated(_) | CommandError::Unexpected(_)
            )
    }

    fn is_transient(&self) -> bool {
        self.is_topology_change() || self.is_read_only() || matches!(self, CommandError::Connect(_))
    }

    fn is_foreign(&self) -> bool {
        self.is_foreign_value()
    }
}

impl RedisStore {
    /// A cluster client sends a call again by itself when its connection drops before the
    /// reply; other clients send nothing again.
    pub(crate) fn calls(&self) -> Calls {
        if self.scripts.sharded {
            Calls::MayRunTwice
        } else {
            Calls::RunOnce
        }
    }
}

impl Grants<LockKey> for RedisStore {
    fn subscribe_in_line(&self, key: &LockKey, holder: &LockOwner) -> Waiter {
        self.subscriber.register(&key.channel, Some(holder.clone()))
    }
}

impl Store for RedisStore {
    type Key = LockKey;
    type Error = CommandError;
    type Sent = Conn;

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            calls: self.calls(),
            records: Records::InAttempt,
            ..Capabilities::default()
        }
    }

    fn key(&self, user: String, kind: Kind) -> Result<LockKey, LockError> {
        Ok(match kind {
            Kind::Permit(_) => LockKey::semaphore(&self.namespace, user, self.max_key_len)?,
            Kind::Exclusive | Kind::Shared => {
                LockKey::new(&self.namespace, user, self.max_key_len)?
            }
        })
    }

    fn attempt(
        self: &Arc<Self>,
        key: &Arc<LockKey>,
        attempt: Attempt,
    ) -> BoxFuture<'static, Sent<Self>> {
        let (store, key) = (self.clone(), key.clone());
        Box::pin(async move {
            let mut conn = match store.pool.connection().await {
                Ok(conn) => conn,
                Err(e) => return (Err(e), None),
            };
            let reply = {
                let invocation = store.acquire_invocation(&key, &attempt);
                conn.invoke::<Vec<i64>>(&invocation).await
            };
            let attempted = match reply {
                Ok(reply) => parse_attempt(&reply, store.turn_grace.is_some(), &store.guard_said),
                Err(e) => return (Err(e), Some(conn)),
            };
            match (&attempted, store.sync_replicas) {
                (Ok(Attempted::Acquired { .. }), Some(sync)) => {
                    if let Err(e) = sync.wait(&mut conn, &key.lock, Write::Acquisition).await {
                        // Not known to be on enough replicas: given back before the attempt
                        // fails, on the same connection, so it runs first. If that cannot
                        // be done, the core undoes it behind the attempt (the error says
                        // the attempt may have taken a hold).
                        return match store.undo(&key, &attempt, conn).await {
                            Ok(()) => (Err(e), None),
                            Err(conn) => (Err(e), Some(conn)),
                        };
                    }
                    (attempted, Some(conn))
                }
                _ => (attempted, Some(conn)),
            }
        })
    }

    fn release<'a>(
        &'a self,
        key: &'a LockKey,
        release: &'a Release<'a>,
    ) -> BoxFuture<'a, Result<Released, CommandError>> {
        Box::pin(async move {
            // Only a handoff grants anything: a release that frees may be lost on a
            // failover and leave the lock to its lease, which is safe.
            if let (Some(sync), Some(_)) = (self.sync_replicas, release.successor) {
                return self.hand_over_acknowledged(key, release, sync).await;
            }
            let invocation = self
                .release_call(key, release)
                .invocation(&self.scripts, self.fence_ttl);
            parse_release(&self.pool.invoke::<Vec<i64>>(&invocation).await?)
        })
    }

    fn release_after<'a>(
        &'a self,
        key: &'a LockKey,
        release: &'a Release<'a>,
        mut conn: Conn,
    ) -> BoxFuture<'a, bool> {
        Box::pin(async move {
            let invocation = self
                .release_call(key, release)
                .invocation(&self.scripts, self.fence_ttl);
            conn.invoke::<Vec<i64>>(&invocation).await.is_ok()
        })
    }

    fn renew<'a>(&'a self, batch: &'a [Due]) -> BoxFuture<'a, Result<Vec<bool>, CommandError>> {
        Box::pin(async move {
            let mut invocation = self.scripts.renew.prepare_invoke();
            for due in batch {
                // A lease of 0 only checks (see renew.lua).
                let lease = if due.renew { millis(due.lease) } else { 0 };
                invocation
                    .key(&*due.key.0)
                    .arg(due.key.1.as_str())
                    .arg(lease);
            }
            let renewed: Vec<i64> = match (self.sync_replicas, batch.first()) {
                (Some(sync), Some(due)) => {
                    sync.invoke(&self.pool, &invocation, &due.key.0, Write::Renewal)
                        .await?
                }
                _ => self.pool.invoke(&invocation).await?,
            };
            if renewed.len() != batch.len() || renewed.iter().any(|r| !matches!(r, 0 | 1)) {
                return Err(CommandError::Unexpected(UnexpectedReply("renew")));
            }
            Ok(renewed.into_iter().map(|held| held == 1).collect())
        })
    }

    fn renewal_calls(&self, due: Vec<Due>) -> Vec<Vec<Due>> {
        // A script's keys must share a hash slot on a cluster (CROSSSLOT otherwise): one
        // call per slot there.
        if self.scripts.sharded {
            cluster::by_slot(due, |d| &d.key.0)
        } else {
            vec![due]
        }
    }

    fn subscribe(&self, key: &LockKey) -> Waiter {
        self.subscriber.register(&key.channel, None)
    }

    fn grants(&self) -> Option<&dyn Grants<LockKey>> {
        self.grant_lease.map(|_| self as &dyn Grants<LockKey>)
    }

    fn remaining(self: &Arc<Self>, key: &Arc<LockKey>) -> BoxFuture<'static, Option<Duration>> {
        let (store, key) = (self.clone(), key.clone());
        Box::pin(async move {
            let mut pttl = redis::cmd("PTTL");
            pttl.arg(&*key.lock);
            let ms = store.pool.query::<i64>(&pttl).await.ok()?;
            u64::try_from(ms).ok().map(Duration::from_millis)
        })
    }

    fn withdraw_writer(
        self: &Arc<Self>,
        key: &Arc<LockKey>,
        holder: LockOwner,
        wake: bool,
    ) -> BoxFuture<'static, ()> {
        let (store, key) = (self.clone(), key.clone());
        Box::pin(async move {
            let [line, until] = key.line();
            let mut leave = store.scripts.withdraw.key(&*key.lock);
            leave
                .key(key.writers())
                .key(line)
                .key(until)
                .arg(holder.as_str())
                .arg(&key.channel)
                .arg(u8::from(store.scripts.sharded))
                .arg(u8::from(wake));
            let sent = timeout(store.command_timeout, store.pool.invoke::<i64>(&leave)).await;
            if !matches!(sent, Ok(Ok(_))) {
                // Its registrations run out with the wait they were made for (and its
                // turn in the line with the grace after the next release).
                tracing::debug!(key = %key.lock, "could not withdraw a waiting holder");
            }
        })
    }

    fn lease(&self, lease: Duration) -> Duration {
        // The restart guard outwaits only leases up to its maximum.
        self.restart_guard.map_or(lease, |max| lease.min(max))
    }

    fn takeovers(&self) -> Takeovers {
        self.pool.topology().takeovers()
    }

    fn inspect(
        self: &Arc<Self>,
        user: String,
        of: Primitive,
    ) -> BoxFuture<'static, Result<LockInfo, LockError>> {
        Box::pin(self.clone().snapshot(user, of))
    }

    fn held_page(
        self: &Arc<Self>,
        prefix: Arc<str>,
        from: Option<String>,
    ) -> BoxFuture<'static, Result<HeldPage, LockError>> {
        let store = self.clone();
        Box::pin(async move {
            let page = store.list_page(&prefix, from).await;
            page.map_err(|e| LockError::backend("list_held", e))
        })
    }

    fn force_release(
        self: &Arc<Self>,
        user: String,
        of: Primitive,
    ) -> BoxFuture<'static, Result<LockInfo, LockError>> {
        Box::pin(self.clone().free_by_force(user, of))
    }

    fn released(
        &self,
        key: &Arc<LockKey>,
        hold: (&LockOwner, Kind),
        token: u64,
        lease: Duration,
        generation: u64,
    ) {
        // Done again after a Sentinel failover (see replay.rs).
        if let Some(replays) = &self.replays {
            replays.record(key, hold, token, lease, generation);
        }
    }
}

//! Releases a failover may have lost, done again on the new master when it is announced.
//!
//! Replication is asynchronous, and in a Sentinel failover the old master may take writes
//! after the replica was promoted and before the sentinels announce it (`+switch-master`):
//! in a planned `SENTINEL FAILOVER` it stays up and serves until then (about a second,
//! thousands of acquisitions of a busy key on the switchover test). What it took then is
//! lost, releases included: the key stays held on the new master by the hold that was
//! current at the promotion, whose release went to the old master, with nobody renewing
//! it, until its lease runs out (30 s by default; seen on 4 of 5 runs of that test).
//!
//! So a Sentinel backend remembers, per key, the newest fencing token it released in the
//! last [`REPLAY_WINDOW`] (a final release: freed or handed over). When a takeover is
//! announced it reads each such key on the new master, and releases a hold found there
//! when all of these hold:
//! - the owner is one of this backend's (other instances clean up their own);
//! - no hold of that owner on that key is alive in this process (the watchdog has none);
//! - its token is at most the newest this backend released for the key: holds of a key
//!   follow one another in token order, so that hold ended before the released one began.
//!
//! The release is the release script of that owner limited to that token, so it acts only
//! if the hold is still there, as it was read: it never frees a newer hold (another
//! owner's, or the same owner's new acquisition, which gets a newer token). A new hold of
//! the same owner that re-entered the stale one on the new master (same token, count 2)
//! loses one count, the stale one, and keeps its own; the release id it is sent with
//! (derived from owner and token) makes a retry of it a no-op.
//!
//! Shared holds and permits are held side by side, each under its own holder field, so
//! their tokens give no order: each one released is remembered by key and holder, and
//! released on the new master if that holder's field is there, no hold of that holder is
//! alive in this process, and the token the script then checks is the released one (a
//! permit's own token; a shared hold's, the last writer's token it was taken under).
//!
//! A release still in flight to the old master when the takeover is announced counts as
//! soon as it completes. Holds are remembered up to [`MAX_KEYS`]; a stale hold beyond that,
//! or a nested one (re-entered at the promotion), waits for its lease as before.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use futures_util::StreamExt;
use tokio::sync::Notify;
use tokio::time::{Instant, sleep, timeout};
use tokio_util::sync::CancellationToken;

use super::connection::pool::{CommandError, Pool};
use super::keys::LockKey;
use super::scripts::Scripts;
use super::scripts::release_call::ReleaseCall;
use crate::core::kit::backoff::Backoff;
use crate::core::runtime::{Daemon, Spawner};
use crate::core::watchdog::Watchdog;
use crate::lock::{Kind, LockOwner};

/// How long a release is remembered: longer than the sentinels take from the promotion to
/// its announcement (they poll the promoted replica's role every second).
const REPLAY_WINDOW: Duration = Duration::from_secs(10);

/// Upper bound on the keys (and shared holds and permits) remembered.
const MAX_KEYS: usize = 10_000;

/// Keys checked on the new master at once.
const KEYS_IN_FLIGHT: usize = 32;

/// What is remembered under: a key (its exclusive holds), or a key and the holder of a
/// shared hold or permit of it.
type Remembered = (Arc<str>, Option<LockOwner>);

/// The newest final release of one key's exclusive holds, or of one shared hold or permit.
struct Released {
    key: Arc<LockKey>,
    kind: Kind,
    /// The newest token released.
    token: u64,
    /// The lease of that hold, re-applied if the stale hold keeps a count (see release.lua).
    lease: Duration,
    completed: Instant,
    /// The topology generation up to which the key is known to be settled: it is checked
    /// once a takeover past it is announced.
    settled: u64,
}

#[derive(Default)]
struct Shared {
    recent: Mutex<HashMap<Remembered, Released>>,
    /// A release sent before a takeover completed after its announcement.
    late: Notify,
}

impl Shared {
    fn recent(&self) -> MutexGuard<'_, HashMap<Remembered, Released>> {
        // Updates cannot panic half-way: a poisoned lock is consistent.
        self.recent.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The holds to check now that `generation` is announced, with the newest token released.
    fn due(&self, generation: u64) -> Vec<Due> {
        let mut recent = self.recent();
        let now = Instant::now();
        recent.retain(|_, r| now.saturating_duration_since(r.completed) <= REPLAY_WINDOW);
        recent
            .iter_mut()
            .filter(|(_, r)| r.settled < generation)
            .map(|((_, holder), r)| {
                r.settled = generation;
                Due {
                    key: r.key.clone(),
                    holder: holder.clone(),
                    kind: r.kind,
                    token: r.token,
                    lease: r.lease,
                }
            })
            .collect()
    }
}

/// A remembered release to check on a new master.
struct Due {
    key: Arc<LockKey>,
    /// The holder of a shared hold or permit; `None` for the key's exclusive holds.
    holder: Option<LockOwner>,
    kind: Kind,
    token: u64,
    lease: Duration,
}

/// The backend's memory of recent releases and the task that redoes them after a takeover.
pub(crate) struct Replays {
    shared: Arc<Shared>,
    pool: Pool,
    task: Daemon,
}

/// What the replay task works with.
pub(crate) struct ReplayConfig {
    pub(crate) pool: Pool,
    pub(crate) scripts: Arc<Scripts>,
    pub(crate) watchdog: Watchdog,
    /// The instance part of this backend's owner ids.
    pub(crate) instance: String,
    pub(crate) fence_ttl: Duration,
    pub(crate) command_timeout: Duration,
}

impl Replays {
    /// Starts checking the recent releases on every takeover the topology announces.
    pub(crate) fn spawn(
        config: ReplayConfig,
        shutdown: CancellationToken,
        spawner: &Spawner,
    ) -> Self {
        let shared = Arc::new(Shared::default());
        let pool = config.pool.clone();
        let replayer = Arc::new(Replayer {
            shared: shared.clone(),
            owner_prefix: format!("{}:", config.instance),
            config,
        });
        let start = move |shutdown| replayer.clone().run(shutdown);
        Replays {
            shared,
            pool,
            task: Daemon::spawn(start, spawner, shutdown),
        }
    }

    /// Remembers a final release of the hold of `token` on `key` (by `holder`, of `kind`),
    /// whose script was sent at topology generation `sent`.
    pub(super) fn record(
        &self,
        key: &Arc<LockKey>,
        (holder, kind): (&LockOwner, Kind),
        token: u64,
        lease: Duration,
        sent: u64,
    ) {
        self.task.ensure_running();
        let now = Instant::now();
        let late = sent < self.pool.topology().generation();
        let remembered = (
            key.lock.clone(),
            (kind != Kind::Exclusive).then(|| holder.clone()),
        );
        {
            let mut recent = self.shared.recent();
            if let Some(known) = recent.get_mut(&remembered) {
                known.token = known.token.max(token);
                known.lease = lease;
                known.completed = now;
                known.settled = known.settled.min(sent);
            } else {
                if recent.len() >= MAX_KEYS {
                    recent
                        .retain(|_, r| now.saturating_duration_since(r.completed) <= REPLAY_WINDOW);
                }
                if recent.len() >= MAX_KEYS {
                    return;
                }
                let released = Released {
                    key: key.clone(),
                    kind,
                    token,
                    lease,
                    completed: now,
                    settled: sent,
                };
                recent.insert(remembered, released);
            }
        }
        if late {
            self.shared.late.notify_one();
        }
    }
}

struct Replayer {
    shared: Arc<Shared>,
    owner_prefix: String,
    config: ReplayConfig,
}

impl Replayer {
    async fn run(self: Arc<Self>, shutdown: CancellationToken) {
        let topology = self.config.pool.topology().clone();
        let mut changes = topology.changes();
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = changes.next() => {}
                _ = self.shared.late.notified() => {}
            }
            let due = self.shared.due(topology.generation());
            if due.is_empty() {
                continue;
            }
            tracing::debug!(
                keys = due.len(),
                "checking recently released keys on the new master"
            );
            let checks = futures_util::stream::iter(due)
                .for_each_concurrent(KEYS_IN_FLIGHT, |due| self.check(due));
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = checks => {}
            }
        }
    }

    /// Releases the stale hold of `due` on the new master, if there is one (see the module
    /// docs), retrying within the window while no master answers.
    async fn check(&self, due: Due) {
        let give_up = Instant::now() + REPLAY_WINDOW;
        let mut backoff = Backoff::up_to(Duration::from_secs(1));
        let key = &due.key;
        loop {
            let checked = match &due.holder {
                None => self.release_stale(key, due.token, due.lease).await,
                Some(holder) => self.release_stale_hold(&due, holder).await,
            };
            match checked {
                Ok(()) => return,
                Err(e) if !retryable(e.as_ref()) || Instant::now() + backoff.peek() >= give_up => {
                    let key = &key.user;
                    let error = e.map_or_else(|| "timed out".to_owned(), |e| e.to_string());
                    tracing::debug!(%key, %error, "cannot check a released key after a failover");
                    return;
                }
                Err(_) => sleep(backoff.next()).await,
            }
        }
    }

    async fn release_stale(
        &self,
        key: &LockKey,
        released: u64,
        lease: Duration,
    ) -> Result<(), Option<CommandError>> {
        let config = &self.config;
        let mut read = redis::cmd("HGETALL");
        read.arg(&*key.lock);
        let hash: HashMap<String, String> =
            timeout(config.command_timeout, config.pool.query(&read))
                .await
                .map_err(|_| None)?
                .map_err(Some)?;
        let Some(token) = hash.get("token").and_then(|t| t.parse::<u64>().ok()) else {
            return Ok(());
        };
        // A release id field holds a '#' (see hold.rs) and an attempt id an '@' (call.rs);
        // an owner field neither.
        let stale = hash
            .keys()
            .find(|field| field.starts_with(&self.owner_prefix) && !field.contains(['#', '@']));
        let Some(owner) = stale.map(|o| LockOwner::new(o.clone())) else {
            return Ok(());
        };
        if token > released || config.watchdog.is_held(&key.lock, &owner) {
            return Ok(());
        }
        self.release_held(key, (&owner, Kind::Exclusive), token, lease)
            .await
    }

    /// The shared hold or permit of `holder` that `due` released, if the new master has it
    /// and this process holds nothing under that holder: released, of its token only.
    async fn release_stale_hold(
        &self,
        due: &Due,
        holder: &LockOwner,
    ) -> Result<(), Option<CommandError>> {
        let config = &self.config;
        let mut read = redis::cmd("HEXISTS");
        read.arg(&*due.key.lock).arg(holder.as_str());
        let there: bool = timeout(config.command_timeout, config.pool.query(&read))
            .await
            .map_err(|_| None)?
            .map_err(Some)?;
        if !there || config.watchdog.is_held(&due.key.lock, holder) {
            return Ok(());
        }
        self.release_held(&due.key, (holder, due.kind), due.token, due.lease)
            .await
    }

    /// Sends the release script of `kind` for `owner`'s hold of `token` on `key`.
    async fn release_held(
        &self,
        key: &LockKey,
        (owner, kind): (&LockOwner, Kind),
        token: u64,
        lease: Duration,
    ) -> Result<(), Option<CommandError>> {
        let config = &self.config;
        let release_id = format!("{}#replay-{token}", owner.as_str());
        let invocation = ReleaseCall {
            key,
            owner,
            kind,
            release_id: &release_id,
            lease,
            successor: None,
            streak_spent: false,
            may_have_run: false,
            token: Some(token),
            issued: None,
            reserve: 0,
            // Replays are Sentinel's, whose client sends nothing again.
            resent_guard: None,
            // A hold the failover kept by mistake is freed, its waiters woken.
            grant: None,
        }
        .invocation(&config.scripts, config.fence_ttl);
        let reply: Vec<i64> = timeout(config.command_timeout, config.pool.invoke(&invocation))
            .await
            .map_err(|_| None)?
            .map_err(Some)?;
        let key = &key.user;
        tracing::info!(%key, ?reply, "released a hold that the failover had kept on the new master");
        Ok(())
    }
}

/// Whether a check that failed with `e` (`None`: no reply in time) may be tried again: it
/// reached no master, or the release may have run (it is idempotent, see above).
fn retryable(e: Option<&CommandError>) -> bool {
    e.is_none_or(|e| {
        e.is_ambiguous()
            || e.is_read_only()
            || e.is_topology_change()
            || matches!(e, CommandError::Connect(_))
    })
}

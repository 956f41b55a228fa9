//! Lease renewal for held locks: one task per backend, one batched script call per round.
//!
//! Every held lock is renewed every lease/3. A failed round is retried soon after and the
//! lock is kept; it is declared lost only when Redis answers that the owner no longer
//! holds it, or when the lease has certainly run out since the last confirmed renewal
//! (Redis unreachable for a whole lease). Releasing deregisters the hold before the release
//! script is sent, so renewal can never outlive an unlock.
//!
//! When Redis may have lost data (see `recheck.rs`), every held lock is renewed at once,
//! and every hold without renewal checked, so a lock that is gone is found lost then.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::{Instant, sleep_until, timeout};
use tokio_util::sync::CancellationToken;

use futures_util::StreamExt;

use super::cluster;
use super::pool::Pool;
use super::recheck::Recheck;
use super::runtime::{Daemon, Spawner};
use super::scripts::Scripts;
use crate::lock::{LockOwner, MAX_DURATION};

/// Leases due within this window of the earliest are renewed in the same call.
const BATCH_WINDOW: Duration = Duration::from_millis(50);
/// Upper bound on the keys renewed by one script call.
const MAX_BATCH: usize = 512;
/// Renewal calls of different hash slots in flight at once, on a cluster.
const SLOT_CALLS_IN_FLIGHT: usize = 32;

type HoldKey = (Arc<str>, LockOwner);

/// Run once when a watched lock is found lost (not when it is released).
pub(crate) type OnLost = Box<dyn FnOnce() + Send>;

struct WatchedLock {
    /// Tells this entry from a later one of the same owner and key (after this one was
    /// lost and the owner acquired again), so a stale release or renewal reply cannot
    /// touch the new hold.
    generation: u64,
    /// Holds of the same owner on the same key (re-entries) share one entry.
    refs: usize,
    lease: Duration,
    /// Holds that asked for renewal; with none left the lease is only watched.
    renewing: usize,
    next: Instant,
    /// A hold without renewal to be checked at `next` (Redis may have lost it).
    recheck: bool,
    /// When the last acquisition or renewal that Redis confirmed was sent: the lease runs
    /// until at least this instant plus `lease`.
    confirmed: Instant,
    lost: CancellationToken,
    on_lost: Vec<OnLost>,
}

impl WatchedLock {
    /// Fires `lost`; the hooks are returned to be run once the state lock is released.
    fn lose(&mut self) -> Vec<OnLost> {
        self.lost.cancel();
        std::mem::take(&mut self.on_lost)
    }
}

fn run_hooks(hooks: Vec<OnLost>) {
    hooks.into_iter().for_each(|hook| hook());
}

#[derive(Default)]
struct State {
    holds: HashMap<HoldKey, WatchedLock>,
    generations: u64,
    /// When the task looks at the holds next (`None`: when told). A new hold due later
    /// needs no wakeup, which spares a hot key one task switch per acquisition.
    wake_at: Option<Instant>,
}

struct Shared {
    state: Mutex<State>,
    changed: Notify,
}

impl Shared {
    fn state(&self) -> MutexGuard<'_, State> {
        // Updates under this lock cannot panic half-way; a poisoned lock is consistent.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Handle to the backend's watchdog task.
#[derive(Clone)]
pub(crate) struct Watchdog {
    shared: Arc<Shared>,
    task: Arc<Daemon>,
}

impl Watchdog {
    pub(crate) fn spawn(
        pool: Pool,
        scripts: Arc<Scripts>,
        command_timeout: Duration,
        recheck: Recheck,
        shutdown: CancellationToken,
        spawner: &Spawner,
    ) -> Self {
        let shared = Arc::new(Shared {
            state: Mutex::default(),
            changed: Notify::new(),
        });
        let renewing = shared.clone();
        let start = move |shutdown| {
            let (pool, scripts, recheck) = (pool.clone(), scripts.clone(), recheck.clone());
            renew_until_shutdown(
                renewing.clone(),
                pool,
                scripts,
                recheck,
                command_timeout,
                shutdown,
            )
        };
        let task = Arc::new(Daemon::spawn(start, spawner, shutdown));
        Watchdog { shared, task }
    }

    /// Starts watching a hold whose acquisition was sent at `sent_at`, and returns the token
    /// that fires when the lock is lost with the generation to unregister. Re-entries share
    /// the outer hold's entry and token; a longer re-entry lease extends the entry's.
    ///
    /// With `renew == false` the lease is only watched: the token fires when it runs out.
    /// `on_lost` runs when the lock is found lost, and is dropped unrun if it is released.
    pub(crate) fn register(
        &self,
        lock_key: Arc<str>,
        owner: LockOwner,
        lease: Duration,
        renew: bool,
        sent_at: Instant,
        on_lost: Option<OnLost>,
    ) -> (CancellationToken, u64) {
        // A hold taken from another runtime than the one the watchdog ran on.
        self.task.ensure_running();
        let mut state = self.shared.state();
        state.generations += 1;
        let generation = state.generations;
        let entry = state
            .holds
            .entry((lock_key, owner))
            .or_insert_with(|| WatchedLock {
                generation,
                refs: 0,
                lease,
                renewing: 0,
                next: sent_at + if renew { lease / 3 } else { lease },
                recheck: false,
                confirmed: sent_at,
                lost: CancellationToken::new(),
                on_lost: Vec::new(),
            });
        entry.refs += 1;
        entry.on_lost.extend(on_lost);
        // The scripts never shorten a lock's TTL, so the longest lease asked for rules.
        if lease > entry.lease {
            entry.lease = lease;
        }
        // A re-entry that asks for renewal turns it on for the shared entry, until it is
        // released again.
        if renew {
            if entry.renewing == 0 {
                entry.next = entry.next.min(sent_at + lease / 3);
            }
            entry.renewing += 1;
        }
        entry.confirmed = entry.confirmed.max(sent_at);
        let lost = entry.lost.clone();
        let generation = entry.generation;
        let next = entry.next;
        let wake = state.wake_at.is_none_or(|at| next < at);
        drop(state);
        if wake {
            self.shared.changed.notify_one();
        }
        (lost, generation)
    }

    /// Stops watching one hold of `generation`. Called before its release is sent.
    pub(crate) fn unregister(
        &self,
        lock_key: &Arc<str>,
        owner: &LockOwner,
        generation: u64,
        renew: bool,
    ) {
        let mut state = self.shared.state();
        let key = (lock_key.clone(), owner.clone());
        if let Some(entry) = state
            .holds
            .get_mut(&key)
            .filter(|e| e.generation == generation)
        {
            entry.refs -= 1;
            if renew {
                entry.renewing -= 1;
            }
            if entry.refs == 0 {
                state.holds.remove(&key);
            }
        }
    }

    /// Whether `owner` has a hold on `lock_key` that has not been released.
    pub(crate) fn is_held(&self, lock_key: &Arc<str>, owner: &LockOwner) -> bool {
        self.shared
            .state()
            .holds
            .contains_key(&(lock_key.clone(), owner.clone()))
    }

    /// Number of locks currently watched.
    pub(crate) fn watched(&self) -> usize {
        self.shared.state().holds.len()
    }
}

struct Due {
    key: HoldKey,
    generation: u64,
    lease: Duration,
    /// False: only check that the lock is still held (a hold without renewal).
    renew: bool,
}

async fn renew_until_shutdown(
    shared: Arc<Shared>,
    pool: Pool,
    scripts: Arc<Scripts>,
    recheck: Recheck,
    command_timeout: Duration,
    shutdown: CancellationToken,
) {
    loop {
        let next = {
            let mut state = shared.state();
            state.wake_at = state.holds.values().map(|e| e.next).min();
            state.wake_at
        };
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = shared.changed.notified() => continue,
            _ = recheck.raised() => recheck_all(&shared),
            _ = async {
                match next {
                    Some(at) => sleep_until(at).await,
                    None => std::future::pending().await,
                }
            } => {}
        }
        let now = Instant::now();
        let (due, hooks) = collect_due(&shared, now);
        run_hooks(hooks);
        if scripts.sharded {
            // A script's keys must share a hash slot on a cluster (CROSSSLOT otherwise):
            // one call per slot, the slots' calls in flight together.
            let batches = cluster::by_slot(due, |d| &d.key.0);
            futures_util::stream::iter(batches.iter().flat_map(|b| b.chunks(MAX_BATCH)))
                .for_each_concurrent(SLOT_CALLS_IN_FLIGHT, |batch| {
                    renew_batch(&shared, &pool, &scripts, command_timeout, batch)
                })
                .await;
        } else {
            for batch in due.chunks(MAX_BATCH) {
                renew_batch(&shared, &pool, &scripts, command_timeout, batch).await;
            }
        }
    }
}

/// Makes every hold due now: renewed if it asked for renewal, else checked.
fn recheck_all(shared: &Shared) {
    let now = Instant::now();
    for entry in shared.state().holds.values_mut() {
        entry.next = now;
        entry.recheck = entry.renewing == 0;
    }
}

/// Expires what has certainly run out and returns what needs renewing (or checking) now,
/// with the hooks of the expired holds.
fn collect_due(shared: &Shared, now: Instant) -> (Vec<Due>, Vec<OnLost>) {
    let mut state = shared.state();
    let mut due = Vec::new();
    let mut hooks = Vec::new();
    state.holds.retain(|key, entry| {
        if now >= entry.confirmed + entry.lease {
            tracing::warn!(key = %key.0, "lock lease ran out before it could be renewed");
            hooks.extend(entry.lose());
            return false;
        }
        let renew = entry.renewing > 0;
        if (renew || entry.recheck) && entry.next <= now + BATCH_WINDOW {
            due.push(Due {
                key: key.clone(),
                generation: entry.generation,
                lease: entry.lease,
                renew,
            });
        }
        true
    });
    // Unrenewed holds wake the loop when their lease ends, to fire `lost`, or earlier for
    // a check still owed.
    for entry in state.holds.values_mut().filter(|e| e.renewing == 0) {
        let end = entry.confirmed + entry.lease;
        entry.next = if entry.recheck {
            entry.next.min(end)
        } else {
            end
        };
    }
    (due, hooks)
}

async fn renew_batch(
    shared: &Shared,
    pool: &Pool,
    scripts: &Scripts,
    command_timeout: Duration,
    batch: &[Due],
) {
    let mut invocation = scripts.renew.prepare_invoke();
    for due in batch {
        // A lease of 0 only checks (see renew.lua).
        let lease = if due.renew { millis(due.lease) } else { 0 };
        invocation
            .key(&*due.key.0)
            .arg(due.key.1.as_str())
            .arg(lease);
    }
    let sent_at = Instant::now();
    let result = timeout(command_timeout, pool.invoke::<Vec<i64>>(&invocation)).await;
    let mut state = shared.state();
    let mut hooks = Vec::new();
    match result {
        Ok(Ok(renewed)) if renewed.len() == batch.len() => {
            for (due, still_held) in batch.iter().zip(renewed) {
                let Some(entry) = state
                    .holds
                    .get_mut(&due.key)
                    .filter(|e| e.generation == due.generation)
                else {
                    continue; // released (or lost and taken anew) while the renewal was in flight
                };
                if still_held == 1 && due.renew {
                    entry.recheck = false;
                    entry.confirmed = sent_at;
                    entry.next = sent_at + entry.lease / 3;
                } else if still_held == 1 {
                    // Checked, not extended: the lease still ends where it did.
                    entry.recheck = false;
                    entry.next = entry.confirmed + entry.lease;
                } else {
                    tracing::warn!(key = %due.key.0, "lock no longer held at renewal");
                    hooks.extend(entry.lose());
                    state.holds.remove(&due.key);
                }
            }
        }
        outcome => {
            match outcome {
                Ok(Ok(_)) => tracing::warn!("lock renewal returned a malformed reply"),
                // Recorded as an error, so subscribers print its sources (the cause).
                Ok(Err(e)) => tracing::warn!(
                    error = &e as &(dyn std::error::Error + 'static),
                    "lock renewal failed; retrying"
                ),
                Err(_) => tracing::warn!("lock renewal timed out; retrying"),
            }
            // Keep the locks and try again soon; `collect_due` declares them lost only once
            // their lease has certainly run out.
            for due in batch {
                if let Some(entry) = state
                    .holds
                    .get_mut(&due.key)
                    .filter(|e| e.generation == due.generation)
                {
                    let retry =
                        (entry.lease / 10).clamp(Duration::from_millis(20), Duration::from_secs(1));
                    entry.next = Instant::now() + retry;
                }
            }
        }
    }
    drop(state);
    run_hooks(hooks);
}

/// `d` as the milliseconds of a `PEXPIRE` or `SET .. PX`: at least 1 (Redis refuses 0)
/// and at most [`MAX_DURATION`], since Redis refuses a deadline past its 64-bit clock
/// ("value is not an integer or out of range", once on every acquisition).
pub(crate) fn millis(d: Duration) -> u64 {
    let ms = d.clamp(Duration::from_millis(1), MAX_DURATION).as_millis();
    u64::try_from(ms).unwrap_or(u64::MAX)
}

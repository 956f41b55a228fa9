//! Lease renewal for held locks: one task per backend, batched store calls (`batch.rs`;
//! split as the store asks, e.g. one per hash slot on a Redis Cluster), each handled as it
//! ends while the task goes on.
//!
//! Every held lock is renewed every lease/3. A failed call is retried soon after and the
//! lock is kept; it is declared lost only when the store answers that the holder no longer
//! holds it, or when the lease has certainly run out since the last confirmed renewal
//! (the store unreachable for a whole lease). Releasing deregisters the hold before the release
//! call is sent, so renewal can never outlive an unlock.
//!
//! When the store may have lost data (see `recheck.rs`), every held lock is renewed at once,
//! and every hold without renewal checked, so a lock that is gone is found lost then.

pub(crate) mod recheck;

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::{Instant, sleep_until};
use tokio_util::sync::CancellationToken;

use futures_util::StreamExt;
use futures_util::stream::FuturesUnordered;

use super::Store;
use super::runtime::{Daemon, Spawner};
use super::watchdog::recheck::Recheck;
use crate::lock::LockOwner;
use crate::telemetry::Namespace;

mod batch;

pub(crate) use batch::Due;
use batch::renew_batch;

/// Leases due within this window of the earliest are renewed in the same call.
const BATCH_WINDOW: Duration = Duration::from_millis(50);
/// A hold is given up 1/`STOP_MARGIN` of its lease (2%, at least [`MIN_STOP_MARGIN`])
/// before the lease can end on the server (Redlock allows 1% + 2 ms for clock drift;
/// this is about twice that, for the handler to stop in time on a busy machine).
const STOP_MARGIN: u32 = 50;
const MIN_STOP_MARGIN: Duration = Duration::from_millis(4);
/// Upper bound on the holds renewed by one store call.
const MAX_BATCH: usize = 512;
/// Renewal calls in flight at once (of different hash slots, on a cluster).
const CALLS_IN_FLIGHT: usize = 32;

/// A watched hold: the lock's name in the store and the holder's identity.
pub(crate) type HoldKey = (Arc<str>, LockOwner);

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
    /// A hold without renewal to be checked at `next` (the store may have lost it).
    recheck: bool,
    /// A renewal call for this hold is queued or in flight: none is added until it ends.
    in_flight: bool,
    /// When the last acquisition or renewal that the store confirmed was sent: the lease runs
    /// until at least this instant plus `lease`.
    confirmed: Instant,
    lost: CancellationToken,
    on_lost: Vec<OnLost>,
}

impl WatchedLock {
    /// When the watchdog must look at this hold next: when it is due, or when its lease
    /// certainly ends if that is sooner. A retry after a failed renewal is due up to
    /// lease/10 later (partitioned from the store, every renewal fails at once): waking only
    /// then stopped the handler up to that long after the lease ran out on the server,
    /// while another instance already held the lock (`tests/jepsen/redis.rs`).
    fn wake(&self) -> Instant {
        let end = self.end();
        if self.in_flight {
            end
        } else {
            self.next.min(end)
        }
    }

    /// When the hold is given up unless a renewal was confirmed: [`STOP_MARGIN`] before its
    /// lease can run out on the server, since the lease there starts no sooner than the
    /// call was sent, but stopping the handler takes a timer tick and a task switch (the
    /// handler ran 0.3-2.2 ms past the expiry in `tests/jepsen/redis.rs` when given up at it).
    fn end(&self) -> Instant {
        let margin = (self.lease / STOP_MARGIN).max(MIN_STOP_MARGIN);
        self.confirmed + self.lease - margin.min(self.lease / 2)
    }

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
    /// How many times every hold was made due because the store may have lost data.
    rechecks: u64,
    /// When the task looks at the holds next (`None`: when told). A new hold due later
    /// needs no wakeup, which spares a hot key one task switch per acquisition.
    wake_at: Option<Instant>,
}

struct Shared {
    state: Mutex<State>,
    changed: Notify,
    metrics: Namespace,
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
    task: Arc<OnceLock<Daemon>>,
}

impl Watchdog {
    /// A watchdog that watches nothing yet; [`start`](Self::start) runs its task.
    pub(crate) fn new(metrics: Namespace) -> Self {
        Watchdog {
            shared: Arc::new(Shared {
                state: Mutex::default(),
                changed: Notify::new(),
                metrics,
            }),
            task: Arc::default(),
        }
    }

    /// Starts the task that renews through `store`, until `shutdown`.
    pub(crate) fn start<S: Store>(
        &self,
        store: Arc<S>,
        command_timeout: Duration,
        recheck: Recheck,
        shutdown: CancellationToken,
        spawner: &Spawner,
    ) {
        let renewing = self.shared.clone();
        let start = move |shutdown| {
            let (store, recheck) = (store.clone(), recheck.clone());
            renew_until_shutdown(renewing.clone(), store, recheck, command_timeout, shutdown)
        };
        let _ = self
            .task
            .get_or_init(|| Daemon::spawn(start, spawner, shutdown));
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
        if let Some(task) = self.task.get() {
            task.ensure_running();
        }
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
                in_flight: false,
                confirmed: sent_at,
                lost: CancellationToken::new(),
                on_lost: Vec::new(),
            });
        entry.refs += 1;
        entry.on_lost.extend(on_lost);
        // A store never shortens a lease, so the longest lease asked for rules.
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

    /// When the last acquisition or renewal of the hold of `generation` that the store
    /// confirmed was sent; `None` once the hold is lost or no longer watched.
    pub(crate) fn confirmed(
        &self,
        lock_key: &Arc<str>,
        owner: &LockOwner,
        generation: u64,
    ) -> Option<Instant> {
        let state = self.shared.state();
        let entry = state.holds.get(&(lock_key.clone(), owner.clone()))?;
        (entry.generation == generation && !entry.lost.is_cancelled()).then_some(entry.confirmed)
    }

    /// Fires `lost()` of `owner`'s hold of `lock_key` now and stops watching it: its store
    /// freed it by force and knows the hold is this backend's (memory).
    pub(crate) fn lose(&self, lock_key: &Arc<str>, owner: &LockOwner) {
        let mut state = self.shared.state();
        let hooks = state
            .holds
            .remove(&(lock_key.clone(), owner.clone()))
            .map(|mut entry| entry.lose())
            .unwrap_or_default();
        drop(state);
        run_hooks(hooks);
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

async fn renew_until_shutdown<S: Store>(
    shared: Arc<Shared>,
    store: Arc<S>,
    recheck: Recheck,
    command_timeout: Duration,
    shutdown: CancellationToken,
) {
    // Renewal calls queued and in flight. Each is handled as it ends, and the loop goes on
    // meanwhile: a call that hangs (its shard down, up to `command_timeout`) must not hold
    // up the renewals of the other shards, whose leases may be shorter than that.
    let mut queued: VecDeque<Vec<Due>> = VecDeque::new();
    let mut calls = FuturesUnordered::new();
    loop {
        while calls.len() < CALLS_IN_FLIGHT {
            let Some(batch) = queued.pop_front() else {
                break;
            };
            calls.push(renew_batch(&shared, &*store, command_timeout, batch));
        }
        let next = {
            let mut state = shared.state();
            state.wake_at = state.holds.values().map(WatchedLock::wake).min();
            state.wake_at
        };
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = shared.changed.notified() => continue,
            _ = recheck.raised() => recheck_all(&shared),
            Some(()) = calls.next(), if !calls.is_empty() => {}
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
        // The store may need several calls (a Redis Cluster: one per hash slot).
        for mut batch in store.renewal_calls(due) {
            while batch.len() > MAX_BATCH {
                let rest = batch.split_off(MAX_BATCH);
                queued.push_back(batch);
                batch = rest;
            }
            if !batch.is_empty() {
                queued.push_back(batch);
            }
        }
    }
}

/// Makes every hold due now: renewed if it asked for renewal, else checked.
fn recheck_all(shared: &Shared) {
    let now = Instant::now();
    let mut state = shared.state();
    state.rechecks += 1;
    for entry in state.holds.values_mut() {
        entry.next = now;
        entry.recheck = entry.renewing == 0;
    }
}

/// Expires what has certainly run out and returns what needs renewing (or checking) now,
/// with the hooks of the expired holds.
fn collect_due(shared: &Shared, now: Instant) -> (Vec<Due>, Vec<OnLost>) {
    let mut state = shared.state();
    let rechecks = state.rechecks;
    let mut due = Vec::new();
    let mut hooks = Vec::new();
    state.holds.retain(|key, entry| {
        if now >= entry.end() {
            tracing::warn!(key = %key.0, "lock lease ran out before it could be renewed");
            hooks.extend(entry.lose());
            return false;
        }
        let renew = entry.renewing > 0;
        if (renew || entry.recheck) && !entry.in_flight && entry.next <= now + BATCH_WINDOW {
            entry.in_flight = true;
            due.push(Due {
                key: key.clone(),
                generation: entry.generation,
                lease: entry.lease,
                renew,
                rechecks,
            });
        }
        true
    });
    // Unrenewed holds wake the loop when their lease ends, to fire `lost`, or earlier for
    // a check still owed.
    for entry in state.holds.values_mut().filter(|e| e.renewing == 0) {
        let end = entry.end();
        entry.next = if entry.recheck {
            entry.next.min(end)
        } else {
            end
        };
    }
    (due, hooks)
}

/// How long after its last confirmed acquisition or renewal was sent a hold may still pass
/// between tasks in memory (see `handoff.rs`): half its lease, less the margin by which the
/// watchdog gives a hold up early (room for clock drift). A renewal every lease/3 keeps a
/// healthy hold inside it.
pub(crate) fn handoff_window(lease: Duration) -> Duration {
    let margin = (lease / STOP_MARGIN).max(MIN_STOP_MARGIN);
    (lease / 2).saturating_sub(margin)
}

//! Wake-ups of waiting tasks: which release channels have waiters, and which of them the
//! store's listening connection has confirmed.
//!
//! The registry (channel -> waiters) is the source of truth; a store's listener task
//! (Redis pub/sub, PostgreSQL `LISTEN`) reconciles its connection's subscriptions with it.
//! A channel is subscribed while it has waiters and given up when the last one leaves.
//! Every waiter owns a [`Notify`], whose stored permit means "try the lock again": a
//! release message, a confirmed subscription or a reconnect all hand out permits, and a
//! permit that arrives before the waiter parks is kept rather than lost (Redisson #5761).
//!
//! A store that grants a freed key to the next waiting holder (Redis, see release.lua)
//! tells the grantee's waiter through [`Registry::granted`]: that waiter gets the grant
//! and makes it a hold without another call, and the key's other waiters are not woken,
//! only told when to look again if the grant runs out unclaimed ([`Wake::Recheck`]).

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::Notify;
use tokio::time::{Duration, Instant};

use crate::lock::LockOwner;
use crate::telemetry::Namespace;

/// A key granted to a waiting holder by a release in the store, as its message said.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Grant {
    pub(crate) token: u64,
    /// Tokens reserved above `token` for a run of the grantee's holders in memory.
    pub(crate) reserved: u64,
    /// The store's clock when the release granted it, in milliseconds.
    pub(crate) at: u64,
    /// How long the grant lasts from `at` unless its holder claims it.
    pub(crate) lease: Duration,
}

/// What woke a waiter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Wake {
    /// The lock may have been freed (or the subscription came up): try again.
    Try,
    /// A release granted the key to this waiter's holder.
    Granted(Grant),
    /// A release granted the key to another holder: try again by then, unless woken
    /// before (the grant may run out unclaimed).
    Recheck(Instant),
}

/// One waiter's wake-ups.
struct Wakeup {
    /// Try again (see the module's doc).
    notify: Notify,
    /// The holder a grant for this waiter names (`None`: it takes no grants).
    holder: Option<LockOwner>,
    /// A grant or a recheck, told through `hinted`.
    hint: std::sync::Mutex<Option<Wake>>,
    hinted: Notify,
}

impl Wakeup {
    fn hint(&self, wake: Wake) {
        let mut hint = self.hint.lock().unwrap_or_else(|e| e.into_inner());
        // A recheck never replaces a grant not yet taken.
        if !matches!(*hint, Some(Wake::Granted(_))) {
            *hint = Some(wake);
        }
        drop(hint);
        self.hinted.notify_one();
    }
}

/// Channels with waiters and the listening connection's state.
#[derive(Default)]
pub(crate) struct Registry {
    /// Channels with waiters, each waiter's wakeup keyed by its id.
    channels: HashMap<String, HashMap<u64, Arc<Wakeup>>>,
    /// Channels the current connection has confirmed. A waiter that registers on one of
    /// these can try again at once: any later release reaches it.
    pub(crate) active: HashSet<String>,
    /// Whether a listening connection is up (for introspection and tests).
    pub(crate) connected: bool,
    /// The subscriptions last counted in the metrics.
    reported: usize,
}

impl Registry {
    pub(crate) fn wake_channel(&self, channel: &str) {
        if let Some(waiters) = self.channels.get(channel) {
            waiters.values().for_each(|w| w.notify.notify_one());
        }
    }

    pub(crate) fn wake_all(&self) {
        self.channels
            .values()
            .flat_map(HashMap::values)
            .for_each(|w| w.notify.notify_one());
    }

    /// A release on `channel` granted the key to `holder`: its waiter gets the grant; the
    /// channel's other waiters look again when the grant would run out unclaimed, counted
    /// from now (it was made before its message came). Returns whether a waiter of this
    /// backend took it.
    pub(crate) fn granted(&self, channel: &str, holder: &str, grant: Grant) -> bool {
        let Some(waiters) = self.channels.get(channel) else {
            return false;
        };
        let recheck = Instant::now() + grant.lease;
        let mut taken = false;
        for waiter in waiters.values() {
            if waiter.holder.as_ref().is_some_and(|h| h.as_str() == holder) {
                taken = true;
                waiter.hint(Wake::Granted(grant));
            } else {
                waiter.hint(Wake::Recheck(recheck));
            }
        }
        taken
    }

    /// Whether `channel` has waiters.
    pub(crate) fn has_waiters(&self, channel: &str) -> bool {
        self.channels.contains_key(channel)
    }

    /// The channels to subscribe (waiters, not active) and to give up (active, no
    /// waiters). The latter are forgotten before the command is sent, so a waiter arriving
    /// meanwhile sees its channel as inactive and asks for it again (the unsubscribe goes
    /// first).
    pub(crate) fn changes(&mut self) -> (Vec<String>, Vec<String>) {
        let unsubscribe: Vec<String> = self
            .active
            .iter()
            .filter(|c| !self.channels.contains_key(*c))
            .cloned()
            .collect();
        for c in &unsubscribe {
            self.active.remove(c);
        }
        let subscribe = self
            .channels
            .keys()
            .filter(|c| !self.active.contains(*c))
            .cloned()
            .collect();
        (subscribe, unsubscribe)
    }

    /// Records confirmed subscriptions. Their waiters try again: a release may have been
    /// published between their last attempt and the subscription.
    pub(crate) fn confirmed(&mut self, channels: impl IntoIterator<Item = String>) {
        for channel in channels {
            self.wake_channel(&channel);
            self.active.insert(channel);
        }
    }
}

/// The waiters of one backend, shared by its listener task. Cheap to clone.
#[derive(Clone)]
pub(crate) struct Wakeups(Arc<Shared>);

struct Shared {
    registry: Mutex<Registry>,
    /// Set whenever the registry changes, so the listener reconciles subscriptions.
    dirty: Notify,
    next_id: AtomicU64,
    connections: AtomicU64,
    metrics: Namespace,
}

impl Wakeups {
    pub(crate) fn new(metrics: Namespace) -> Self {
        Wakeups(Arc::new(Shared {
            registry: Mutex::default(),
            dirty: Notify::new(),
            next_id: AtomicU64::new(0),
            connections: AtomicU64::new(0),
            metrics,
        }))
    }

    pub(crate) fn registry(&self) -> MutexGuard<'_, Registry> {
        // The registry holds plain data and no code runs under the lock that can panic
        // half-way through an update, so a poisoned lock is still consistent.
        self.0.registry.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Resolves when the registry changed since the last call returned (the listener
    /// reconciles then). Keeps one permit.
    pub(crate) async fn changed(&self) {
        self.0.dirty.notified().await;
    }

    /// Asks the listener to reconcile.
    pub(crate) fn mark_changed(&self) {
        self.0.dirty.notify_one();
    }

    /// Registers a waiter on `channel`. If the channel is already subscribed the waiter
    /// starts with a permit, so its first wait returns at once and it tries again.
    pub(crate) fn register(&self, channel: &str) -> Waiter {
        self.register_waiter(channel, None)
    }

    /// Registers a waiter on `channel` that takes the grants a release makes to `holder`
    /// (see [`Registry::granted`]).
    pub(crate) fn register_as(&self, channel: &str, holder: LockOwner) -> Waiter {
        self.register_waiter(channel, Some(holder))
    }

    /// Registers a waiter on `channel` of a store whose wake-ups need no subscription
    /// (memory: every release reaches a waiter from the moment it registers). The waiter
    /// starts with a permit, as on a subscribed channel, so the acquisition tries again.
    pub(crate) fn register_confirmed(&self, channel: &str) -> Waiter {
        let waiter = self.register_waiter(channel, None);
        waiter.wakeup.notify.notify_one();
        waiter
    }

    fn register_waiter(&self, channel: &str, holder: Option<LockOwner>) -> Waiter {
        let id = self.0.next_id.fetch_add(1, Ordering::Relaxed);
        let wakeup = Arc::new(Wakeup {
            notify: Notify::new(),
            holder,
            hint: std::sync::Mutex::new(None),
            hinted: Notify::new(),
        });
        let mut registry = self.registry();
        let already_active = registry.active.contains(channel);
        registry
            .channels
            .entry(channel.to_owned())
            .or_default()
            .insert(id, wakeup.clone());
        drop(registry);
        if already_active {
            wakeup.notify.notify_one();
        } else {
            self.mark_changed();
        }
        Waiter {
            wakeups: self.clone(),
            channel: channel.to_owned(),
            id,
            wakeup,
            also: Vec::new(),
        }
    }

    /// The listening connection is up.
    pub(crate) fn connected(&self) {
        if self.0.connections.fetch_add(1, Ordering::Relaxed) > 0 {
            self.0.metrics.subscriber_reconnected();
        }
        self.registry().connected = true;
    }

    /// The listening connection went down: no subscription is confirmed any more, and
    /// every waiter tries again now (messages may have been missed while it was going
    /// down), and again once its channel is subscribed anew (Redisson #3891).
    pub(crate) fn disconnected(&self) {
        let mut registry = self.registry();
        registry.connected = false;
        registry.active.clear();
        registry.wake_all();
        drop(registry);
        self.report_subscriptions();
    }

    /// Counts the change in confirmed subscriptions since the last report (a change, not
    /// a value: several backends of one process add up in one gauge).
    pub(crate) fn report_subscriptions(&self) {
        let mut registry = self.registry();
        let (before, now) = (registry.reported, registry.active.len());
        registry.reported = now;
        drop(registry);
        self.0.metrics.subscribed_channels(before, now);
    }

    /// Number of channels with waiters.
    pub(crate) fn channels_with_waiters(&self) -> usize {
        self.registry().channels.len()
    }

    /// Whether the listening connection is up.
    pub(crate) fn is_connected(&self) -> bool {
        self.registry().connected
    }

    /// How many times the listening connection has been established (1 + reconnects).
    pub(crate) fn connections_made(&self) -> u64 {
        self.0.connections.load(Ordering::Relaxed)
    }
}

/// Marks the listener disconnected when dropped: its task ended, however (even dropped
/// with its runtime), so no connection is claimed and every waiter tries again.
pub(crate) struct Disconnected<'a>(pub(crate) &'a Wakeups);

impl Drop for Disconnected<'_> {
    fn drop(&mut self) {
        self.0.disconnected();
    }
}

/// One task waiting for a release on one channel (or on several stores' channels at once,
/// see [`any`](Self::any)). Dropping it (including when the waiting future is cancelled)
/// deregisters it, and gives the channel up if it was the last.
pub(crate) struct Waiter {
    wakeups: Wakeups,
    channel: String,
    id: u64,
    wakeup: Arc<Wakeup>,
    /// Further registrations whose wake-ups count as this one's (a quorum of stores).
    also: Vec<Waiter>,
}

impl Waiter {
    /// Resolves when the lock may have been freed (or the subscription came up): the
    /// caller must then try again, as a wakeup is a hint, not a handoff; or with a grant
    /// to this waiter's holder, or a time to look again by (see [`Wake`]).
    pub(crate) async fn woken(&self) -> Wake {
        if self.also.is_empty() {
            let wakeup = &self.wakeup;
            // A grant goes first: the key is this waiter's already.
            tokio::select! {
                biased;
                _ = wakeup.hinted.notified() => {
                    let hint = wakeup.hint.lock().unwrap_or_else(|e| e.into_inner()).take();
                    return hint.unwrap_or(Wake::Try);
                }
                _ = wakeup.notify.notified() => return Wake::Try,
            }
        }
        let all = || std::iter::once(self).chain(&self.also);
        futures_util::future::select_all(all().map(|w| Box::pin(w.wakeup.notify.notified()))).await;
        // One try answers every wake-up that came before it: a release on N stores wakes
        // once, not N times.
        for waiter in all() {
            let _ = futures_util::FutureExt::now_or_never(waiter.wakeup.notify.notified());
        }
        Wake::Try
    }

    /// One waiter woken by whichever of `first` and `rest` is woken first.
    pub(crate) fn any(mut first: Waiter, rest: impl IntoIterator<Item = Waiter>) -> Waiter {
        first.also.extend(rest);
        first
    }
}

impl Drop for Waiter {
    fn drop(&mut self) {
        let mut registry = self.wakeups.registry();
        if let Some(waiters) = registry.channels.get_mut(&self.channel) {
            waiters.remove(&self.id);
            if waiters.is_empty() {
                registry.channels.remove(&self.channel);
                drop(registry);
                self.wakeups.mark_changed();
            }
        }
    }
}

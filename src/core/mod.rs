//! What makes a hold safe, whatever the store: written once, reused by every store.
//!
//! A store (`src/redis/`, `src/postgres/`, ...) implements the narrow [`Store`] trait of
//! primitive calls (one attempt, one release, a batch renewal, wake-ups for a key's
//! waiters, what its errors mean) and speaks only its own protocol. What sets a store
//! apart in how the core must treat it is declared once, as typed [`Capabilities`] (and,
//! for a store that grants freed keys to a line of waiting holders, the `Grants`
//! sub-trait), never as a method per quirk. [`Core`] drives it:
//!
//! - `acquire/`: the acquisition: the key's local queue first (one contender per key per
//!   process, `queue/`), then try -> subscribe -> try again -> wait for a wake-up or the
//!   holder's lease -> loop (never sleep-and-poll), as named steps: `attempt.rs`, one
//!   attempt and what its answer means; `call.rs`, its call, cancel-safe (a reply nobody
//!   took is given back); `wait.rs`, where the acquisition stands between attempts, the
//!   permit gate, the waiter and the nap; `yielding.rs`, the yield to other instances
//!   after a run of this process's holders; `grant.rs`, keys a release in the store
//!   granted to a waiting acquisition; `record.rs`, the idempotency record check;
//!   `contender.rs`, the contender in the store.
//! - `hold/`: the guard's hold and its release on every exit path (`release.rs`), retried,
//!   idempotent, finished in the background when nobody waits for it, never outlived by
//!   renewal; `handoff.rs`, runs of this process's holders taking turns under one hold in
//!   the store; `value.rs`, a hold as the consensus stores keep it.
//! - `watchdog/`: batched renewal every lease/3, the stop margin before a lease ends, and
//!   `lost()`; `recheck.rs`, the re-check of every hold when the store may have lost data.
//! - `store/`: the [`Store`] trait and its [`Capabilities`], a store's line of waiting
//!   holders (`line.rs`), the integer replies the Redis scripts and the SQL functions
//!   share (`replies.rs`, read by those stores only), the backends' shared methods and
//!   operator calls, and the takeovers a store announces.
//! - `kit/`: the store kit, what every store's builder takes from the core: the settings
//!   they share (`settings.rs`), the supervised listening connection that wakes waiters
//!   (`listener.rs`: pub/sub, LISTEN, the MySQL wake connection, etcd's watch,
//!   ZooKeeper's session, each reconnected with one capped backoff, `backoff.rs`, and
//!   each outage logged once).
//! - `wakeups.rs`: which channels have waiters, for the store's listening connection.
//! - `runtime/`: where tasks run, and the janitor that sweeps expired rows and records.
//!
//! Metrics live below every layer, in `src/telemetry.rs`; the span of an acquisition and
//! the owner ids in the lock API's `observe.rs`.

pub(crate) mod acquire;
pub(crate) mod hold;
pub(crate) mod kit;
pub(crate) mod queue;
pub(crate) mod runtime;
pub(crate) mod store;
pub(crate) mod wakeups;
pub(crate) mod watchdog;

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use self::queue::Queues;
use self::runtime::Spawner;
pub(crate) use self::store::Store;
use self::store::capabilities::Capabilities;
pub(crate) use self::store::methods::lock_backend_methods;
use self::watchdog::Watchdog;
use self::watchdog::recheck::Recheck;
use crate::lock::observe::OwnerIds;
use crate::lock::{Kind, LockOwner};
use crate::telemetry::Namespace;

/// A command never gets less time than this, even right at a wait's deadline, so that a
/// final attempt is not failed by its own budget on a busy machine.
const MIN_COMMAND_BUDGET: Duration = Duration::from_millis(250);

/// The settings the core applies to every store.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Settings {
    /// How long one store call may take.
    pub(crate) command_timeout: Duration,
    /// See `max_local_handoffs` on a backend's builder (0: no handoffs in memory).
    pub(crate) max_local_handoffs: u32,
    /// See `max_local_handoff_time` on a backend's builder.
    pub(crate) max_local_handoff_time: Duration,
    /// The longest key accepted, in bytes.
    pub(crate) max_key_len: usize,
}

/// A backend: a store and the machinery that makes its holds safe. Shared by every clone
/// of the public backend type; its tasks stop when it is dropped.
pub(crate) struct Core<S: Store> {
    pub(crate) store: Arc<S>,
    /// What the store declared of itself when the core was made.
    pub(crate) capabilities: Capabilities,
    pub(crate) watchdog: Watchdog,
    pub(crate) queues: Queues,
    pub(crate) owners: OwnerIds,
    pub(crate) settings: Settings,
    /// The `namespace` label of the backend's metrics.
    pub(crate) metrics: Namespace,
    pub(crate) runtime: Spawner,
    pub(crate) shutdown: CancellationToken,
}

/// What a store's builder made before the core: parts the store's own tasks share.
pub(crate) struct Parts {
    pub(crate) settings: Settings,
    pub(crate) metrics: Namespace,
    pub(crate) owners: OwnerIds,
    /// Raised by the store on every sign that it may have lost data.
    pub(crate) recheck: Recheck,
    /// The watchdog's handle, made before the store (which may ask it what is held).
    pub(crate) watchdog: Watchdog,
    pub(crate) runtime: Spawner,
    /// Cancelled when the core is dropped: every task of the backend stops.
    pub(crate) shutdown: CancellationToken,
}

impl Parts {
    /// Parts for a new backend on the current runtime.
    pub(crate) fn new(settings: Settings, metrics: Namespace) -> Self {
        Parts::on(settings, metrics, Spawner::current())
    }

    /// Parts for a new backend whose tasks run on `runtime`.
    pub(crate) fn on(settings: Settings, metrics: Namespace, runtime: Spawner) -> Self {
        Parts {
            settings,
            watchdog: Watchdog::new(metrics.clone()),
            metrics,
            owners: OwnerIds::new(),
            recheck: Recheck::default(),
            runtime,
            shutdown: CancellationToken::new(),
        }
    }
}

impl<S: Store> Core<S> {
    /// The core over `store`, starting the watchdog.
    pub(crate) fn new(store: S, parts: Parts) -> Arc<Self> {
        let store = Arc::new(store);
        let capabilities = store.capabilities();
        parts.watchdog.start(
            store.clone(),
            parts.settings.command_timeout,
            parts.recheck,
            parts.shutdown.clone(),
            &parts.runtime,
        );
        Arc::new(Core {
            store,
            capabilities,
            watchdog: parts.watchdog,
            queues: Queues::default(),
            owners: parts.owners,
            settings: parts.settings,
            metrics: parts.metrics,
            runtime: parts.runtime,
            shutdown: parts.shutdown,
        })
    }

    /// A snapshot of the backend's bookkeeping and of its store's listening connection.
    pub(crate) fn stats(&self, wakeups: &wakeups::Wakeups) -> crate::backend::BackendStats {
        crate::backend::BackendStats {
            subscriber_connected: wakeups.is_connected(),
            subscriber_connections_made: wakeups.connections_made(),
            channels_with_waiters: wakeups.channels_with_waiters(),
            watched_locks: self.watchdog.watched(),
            local_queues: self.queues.keys(),
            local_waiters: self.queues.waiting(),
        }
    }

    /// Tokens reserved above a hold's own for a run of holders in memory.
    pub(crate) fn reserve(&self) -> u64 {
        u64::from(self.settings.max_local_handoffs)
    }
}

impl<S: Store> Drop for Core<S> {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

/// The identity a store keeps a hold of `kind` by `owner` under, and the watchdog watches
/// it as: the owner id itself, or `r:` and the id for a shared hold, which lives beside the
/// owner's exclusive hold of the same key (a downgrade holds both).
pub(crate) fn holder(kind: Kind, owner: &LockOwner) -> LockOwner {
    match kind {
        Kind::Shared => LockOwner::new(format!("r:{}", owner.as_str())),
        Kind::Exclusive | Kind::Permit(_) => owner.clone(),
    }
}

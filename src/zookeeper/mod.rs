//! The ZooKeeper backend: Curator's `InterProcessMutex`, `InterProcessReadWriteLock` and
//! semaphore recipes on the core, every hold an ephemeral sequential node of the backend's
//! one session, waiters woken by a watch on the node they wait behind.
//!
//! The type and its design are documented on [`ZooKeeperBackend`].
//!
//! # Why the core's queue, and not a node per waiter
//!
//! Curator puts a node in the lock for every waiter, each watching the node just before
//! its own. Here the core already lines up every waiter of one process behind one
//! contender per key (its local queue), so at most one node per process and key is ever
//! in the lock. An attempt creates this session's node only when the lock has none, keeps
//! it if it is the lowest (the holder, as in Curator), and else deletes it again and
//! watches the lowest. A waiter therefore leaves nothing in ZooKeeper (a request that
//! gives up, times out or is cancelled has nothing to clean up; a writer kept out by
//! shared holders is the one exception, below), and fits the core's try -> subscribe ->
//! try again -> wait loop as the other stores do. The watch is set in the
//! same call that checks the holder's node exists, so a deletion is never missed between
//! the two; each process watches only the holder's node (one watch per node, however
//! many of its requests wait), never the lock's children (the herd effect). What this
//! gives up against the per-waiter recipe is fairness *between* processes (within one,
//! the queue is first come, first served): a deletion wakes the one contender of each
//! waiting process, and the first to create its node holds the lock.
//!
//! # Shared holds and permits: a node per holder
//!
//! Shared holds and permits do not line up in the core's queue (they admit each other):
//! each holder takes its own hold in the store, so one session may hold a lock shared for
//! several owners at once, beside a writer's exclusive hold of its own key (a downgrade).
//! So every holder has a node of its own, its value naming the holder (`r:` and the owner
//! for a shared hold, as the core names it) with its re-entry count and applied releases
//! (`HoldValue`, in `core/hold_value.rs`): a writer's (or a permit's) node is
//! `<session>-<sequence>`, a reader's `<session>-r-<sequence>`, and a call finds a holder's
//! node among its session's nodes of the lock by their values (one multi-read). One node
//! per holder, rather than one per session listing its owners, keeps every write a
//! versioned write of one holder's node, and lets ZooKeeper's order of nodes be the order
//! of holders, which is what the recipes decide on.
//!
//! Whose turn it is, as Curator decides it (the store kit's `turn.rs`, apart from any call): a writer holds
//! when its node is the lowest; a reader when no write node is below its own (its owner's
//! exclusive hold excepted); a permit when its node is among the `n` lowest of the
//! semaphore's node (`/namespace/{key}:permits`; `n` is the caller's, read at every
//! acquisition, so a smaller `n` revokes no permit). As for the exclusive lock, an attempt
//! that is not granted deletes its node and watches the node it waits behind: a reader the
//! nearest write node below it, a writer its predecessor, a permit the `n` nodes that hold
//! (any of them leaving lets it in). One exception keeps a stream of readers from starving
//! a writer: a writer kept out by readers only, that will wait, keeps its node in line
//! with a count of 0 (a waiter, not a hold), so that later readers find a write node below
//! theirs and wait behind it; its next attempt, woken by its predecessor's deletion, turns
//! it into a hold, and a writer that stops waiting deletes it (`withdraw_writer`). A
//! reader asking for its key exclusively is refused (an upgrade would wait for itself).
//!
//! A shared hold carries the token of the key's last exclusive acquisition, which every
//! writer records in the lock's node when it is granted (on a lock's node no writer was
//! granted under yet, the node's own creation zxid, which lies between every earlier
//! writer's token and every later one's); a permit's token is its node's creation zxid.
//!
//! The fencing token is the hold node's creation zxid: ZooKeeper's transaction id is one
//! for the whole ensemble, raised by every write and agreed by its quorum (its high half
//! is the leader's epoch, raised at every election), so every new hold of a key gets a
//! zxid above every earlier hold's, across failovers, with no counter to keep. For the
//! same reason no block of tokens can be set aside for holders that take turns in memory:
//! handoffs in memory are off for this store.

mod attempt;
mod builder;
mod error;
mod keys;
mod line;
mod records;
mod release;
mod renew;
mod session;
mod store;
mod watch;

use std::fmt;
use std::sync::Arc;

pub use self::builder::ZooKeeperBackendBuilder;
use self::store::ZkStore;
use crate::backend::{BackendStats, LockBackend};
use crate::core::Core;
use crate::lock::backend::{Backend, Sealed};

/// Distributed locks in ZooKeeper (feature `zookeeper`). Cheap to clone; clones share the
/// session.
///
/// The same locks as [`RedisBackend`](crate::RedisBackend), for teams that run ZooKeeper
/// and want a lock that survives the loss of a minority of servers: the ensemble
/// acknowledges a write only once a quorum has it, so a granted lock is not lost in a
/// failover. The layer, [`LockRequest`](crate::LockRequest),
/// [`HeldLock`](crate::HeldLock), multi-key locks, shared (read/write) locks, permits,
/// fencing tokens and the errors are the same.
///
/// ```no_run
/// use tower_lock::ZooKeeperBackend;
///
/// # async fn run() -> Result<(), tower_lock::BuildError> {
/// let backend = ZooKeeperBackend::builder("zk-1:2181,zk-2:2181,zk-3:2181")
///     .build()
///     .await?;
/// let guard = backend.lock("order:42").try_once().await;
/// # drop(guard);
/// # Ok(())
/// # }
/// ```
///
/// A lock is a container node, `/namespace/{key}` (a semaphore `/namespace/{key}:permits`);
/// a hold is an ephemeral sequential node under it named after the backend's session,
/// `<session id>-<sequence>` (`<session id>-r-<sequence>` for a shared hold), one per
/// holder, and Curator's recipes decide on their order: the lowest holds the lock, readers
/// hold while no write node is below theirs, a permit is among the `n` lowest. Its data
/// names the holder and counts its re-entries. The fencing token is the node's creation
/// zxid; a shared hold carries the last writer's, recorded in the lock's node.
///
/// **The session is the watchdog.** A hold is a node of the backend's session, which the
/// client keeps alive by itself (pinging every third of the session timeout, reconnecting
/// to another server when one fails); a renewal of a hold is a read of its node answered
/// on the session. A connection loss is not a session loss: holds live on while the
/// client reconnects within the timeout. When the session ends (expired because the
/// process was cut off or paused, or closed) every hold under it is deleted by the
/// ensemble and reported [`lost`](crate::HeldLock::lost) to its holder, and the backend
/// opens a new session for new holds. A holder's deadline is half the negotiated session
/// timeout from its acquisition or its last renewal, so it stops before the ensemble
/// could expire the session and free its node. A request's own
/// [`lease`](crate::LockRequest::lease) is replaced by that; a hold taken
/// [`without_watchdog`](crate::LockRequest::without_watchdog) is reported lost at that
/// deadline, and its node deleted when its guard goes.
///
/// Waiters are woken by a watch on the node they wait behind (no polling, no herd); when the connection
/// drops, every waiter tries again, and again once it is back. When no server can be
/// reached, calls fail with 503 after the command timeout.
#[derive(Clone)]
pub struct ZooKeeperBackend {
    inner: Arc<Core<ZkStore>>,
}

impl ZooKeeperBackend {
    /// Starts configuring a backend on the ZooKeeper ensemble at `hosts`, a connection
    /// string as ZooKeeper's own clients take it: `host:port,host:port`, optionally
    /// followed by a chroot (`zk-1:2181,zk-2:2181/apps/shop`), which must exist.
    pub fn builder(hosts: impl Into<String>) -> ZooKeeperBackendBuilder {
        ZooKeeperBackendBuilder::new(hosts.into())
    }

    crate::core::lock_backend_methods! {
        /// A snapshot of `key`'s lock (see [`LockBackend::inspect`]). Two reads; changes
        /// nothing. The lease reported is the session timeout, the longest the holder may
        /// keep it once cut off.
        fn inspect;
        /// Frees `key`'s lock whatever holds it (see [`LockBackend::force_release`]); the
        /// holder sees `lost()` at its next renewal, within a third of its lease. The next
        /// holder's token is above the freed one's (a new node, a new zxid).
        fn force_release;
    }

    /// A snapshot of the backend's watches and bookkeeping.
    pub fn stats(&self) -> BackendStats {
        self.inner.stats(self.inner.store.listener.wakeups())
    }

    /// The namespace that names the node every lock of this backend lives under.
    pub fn namespace(&self) -> &str {
        &self.inner.store.namespace
    }

    /// The id of the backend's current session, every hold of the backend a node of it
    /// (its hold nodes' names start with it in 16 hex digits). Closing or expiring it
    /// frees them all: their holders see `lost()`.
    pub fn session_id(&self) -> i64 {
        self.inner.store.session.id()
    }
}

impl fmt::Debug for ZooKeeperBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ZooKeeperBackend")
            .field("namespace", &self.inner.store.namespace)
            .field(
                "session",
                &format_args!("{:#x}", self.inner.store.session.id()),
            )
            .field("instance", &self.inner.owners.instance())
            .finish_non_exhaustive()
    }
}

impl Sealed for ZooKeeperBackend {
    fn store(&self) -> Arc<dyn Backend> {
        self.inner.clone()
    }
}

impl LockBackend for ZooKeeperBackend {}

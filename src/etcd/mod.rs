//! The etcd backend: every hold a key attached to the backend's one lease, ordered by
//! create revision, waiters woken by one watch per backend.
//!
//! The type and its design are documented on [`EtcdBackend`].
//!
//! # Which waiters put a key
//!
//! etcd's own recipes (`concurrency.Mutex`, the read/write lock and semaphore built the
//! same way) put a key for every waiter, each watching the deletion of the key it waits
//! behind. Here the core already lines up the exclusive waiters of one process behind one
//! contender per key (its local queue), so at most one exclusive attempt per process and
//! key is ever in etcd: *if the lock's directory has no key, put this backend's hold there
//! under its lease; else read the keys there*. Such a waiter leaves nothing in etcd (a
//! request that gives up, times out or is cancelled has nothing to clean up), nor does a
//! reader. A key waits in line only where the order is the point: a writer kept out by
//! readers (new readers queue behind it, so writers are not starved) and a permit waiter
//! (first come, first served), both deleted when the acquisition ends without the hold,
//! once every call of it returned (see `line.rs`), or with the lease.
//!
//! Wake-ups come from the backend's watch on the namespace's deletions, routed in
//! `behind.rs` to the acquisitions waiting behind the deleted key, each on a channel of its
//! own: a release wakes what it may let in, not every waiter of the lock. What the core's
//! queue gives up against a key per exclusive waiter is fairness *between* processes
//! (within one, the queue is first come, first served).
//!
//! The fencing token is the hold key's create revision (a shared hold's: the last
//! writer's, read from the fence record written with it): etcd's revision counter is one
//! for the whole cluster, raised by every write, and replicated by Raft, so every new hold
//! of a key gets a revision above every earlier hold's, across failovers, with no counter
//! to keep. For the same reason no block of tokens can be set aside for holders that take
//! turns in memory: handoffs in memory are off for this store (every holder gets its hold
//! from etcd).

mod behind;
mod builder;
mod error;
mod inspect;
mod keys;
mod lease;
mod line;
mod members;
mod orphans;
mod permits;
mod records;
mod rw;
mod store;
mod watch;

use std::fmt;
use std::sync::Arc;

pub use self::builder::EtcdBackendBuilder;
use self::store::EtcdStore;
use crate::backend::{BackendStats, LockBackend};
use crate::core::Core;
use crate::lock::backend::{Backend, Sealed};

/// Distributed locks in etcd (feature `etcd`, which needs `protoc` to build). Cheap to
/// clone; clones share the connection and the lease.
///
/// The same locks as [`RedisBackend`](crate::RedisBackend), for teams that want a lock
/// that survives the loss of a minority of servers: etcd acknowledges a write only once a
/// majority of its members have it, so a granted lock is not lost in a failover. The
/// layer, [`LockRequest`](crate::LockRequest), [`HeldLock`](crate::HeldLock), exclusive and
/// shared (read/write) locks, permits, multi-key locks, fencing tokens and the errors are
/// the same.
///
/// ```no_run
/// use tower_lock::EtcdBackend;
///
/// # async fn run() -> Result<(), tower_lock::BuildError> {
/// let backend = EtcdBackend::builder(["http://etcd-1:2379", "http://etcd-2:2379"])
///     .build()
///     .await?;
/// let guard = backend.lock("order:42").try_once().await;
/// # drop(guard);
/// # Ok(())
/// # }
/// ```
///
/// A lock is a directory of keys, `namespace:{key}/`, ordered by create revision as in
/// etcd's recipes, every key attached to its backend's lease: an exclusive hold (put only
/// when the directory has no key, in one transaction), a writer waiting in line behind
/// shared holders (new shared holds queue behind it), a shared hold (put when no writer's
/// key is there), and in the key's semaphore (`namespace:{key}:permits/`) a permit, held
/// while fewer than `n` keys came before it. A value names the holder and counts its
/// re-entries. The fencing token is the key's create revision; a shared hold carries the
/// last writer's, as on the other stores.
///
/// **The lease is the watchdog.** Each backend grants one lease
/// ([`lease_ttl`](EtcdBackendBuilder::lease_ttl), 30 s by default) and keeps it alive: a
/// renewal of the backend's holds is one keep-alive answered, which confirms every hold
/// under the lease at once. When the lease is gone (expired because the process was cut
/// off or paused, or revoked by an operator) every hold under it is deleted by etcd and
/// reported [`lost`](crate::HeldLock::lost) to its holder, and the backend grants a new
/// lease for new holds. A keep-alive stream can stall without failing: a hold counts as
/// confirmed only by an answered keep-alive, and the holder's deadline is half the TTL
/// from its acquisition or its last renewal (so it stops before etcd frees the key; a
/// lease left unconfirmed past every such deadline is revoked and replaced, even if etcd
/// kept it). A request's own
/// [`lease`](crate::LockRequest::lease) is replaced by that; a hold taken
/// [`without_watchdog`](crate::LockRequest::without_watchdog) is reported lost at that
/// deadline, and its key deleted when its guard goes, since the lease it lives under is
/// renewed for the backend's other holds.
///
/// Waiters are woken by one watch per backend on the namespace's deletions (no polling),
/// each only when the key it waits behind goes (a writer its predecessor, a reader the
/// last writer, a permit waiter a freed permit: no herd); when the watch breaks, every
/// waiter tries again, and again once it is back. When etcd
/// cannot be reached (or has no leader), calls fail with 503 after the command timeout.
#[derive(Clone)]
pub struct EtcdBackend {
    inner: Arc<Core<EtcdStore>>,
}

impl EtcdBackend {
    /// Starts configuring a backend on the etcd cluster at `endpoints`
    /// (`http://host:port`, `host:port`, or `https://host:port` with the `tls` feature).
    /// Give every member: calls go to one member at a time, and to the next when one
    /// cannot serve them (down, unreachable, without a leader), so a minority of members
    /// down costs no call.
    pub fn builder<I>(endpoints: I) -> EtcdBackendBuilder
    where
        I: IntoIterator,
        I::Item: Into<String>,
    {
        EtcdBackendBuilder::new(endpoints.into_iter().map(Into::into).collect())
    }

    crate::core::lock_backend_methods! {
        /// A snapshot of `key`'s lock (see [`LockBackend::inspect`]). One read; changes
        /// nothing. The lease reported is the TTL, the longest the holder may keep it.
        fn inspect;
        /// Frees `key`'s lock whatever holds it (see [`LockBackend::force_release`]); the
        /// holder sees `lost()` at its next renewal, within a third of its lease. The next
        /// holder's token is above the freed one's (a new key, a new revision).
        fn force_release;
    }

    /// A snapshot of the backend's watch and bookkeeping.
    pub fn stats(&self) -> BackendStats {
        self.inner.stats(self.inner.store.listener.wakeups())
    }

    /// The namespace that prefixes every lock key of this backend.
    pub fn namespace(&self) -> &str {
        &self.inner.store.namespace
    }

    /// The id of the backend's current lease in etcd, every hold of the backend attached
    /// to it (`etcdctl lease timetolive --keys <id in hex>` lists them). Revoking it frees
    /// them all: their holders see `lost()`.
    pub fn lease_id(&self) -> i64 {
        self.inner.store.lease.id()
    }
}

impl fmt::Debug for EtcdBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EtcdBackend")
            .field("namespace", &self.inner.store.namespace)
            .field("lease", &self.inner.store.lease.id())
            .field("instance", &self.inner.owners.instance())
            .finish_non_exhaustive()
    }
}

impl Sealed for EtcdBackend {
    fn store(&self) -> Arc<dyn Backend> {
        self.inner.clone()
    }
}

impl LockBackend for EtcdBackend {}

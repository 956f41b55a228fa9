//! The Redis backend: Redisson-style reentrant hash locks driven by Lua scripts.
//!
//! The type and its design are documented on [`RedisBackend`] (also at the crate root,
//! with its builder). Here too: [`FencedStore`], a store in the lock's Redis that refuses
//! writes with stale fencing tokens, and the builder's defaults.

mod admin;
mod builder;
mod calls;
mod connection;
mod fence;
mod held;
mod inspect;
mod keys;
mod pubsub;
mod quorum;
mod records;
mod replay;
mod replicas;
mod replies;
mod run_id;
mod scripts;
mod store;

use std::fmt;
use std::sync::Arc;

pub use self::builder::{DEFAULT_GRANT_LEASE, DEFAULT_TURN_GRACE, RedisBackendBuilder};
pub use self::fence::{FencedStore, FencedValue, FencedWrite};
use self::quorum::QuorumStore;
use self::store::RedisStore;
use crate::backend::{BackendStats, LockBackend};
use crate::core::Core;
use crate::error::BuildError;
use crate::lock::backend::{Backend, Sealed};

/// Distributed locks on Redis: one server, a Sentinel group ([`sentinel`](Self::sentinel)),
/// a Redis Cluster ([`cluster`](Self::cluster)) or a quorum of independent masters
/// ([`quorum`](Self::quorum), RedLock).
/// Cheap to clone; clones share connections.
///
/// Create one per process with [`connect`](Self::connect) or [`builder`](Self::builder)
/// and hand clones to every [`LockLayer`](crate::LockLayer).
///
/// ```no_run
/// use std::time::Duration;
/// use tower_lock::RedisBackend;
///
/// # async fn run() -> Result<(), tower_lock::BuildError> {
/// let backend = RedisBackend::builder("redis://127.0.0.1:6379")
///     .namespace("shop")
///     .pool_size(8)
///     .command_timeout(Duration::from_millis(500))
///     .build()
///     .await?;
/// # drop(backend);
/// # Ok(())
/// # }
/// ```
///
/// A lock is a Redis hash `namespace:{key} -> {owner: count}` with a lease, taken,
/// renewed and released by Lua scripts (the Redisson model); waiters are woken by the
/// release message on the key's channel, never by polling.
///
/// Each backend owns a bb8 pool of multiplexed command connections, one subscriber
/// connection that carries the release channels of every key with local waiters, and one
/// watchdog task that renews held leases in batches. On a cluster each of these is a
/// cluster connection (one multiplexed socket per node), channels are subscribed with
/// `SSUBSCRIBE` on the shard that owns them, and renewals are batched per hash slot. Its background tasks stop when the
/// last clone of the backend and the last guard it issued are dropped.
///
/// On every sign that Redis may have lost data (the subscriber reconnected, a command
/// connection was reopened after a failure, the server's `run_id` changed), the watchdog
/// re-checks every held lock at once, so a holder whose lock a restart without persistence
/// erased sees [`HeldLock::lost`](crate::HeldLock::lost) within milliseconds instead of at
/// its next renewal. To keep a second holder out even in those milliseconds, see
/// [`restart_guard`](RedisBackendBuilder::restart_guard); for failovers,
/// [`sync_replicas`](RedisBackendBuilder::sync_replicas).
///
/// Tasks of one backend that wait for the same key queue in-process: only the first talks
/// to Redis, and a release hands the lock straight to the next task in line, in memory
/// under the same hold in Redis while it is confirmed, for up to
/// [`max_local_handoffs`](RedisBackendBuilder::max_local_handoffs) times in a row (each
/// holder with its own owner and fencing token).
#[derive(Clone)]
pub struct RedisBackend {
    inner: Inner,
}

/// The core over one deployment, or over a quorum of masters.
#[derive(Clone)]
enum Inner {
    Single(Arc<Core<RedisStore>>),
    Quorum(Arc<Core<QuorumStore>>),
}

impl RedisBackend {
    /// Connects with default settings. Fails if Redis does not answer a PING.
    pub async fn connect(url: &str) -> Result<Self, BuildError> {
        Self::builder(url).build().await
    }

    /// Starts configuring a backend for the Redis server at `url`:
    /// `redis://[[user]:password@]host:port[/db]`, or `rediss://..` for TLS (feature `tls`,
    /// on by default). `user` is an ACL user; without one Redis logs in as `default`.
    /// Percent-encode `@`, `:` and `/` in the user and password.
    pub fn builder(url: impl Into<String>) -> RedisBackendBuilder {
        RedisBackendBuilder::new(url.into())
    }

    /// Starts configuring a backend for the Redis Cluster that `nodes` belong to: the URLs
    /// (`redis://[user:password@]host:port`) of one or more of its nodes, from which the
    /// client learns the rest. Keys, fencing counters and release channels of one lock share
    /// a hash slot; releases are published with sharded pub/sub (`SPUBLISH`, Redis 7), and
    /// the backend subscribes only on the shards that own a channel with waiters.
    ///
    /// ```no_run
    /// # async fn run() -> Result<(), tower_lock::BuildError> {
    /// let backend = tower_lock::RedisBackend::cluster(["redis://10.0.0.1:7000", "redis://10.0.0.2:7001"])
    ///     .build()
    ///     .await?;
    /// # drop(backend);
    /// # Ok(())
    /// # }
    /// ```
    pub fn cluster(nodes: impl IntoIterator<Item = impl AsRef<str>>) -> RedisBackendBuilder {
        let nodes = nodes.into_iter().map(|n| n.as_ref().to_owned()).collect();
        RedisBackendBuilder::new_cluster(nodes)
    }

    /// Starts configuring a backend on a quorum of independent Redis masters (RedLock):
    /// `masters` are the URLs of at least three single servers, each with its own TLS
    /// (`rediss://`) and ACL user, as [`builder`](Self::builder) takes one. A lock is held
    /// while a majority of them hold it, so losing a minority of the masters (down,
    /// restarted empty, cut off) loses no lock and stops no acquisition.
    ///
    /// ```no_run
    /// # async fn run() -> Result<(), tower_lock::BuildError> {
    /// let backend = tower_lock::RedisBackend::quorum([
    ///     "redis://10.0.0.1:6379",
    ///     "redis://10.0.0.2:6379",
    ///     "redis://10.0.0.3:6379",
    /// ])
    /// .max_lease(std::time::Duration::from_secs(30))
    /// .build()
    /// .await?;
    /// # drop(backend);
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// - **Acquire**: the same script runs on every master at once under one owner; the
    ///   lock is granted when a majority granted it within its validity: the lease, less
    ///   the time the calls took, less a clock-drift allowance of 1% of the lease plus 2 ms
    ///   (the Redlock algorithm). Otherwise what was taken is given back at once. Contenders
    ///   that split the masters between them give back, and try again after a random delay
    ///   of up to 10 ms. Re-entry, shared holds, permits and
    ///   [`lock_many`](Self::lock_many) follow the same rule.
    /// - **Fencing tokens** strictly increase across the quorum: a grant's token is the
    ///   highest its majority issued, written back to that majority before the grant is
    ///   returned; any two majorities share a master (the argument, and what breaks it, are
    ///   in the fencing guide).
    /// - **Renewal** goes to every master; a hold is lost when fewer than a majority
    ///   confirm it. **Release** goes to every master.
    /// - **The [restart guard](RedisBackendBuilder::restart_guard) is on**: a master that
    ///   started less than one [`max_lease`](RedisBackendBuilder::max_lease) ago grants
    ///   nothing, so one restarted empty cannot help a second holder to a majority while
    ///   the first runs. Set `max_lease` to the longest lease of the namespace. Tokens and
    ///   leases assume the masters' clocks run at about the same rate (drift within the
    ///   allowance above) and never jump; a holder paused past its validity is stopped by
    ///   fencing only.
    /// - **Waiting** subscribes the key's channel on every master and tries again on a
    ///   release on any of them, when the holder's validity runs out, or when any master's
    ///   subscriber reconnects. Handoffs in memory between tasks of one backend
    ///   ([`max_local_handoffs`](RedisBackendBuilder::max_local_handoffs)) are off.
    /// - **Errors**: with fewer than a majority of the masters answering, acquisitions,
    ///   releases and renewals fail (503 from the layer), with how many answered.
    ///
    /// `build` refuses fewer than three URLs, a URL whose server is a replica or a node of
    /// a Redis Cluster, and two URLs of one server (by its `run_id`), with
    /// [`BuildError::Quorum`] naming the URL's address; each master is checked as
    /// [`build`](RedisBackendBuilder::build) checks a single server. A master that cannot
    /// be reached (down, restarting) does not stop the build while a majority is checked:
    /// it takes no part in acquisitions until it answers and passes the same checks (one
    /// WARN when built without it, one INFO when it takes part, an ERROR if a check
    /// refuses it); with fewer than a majority reachable, `build` fails naming the first
    /// that was not.
    pub fn quorum(masters: impl IntoIterator<Item = impl AsRef<str>>) -> RedisBackendBuilder {
        let urls = masters.into_iter().map(|u| u.as_ref().to_owned()).collect();
        RedisBackendBuilder::new_quorum(urls)
    }

    /// Starts configuring a backend for the master that Redis Sentinel names `master_name`.
    ///
    /// `sentinels` are the sentinels' URLs (`redis://[[user]:password@]host:port`). Each
    /// connection the backend opens asks them all at once for the current master and takes
    /// the address more than half of them name (a sentinel that has not heard of a
    /// failover may still name the old master; without a majority the connection fails,
    /// and the request gets 503), then checks the server's `ROLE` on that connection and
    /// refuses a replica. So after a failover the backend's connections and its subscriber
    /// move to the promoted replica as they are replaced: connections to a dead master fail
    /// and are retired, and a demoted master's `READONLY` reply retires its connection too.
    /// The backend also listens to the sentinels' `+switch-master` announcement: from then
    /// on its new connections go to the announced master (while it answers as one), it
    /// uses no connection opened before (an old master cut off from the sentinels may still
    /// answer, and take writes), its subscriber moves and its waiters try again, and
    /// releases owed to the dead master are retried at once.
    ///
    /// Each sentinel is reached with its own URL's username and password. The master is
    /// reached with the username, password and database (`/db`) of the first URL, so
    /// sentinels and data nodes that share one password need nothing else; where they do
    /// not (commonly: sentinels without a password, data nodes with one), set the master's
    /// with [`master_password`](RedisBackendBuilder::master_password) and
    /// [`master_username`](RedisBackendBuilder::master_username).
    ///
    /// ```no_run
    /// use tower_lock::RedisBackend;
    ///
    /// # async fn run() -> Result<(), tower_lock::BuildError> {
    /// let backend = RedisBackend::sentinel(
    ///     ["redis://10.0.0.1:26379", "redis://10.0.0.2:26379", "redis://10.0.0.3:26379"],
    ///     "mymaster",
    /// )
    /// .build()
    /// .await?;
    /// # drop(backend);
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// TLS: with `rediss://` sentinel URLs (all of them; mixing schemes is refused) the
    /// sentinels and the master they name are both reached over TLS (feature `tls`, on by
    /// default), verified against the system roots, or against
    /// [`tls_root_cert`](RedisBackendBuilder::tls_root_cert), and presenting
    /// [`tls_client_cert`](RedisBackendBuilder::tls_client_cert) where set. Sentinels
    /// configured with `tls-replication yes` talk TLS to the data nodes and to each other.
    ///
    /// `build` fails with [`BuildError::Sentinel`] when no sentinel can be reached, none
    /// knows `master_name`, no master has a majority, or the master they name is down or
    /// reports itself a replica.
    ///
    /// Replication is asynchronous, so a failover loses the writes the replica had not
    /// received, and those that reached the old master after the promotion: a lock taken
    /// there may be taken again ([fencing tokens](crate::HeldLock::fencing_token) stay
    /// increasing and are the safety net, and the holder sees
    /// [`lost`](crate::HeldLock::lost)), and a lock released there would stay held on the
    /// new master until its lease ran out. So when the promotion is announced, the backend
    /// looks up on the new master the keys it released in the last seconds, and releases a
    /// hold found there that it had already released (one of its own owners, no longer
    /// holding in this process, with a fencing token no newer than the one it released
    /// last): the key is free again within milliseconds of the announcement. Only such a
    /// hold is touched; a newer one (another owner's, or a new acquisition of the same
    /// owner) never is.
    pub fn sentinel(
        sentinels: impl IntoIterator<Item = impl AsRef<str>>,
        master_name: &str,
    ) -> RedisBackendBuilder {
        let urls = sentinels
            .into_iter()
            .map(|url| url.as_ref().to_owned())
            .collect();
        RedisBackendBuilder::sentinel(urls, master_name.to_owned())
    }

    crate::core::lock_backend_methods! {
        /// A snapshot of `key`'s lock: how it is held, for how long, and the fencing token
        /// reached (see [`LockBackend::inspect`]). One script call; changes nothing.
        fn inspect;
        /// Frees `key`'s lock whatever holds it, fenced; the holder sees `lost()` within a
        /// round trip or two, at the latest at its next renewal (see
        /// [`LockBackend::force_release`]). Returns what was freed.
        fn force_release;
    }

    /// A snapshot of the backend's connections and bookkeeping.
    /// On a quorum, the subscriber is the first master's.
    pub fn stats(&self) -> BackendStats {
        match &self.inner {
            Inner::Single(core) => core.stats(core.store.subscriber.wakeups()),
            Inner::Quorum(core) => core.stats(core.store.lead.subscriber.wakeups()),
        }
    }

    /// The namespace that prefixes every Redis key of this backend.
    pub fn namespace(&self) -> &str {
        match &self.inner {
            Inner::Single(core) => &core.store.namespace,
            Inner::Quorum(core) => &core.store.lead.namespace,
        }
    }

    /// The store of the backend's deployment, or of a quorum's first master (whose settings,
    /// such as the namespace and the longest key, every master shares).
    fn lead(&self) -> &Arc<RedisStore> {
        match &self.inner {
            Inner::Single(core) => &core.store,
            Inner::Quorum(core) => &core.store.lead,
        }
    }

    /// The store of each Redis deployment the backend writes to: one, or each master of a
    /// quorum.
    fn stores(&self) -> &[Arc<RedisStore>] {
        match &self.inner {
            Inner::Single(core) => std::slice::from_ref(&core.store),
            Inner::Quorum(core) => &core.store.masters,
        }
    }
}

impl fmt::Debug for RedisBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisBackend")
            .field("namespace", &self.namespace())
            .field(
                "instance",
                &match &self.inner {
                    Inner::Single(core) => core.owners.instance(),
                    Inner::Quorum(core) => core.owners.instance(),
                },
            )
            .finish_non_exhaustive()
    }
}

/// A script answered with something it never returns (a bug, or a key changed from
/// outside).
#[derive(Debug)]
pub(crate) struct UnexpectedReply(&'static str);

impl fmt::Display for UnexpectedReply {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "unexpected reply from the {} script", self.0)
    }
}

impl std::error::Error for UnexpectedReply {}

impl Sealed for RedisBackend {
    fn store(&self) -> Arc<dyn Backend> {
        match &self.inner {
            Inner::Single(core) => core.clone(),
            Inner::Quorum(core) => core.clone(),
        }
    }
}

impl LockBackend for RedisBackend {}

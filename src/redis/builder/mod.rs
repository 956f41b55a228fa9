//! [`RedisBackendBuilder`]: the settings. `build.rs` validates them and connects.

mod build;
mod checks;
mod cluster_checks;
mod coverage;
mod diagnose;
mod quorum;
mod replica_checks;

use std::time::Duration;

use super::connection::tls::TlsSettings;
use super::replicas::SyncReplicas;
use crate::core::kit::settings::{StoreSettings, store_setters};
// Named by the docs' links only.
#[cfg(doc)]
use super::RedisBackend;
#[cfg(doc)]
use crate::error::BuildError;
use crate::lock::{DEFAULT_LEASE, MAX_DURATION};

/// The default [`turn_grace`](RedisBackendBuilder::turn_grace): a quarter of a second,
/// tens of round trips on a busy network, far below any lease.
pub const DEFAULT_TURN_GRACE: Duration = Duration::from_millis(250);

/// The default [`grant_lease`](RedisBackendBuilder::grant_lease): a quarter of a second,
/// like the turn grace: tens of round trips under load for the grantee to hear of the
/// grant and claim it, and all that a grantee that died costs the next waiter.
pub const DEFAULT_GRANT_LEASE: Duration = Duration::from_millis(250);

/// Configures a [`RedisBackend`]; created by [`RedisBackend::builder`].
#[derive(Debug, Clone)]
#[must_use = "a builder does nothing until `build` is awaited"]
pub struct RedisBackendBuilder {
    target: Target,
    settings: StoreSettings,
    fence_ttl: Duration,
    ping_interval: Duration,
    turn_grace: Duration,
    grant_lease: Duration,
    tls: TlsSettings,
    allow_eviction: bool,
    restart_guard: bool,
    max_lease: Duration,
    sync_replicas: Option<SyncReplicas>,
    /// The master's credentials when they differ from the first sentinel URL's.
    master_username: Option<String>,
    master_password: Option<String>,
    /// This builds one master of a quorum (see quorum.rs).
    quorum_master: bool,
}

/// Where the backend's Redis is, as the user gave it.
#[derive(Debug, Clone)]
enum Target {
    /// One server's URL.
    Url(String),
    /// The URLs of the sentinels that monitor `master_name`.
    Sentinel {
        urls: Vec<String>,
        master_name: String,
    },
    /// The seed nodes of a Redis Cluster.
    Cluster(Vec<String>),
    /// The independent masters of a quorum (RedLock).
    Quorum(Vec<String>),
}

impl RedisBackendBuilder {
    pub(super) fn new(url: String) -> Self {
        Self::with_target(Target::Url(url))
    }

    pub(super) fn sentinel(urls: Vec<String>, master_name: String) -> Self {
        Self::with_target(Target::Sentinel { urls, master_name })
    }

    pub(super) fn new_cluster(nodes: Vec<String>) -> Self {
        Self::with_target(Target::Cluster(nodes))
    }

    pub(super) fn new_quorum(urls: Vec<String>) -> Self {
        Self::with_target(Target::Quorum(urls))
    }

    fn with_target(target: Target) -> Self {
        // A quorum's masters restart independently: the guard is what keeps a lock that
        // a restarted master forgot from being granted again (see `RedisBackend::quorum`).
        let restart_guard = matches!(target, Target::Quorum(_));
        RedisBackendBuilder {
            target,
            settings: StoreSettings {
                pool_size: 4,
                ..StoreSettings::new(Duration::from_secs(1))
            },
            // Ten minutes: see `fence_ttl` for why.
            fence_ttl: Duration::from_secs(10 * 60),
            ping_interval: Duration::from_secs(1),
            turn_grace: DEFAULT_TURN_GRACE,
            grant_lease: DEFAULT_GRANT_LEASE,
            tls: TlsSettings::default(),
            allow_eviction: false,
            restart_guard,
            max_lease: DEFAULT_LEASE,
            sync_replicas: None,
            master_username: None,
            master_password: None,
            quorum_master: false,
        }
    }

    store_setters! {
        settings;
        /// Each is multiplexed: it carries many concurrent commands, so a handful is
        /// plenty. On a cluster each is a cluster connection with one socket per node.
        fn pool_size = 4;
        /// On Redis it prefixes every key and channel.
        fn namespace;
        fn max_key_len;
        fn connect_timeout = "1 s";
        fn command_timeout = "1 s";
    }

    /// How long a key's fencing counter is kept after the last token was issued for it
    /// (default 10 minutes; clamped to 1 ms ..= [`MAX_DURATION`](crate::lock::MAX_DURATION),
    /// so that `Duration::MAX` or zero still give `SET .. PX` a value Redis accepts).
    ///
    /// The counter is the only state a released key leaves in Redis: with a new key per
    /// request (say, keyed on an `Idempotency-Key` header) Redis holds one counter, about
    /// 165 bytes, per key taken in the last `ttl`. Under the default that is some 100 MB
    /// at 1,000 new keys a second, where the former 7 days meant 600 M counters and an
    /// out-of-memory Redis within hours.
    ///
    /// Once the counter is gone, a key's next token is the Redis clock (`TIME`) in
    /// microseconds. Tokens stay strictly increasing as long as the Redis server clock
    /// does not step back by more than `ttl` − *L*, where *L* is how many microseconds the
    /// key's last token ran ahead of that clock when the script issuing it started. Redis
    /// deletes the counter only once its clock is more than `ttl` past the counter's last
    /// write, so a clock that has since lost no more than `ttl` − *L* still reads above
    /// that token. *L* is at most the few microseconds a script runs unless the clock
    /// already stepped back while the counter was kept (tokens then continue from the
    /// counter, ahead of the clock, so such steps count against the same window) or the
    /// key got more than one token per microsecond, which one Redis cannot serve.
    ///
    /// NTP and chrony corrections and leap seconds are a second or less: ten minutes
    /// covers them many times over while keeping the counters small, and a clock wrong by
    /// more is a misconfigured host that an hour would not cover either. A counter lost
    /// another way (`DEL`, `FLUSHALL`, eviction under an `allkeys-*` policy, a restart
    /// without persistence) leaves only the clock: tokens then keep increasing as long as
    /// it has not stepped back since the last token was issued.
    pub fn fence_ttl(mut self, ttl: Duration) -> Self {
        self.fence_ttl = ttl.clamp(Duration::from_millis(1), crate::lock::MAX_DURATION);
        self
    }

    /// How often the subscriber connection is pinged to detect a half-open connection
    /// (default 1 s).
    pub fn subscriber_ping_interval(mut self, interval: Duration) -> Self {
        self.ping_interval = interval.max(Duration::from_millis(10));
        self
    }

    store_setters! {
        settings;
        /// On Redis, a release that goes to Redis while another instance waits for the key
        /// (it is in the key's line of waiting instances, see
        /// [`turn_grace`](Self::turn_grace)) grants the lock to the first of them (see
        /// [`grant_lease`](Self::grant_lease)), and the instances that wait take it in
        /// turn; otherwise one script hands it to the next task under a new hold and a new
        /// block of tokens, and the turns go on.
        fn max_local_handoffs;
        fn max_local_handoff_time;
    }

    /// How long the instance whose turn it is has to take a freed key (default
    /// [`DEFAULT_TURN_GRACE`]).
    ///
    /// The instances that wait for a key take it in the order they began waiting: an
    /// attempt refused while it waits puts its instance in the key's line in Redis (in the
    /// key's hash slot), taking the key or giving up takes it out, and a free key goes
    /// only to the head of the line. A head that neither takes the key nor gives up (its
    /// process died, or lost its connection) keeps the others out until `grace` after the
    /// release that freed the key (or after it was last known to wait, when the key's
    /// lease ran out instead), then drops out of the line. Long enough for a release
    /// message to reach a live instance and its attempt to come back, a few round trips
    /// under load; a head that comes later loses its place (it joins the line's end), never
    /// the lock's safety. A quorum (RedLock) keeps no line: its masters could each line up
    /// waiters in their own order, and no order might win a majority.
    pub fn turn_grace(mut self, grace: Duration) -> Self {
        self.turn_grace = grace.clamp(Duration::from_millis(1), MAX_DURATION);
        self
    }

    /// How long a key granted to the next waiting instance stays its own unclaimed
    /// (default [`DEFAULT_GRANT_LEASE`]).
    ///
    /// A release that frees a key while instances wait in its line grants it to the head
    /// in the same script: the grantee's task holds it on the release's message, without
    /// another call, and its first renewal, at once, claims it for its full lease. A
    /// grantee that died keeps the key this long at most. Refused at build if zero or
    /// above [`max_lease`](Self::max_lease). A quorum and
    /// [`sync_replicas`](Self::sync_replicas) grant nothing.
    pub fn grant_lease(mut self, lease: Duration) -> Self {
        self.grant_lease = lease;
        self
    }

    /// Trusts the PEM certificate(s) `pem` for `rediss://` connections, instead of the
    /// system roots: for a server whose certificate a private CA signed. The server's
    /// certificate must still name the URL's host.
    ///
    /// Needs the crate's `tls` feature (on by default); without it `build` fails with
    /// [`BuildError::Tls`].
    pub fn tls_root_cert(mut self, pem: impl Into<Vec<u8>>) -> Self {
        self.tls.root_cert = Some(pem.into());
        self
    }

    /// Presents the client certificate `cert_pem` (a PEM chain, leaf first) with its private
    /// key `key_pem` to servers that require one (mutual TLS, `tls-auth-clients yes`).
    ///
    /// Needs the crate's `tls` feature (on by default); without it `build` fails with
    /// [`BuildError::Tls`].
    pub fn tls_client_cert(
        mut self,
        cert_pem: impl Into<Vec<u8>>,
        key_pem: impl Into<Vec<u8>>,
    ) -> Self {
        self.tls.client_cert = Some((cert_pem.into(), key_pem.into()));
        self
    }

    /// Accepts a server whose `maxmemory-policy` may evict keys; by default `build` refuses
    /// every policy but `noeviction` with [`BuildError::Eviction`], on the server (every
    /// primary of a cluster) and on every replica a failover may promote (Sentinel's and a
    /// cluster's, see [`build`](Self::build)).
    ///
    /// With it, `build` reads no eviction policy at all: the replicas are then not
    /// contacted, so a replica that is unreachable or refuses the credentials is not
    /// noticed either.
    ///
    /// What it costs: under memory pressure Redis may evict a held lock (every lock key has
    /// a lease, so `volatile-*` policies evict them as readily as `allkeys-*`), and a second
    /// owner then gets the lock while the first still runs; the fencing counter may be
    /// evicted too, after which a key's tokens only follow the server clock (see
    /// [`fence_ttl`](Self::fence_ttl)), and a [`FencedStore`](crate::redis::FencedStore) value may
    /// be evicted and then accept a write with an older token. Only opt in when the
    /// server never reaches `maxmemory`, or losing mutual exclusion now and then is fine.
    pub fn allow_eviction(mut self) -> Self {
        self.allow_eviction = true;
        self
    }

    /// Turns on the restart guard (off by default): a Redis server that started less than
    /// one [`max_lease`](Self::max_lease) ago grants no new acquisition until then.
    ///
    /// Without persistence, a restarted Redis has forgotten every lock while the holders
    /// of the old ones may still run. The backend re-checks its held locks as soon as it
    /// sees the restart, so each holder's [`HeldLock::lost`](crate::HeldLock::lost) fires
    /// within milliseconds (about one
    /// [`subscriber_ping_interval`](Self::subscriber_ping_interval) when the connection
    /// was half-open), but an instance that asks first may be granted the lock before then:
    /// for those milliseconds two handlers run. The guard closes that window: a holder from
    /// before the restart stops within one lease of its last renewal (when it learns of the
    /// loss, or when its lease runs out unrenewed), so nothing is granted before the
    /// server's start plus the longest lease any holder may have. The decision is taken
    /// inside the acquire script from the server's uptime (`INFO server`), so it holds for
    /// every instance and for each node of a Cluster on its own.
    ///
    /// What it costs: after every start of the server, the first start and restarts with
    /// persistence included, new acquisitions of keys that are not held wait until one
    /// `max_lease` after the start, and up to two seconds more (Redis counts its uptime in
    /// whole seconds, which the guard rounds so as never to end early); waiting requests
    /// wait it out (503 if their wait is shorter), a
    /// [`try_once`](crate::LockRequest::try_once) or fail-fast layer gets
    /// [`LockError::Contended`](crate::LockError::Contended) (409) with the time left as
    /// `Retry-After`; the backend says so once per server at INFO (`the Redis server
    /// started less than max_lease ago: ...`), and once when the server grants again. The
    /// guard counts the server's uptime: a backend built later (a deploy of the service)
    /// waits for nothing. Locks that survived the restart (persistence) are held, renewed and
    /// re-entered as before. With the guard on, a request's lease is capped at `max_lease`.
    /// The Redis user must be allowed to run `INFO`.
    ///
    /// What it does not cover: data lost without a restart (`FLUSHALL`, a failover to a
    /// replica that had not yet received a lock; see [`sync_replicas`](Self::sync_replicas)).
    /// Every backend of the namespace must turn it on, with the same `max_lease`. Fencing
    /// tokens remain the safety net.
    ///
    /// On for a [`RedisBackend::quorum`], where a master that restarted empty would
    /// otherwise help a second holder to a majority.
    pub fn restart_guard(mut self) -> Self {
        self.restart_guard = true;
        self
    }

    /// The longest lease used in this namespace, which the
    /// [`restart_guard`](Self::restart_guard) waits out after a restart (default 30 s, the
    /// default lease). With the guard on, longer leases asked for are shortened to it.
    /// Clamped to at most [`MAX_DURATION`](crate::lock::MAX_DURATION).
    pub fn max_lease(mut self, max: Duration) -> Self {
        self.max_lease = max.min(MAX_DURATION);
        self
    }

    /// After each write that grants or extends a hold, waits until `replicas` replicas have
    /// it (`WAIT replicas timeout`, on the connection that ran the script), for up to
    /// `timeout`. Off by default. `replicas` must be at least 1 and `timeout` above zero
    /// and below the [`command_timeout`](Self::command_timeout). A write fewer replicas
    /// acknowledged in time does not count:
    ///
    /// - an acquisition is released again and fails with
    ///   [`LockError::Backend`](crate::LockError::Backend) (503 from the layer) whose cause
    ///   reads, say, "acquired but acknowledged by 0 of 1 replicas within 50ms";
    /// - a renewal counts as failed: it is tried again, and the hold is lost
    ///   ([`LockGuard::lost`](crate::LockGuard::lost)) once the lease last acknowledged has
    ///   run out;
    /// - a release's handoff through Redis to the next task of the same process is undone:
    ///   the key is freed and that task asks Redis as any waiter. (Handoffs in memory write
    ///   nothing: they pass a hold whose renewals were acknowledged.)
    ///
    /// What it guarantees: a hold, as granted and as extended, was on `replicas` replicas
    /// when its holder was told, so a failover to one of them keeps it, instead of granting
    /// it to someone else while its holder runs. With the replicas down or lagging,
    /// acquisitions fail and held locks are lost one lease after their last acknowledged
    /// renewal (the lock service is unavailable) rather than be kept unreplicated.
    ///
    /// What it does not: replication stays asynchronous. `WAIT` does not make Redis
    /// consistent: a failover may still promote a replica that did not acknowledge (Sentinel
    /// and Cluster pick by replication offset, not by who acknowledged), and an
    /// acknowledged write can still be lost with a replica restarted without persistence.
    /// Holders learn of a lost lock soon after the failover (the backend re-checks held
    /// locks when it reconnects); fencing tokens remain the safety net. Each acquisition,
    /// renewal call and handoff through Redis also keeps its pooled connection waiting for
    /// up to `timeout` while replicas acknowledge.
    pub fn sync_replicas(mut self, replicas: u32, timeout: Duration) -> Self {
        self.sync_replicas = Some(SyncReplicas { replicas, timeout });
        self
    }

    /// Sentinel only: the username the master is reached with, when it is not the first
    /// sentinel URL's (see [`RedisBackend::sentinel`]).
    pub fn master_username(mut self, username: impl Into<String>) -> Self {
        self.master_username = Some(username.into());
        self
    }

    /// Sentinel only: the password the master is reached with, when it is not the first
    /// sentinel URL's: for sentinels that need another password than the data nodes, or
    /// none (see [`RedisBackend::sentinel`]).
    pub fn master_password(mut self, password: impl Into<String>) -> Self {
        self.master_password = Some(password.into());
        self
    }
}

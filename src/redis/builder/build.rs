//! [`RedisBackendBuilder::build`]: validation, the topology, the checks of the server and
//! the backend's tasks.

use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use super::checks::ServerChecks;
use super::coverage;
use super::diagnose::{Peer, diagnose, seed_handshake};
use super::quorum::refuse_non_master;
use super::{RedisBackendBuilder, Target};
use crate::core::wakeups::Wakeups;
use crate::core::{Core, Parts};
use crate::error::{BuildError, ConnectFailure};
use crate::redis::connection::cluster::ClusterNodes;
use crate::redis::connection::pool::{Pool, RedisCause};
use crate::redis::connection::sentinel::{MasterAuth, SentinelGroup};
use crate::redis::connection::topology::Topology;
use crate::redis::keys::admin_channel;
use crate::redis::pubsub::{Subscriber, SubscriberConfig};
use crate::redis::replay::{ReplayConfig, Replays};
use crate::redis::replies::GuardSaid;
use crate::redis::run_id::ServerIdentity;
use crate::redis::scripts::Scripts;
use crate::redis::store::RedisStore;
use crate::redis::{Inner, RedisBackend};

impl RedisBackendBuilder {
    /// Connects and starts the backend's tasks. Must be called inside a Tokio runtime.
    ///
    /// The backend may be used from other runtimes too, also after this one shut down (a
    /// `static` shared by `#[tokio::test]`s): its tasks run on the caller's runtime, and
    /// its connections and background tasks are started again there when theirs is gone.
    ///
    /// Fails with the cause as soon as it is known (connection refused, unknown host,
    /// wrong password, a TLS certificate that does not verify, ...); only a server that
    /// does not answer takes the connect timeout, and so does a `rediss://` URL for a
    /// plaintext port, which the error then names as such. The error's own message names
    /// the server's address and what went wrong there (see [`BuildError`] and
    /// [`ConnectFailure`](crate::ConnectFailure)). Before the backend is returned, the
    /// server is checked: its `maxmemory-policy` must be `noeviction` (unless
    /// [`allow_eviction`](Self::allow_eviction)), and the URL's ACL user must be allowed to
    /// load and run the lock scripts on the namespace's keys, and to `PUBLISH` and
    /// `SUBSCRIBE` on its channels, or the error says which right is missing. The checks
    /// run on a probe key of the namespace and leave nothing behind.
    ///
    /// A replica that a failover may promote must be `noeviction` too (unless
    /// `allow_eviction`), or it becomes a master that evicts held locks: on Sentinel, every
    /// replica the sentinels report (the first that answers `SENTINEL REPLICAS`) except
    /// those they flag down or disconnected, which they would not promote; on a Redis
    /// Cluster, every replica of the slot map (which leaves out those the cluster flags as
    /// failed). Each is asked for its `INFO memory` with the master's credentials and TLS
    /// settings (a cluster's seed URL's); one that cannot be reached, refuses them or
    /// refuses `INFO` fails the build too, as a primary would, and the error names it.
    ///
    /// On a Redis Cluster, where ACL users and settings are per node, every primary that
    /// owns hash slots is checked on its own: the user must log in to it, its
    /// `maxmemory-policy` must be `noeviction`, and a probe key in its own slots must pass
    /// the scripts, `SPUBLISH` and `SSUBSCRIBE`; the error names the
    /// primary that refused. Replicas are checked for their eviction policy only (and so
    /// that the user may log in to them). Each primary's
    /// `cluster-require-full-coverage` is read too (when the user may run `CONFIG GET`):
    /// where it is `yes`, Redis' default, every shard refuses commands while any hash slot
    /// is uncovered (one primary down until its replica takes over), so every lock answers
    /// 503 meanwhile; the build goes on, and logs a warning naming those primaries and the
    /// setting that keeps the other shards serving, `cluster-require-full-coverage no`.
    pub async fn build(self) -> Result<RedisBackend, BuildError> {
        self.settings.validate()?;
        self.validate_settings()?;
        if let Target::Quorum(urls) = &self.target {
            let urls = urls.clone();
            return self.build_quorum(urls).await;
        }
        let parts = self.settings.parts();
        let store = self.store(&parts).await?;
        Ok(RedisBackend {
            inner: Inner::Single(Core::new(store, parts)),
        })
    }

    /// Connects to one deployment (a server, a Sentinel group, a cluster), checks it and
    /// starts its subscriber: the store of a backend.
    pub(super) async fn store(&self, parts: &Parts) -> Result<RedisStore, BuildError> {
        let (store, _) = self.master(parts, false).await?;
        Ok(store)
    }

    /// [`store`](Self::store), for one master of a quorum when `down_is_later`: a server
    /// that cannot be reached is built unchecked, with its checks to run when it answers.
    pub(super) async fn master(
        &self,
        parts: &Parts,
        down_is_later: bool,
    ) -> Result<(RedisStore, Option<LaterChecks>), BuildError> {
        let (topology, peer) = self.topology().await?;
        let scripts = Arc::new(Scripts::new(topology.is_cluster()));
        let server = ServerIdentity::new(parts.recheck.clone());
        let pool = Pool::new(
            topology.clone(),
            self.settings.pool_size,
            self.settings.connect_timeout,
            self.settings.command_timeout,
            server.clone(),
        );
        let mut later = None;
        if let Err(error) = self.check(&pool, &scripts, &peer).await {
            let error = match &topology {
                Topology::Cluster(nodes) if peer.tls => {
                    seed_handshake(error, nodes, self.settings.connect_timeout).await
                }
                _ => error,
            };
            let error = diagnose(error, peer.tls, self.settings.connect_timeout).await;
            if !(down_is_later && is_down(&error)) {
                return Err(error);
            }
            later = Some(LaterChecks {
                builder: self.clone(),
                pool: pool.clone(),
                scripts: scripts.clone(),
                peer: peer.clone(),
                error,
            });
        }
        let subscriber = Subscriber::spawn(
            (topology, Wakeups::new(parts.metrics.clone())),
            SubscriberConfig {
                connect_timeout: self.settings.connect_timeout,
                command_timeout: self.settings.command_timeout,
                ping_interval: self.ping_interval,
                max_backoff: self.settings.max_backoff,
                admin_channel: admin_channel(&self.settings.namespace),
            },
            pool.failure_epoch(),
            server,
            parts.shutdown.clone(),
            &parts.runtime,
        );
        // Only a topology that announces takeovers can redo what one lost.
        let replays = matches!(pool.topology(), Topology::Sentinel(_)).then(|| {
            let config = ReplayConfig {
                pool: pool.clone(),
                scripts: scripts.clone(),
                watchdog: parts.watchdog.clone(),
                instance: parts.owners.instance().to_owned(),
                fence_ttl: self.fence_ttl,
                command_timeout: self.settings.command_timeout,
            };
            Replays::spawn(config, parts.shutdown.clone(), &parts.runtime)
        });
        // A cluster client sends a call again by itself (see acquire.lua).
        let resent_guard = scripts.sharded.then(|| Arc::from(parts.owners.instance()));
        let store = RedisStore {
            pool,
            scripts,
            subscriber,
            replays,
            namespace: self.settings.namespace.clone(),
            max_key_len: self.settings.max_key_len,
            command_timeout: self.settings.command_timeout,
            fence_ttl: self.fence_ttl,
            turn_grace: (!self.quorum_master).then_some(self.turn_grace),
            // A grant is made on the master alone: acquisitions that must reach replicas
            // first take the key as before.
            grant_lease: (!self.quorum_master && self.sync_replicas.is_none())
                .then_some(self.grant_lease),
            restart_guard: self.restart_guard.then_some(self.max_lease),
            guard_said: GuardSaid::new(&peer.addr),
            sync_replicas: self.sync_replicas,
            resent_guard,
            force_serials: AtomicU64::new(0),
        };
        Ok((store, later))
    }
}

/// Whether a failed build says only that the server cannot be reached now.
pub(super) fn is_down(error: &BuildError) -> bool {
    matches!(
        error,
        BuildError::Connect {
            failure: ConnectFailure::Refused | ConnectFailure::TimedOut | ConnectFailure::Closed,
            ..
        }
    )
}

/// The checks of a quorum's master that was down at build, to run when it answers (see
/// `quorum.rs`).
pub(super) struct LaterChecks {
    builder: RedisBackendBuilder,
    pool: Pool,
    scripts: Arc<Scripts>,
    peer: Peer,
    /// Why the build could not check it.
    pub(super) error: BuildError,
}

impl LaterChecks {
    /// The checks a build runs, now.
    pub(super) async fn run(&self) -> Result<(), BuildError> {
        self.builder
            .check(&self.pool, &self.scripts, &self.peer)
            .await
    }

    /// The server's pool.
    pub(super) fn pool(&self) -> &Pool {
        &self.pool
    }
}

impl RedisBackendBuilder {
    /// Checks the servers before the backend relies on them (see [`build`](Self::build)).
    async fn check(&self, pool: &Pool, scripts: &Scripts, peer: &Peer) -> Result<(), BuildError> {
        let topology = pool.topology();
        // The pool bounds the connect by the connect timeout and the reply by the command
        // timeout, so no outer timeout is needed (one would cut a slow connect short).
        // Every primary of a cluster must answer, as the one server must.
        pool.query_each_primary::<String>(&redis::cmd("PING"))
            .await
            .map_err(|e| peer.failure(e))?;
        if self.quorum_master {
            refuse_non_master(pool, &peer.addr).await?;
        }
        if !topology.is_cluster() {
            refuse_cluster_node(pool).await?;
        }
        ServerChecks {
            pool,
            scripts,
            peer,
            namespace: &self.settings.namespace,
            connect_timeout: self.settings.connect_timeout,
            command_timeout: self.settings.command_timeout,
            publish: if topology.is_cluster() {
                "SPUBLISH"
            } else {
                "PUBLISH"
            },
        }
        .run(topology, self.allow_eviction)
        .await?;
        if self.restart_guard {
            // The guard reads the uptime inside the acquire script: refuse a user that may
            // not, instead of failing every acquisition.
            let mut info = redis::cmd("INFO");
            info.arg("server");
            match pool.query::<String>(&info).await {
                Ok(_) => {}
                Err(e) if e.is_no_permission() => {
                    return Err(BuildError::Setting {
                        name: "restart_guard",
                        reason: "the Redis user must be allowed to run INFO (the guard reads \
                                 the server's uptime)",
                    });
                }
                Err(e) => return Err(peer.failure(e)),
            }
        }
        if topology.is_cluster() {
            coverage::warn_if_full_coverage_required(pool).await;
        }
        Ok(())
    }

    /// Where the servers are (for Sentinel: the master the sentinels name now, asked once
    /// so that unreachable sentinels or an unknown name fail the build with that cause),
    /// and who the connections log in as where (for errors).
    async fn topology(&self) -> Result<(Topology, Peer), BuildError> {
        let info_of = |url: &str| {
            redis::IntoConnectionInfo::into_connection_info(url).map_err(|e| BuildError::Url {
                source: Box::new(e),
            })
        };
        // Several servers tried alike are named together.
        let addrs = |urls: &[String]| -> Result<String, BuildError> {
            let addrs: Result<Vec<String>, BuildError> = urls
                .iter()
                .map(|url| Ok(info_of(url)?.addr().to_string()))
                .collect();
            Ok(addrs?.join(", "))
        };
        Ok(match &self.target {
            Target::Url(url) => {
                let client = self.tls.client(url)?;
                let peer = Peer::of(client.get_connection_info(), None);
                (Topology::Server(client), peer)
            }
            // Each master of a quorum is built as a single server (see quorum.rs).
            Target::Quorum(_) => {
                return Err(BuildError::Setting {
                    name: "RedisBackend::quorum",
                    reason: "a quorum's masters are connected one by one",
                });
            }
            Target::Cluster(nodes) => {
                self.tls.check_cluster(nodes)?;
                let cluster = ClusterNodes::new(
                    nodes.clone(),
                    self.tls.clone(),
                    self.settings.connect_timeout,
                    self.settings.command_timeout,
                )
                .map_err(|e| BuildError::Url {
                    source: Box::new(e),
                })?;
                // The cluster client checked that there are seeds and that they agree.
                let first = info_of(nodes.first().map(String::as_str).unwrap_or_default())?;
                let peer = Peer::of(&first, Some(addrs(nodes)?));
                (Topology::Cluster(cluster), peer)
            }
            Target::Sentinel { urls, master_name } => {
                let use_tls = self.tls.check_sentinel(urls)?;
                let master = MasterAuth {
                    username: self.master_username.as_deref(),
                    password: self.master_password.as_deref(),
                };
                let group = SentinelGroup::new(
                    urls,
                    master_name,
                    master,
                    (&self.tls, use_tls),
                    (self.settings.connect_timeout, self.settings.command_timeout),
                )?;
                let sentinels = addrs(urls)?;
                // Each sentinel's connect and reply are bounded by the backend's timeouts.
                let master = group.master().await.map_err(|e| BuildError::Sentinel {
                    master_name: master_name.clone(),
                    addr: sentinels,
                    source: Box::new(RedisCause::from(e)),
                })?;
                // The master's client logs in with the master's credentials.
                let peer = Peer::of(master.get_connection_info(), None);
                (Topology::Sentinel(Arc::new(group)), peer)
            }
        })
    }

    /// Refuses Redis's own settings that would fail every call, instead of failing each
    /// request later (the shared ones are
    /// [`StoreSettings::validate`](crate::core::kit::settings::StoreSettings::validate)'s).
    fn validate_settings(&self) -> Result<(), BuildError> {
        let refuse = |name, reason| Err(BuildError::Setting { name, reason });
        if self.max_lease < Duration::from_millis(3) {
            return refuse("max_lease", "it must be at least 3 ms, the shortest lease");
        }
        if self.grant_lease.is_zero() || self.grant_lease > self.max_lease {
            return refuse(
                "grant_lease",
                "it must be above zero and no longer than `max_lease`",
            );
        }
        if let Some(sync) = self.sync_replicas {
            if sync.replicas == 0 {
                return refuse("sync_replicas", "it must wait for at least one replica");
            }
            // WAIT 0 would block forever; a wait past the command timeout would fail every
            // acquisition by the reply's timeout instead.
            if sync.timeout.is_zero() || sync.timeout >= self.settings.command_timeout {
                return refuse(
                    "sync_replicas",
                    "its timeout must be above zero and below the command timeout",
                );
            }
        }
        if !matches!(self.target, Target::Sentinel { .. }) {
            let sentinel_only =
                "it applies to a Sentinel backend only; put the credentials in the URL(s)";
            if self.master_username.is_some() {
                return refuse("master_username", sentinel_only);
            }
            if self.master_password.is_some() {
                return refuse("master_password", sentinel_only);
            }
        }
        Ok(())
    }
}

/// Refuses a single-server backend pointed at a node of a Redis Cluster, which would
/// otherwise fail later with a bare `MOVED` for every key the node does not own. A user
/// who may not run `INFO` is let through (the checks after this one name that right).
async fn refuse_cluster_node(pool: &Pool) -> Result<(), BuildError> {
    let info = pool
        .query::<String>(redis::cmd("INFO").arg("cluster"))
        .await
        .unwrap_or_default();
    if info.lines().any(|line| line.trim() == "cluster_enabled:1") {
        return Err(BuildError::Setting {
            name: "RedisBackend::builder",
            reason: "the server is a node of a Redis Cluster: build the backend with \
                     `RedisBackend::cluster(nodes)`",
        });
    }
    Ok(())
}

//! What `build()` checks on a server before the backend relies on it, so that a server or
//! an ACL user that cannot keep locks is refused with the cause instead of failing every
//! request later (a user without channel rights built fine and then failed every release).
//!
//! Every check is a real probe, never `ACL DRYRUN` (a user without ACL rights must still be
//! checkable): the lock scripts run on a probe key of the namespace, the subscriber
//! subscribes to the probe key's channel, and the probe key is deleted afterwards. A
//! cluster runs them on every shard (`cluster_checks.rs`).

use std::time::Duration;

use redis::AsyncConnectionConfig;
use tokio::time::timeout;

use super::diagnose::Peer;
use crate::error::BuildError;
use crate::redis::connection::command_error::{Refused, refused, refused_call};
use crate::redis::connection::pool::{CommandError, Pool};
use crate::redis::connection::topology::Topology;
use crate::redis::keys::LockKey;
use crate::redis::scripts;
use crate::redis::scripts::Scripts;

/// How long the probe lock and its fencing counter live if deleting them fails.
const PROBE_TTL_MS: u64 = 10_000;

/// The checks of one server.
pub(crate) struct ServerChecks<'a> {
    pub(crate) pool: &'a Pool,
    pub(crate) scripts: &'a Scripts,
    /// Who the connections log in as and where, for the errors.
    pub(crate) peer: &'a Peer,
    pub(crate) namespace: &'a str,
    pub(crate) connect_timeout: Duration,
    pub(crate) command_timeout: Duration,
    /// The command the release script publishes with (`PUBLISH`; `SPUBLISH` on a cluster).
    pub(crate) publish: &'static str,
}

impl ServerChecks<'_> {
    /// Runs every check: on a cluster, each primary lets the user log in (see
    /// `cluster_checks.rs`); the scripts load; the eviction policy of every primary and of
    /// every replica that may take over from one (unless `allow_eviction`, see
    /// `replica_checks.rs`); then the probes: the scripts on a probe key, and `SUBSCRIBE` on
    /// its channel, or on a cluster the same sharded, once per shard.
    pub(crate) async fn run(
        &self,
        topology: &Topology,
        allow_eviction: bool,
    ) -> Result<(), BuildError> {
        let shards = match topology {
            Topology::Cluster(nodes) => Some(self.shards(nodes).await?),
            Topology::Server(_) | Topology::Sentinel(_) => None,
        };
        for script in self.scripts.all() {
            self.pool
                .load(script)
                .await
                .map_err(|e| match refused(&e) {
                    Some(_) => self.rights_error(
                        "run SCRIPT LOAD (the lock scripts are loaded at build)".to_owned(),
                        e.into_cause(),
                    ),
                    None => BuildError::Scripts {
                        addr: self.peer.addr.clone(),
                        source: e.into_cause(),
                    },
                })?;
        }
        if !allow_eviction {
            self.eviction_policy().await?;
            self.replicas_keep_locks(topology, shards.as_ref()).await?;
        }
        if let Some(shards) = shards {
            return self.probe_shards(shards).await;
        }
        let probe = self.probe_key(&uuid::Uuid::new_v4().simple().to_string())?;
        self.probe_scripts(&probe).await?;
        let client = topology
            .subscriber_client()
            .await
            .map_err(|e| self.peer.failure(CommandError::Redis(e)))?;
        self.subscribe(&client, &probe.channel).await
    }

    /// Runs the lock scripts on `probe` and deletes it.
    pub(crate) async fn probe_scripts(&self, probe: &LockKey) -> Result<(), BuildError> {
        let scripts = self.lock_scripts(probe).await;
        self.delete(probe).await;
        scripts
    }

    /// A lock key of the namespace that no application key maps to by chance.
    /// `id` makes it unique (a fresh UUID, plus a number to pick its hash slot).
    pub(crate) fn probe_key(&self, id: &str) -> Result<LockKey, BuildError> {
        let user = format!("tower-lock-build-check:{id}");
        // Only an invalid namespace can fail this, and `build` checked it already.
        LockKey::new(self.namespace, user, usize::MAX).map_err(|_| BuildError::Namespace {
            namespace: self.namespace.to_owned(),
        })
    }

    /// The semaphore of the probe lock's key (in its hash slot, so on its shard).
    fn probe_permits(&self, probe: &LockKey) -> Result<LockKey, BuildError> {
        LockKey::semaphore(self.namespace, probe.user.clone(), usize::MAX).map_err(|_| {
            BuildError::Namespace {
                namespace: self.namespace.to_owned(),
            }
        })
    }

    /// The error for a refusal of `right`, for the probes other topologies run themselves.
    pub(crate) fn rights_error(
        &self,
        right: String,
        source: Box<dyn std::error::Error + Send + Sync>,
    ) -> BuildError {
        BuildError::Rights {
            user: self.peer.user.clone(),
            right,
            addr: self.peer.addr.clone(),
            source,
        }
    }

    /// Refuses a server (on a cluster: any primary) whose `maxmemory-policy` may evict
    /// keys. `INFO memory` is read rather than `CONFIG GET`, which managed services and ACL
    /// users are often denied.
    async fn eviction_policy(&self) -> Result<(), BuildError> {
        let infos: Vec<(Option<String>, String)> = self
            .pool
            .query_each_primary(redis::cmd("INFO").arg("memory"))
            .await
            .map_err(|e| self.info_failure(e))?;
        for (node, info) in infos {
            keeps_locks(&info, || node.unwrap_or_else(|| self.peer.addr.clone()))?;
        }
        Ok(())
    }

    /// The error of a failed `INFO memory`: a refusal names the right.
    pub(crate) fn info_failure(&self, error: CommandError) -> BuildError {
        self.failure(
            error,
            "run INFO (it tells the maxmemory-policy; `allow_eviction` skips this)",
        )
    }

    /// The settings of a connection of its own to one node, with the backend's timeouts.
    pub(crate) fn node_config(&self) -> AsyncConnectionConfig {
        AsyncConnectionConfig::new()
            .set_connection_timeout(Some(self.connect_timeout))
            .set_response_timeout(Some(self.command_timeout))
    }

    /// Takes, renews and releases the probe lock, then takes and gives back a permit of
    /// the probe's semaphore, with the real scripts, so every command, key and channel
    /// they touch is checked the way locks and permits will use them. (The shared-lock
    /// scripts call no command the exclusive ones do not, on the same keys and channel.)
    async fn lock_scripts(&self, probe: &LockKey) -> Result<(), BuildError> {
        let owner = "tower-lock-build-check";
        let lock = &*probe.lock;
        let [line, until] = probe.line();
        let mut acquire = self.scripts.acquire.key(lock);
        acquire
            .key(&probe.fence)
            .key(probe.writers())
            .key(&line)
            .key(&until)
            .arg(owner)
            .arg(PROBE_TTL_MS)
            .arg(PROBE_TTL_MS)
            // The restart guard is off for the probe: it checks rights, not the server's age.
            .arg(0)
            .arg(format!("{owner}@1"))
            // As a waiting acquisition, which also touches the waiting writers' set
            .arg(PROBE_TTL_MS)
            // and the line of waiting holders.
            .arg(PROBE_TTL_MS);
        let mut renew = self.scripts.renew.key(lock);
        renew.arg(owner).arg(PROBE_TTL_MS);
        let mut release = self.scripts.release.key(lock);
        release
            .key(&line)
            .key(&until)
            .arg(owner)
            .arg(format!("{owner}#1"))
            .arg(PROBE_TTL_MS)
            .arg(&probe.channel)
            .arg(u8::from(self.scripts.sharded));
        let permits = self.probe_permits(probe)?;
        let mut permit_acquire = self.scripts.permit_acquire.key(&*permits.lock);
        permit_acquire
            .key(&permits.fence)
            .arg(owner)
            .arg(PROBE_TTL_MS)
            .arg(PROBE_TTL_MS)
            .arg(0)
            .arg(format!("{owner}@2"))
            // One permit.
            .arg(1);
        let mut permit_release = self.scripts.permit_release.key(&*permits.lock);
        permit_release
            .arg(owner)
            .arg(format!("{owner}#2"))
            .arg(PROBE_TTL_MS)
            .arg(&permits.channel)
            .arg(u8::from(self.scripts.sharded))
            // Whatever the permit's token.
            .arg("");
        let steps = [
            ("acquire", &acquire, scripts::ACQUIRE),
            ("renew", &renew, scripts::RENEW),
            ("release", &release, scripts::RELEASE),
            ("permit acquire", &permit_acquire, scripts::PERMIT_ACQUIRE),
            ("permit release", &permit_release, scripts::PERMIT_RELEASE),
        ];
        for (name, invocation, source) in steps {
            let ran = self.pool.invoke::<redis::Value>(invocation).await;
            ran.map_err(|e| self.script_refused(e, (name, source), probe))?;
        }
        Ok(())
    }

    /// What a probe script's failure means: a right the user lacks (which one, as the
    /// step `name` of `source` needed it), or scripts the server did not load.
    fn script_refused(
        &self,
        e: CommandError,
        (name, source): (&str, &str),
        probe: &LockKey,
    ) -> BuildError {
        let right = match refused(&e) {
            None => {
                return BuildError::Scripts {
                    addr: self.peer.addr.clone(),
                    source: e.into_cause(),
                };
            }
            Some(Refused::Channel) => {
                format!("{} to channel `{}`", self.publish, probe.channel)
            }
            Some(Refused::Key) => format!("access key `{}` of the namespace", &*probe.lock),
            // Refused before the script ran, so EVALSHA itself.
            Some(Refused::Command) if e.redis_error().and_then(|e| e.code()) == Some("NOPERM") => {
                "run EVALSHA (every lock operation is a script)".to_owned()
            }
            Some(Refused::Command) => refused_call(&e, name, source, self.scripts.sharded),
        };
        self.rights_error(right, e.into_cause())
    }

    /// Deletes the probe lock, its semaphore and their counters; if that fails they
    /// expire by themselves.
    async fn delete(&self, probe: &LockKey) {
        let mut del = redis::cmd("DEL");
        del.arg(&*probe.lock).arg(&probe.fence);
        if let Ok(permits) = self.probe_permits(probe) {
            del.arg(&*permits.lock).arg(&permits.fence);
        }
        let _ = self.pool.query::<i64>(&del).await;
    }

    /// Subscribes to the probe channel on a connection of its own, as the subscriber will.
    async fn subscribe(&self, client: &redis::Client, channel: &str) -> Result<(), BuildError> {
        let connected = timeout(self.connect_timeout, client.get_async_pubsub()).await;
        let mut pubsub = connected
            .map_err(|elapsed| self.peer.timed_out(elapsed))?
            .map_err(|e| self.peer.failure(CommandError::Redis(e)))?;
        let subscribed = timeout(self.command_timeout, pubsub.subscribe(channel))
            .await
            .map_err(|elapsed| self.peer.timed_out(elapsed))?
            .map_err(CommandError::Redis);
        subscribed.map_err(|e| self.subscribe_failure(e, "SUBSCRIBE", channel))
    }

    /// The error of a failed `command` (`SUBSCRIBE`, `SSUBSCRIBE`) on `channel`: a refusal
    /// names the command, or the channel when the command itself is allowed.
    pub(crate) fn subscribe_failure(
        &self,
        error: CommandError,
        command: &str,
        channel: &str,
    ) -> BuildError {
        match refused(&error) {
            Some(Refused::Command) => self.failure(error, &format!("run {command}")),
            _ => self.failure(error, &format!("{command} to channel `{channel}`")),
        }
    }

    /// A refusal of `right` as [`BuildError::Rights`]; any other failure as what it is.
    pub(crate) fn failure(&self, error: CommandError, right: &str) -> BuildError {
        if refused(&error).is_some() {
            return self.rights_error(right.to_owned(), error.into_cause());
        }
        self.peer.failure(error)
    }
}

/// Refuses the server whose `INFO memory` is `info` (at `addr`) unless its
/// `maxmemory-policy` is `noeviction`.
pub(crate) fn keeps_locks(info: &str, addr: impl FnOnce() -> String) -> Result<(), BuildError> {
    let policy = info
        .lines()
        .find_map(|line| line.strip_prefix("maxmemory_policy:"))
        .map_or("(not reported)", str::trim);
    if policy == "noeviction" {
        return Ok(());
    }
    Err(BuildError::Eviction {
        policy: policy.to_owned(),
        addr: addr(),
    })
}

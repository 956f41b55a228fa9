//! The eviction policy of the replicas that a failover may promote.
//!
//! A replica whose `maxmemory-policy` evicts keys becomes, one failover later, a primary
//! that evicts held locks. So `build()` reads `INFO memory` on every replica that may take
//! over: on Sentinel, the master's replicas as the sentinels report them, leaving out those
//! flagged down or disconnected (the sentinels promote none of those); on a cluster, the
//! replicas of the slot map, which leaves out those the cluster flags as failed. Each is
//! reached on a connection of its own, with the master's credentials, database and TLS
//! settings (on a cluster, the seed's), all of them at once. A replica that cannot be
//! reached, refuses the credentials or refuses `INFO` could not be checked, and fails the
//! build as a primary would, naming the replica. A single server's replicas are not looked
//! for: nothing promotes them.

use futures_util::future::join_all;
use redis::ConnectionInfo;

use super::checks::{ServerChecks, keeps_locks};
use super::cluster_checks::Shards;
use super::diagnose::Peer;
use crate::error::BuildError;
use crate::redis::connection::pool::CommandError;
use crate::redis::connection::topology::Topology;

impl ServerChecks<'_> {
    /// Refuses a replica that may take over from a primary of `topology` (on a cluster, of
    /// the slot map `shards`) if its `maxmemory-policy` may evict keys.
    pub(crate) async fn replicas_keep_locks(
        &self,
        topology: &Topology,
        shards: Option<&Shards>,
    ) -> Result<(), BuildError> {
        let clients = match topology {
            Topology::Server(_) => return Ok(()),
            Topology::Sentinel(group) => {
                let found = group
                    .replicas(&self.node_config())
                    .await
                    .map_err(|(sentinel, error)| self.sentinel_failure(sentinel, error))?;
                found
                    .iter()
                    .map(|(host, port)| group.data_node(host, *port))
                    .collect::<Result<Vec<_>, _>>()?
            }
            Topology::Cluster(nodes) => shards
                .map_or(&[][..], |shards| &shards.replicas)
                .iter()
                // A node the slot map cannot address cannot be reached on its own.
                .filter(|(host, _)| host != "?")
                .map(|(host, port)| nodes.node_client(host, *port))
                .collect::<Result<Vec<_>, _>>()?,
        };
        let reads = clients.iter().map(|client| async move {
            let addr = client.get_connection_info().addr().to_string();
            let info = self
                .memory_info(client)
                .await
                .map_err(|e| e.at(addr.clone()))?;
            keeps_locks(&info, || addr)
        });
        join_all(reads).await.into_iter().collect()
    }

    /// `INFO memory` of the node `client` reaches, on a connection of its own. Its errors
    /// name the backend's server until the caller names the node.
    async fn memory_info(&self, client: &redis::Client) -> Result<String, BuildError> {
        let mut conn = client
            .get_multiplexed_async_connection_with_config(&self.node_config())
            .await
            .map_err(|e| self.peer.failure(CommandError::Redis(e)))?;
        redis::cmd("INFO")
            .arg("memory")
            .query_async(&mut conn)
            .await
            .map_err(|e| self.info_failure(CommandError::Redis(e)))
    }

    /// The error of a sentinel that did not name the replicas: a refusal names the right,
    /// any other failure the sentinel.
    fn sentinel_failure(&self, sentinel: &ConnectionInfo, error: redis::RedisError) -> BuildError {
        let peer = Peer::of(sentinel, None);
        let at_sentinel = ServerChecks {
            peer: &peer,
            ..*self
        };
        at_sentinel.failure(
            CommandError::Redis(error),
            "run SENTINEL REPLICAS (it names the replicas whose maxmemory-policy is checked; \
             `allow_eviction` skips this)",
        )
    }
}

//! Where the backend's Redis is, and the connections it opens there.
//!
//! Every connection the backend makes goes through [`Topology`]: the command pool asks it
//! for a command connection ([`Topology::connect`]) and the subscriber for the client of
//! the server whose release channels it listens to ([`Topology::subscriber_client`]). A
//! topology that moves (a failover) answers each call with the server that is current
//! then, so a reconnect is also how the backend follows the primary.

use std::sync::Arc;
use std::time::Duration;

use redis::aio::{ConnectionLike, MultiplexedConnection};
use redis::{AsyncConnectionConfig, Cmd, Pipeline, RedisFuture, RedisResult, Value};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::pool::FailureEpoch;
use super::sentinel::SentinelGroup;
use crate::core::store::Takeovers;

use super::cluster::{self, ClusterConn, ClusterNodes};

/// The Redis deployment a backend talks to.
// One per backend, cloned only into its pool and subscriber: the size of a variant does
// not matter, and boxing the client would only add an indirection.
#[allow(clippy::large_enum_variant)]
#[derive(Clone)]
pub(crate) enum Topology {
    /// One server (plaintext or TLS) at a fixed address.
    Server(redis::Client),
    /// A Redis Cluster, found through its seed nodes (see `cluster.rs`).
    Cluster(Arc<ClusterNodes>),
    /// The master of a Sentinel group, asked of the sentinels at every connect.
    Sentinel(Arc<SentinelGroup>),
}

impl Topology {
    /// Opens a command connection to the server that takes writes now.
    pub(crate) async fn connect(&self, config: &AsyncConnectionConfig) -> RedisResult<AnyConn> {
        match self {
            Topology::Server(client) => client
                .get_multiplexed_async_connection_with_config(config)
                .await
                .map(AnyConn::Server),
            Topology::Cluster(nodes) => nodes.connect().await.map(AnyConn::Cluster),
            // A master connection is a plain one: commands on it need no routing.
            Topology::Sentinel(group) => group
                .connect(config)
                .await
                .map(|(_, conn)| AnyConn::Server(conn)),
        }
    }

    /// Whether keys live in hash slots spread over shards: a script's keys must then share
    /// a slot, and releases go out on sharded pub/sub.
    pub(crate) fn is_cluster(&self) -> bool {
        matches!(self, Topology::Cluster(_))
    }

    /// The client of the server whose release channels the subscriber listens to. A
    /// cluster has no one such server: its subscriber is served by `shard_pubsub.rs`.
    pub(crate) async fn subscriber_client(&self) -> RedisResult<redis::Client> {
        match self {
            Topology::Server(client) => Ok(client.clone()),
            Topology::Cluster(_) => Err(cluster::no_single_server()),
            Topology::Sentinel(group) => group.master().await,
        }
    }
}

impl Topology {
    /// Announcements that another server took over (a Sentinel promotion), so that code
    /// sleeping before a retry can retry at once. A single server announces nothing.
    pub(crate) fn changes(&self) -> TopologyChanges {
        match self {
            Topology::Server(_) | Topology::Cluster(_) => TopologyChanges(None),
            Topology::Sentinel(group) => TopologyChanges(Some(group.promotions())),
        }
    }

    /// The takeovers [`changes`](Self::changes) announces, as the core follows them.
    pub(crate) fn takeovers(&self) -> Takeovers {
        match self {
            Topology::Server(_) | Topology::Cluster(_) => Takeovers::none(),
            Topology::Sentinel(group) => Takeovers::from(group.promotions()),
        }
    }

    /// How many takeovers [`changes`](Self::changes) announced so far.
    pub(crate) fn generation(&self) -> u64 {
        match self {
            Topology::Server(_) | Topology::Cluster(_) => 0,
            Topology::Sentinel(group) => group.generation(),
        }
    }

    /// Listens for the announcements of [`changes`](Self::changes) until `shutdown`
    /// (returns at once for a topology that makes none).
    pub(crate) async fn announce_changes(
        &self,
        failure_epoch: FailureEpoch,
        connect_timeout: Duration,
        max_backoff: Duration,
        shutdown: CancellationToken,
    ) {
        match self {
            Topology::Server(_) | Topology::Cluster(_) => {}
            Topology::Sentinel(group) => {
                group
                    .listen_for_promotions(failure_epoch, connect_timeout, max_backoff, shutdown)
                    .await
            }
        }
    }
}

/// See [`Topology::changes`].
pub(crate) struct TopologyChanges(Option<watch::Receiver<u64>>);

impl TopologyChanges {
    /// Resolves at the next announced change; never, for a topology that makes none.
    /// Cancel-safe.
    pub(crate) async fn next(&mut self) {
        if let Some(promotions) = &mut self.0 {
            if promotions.changed().await.is_ok() {
                return;
            }
        }
        std::future::pending().await
    }
}

/// A command connection of any topology. Cheap to clone: clones share the connection.
#[derive(Clone)]
pub(crate) enum AnyConn {
    /// A multiplexed connection to one server.
    Server(MultiplexedConnection),
    /// A cluster connection: one multiplexed connection per node, commands routed by key,
    /// MOVED and ASK followed, and the slot map refreshed by redis-rs; TRYAGAIN waited out
    /// (see `cluster.rs`).
    Cluster(ClusterConn),
}

impl AnyConn {
    /// Whether the connection repairs itself: a cluster connection reconnects to a node
    /// that failed and follows a failover, so one failed command does not make it broken
    /// (retiring it would cut the healthy shards off too).
    pub(crate) fn heals_itself(&self) -> bool {
        matches!(self, AnyConn::Cluster(_))
    }
}

impl ConnectionLike for AnyConn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            AnyConn::Server(conn) => conn.req_packed_command(cmd),
            AnyConn::Cluster(conn) => conn.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            AnyConn::Server(conn) => conn.req_packed_commands(pipeline, offset, count),
            AnyConn::Cluster(conn) => conn.conn.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            AnyConn::Server(conn) => conn.get_db(),
            AnyConn::Cluster(conn) => conn.conn.get_db(),
        }
    }
}

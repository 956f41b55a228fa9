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

/// The Redis deployment a backend talks to.
// One per backend, cloned only into its pool and subscriber: the size of a variant does
// not matter, and boxing the client would only add an indirection.
#[allow(clippy::large_enum_variant)]
#[derive(Clone)]
pub(crate) enum Topology {
    /// One server (plaintext or TLS) at a fixed address.
    Server(redis::Client),
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
            // A master connection is a plain one: commands on it need no routing.
            Topology::Sentinel(group) => group
                .master()
                .await?
                .get_multiplexed_async_connection_with_config(config)
                .await
                .map(AnyConn::Server),
        }
    }

    /// The client of the server whose release channels the subscriber listens to.
    pub(crate) async fn subscriber_client(&self) -> RedisResult<redis::Client> {
        match self {
            Topology::Server(client) => Ok(client.clone()),
            Topology::Sentinel(group) => group.master().await,
        }
    }
}

impl Topology {
    /// Announcements that another server took over (a Sentinel promotion), so that code
    /// sleeping before a retry can retry at once. A single server announces nothing.
    pub(crate) fn changes(&self) -> TopologyChanges {
        match self {
            Topology::Server(_) => TopologyChanges(None),
            Topology::Sentinel(group) => TopologyChanges(Some(group.promotions())),
        }
    }

    /// How many takeovers [`changes`](Self::changes) announced so far.
    pub(crate) fn generation(&self) -> u64 {
        match self {
            Topology::Server(_) => 0,
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
            Topology::Server(_) => {}
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
}

impl ConnectionLike for AnyConn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            AnyConn::Server(conn) => conn.req_packed_command(cmd),
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
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            AnyConn::Server(conn) => conn.get_db(),
        }
    }
}

//! Redis Cluster: the seed nodes, the clients built from them, and what the rest of the
//! backend needs to know about hash slots.
//!
//! Commands go through redis-rs' cluster client, which routes each command by its first
//! key, follows MOVED and ASK, and refreshes its slot map after a failover or a reshard.
//! Every Redis name of one lock shares the lock's hash tag (`keys.rs`), so each script runs
//! on one shard; only the watchdog's batches mix locks, and it groups them with `by_slot`.
//!
//! The client also sends a command again by itself when the node's connection drops or a
//! read fails before the reply, whether or not the command ran: the lock scripts are made
//! safe to run twice for one call (acquire.lua's attempt id, release.lua's release id and
//! handoff check, which `hold.rs` always asks for on a cluster).
//!
//! While a slot moves to another primary (`redis-cli --cluster reshard`: the slot marked
//! MIGRATING on its owner and IMPORTING on the target, its keys moved with `MIGRATE`, then
//! its new owner announced), a script whose keys are not all on one node is refused with
//! `TRYAGAIN`: some moved and some not, or, after `ASK` to the target, some missing there
//! (a lock's line or writers often do not exist). A lock's keys are split that way until
//! the last ones moved. redis-rs sends a refused command again only twice, 10-100 ms
//! apart (and may give up on the source's `ASK` it was following), so [`ClusterConn`]
//! keeps sending it, within the command timeout: nothing ran, and an acquisition would
//! otherwise fail (a waiter given up, a 503) for a slot that settles a few milliseconds
//! later.

use std::collections::HashMap;
use std::num::NonZeroUsize;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::tls::TlsSettings;
use crate::core::kit::backoff::Backoff;
use crate::error::BuildError;
use redis::aio::{AsyncPushSender, ConnectionLike};
use redis::cluster::{ClusterClient, ClusterClientBuilder};
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{
    MultipleNodeRoutingInfo, Route, RoutingInfo, SingleNodeRoutingInfo, Slot, SlotAddr,
};
use redis::{
    Cmd, ErrorKind, FromRedisValue, ProtocolVersion, RedisError, RedisFuture, RedisResult, Value,
};

/// The seed nodes of a cluster and the timeouts of the connections made to it.
pub(crate) struct ClusterNodes {
    nodes: Vec<String>,
    tls: TlsSettings,
    connect_timeout: Duration,
    command_timeout: Duration,
    /// The client of the command connections.
    commands: ClusterClient,
}

impl ClusterNodes {
    /// Checks the seed URLs (they must parse and agree on credentials) without connecting.
    pub(crate) fn new(
        nodes: Vec<String>,
        tls: TlsSettings,
        connect_timeout: Duration,
        command_timeout: Duration,
    ) -> RedisResult<Arc<Self>> {
        let commands = client_builder(&nodes, &tls, connect_timeout, command_timeout).build()?;
        Ok(Arc::new(ClusterNodes {
            nodes,
            tls,
            connect_timeout,
            command_timeout,
            commands,
        }))
    }

    /// Opens a command connection: one multiplexed connection per node, with the
    /// backend's connect and command timeouts (set on the client).
    pub(crate) async fn connect(&self) -> RedisResult<ClusterConn> {
        Ok(ClusterConn {
            conn: self.commands.get_async_connection().await?,
            settle: self.command_timeout,
        })
    }

    /// A client of the node at `host:port` (from the slot map), with the seeds' credentials
    /// and TLS settings.
    pub(crate) fn node_client(&self, host: &str, port: u16) -> Result<redis::Client, BuildError> {
        let seed = self.nodes.first().map(String::as_str).unwrap_or_default();
        self.tls.node_client(seed, host, port)
    }

    /// Opens the subscriber's connection: RESP3, so that one connection per node carries
    /// both `SSUBSCRIBE` and the messages, which redis-rs hands to `pushes`. redis-rs
    /// re-subscribes each sharded channel on the node that owns its slot after a
    /// reconnect or a change of the slot map.
    pub(crate) async fn connect_subscriber(
        &self,
        pushes: impl AsyncPushSender,
    ) -> RedisResult<ClusterConnection> {
        client_builder(
            &self.nodes,
            &self.tls,
            self.connect_timeout,
            self.command_timeout,
        )
        .use_protocol(ProtocolVersion::RESP3)
        .push_sender(pushes)
        .build()?
        .get_async_connection()
        .await
    }
}

/// How many times a connection tries to reach a node it lost before giving it up (redis-rs
/// spaces the tries 50 ms, 100 ms, ... apart, so five take under a second).
///
/// redis-rs' default is to try forever, once a second (a WARN line each time), as long as
/// the node is in the connection's slot map, and only a command routed to a moved slot
/// refreshes that map: the subscriber's connection, which pings only the primaries it knows
/// and sends nothing to a lost replica's slots, kept trying a killed node without end. A
/// node given up is not cut off: a command for its slots goes to another node of its shard
/// (the replica that took over) or follows `MOVED` to it, connecting anew, and the
/// subscriber subscribes its channels again itself.
const RECONNECT_ATTEMPTS: NonZeroUsize = NonZeroUsize::MIN.saturating_add(4);

/// A client builder with the seeds and timeouts; each connection's settings go on top.
fn client_builder(
    nodes: &[String],
    tls: &TlsSettings,
    connect_timeout: Duration,
    command_timeout: Duration,
) -> ClusterClientBuilder {
    let builder = ClusterClientBuilder::new(nodes.iter().map(String::as_str));
    #[cfg(feature = "tls")]
    let builder = match tls.certificates() {
        Some(certificates) => builder.certs(certificates),
        None => builder,
    };
    #[cfg(not(feature = "tls"))]
    let _ = tls;
    builder
        .connection_timeout(connect_timeout)
        .response_timeout(command_timeout)
        // A command to a shard whose primary is down fails within the command timeout
        // (a 503), instead of being retried past it.
        .retries(2)
        .min_retry_wait(10)
        .max_retry_wait(100)
        .max_connection_attempts(RECONNECT_ATTEMPTS)
}

/// `items` grouped by the hash slot of their key (its hash tag's, when it has one): the
/// keys (and sharded channels) of one command must share a slot.
pub(crate) fn by_slot<T>(items: Vec<T>, key: impl Fn(&T) -> &str) -> Vec<Vec<T>> {
    let mut slots: HashMap<Slot, Vec<T>> = HashMap::new();
    for item in items {
        slots
            .entry(Slot::for_key(key(&item)))
            .or_default()
            .push(item);
    }
    slots.into_values().collect()
}

/// A command connection to a cluster: redis-rs' connection, whose commands refused while
/// their slot moves are sent again until it settles (see the module's documentation).
#[derive(Clone)]
pub(crate) struct ClusterConn {
    pub(crate) conn: ClusterConnection,
    /// How long after its first send a command refused while its slot moves is sent
    /// again: the command timeout.
    settle: Duration,
}

/// The first pause before a command refused while its slot moves is sent again; doubled
/// each time, up to [`TRY_AGAIN_MAX_PAUSE`].
const TRY_AGAIN_PAUSE: Duration = Duration::from_millis(10);
const TRY_AGAIN_MAX_PAUSE: Duration = Duration::from_millis(100);

impl ClusterConn {
    /// Sends one command, again while the cluster refuses it because its slot is moving,
    /// for up to the command timeout. `INFO` goes to one primary: redis-rs would ask every primary
    /// and answer with a map of replies, which no caller of a single command can read.
    pub(crate) fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        let is_info = cmd.args_iter().next().is_some_and(
            |name| matches!(name, redis::Arg::Simple(n) if n.eq_ignore_ascii_case(b"INFO")),
        );
        if is_info {
            let routing = RoutingInfo::SingleNode(SingleNodeRoutingInfo::RandomPrimary);
            return Box::pin(self.conn.route_command(cmd.clone(), routing));
        }
        Box::pin(async move {
            let give_up = Instant::now() + self.settle;
            let mut pause = Backoff::new(TRY_AGAIN_PAUSE, TRY_AGAIN_MAX_PAUSE);
            loop {
                match self.conn.req_packed_command(cmd).await {
                    Err(e) if is_slot_moving(&e) && Instant::now() + pause.peek() < give_up => {
                        tokio::time::sleep(pause.next()).await;
                    }
                    reply => return reply,
                }
            }
        })
    }
}

/// Whether the cluster refused a command because its slot is moving: its keys are split
/// between the two nodes (`TRYAGAIN`), or redis-rs ran out of retries while following the
/// node's redirection (`ASK`, or `MOVED` before its slot map caught up). It did not run.
fn is_slot_moving(e: &RedisError) -> bool {
    [
        redis::ServerErrorKind::TryAgain,
        redis::ServerErrorKind::Ask,
        redis::ServerErrorKind::Moved,
    ]
    .into_iter()
    .any(|kind| e.kind() == kind.into())
}

/// Sends `cmd` to the primary that owns the slot of `key`.
pub(crate) async fn query_at(
    conn: &mut ClusterConnection,
    key: &str,
    cmd: &Cmd,
) -> RedisResult<Value> {
    let route = Route::with_key(key, SlotAddr::Master);
    let routing = RoutingInfo::SingleNode(SingleNodeRoutingInfo::SpecificNode(route));
    conn.route_command(cmd.clone(), routing).await
}

/// Sends `cmd` to the node at `node` (`host:port`, as [`query_each_primary`] names it).
pub(crate) async fn query_node(
    conn: &mut ClusterConnection,
    node: &str,
    cmd: &Cmd,
) -> RedisResult<Value> {
    let Some((host, port)) = node.rsplit_once(':').and_then(|(host, port)| {
        let port = port.parse().ok()?;
        Some((host.trim_start_matches('[').trim_end_matches(']'), port))
    }) else {
        return Err(RedisError::from((
            ErrorKind::InvalidClientConfig,
            "not a cluster node's address",
            node.to_owned(),
        )));
    };
    let host = host.to_owned();
    let routing = RoutingInfo::SingleNode(SingleNodeRoutingInfo::ByAddress { host, port });
    conn.route_command(cmd.clone(), routing).await
}

/// Sends `cmd` to every primary and returns each one's address (`host:port`) and reply,
/// in no particular order: a setting that must hold on every shard (an eviction policy) is
/// read from each.
pub(crate) async fn query_each_primary(
    conn: &mut ClusterConnection,
    cmd: &Cmd,
) -> RedisResult<Vec<(Option<String>, Value)>> {
    let routing = RoutingInfo::MultiNode((MultipleNodeRoutingInfo::AllMasters, None));
    match conn.route_command(cmd.clone(), routing).await? {
        // Without a response policy redis-rs answers with a map: node address -> reply.
        // A node's error reply is a value among the others.
        Value::Map(replies) => replies
            .into_iter()
            .map(|(node, reply)| {
                let node = String::from_redis_value(node).ok();
                Ok((node, reply.extract_error()?))
            })
            .collect(),
        other => Ok(vec![(None, other.extract_error()?)]),
    }
}

/// The error of asking a cluster for the one server of a single-server topology.
pub(crate) fn no_single_server() -> RedisError {
    RedisError::from((
        ErrorKind::InvalidClientConfig,
        "a Redis Cluster has no single server to subscribe on",
    ))
}

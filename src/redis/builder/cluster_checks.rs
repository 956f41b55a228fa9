//! The build-time checks of a Redis Cluster, shard by shard.
//!
//! ACL users, their rights and the server settings are per node in a cluster: a user
//! created on two primaries of three, or with channel rights on only some, builds fine
//! when one server is probed, and then fails every lock of the other shards. So, from the
//! slot map (`CLUSTER SLOTS`), every primary that owns slots is checked on its own:
//!
//! - the user logs in to it, on a connection of its own (redis-rs' cluster client leaves a
//!   node that refuses the credentials out of its connections without a word, and the
//!   commands of its slots then fail with `MOVED`);
//! - a probe key of the namespace whose hash slot the primary owns goes through the lock
//!   scripts (acquire, renew, release with `SPUBLISH`), and is deleted;
//! - `SSUBSCRIBE` (then `SUNSUBSCRIBE`) on the probe key's channel, as the sharded
//!   subscriber will.
//!
//! A failure names the primary. The replicas the slot map lists (it leaves out those the
//! cluster flags as failed) are checked for their eviction policy only, on a connection of
//! their own (`replica_checks.rs`), which also refuses one without the user.

use std::collections::HashMap;
use std::future::Future;
use std::time::Duration;

use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{RoutingInfo, SingleNodeRoutingInfo, Slot};
use redis::{FromRedisValue, PushInfo, RedisError, Value};
use tokio::sync::mpsc::{UnboundedReceiver, unbounded_channel};
use tokio::time::timeout;

use super::checks::ServerChecks;
use crate::error::BuildError;
use crate::redis::connection::cluster::ClusterNodes;
use crate::redis::connection::pool::CommandError;
use crate::redis::keys::LockKey;

/// How many candidate probe keys are tried for a primary that owns few slots: a primary
/// with a single slot is hit once in 16384 keys on average.
const PROBE_CANDIDATES: u32 = 1 << 20;

/// The primaries of a cluster with a probe key each, and the RESP3 connection the sharded
/// probes use.
pub(crate) struct Shards {
    conn: ClusterConnection,
    /// Kept open so that the connection's pushes (the `ssubscribe` confirmations) have
    /// somewhere to go.
    _pushes: UnboundedReceiver<PushInfo>,
    primaries: Vec<Primary>,
    /// The replicas of the slot map (`host`, `port`), each once.
    pub(crate) replicas: Vec<(String, u16)>,
}

/// A primary of a `CLUSTER SLOTS` reply, the slot ranges it owns and its replicas.
struct SlotOwner {
    host: String,
    port: u16,
    ranges: Vec<(u16, u16)>,
    replicas: Vec<(String, u16)>,
}

/// A primary that owns hash slots, and a probe key in one of its slots.
struct Primary {
    host: String,
    port: u16,
    probe: LockKey,
}

impl ServerChecks<'_> {
    /// Reads the slot map, checks that the user may log in to every primary that owns
    /// slots, and picks a probe key for each.
    pub(crate) async fn shards(&self, nodes: &ClusterNodes) -> Result<Shards, BuildError> {
        let (sender, pushes) = unbounded_channel();
        let mut conn = self
            .bounded(self.connect_timeout, nodes.connect_subscriber(sender))
            .await?;
        let routing = RoutingInfo::SingleNode(SingleNodeRoutingInfo::Random);
        let mut cluster_slots = redis::cmd("CLUSTER");
        cluster_slots.arg("SLOTS");
        let slots = self
            .bounded(
                self.command_timeout,
                routed(&mut conn, cluster_slots, routing),
            )
            .await?;
        let owners = slot_owners(slots).map_err(|e| self.peer.failure(e))?;
        let mut slot_owner = HashMap::new();
        for (i, owner) in owners.iter().enumerate() {
            for &(start, end) in &owner.ranges {
                slot_owner.extend((start..=end).filter_map(Slot::new).map(|slot| (slot, i)));
            }
        }
        let mut probes: Vec<Option<LockKey>> = vec![None; owners.len()];
        let id = uuid::Uuid::new_v4().simple().to_string();
        for n in 0..PROBE_CANDIDATES {
            if probes.iter().all(Option::is_some) {
                break;
            }
            let probe = self.probe_key(&format!("{id}:{n}"))?;
            if let Some(&i) = slot_owner.get(&Slot::for_key(&*probe.lock)) {
                probes[i].get_or_insert(probe);
            }
        }
        let mut primaries = Vec::with_capacity(owners.len());
        let mut replicas = Vec::new();
        for (owner, probe) in owners.into_iter().zip(probes) {
            let SlotOwner {
                host,
                port,
                replicas: of_owner,
                ..
            } = owner;
            replicas.extend(of_owner);
            let Some(probe) = probe else {
                // Not reachable with a well-formed slot map; the primary is left unprobed.
                tracing::warn!(%host, port, "no probe key found for a primary's slots");
                continue;
            };
            // A node the slot map cannot address is probed through the cluster client only.
            if host != "?" {
                self.log_in(nodes, &host, port)
                    .await
                    .map_err(|e| on_primary(e, &host, port))?;
            }
            primaries.push(Primary { host, port, probe });
        }
        Ok(Shards {
            conn,
            _pushes: pushes,
            primaries,
            replicas,
        })
    }

    /// Runs the sharded probes on every primary.
    pub(crate) async fn probe_shards(&self, shards: Shards) -> Result<(), BuildError> {
        let Shards {
            mut conn,
            _pushes,
            primaries,
            ..
        } = shards;
        for primary in &primaries {
            self.probe_shard(&mut conn, &primary.probe)
                .await
                .map_err(|e| on_primary(e, &primary.host, primary.port))?;
        }
        Ok(())
    }

    async fn probe_shard(
        &self,
        conn: &mut ClusterConnection,
        probe: &LockKey,
    ) -> Result<(), BuildError> {
        self.probe_scripts(probe).await?;
        let channel = &probe.channel;
        // redis-rs returns once the server confirmed the subscription (or refused it).
        let subscribed = timeout(self.command_timeout, conn.ssubscribe(channel)).await;
        command_outcome(subscribed)
            .map_err(|e| self.subscribe_failure(e, "SSUBSCRIBE", channel))?;
        // The connection is dropped after the probes anyway, which ends the subscription.
        let _ = timeout(self.command_timeout, conn.sunsubscribe(channel)).await;
        Ok(())
    }

    /// Logs in to the node at `host:port` and PINGs it. A failure is the cluster's until
    /// [`on_primary`] names the node.
    async fn log_in(&self, nodes: &ClusterNodes, host: &str, port: u16) -> Result<(), BuildError> {
        let client = nodes.node_client(host, port)?;
        let failed = |e| self.peer.failure(CommandError::Redis(e));
        let mut conn = client
            .get_multiplexed_async_connection_with_config(&self.node_config())
            .await
            .map_err(failed)?;
        redis::cmd("PING")
            .query_async::<()>(&mut conn)
            .await
            .map_err(failed)
    }

    /// `future` within `limit`, a failure as a connection failure.
    async fn bounded<T>(
        &self,
        limit: Duration,
        future: impl Future<Output = Result<T, RedisError>>,
    ) -> Result<T, BuildError> {
        command_outcome(timeout(limit, future).await).map_err(|e| self.peer.failure(e))
    }
}

/// Sends `cmd` where `routing` says. A routed command's error reply comes back as a value.
async fn routed(
    conn: &mut ClusterConnection,
    cmd: redis::Cmd,
    routing: RoutingInfo,
) -> Result<Value, RedisError> {
    conn.route_command(cmd, routing).await?.extract_error()
}

/// A command's outcome within its timeout, an elapsed timeout as an I/O error.
fn command_outcome<T>(
    outcome: Result<Result<T, RedisError>, tokio::time::error::Elapsed>,
) -> Result<T, CommandError> {
    match outcome {
        Ok(done) => done.map_err(CommandError::Redis),
        Err(elapsed) => Err(CommandError::Redis(RedisError::from(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            elapsed,
        )))),
    }
}

/// The primaries (`host`, `port`) of a `CLUSTER SLOTS` reply, each with its slot ranges
/// and its replicas (each once).
fn slot_owners(reply: Value) -> Result<Vec<SlotOwner>, CommandError> {
    let unexpected = || {
        CommandError::Redis(RedisError::from((
            redis::ErrorKind::Parse,
            "unexpected CLUSTER SLOTS reply",
        )))
    };
    let ranges: Vec<Vec<Value>> = FromRedisValue::from_redis_value(reply)
        .map_err(|e| CommandError::Redis(RedisError::from(e)))?;
    let mut owners: Vec<SlotOwner> = Vec::new();
    for range in ranges {
        let mut fields = range.into_iter();
        let (Some(start), Some(end), Some(primary)) = (fields.next(), fields.next(), fields.next())
        else {
            return Err(unexpected());
        };
        // The replicas of the range follow its primary.
        let replicas = fields
            .map(|node| node_address(node).ok_or_else(unexpected))
            .collect::<Result<Vec<_>, _>>()?;
        let parsed = (
            u16::from_redis_value(start),
            u16::from_redis_value(end),
            node_address(primary),
        );
        let (Ok(start), Ok(end), Some((host, port))) = parsed else {
            return Err(unexpected());
        };
        let at = owners
            .iter()
            .position(|o| o.host == host && o.port == port)
            .unwrap_or_else(|| {
                owners.push(SlotOwner {
                    host,
                    port,
                    ranges: Vec::new(),
                    replicas: Vec::new(),
                });
                owners.len() - 1
            });
        let owner = &mut owners[at];
        owner.ranges.push((start, end));
        for replica in replicas {
            if !owner.replicas.contains(&replica) {
                owner.replicas.push(replica);
            }
        }
    }
    Ok(owners)
}

/// The host and port of a node of a `CLUSTER SLOTS` reply: `[host, port, id, ...]`. A node
/// that does not know its address announces an empty, NULL or wildcard host (read as the
/// seed's, see `TlsSettings::node_client`), an unknown node "?".
fn node_address(node: Value) -> Option<(String, u16)> {
    let mut node = Vec::<Value>::from_redis_value(node).ok()?.into_iter();
    let host = match node.next()? {
        Value::Nil => String::new(),
        host => String::from_redis_value(host).ok()?,
    };
    let host = match host.as_str() {
        "0.0.0.0" | "::" => String::new(),
        _ => host,
    };
    Some((host, u16::from_redis_value(node.next()?).ok()?))
}

/// `error`, naming the primary it came from.
fn on_primary(error: BuildError, host: &str, port: u16) -> BuildError {
    error.at(format!("{host}:{port}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(host: Value, port: i64) -> Value {
        let id = Value::BulkString(b"id".to_vec());
        Value::Array(vec![host, Value::Int(port), id, Value::Map(Vec::new())])
    }

    fn range(start: i64, end: i64, primary: Value, replica: Value) -> Value {
        Value::Array(vec![Value::Int(start), Value::Int(end), primary, replica])
    }

    #[test]
    fn slot_owners_groups_ranges_and_replicas_by_primary_and_reads_unknown_hosts_as_the_seeds() {
        let a = || node(Value::BulkString(b"10.0.0.1".to_vec()), 7000);
        let replica = || node(Value::BulkString(b"10.0.0.9".to_vec()), 7009);
        let reply = Value::Array(vec![
            range(0, 99, a(), replica()),
            range(100, 199, node(Value::Nil, 7001), node(Value::Nil, 7002)),
            range(200, 16383, a(), replica()),
        ]);
        let owners = slot_owners(reply).expect("parsed");
        let found: Vec<String> = owners
            .iter()
            .map(|o| format!("{}:{} {:?} {:?}", o.host, o.port, o.ranges, o.replicas))
            .collect();
        assert_eq!(
            found,
            [
                r#"10.0.0.1:7000 [(0, 99), (200, 16383)] [("10.0.0.9", 7009)]"#,
                r#":7001 [(100, 199)] [("", 7002)]"#
            ]
        );
        assert!(slot_owners(Value::Array(vec![Value::Int(1)])).is_err());
    }
}

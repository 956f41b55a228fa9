//! A throwaway Redis Cluster: six `redis-server --cluster-enabled yes` (three primaries
//! with one replica each) on free loopback ports, joined by `redis-cli --cluster create`,
//! every process killed when the [`Cluster`] is dropped.

use std::collections::HashMap;
use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tower_lock::RedisBackend;

use super::redis_tool;

/// A test cluster node's settings: a failover within a couple of seconds, a replica of any
/// age promoted, the healthy shards serving while one has no primary, nothing on disk.
pub const NODE_ARGS: [&str; 16] = [
    "--cluster-enabled",
    "yes",
    "--cluster-config-file",
    "nodes.conf",
    "--cluster-node-timeout",
    "1000",
    "--cluster-replica-validity-factor",
    "0",
    "--cluster-require-full-coverage",
    "no",
    "--repl-diskless-sync-delay",
    "0",
    "--save",
    "",
    "--appendonly",
    "no",
];

/// One node of the cluster.
struct Node {
    port: u16,
    child: Option<Child>,
    _dir: tempfile::TempDir,
}

/// Six nodes, three shards. Dropping it kills them all.
pub struct Cluster {
    nodes: Vec<Node>,
}

impl Cluster {
    /// Starts the nodes, creates the cluster and waits until every node reports
    /// `cluster_state:ok` and every primary has its replica linked.
    pub fn start() -> Self {
        // Another process may take a picked port before redis-server binds it: retry with
        // new ports (a node that did not come up is killed with the others).
        let cluster = (0..10)
            .find_map(|_| Cluster::spawn_nodes())
            .expect("six redis-server nodes on free ports");
        let status = redis_tool(
            Command::new("redis-cli")
                .arg("--cluster")
                .arg("create")
                .args(
                    cluster
                        .nodes
                        .iter()
                        .map(|n| format!("127.0.0.1:{}", n.port)),
                )
                .args(["--cluster-replicas", "1", "--cluster-yes"])
                .stdout(Stdio::null())
                .stderr(Stdio::null()),
            Command::status,
        )
        .expect("run redis-cli");
        assert!(status.success(), "redis-cli --cluster create");
        cluster.wait_until_healthy();
        cluster
    }

    /// Spawns six cluster-enabled nodes; `None` if one did not come up as ours.
    fn spawn_nodes() -> Option<Self> {
        let mut cluster = Cluster { nodes: Vec::new() };
        for port in cluster_ports(6) {
            let dir = tempfile::tempdir().expect("temp dir");
            let child = redis_tool(
                Command::new("redis-server")
                    .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
                    .args(NODE_ARGS)
                    .arg("--dir")
                    .arg(dir.path())
                    .stdout(Stdio::null())
                    .stderr(Stdio::null()),
                Command::spawn,
            )
            .expect("spawn redis-server");
            cluster.nodes.push(Node {
                port,
                child: Some(child),
                _dir: dir,
            });
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        for node in &mut cluster.nodes {
            // Only our own process counts: another test's server may have won the port.
            let ours = format!("process_id:{}", node.child.as_ref()?.id());
            loop {
                if info(node.port, "INFO server").is_some_and(|i| i.contains(&ours)) {
                    break;
                }
                let exited = node.child.as_mut()?.try_wait().ok().flatten().is_some();
                if exited || Instant::now() > deadline {
                    return None; // dropping `cluster` kills the nodes that did start
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        Some(cluster)
    }

    /// Waits until every live node says `cluster_state:ok` and every primary has its
    /// replica linked.
    pub fn wait_until_healthy(&self) {
        self.wait_until_ok();
        for primary in self.primaries() {
            wait_until(&format!("primary {primary} has a linked replica"), || {
                let replication = info(primary, "INFO replication").unwrap_or_default();
                replication.contains("connected_slaves:1") && replication.contains("online")
            });
        }
    }

    /// Waits until every live node says `cluster_state:ok` and sees every slot served by a
    /// primary it does not suspect. The tests' nodes run with
    /// `cluster-require-full-coverage no`, so `cluster_state:ok` alone also holds while a
    /// node still flags a paused primary `fail?` or waits for its replica's promotion.
    pub fn wait_until_ok(&self) {
        for node in self.live() {
            wait_until(&format!("node {node} sees every slot served"), || {
                info(node, "CLUSTER INFO").is_some_and(|i| {
                    i.contains("cluster_state:ok") && i.contains("cluster_slots_ok:16384")
                })
            });
        }
    }

    /// Seed URLs: every node.
    pub fn urls(&self) -> Vec<String> {
        self.nodes
            .iter()
            .map(|n| format!("redis://127.0.0.1:{}", n.port))
            .collect()
    }

    /// A backend on the cluster with short timeouts (as `support::backend` for one server).
    pub async fn backend(&self) -> RedisBackend {
        self.builder()
            .build()
            .await
            .expect("backend connects to the test cluster")
    }

    /// The builder of [`backend`](Self::backend), for tests that set more before building.
    pub fn builder(&self) -> tower_lock::RedisBackendBuilder {
        RedisBackend::cluster(self.urls())
            .command_timeout(Duration::from_millis(500))
            .connect_timeout(Duration::from_millis(500))
    }

    /// A cluster connection for the test's own data.
    pub async fn conn(&self) -> redis::cluster_async::ClusterConnection {
        redis::cluster::ClusterClient::new(self.urls())
            .expect("cluster urls")
            .get_async_connection()
            .await
            .expect("connect to the test cluster")
    }

    /// Ports of the live nodes.
    pub fn live(&self) -> Vec<u16> {
        self.nodes
            .iter()
            .filter(|n| n.child.is_some())
            .map(|n| n.port)
            .collect()
    }

    /// Ports of the live primaries that own slots, by the first live node's view.
    pub fn primaries(&self) -> Vec<u16> {
        let mut ports: Vec<u16> = self.slot_owners().into_values().collect();
        ports.sort_unstable();
        ports.dedup();
        ports
    }

    /// The port of the primary that owns `key`'s slot.
    pub fn primary_of(&self, key: &str) -> u16 {
        let node = self.live()[0];
        let slot: u16 = query(node, &["CLUSTER", "KEYSLOT", key])
            .trim_start_matches(':')
            .trim()
            .parse()
            .expect("CLUSTER KEYSLOT");
        self.slot_owner(slot)
    }

    /// The port of the primary that owns `slot`.
    pub fn slot_owner(&self, slot: u16) -> u16 {
        self.slot_owners()
            .into_iter()
            .find(|((start, end), _)| (*start..=*end).contains(&slot))
            .map(|(_, port)| port)
            .expect("an owner of the slot")
    }

    /// Slot ranges and the port of the live primary serving them, from `CLUSTER NODES`.
    fn slot_owners(&self) -> HashMap<(u16, u16), u16> {
        let live = self.live();
        let nodes = query(live[0], &["CLUSTER", "NODES"]);
        let mut owners = HashMap::new();
        for line in nodes.lines() {
            let fields: Vec<&str> = line.split_whitespace().collect();
            if fields.len() < 9 || !fields[2].contains("master") || fields[2].contains("fail") {
                continue;
            }
            let port: u16 = fields[1]
                .split(['@', ':'])
                .nth(1)
                .and_then(|p| p.parse().ok())
                .expect("node port");
            for range in &fields[8..] {
                let (start, end) = range.split_once('-').unwrap_or((range, range));
                if let (Ok(start), Ok(end)) = (start.parse(), end.parse()) {
                    owners.insert((start, end), port);
                }
            }
        }
        owners
    }

    /// Sum of `calls=` of `commands` in `INFO commandstats` of the node on `port`.
    pub fn command_calls(&self, port: u16, commands: &[&str]) -> u64 {
        super::calls_in(
            &info(port, "INFO commandstats").unwrap_or_default(),
            commands,
        )
    }

    /// `PUBSUB SHARDNUMSUB channel` on the node on `port`.
    pub fn shard_subscribers(&self, port: u16, channel: &str) -> i64 {
        let reply = query(port, &["PUBSUB", "SHARDNUMSUB", channel]);
        reply
            .lines()
            .last()
            .and_then(|n| n.trim_start_matches(':').trim().parse().ok())
            .expect("PUBSUB SHARDNUMSUB")
    }

    /// Runs one command on the node on `port` (ACL and CONFIG changes are per node) and
    /// returns `redis-cli`'s output.
    pub fn run(&self, port: u16, args: &[&str]) -> String {
        query(port, args)
    }

    /// Whether the node on `port` has `key` (it must own the key's slot to say yes).
    pub fn exists_on(&self, port: u16, key: &str) -> bool {
        query(port, &["EXISTS", key]).trim() == "1"
    }

    /// Moves the slot of `key` with its keys from its primary to the primary on `to`, as
    /// `redis-cli --cluster reshard` does for each slot, in one go.
    pub fn move_slot(&self, key: &str, to: u16) {
        let migration = super::reshard::Migration::begin(self, key, to);
        migration.migrate_rest();
        migration.finish();
    }

    /// Waits until the first live node's slot map says the primary on `to` serves `slot`.
    pub fn wait_until_slot_served(&self, slot: &str, to: u16) {
        let slot: u16 = slot.parse().expect("a slot number");
        wait_until(&format!("slot {slot} served by {to}"), || {
            self.slot_owner(slot) == to
        });
    }

    /// SIGSTOP of the node on `port`: it answers nothing (TCP still accepts and buffers)
    /// until [`resume`](Self::resume).
    pub fn pause(&self, port: u16) {
        super::send_signal(self.pid(port), "-STOP");
    }

    /// SIGCONT of the node on `port`.
    pub fn resume(&self, port: u16) {
        super::send_signal(self.pid(port), "-CONT");
    }

    fn pid(&self, port: u16) -> u32 {
        self.nodes
            .iter()
            .find(|n| n.port == port)
            .and_then(|n| n.child.as_ref())
            .map(Child::id)
            .expect("a live node on the port")
    }

    /// The port of the replica of the primary on `primary`.
    pub fn replica_of(&self, primary: u16) -> u16 {
        let id = query(primary, &["CLUSTER", "MYID"]).trim().to_owned();
        let replicas = query(primary, &["CLUSTER", "REPLICAS", &id]);
        replicas
            .split_whitespace()
            .nth(1)
            .and_then(|addr| addr.split(['@', ':']).nth(1))
            .and_then(|p| p.parse().ok())
            .expect("CLUSTER REPLICAS names a replica")
    }

    /// The re-entry count of `owner` in the lock hash `lock` on the node on `port`.
    pub fn hold_count(&self, port: u16, lock: &str, owner: &str) -> Option<i64> {
        query(port, &["HGET", lock, owner]).trim().parse().ok()
    }

    /// A plain (not cluster-aware) connection to the node on `port`.
    pub async fn node_conn(&self, port: u16) -> redis::aio::MultiplexedConnection {
        redis::Client::open(format!("redis://127.0.0.1:{port}"))
            .expect("node url")
            .get_multiplexed_async_connection()
            .await
            .expect("connect to the node")
    }

    /// SIGKILL of the node on `port`, as a crash would.
    pub fn kill(&mut self, port: u16) {
        if let Some(node) = self.nodes.iter_mut().find(|n| n.port == port) {
            if let Some(mut child) = node.child.take() {
                let _ = child.kill();
                let _ = child.wait();
            }
        }
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for port in self.live() {
            self.kill(port);
        }
    }
}

/// A key whose slot the primary on `port` owns: `prefix` plus a number.
pub fn key_on(cluster: &Cluster, port: u16, prefix: &str) -> String {
    (0..10_000)
        .map(|i| format!("{prefix}{i}"))
        .find(|k| cluster.primary_of(&format!("tower-lock:{{{k}}}")) == port)
        .expect("a key on every shard")
}

/// `n` free ports whose cluster bus port (+10000) is free too.
pub fn cluster_ports(n: usize) -> Vec<u16> {
    let mut ports = Vec::new();
    while ports.len() < n {
        let port = super::free_port();
        let bus = port.checked_add(10_000).filter(|b| *b < 65_535);
        if bus.is_some_and(|b| TcpListener::bind(("0.0.0.0", b)).is_ok()) {
            ports.push(port);
        }
    }
    ports
}

/// Runs one command with `redis-cli` (no Redis client needed outside a runtime).
fn query(port: u16, args: &[&str]) -> String {
    let out = redis_tool(
        Command::new("redis-cli")
            .args(["-p", &port.to_string()])
            .args(args),
        Command::output,
    )
    .expect("redis-cli");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The reply of `command` (split on spaces), or `None` when the node does not answer.
fn info(port: u16, command: &str) -> Option<String> {
    let out = redis_tool(
        Command::new("redis-cli")
            .args(["-p", &port.to_string()])
            .args(command.split(' ')),
        Command::output,
    )
    .ok()?;
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    (out.status.success() && !text.is_empty() && !text.starts_with("Could not connect"))
        .then_some(text)
}

fn wait_until(what: &str, mut check: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while Instant::now() < deadline {
        if check() {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("timed out waiting until {what}");
}

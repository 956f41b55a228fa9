//! The cluster Jepsen test's deployment: six Redis Cluster nodes (three primaries with a
//! replica each) and the three app instances, each on a host of its own, all on one LAN
//! (a bridge on a host of its own). A partition is a pair of blackhole routes, one on
//! each side, for every pair of hosts it separates, so the rest of the LAN keeps working:
//! an instance cut from every node, or a primary cut from every other node while the
//! instances still reach it. The latter is why hosts and not a proxy on the bus port
//! (`cluster-announce-bus-port`): a real partition cuts the replication link along with
//! the bus, and only then do the old primary's last writes miss its replica.

use std::net::{Ipv4Addr, SocketAddr};
use std::process::{Command, Stdio};

use support::cluster::NODE_ARGS;
use support::netns::{HostRedis, Net, ip};

use super::*;

/// The nodes, `n0` to `n5`.
pub(super) const NODES: usize = 6;
const PORT: u16 = 6379;
/// The third octet of the LAN's addresses (the uplinks use the low ones).
const LAN: u8 = 200;

/// The hosts, the nodes on them, and what the nemesis did to the nodes.
pub(super) struct Deployment {
    pub(super) net: Net,
    nodes: Vec<HostRedis>,
    /// Whether node `i` runs (not killed).
    up: Vec<bool>,
}

/// A primary and its replica (node numbers), as their `INFO replication` tells.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Shard {
    pub(super) primary: usize,
    pub(super) replica: usize,
}

fn node_host(i: usize) -> String {
    format!("n{i}")
}

impl Deployment {
    /// The hosts, the LAN, the nodes and the cluster, healthy.
    pub(super) async fn start(instances: &[&str]) -> Deployment {
        let mut hosts: Vec<String> = vec!["lan".to_owned()];
        hosts.extend((0..NODES).map(node_host));
        hosts.extend(instances.iter().map(|h| (*h).to_owned()));
        let names: Vec<&str> = hosts.iter().map(String::as_str).collect();
        let net = Net::new(&names);
        let lan = net.ns("lan");
        ip(&["-n", &lan, "link", "add", "br0", "type", "bridge"]);
        ip(&["-n", &lan, "link", "set", "br0", "up"]);
        let mut deployment = Deployment {
            net,
            nodes: Vec::new(),
            up: vec![true; NODES],
        };
        for (n, host) in names[1..].iter().enumerate() {
            let (port, ns) = (format!("p{n}"), deployment.net.ns(host));
            let add = ["link", "add", &port, "type", "veth", "peer", "name", "lan"];
            ip(&[&["-n", &lan][..], &add, &["netns", &ns]].concat());
            ip(&["-n", &lan, "link", "set", &port, "master", "br0", "up"]);
            let addr = format!("{}/24", deployment.lan_ip(host));
            ip(&["-n", &ns, "addr", "add", &addr, "dev", "lan"]);
            ip(&["-n", &ns, "link", "set", "lan", "up"]);
        }
        for i in 0..NODES {
            let host = node_host(i);
            let (lan, uplink) = (deployment.lan_ip(&host), deployment.net.host_ip(&host));
            let announce = lan.to_string();
            let mut args = NODE_ARGS.to_vec();
            args.extend(["--cluster-announce-ip", &announce]);
            let node = HostRedis::start(
                &deployment.net,
                Some(&host),
                &[lan, uplink],
                SocketAddr::from((uplink, PORT)),
                &args,
            );
            deployment.nodes.push(node);
        }
        let status = Command::new("ip")
            .args(["netns", "exec", &deployment.net.ns("n0")])
            .args(["redis-cli", "--cluster", "create"])
            .args((0..NODES).map(|i| format!("{}:{PORT}", deployment.lan_ip(&node_host(i)))))
            .args(["--cluster-replicas", "1", "--cluster-yes"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .expect("redis-cli");
        assert!(status.success(), "redis-cli --cluster create");
        deployment.wait_until_healthy().await;
        deployment
    }

    /// The address of `host` on the LAN.
    pub(super) fn lan_ip(&self, host: &str) -> Ipv4Addr {
        let [_, octet, ..] = self.net.host_ip("lan").octets();
        let last = match host.strip_prefix('n') {
            Some(i) => 10 + i.parse::<u8>().expect("node number"),
            None => {
                100 + host
                    .trim_start_matches("app")
                    .parse::<u8>()
                    .expect("app number")
            }
        };
        Ipv4Addr::new(10, octet, LAN, last)
    }

    /// The seed URLs the instances get: every node, on the LAN.
    pub(super) fn seeds(&self) -> String {
        let urls: Vec<String> = (0..NODES)
            .map(|i| format!("redis://{}:{PORT}", self.lan_ip(&node_host(i))))
            .collect();
        urls.join(",")
    }

    /// Where the test reaches node `i` (its uplink: no partition cuts it).
    pub(super) fn node_addr(&self, i: usize) -> SocketAddr {
        self.nodes[i].addr()
    }

    /// Separates host `a` from every host of `others` on the LAN (`cut`) or joins them
    /// again.
    fn separate(&self, a: &str, others: &[String], cut: bool) {
        let verb = if cut { "add" } else { "del" };
        for b in others {
            for (from, to) in [(a, b.as_str()), (b.as_str(), a)] {
                let to = format!("{}/32", self.lan_ip(to));
                ip(&["-n", &self.net.ns(from), "route", verb, "blackhole", &to]);
            }
        }
    }

    /// Cuts instance host `app` from every node (or heals the cut).
    pub(super) fn partition_instance(&self, app: &str, cut: bool) {
        let nodes: Vec<String> = (0..NODES).map(node_host).collect();
        self.separate(app, &nodes, cut);
    }

    /// Cuts node `i` from every other node, the cluster bus and replication alike, while
    /// the instances still reach it (or heals the cut).
    pub(super) fn partition_node(&self, i: usize, cut: bool) {
        let others: Vec<String> = (0..NODES).filter(|&j| j != i).map(node_host).collect();
        self.separate(&node_host(i), &others, cut);
    }

    /// `kill -9` of node `i`.
    pub(super) fn kill(&mut self, i: usize) {
        self.nodes[i].kill();
        self.up[i] = false;
    }

    /// Starts node `i` again, empty (its `nodes.conf` kept: it rejoins as itself).
    pub(super) fn restart(&mut self, i: usize) {
        self.nodes[i].restart();
        self.up[i] = true;
    }

    /// `SIGSTOP` (`"-STOP"`) or `SIGCONT` (`"-CONT"`) to node `i`.
    pub(super) fn signal(&self, i: usize, signal: &str) {
        support::send_signal(self.nodes[i].pid().expect("a running node"), signal);
    }

    /// One command on node `i` over a fresh connection; `None` when the node does not
    /// answer within a second (down, frozen).
    pub(super) async fn query(&self, i: usize, args: &[&str]) -> Option<redis::Value> {
        let client = redis::Client::open(format!("redis://{}", self.node_addr(i))).ok()?;
        let second = Duration::from_secs(1);
        tokio::time::timeout(second, async {
            let mut conn = client.get_multiplexed_async_connection().await.ok()?;
            redis::cmd(args[0])
                .arg(&args[1..])
                .query_async(&mut conn)
                .await
                .ok()
        })
        .await
        .ok()
        .flatten()
    }

    /// The reply of [`query`](Self::query) as text; empty when there is none.
    async fn text(&self, i: usize, args: &[&str]) -> String {
        match self.query(i, args).await {
            Some(value) => redis::from_redis_value::<String>(value).unwrap_or_default(),
            None => String::new(),
        }
    }

    /// The shards as the nodes themselves say (`INFO replication`): each primary with
    /// its linked replica; `None` unless there are three, each replica's link up.
    pub(super) async fn shards(&self) -> Option<Vec<Shard>> {
        let mut shards = Vec::new();
        for i in (0..NODES).filter(|&i| self.up[i]) {
            let info = self.text(i, &["INFO", "replication"]).await;
            if !info.contains("role:master") {
                continue;
            }
            let line = info.lines().find(|l| l.starts_with("slave0:"))?;
            if !line.contains("state=online") {
                return None;
            }
            let ip = line.split(',').find_map(|f| f.strip_prefix("slave0:ip="))?;
            let replica = (0..NODES).find(|&j| self.lan_ip(&node_host(j)).to_string() == ip)?;
            let linked = self.text(replica, &["INFO", "replication"]).await;
            if !linked.contains("master_link_status:up") {
                return None;
            }
            shards.push(Shard {
                primary: i,
                replica,
            });
        }
        (shards.len() == 3).then_some(shards)
    }

    /// The shard that serves `key`, once the cluster is healthy.
    pub(super) async fn shard_of(&self, key: &str) -> Shard {
        let shards = self.wait_until_healthy().await;
        let slot = match self
            .query(shards[0].primary, &["CLUSTER", "KEYSLOT", key])
            .await
        {
            Some(redis::Value::Int(slot)) => u16::try_from(slot).expect("a slot"),
            other => panic!("CLUSTER KEYSLOT {key}: {other:?}"),
        };
        for shard in shards {
            // Each primary's own line of its slot map (`myself`).
            let nodes = self.text(shard.primary, &["CLUSTER", "NODES"]).await;
            if nodes
                .lines()
                .any(|line| line.contains("myself") && line_has_slot(line, slot))
            {
                return shard;
            }
        }
        panic!("no primary serves {key}");
    }

    /// Waits until every node says the cluster is ok with every slot served, and every
    /// primary has its replica linked; the shards then.
    pub(super) async fn wait_until_healthy(&self) -> Vec<Shard> {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(shards) = self.healthy().await {
                return shards;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "the cluster did not heal within 30 s"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    async fn healthy(&self) -> Option<Vec<Shard>> {
        for i in (0..NODES).filter(|&i| self.up[i]) {
            let info = self.text(i, &["CLUSTER", "INFO"]).await;
            let ok = info.contains("cluster_state:ok")
                && info.contains("cluster_slots_ok:16384")
                && info.contains("cluster_slots_pfail:0")
                && info.contains("cluster_slots_fail:0");
            if !ok {
                return None;
            }
        }
        self.shards().await
    }

    /// Waits until node `i` says it is a primary (a replica promoted).
    pub(super) async fn wait_until_primary(&self, i: usize) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        while !self
            .text(i, &["INFO", "replication"])
            .await
            .contains("role:master")
        {
            assert!(
                tokio::time::Instant::now() < deadline,
                "node {i} was not promoted within 30 s"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// Whether a `CLUSTER NODES` line lists `slot` among its ranges.
fn line_has_slot(line: &str, slot: u16) -> bool {
    line.split_whitespace().skip(8).any(|range| {
        let (start, end) = range.split_once('-').unwrap_or((range, range));
        matches!((start.parse::<u16>(), end.parse::<u16>()), (Ok(s), Ok(e)) if (s..=e).contains(&slot))
    })
}

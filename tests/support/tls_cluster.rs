//! A throwaway Redis Cluster that speaks only TLS, to its clients, on its bus and between
//! primaries and replicas: six `redis-server --tls-port P --port 0 --tls-cluster yes
//! --tls-replication yes` (three primaries with a replica each) on free loopback ports,
//! with certificates from [`Certs`], joined by `redis-cli --tls --cluster create`, every
//! process killed when the [`TlsCluster`] is dropped.
//!
//! A node opens the bus and replication links as a TLS client, and the other node asks it
//! for a certificate (`tls-auth-clients` is on): it presents the client certificate
//! (`tls-client-cert-file`), since the server certificate is for `serverAuth` only.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::cluster::{NODE_ARGS, cluster_ports};
use super::redis_tool;
use super::tls::{Certs, cli, wait_ready};

/// Six TLS nodes, three shards, and the certificates they trust.
pub struct TlsCluster {
    nodes: Vec<(u16, Option<Child>, tempfile::TempDir)>,
    pub certs: Certs,
}

impl TlsCluster {
    /// Starts the nodes, creates the cluster and waits until every node sees every slot
    /// served and every primary has its replica linked.
    pub fn start() -> Self {
        let certs = Certs::new();
        let mut cluster = TlsCluster {
            nodes: Vec::new(),
            certs,
        };
        // Another process may take a picked port before redis-server binds it: retry.
        for _ in 0..10 {
            if cluster.spawn_nodes() {
                break;
            }
            cluster.kill_all();
        }
        assert_eq!(cluster.live().len(), 6, "six TLS nodes on free ports");
        let status = redis_tool(
            cluster
                .cli_command()
                .args(["--cluster", "create"])
                .args(cluster.live().iter().map(|p| format!("127.0.0.1:{p}")))
                .args(["--cluster-replicas", "1", "--cluster-yes"])
                .stdout(Stdio::null()),
            Command::status,
        )
        .expect("run redis-cli");
        assert!(status.success(), "redis-cli --tls --cluster create");
        cluster.wait_until_ok();
        for primary in cluster.primaries() {
            wait_until(&format!("primary {primary} has a linked replica"), || {
                let replication = cluster.cli(primary, &["INFO", "replication"]);
                replication.contains("connected_slaves:1") && replication.contains("online")
            });
        }
        cluster
    }

    /// Spawns six nodes; false if one did not come up as ours.
    fn spawn_nodes(&mut self) -> bool {
        for port in cluster_ports(6) {
            let dir = tempfile::tempdir().expect("temp dir");
            let path = |name: &str| self.certs.path(name);
            let child = redis_tool(
                Command::new("redis-server")
                    .args(["--port", "0", "--bind", "127.0.0.1"])
                    .args(["--tls-port", &port.to_string()])
                    .args(["--tls-cluster", "yes", "--tls-replication", "yes"])
                    .args(self.certs.server_args())
                    .arg("--tls-client-cert-file")
                    .arg(path("client.crt"))
                    .arg("--tls-client-key-file")
                    .arg(path("client.key"))
                    .args(NODE_ARGS)
                    .arg("--dir")
                    .arg(dir.path())
                    .stdout(Stdio::null())
                    .stderr(Stdio::null()),
                Command::spawn,
            )
            .expect("spawn redis-server");
            self.nodes.push((port, Some(child), dir));
        }
        let certs = &self.certs;
        self.nodes.iter_mut().all(|(port, child, _)| {
            child
                .as_mut()
                .is_some_and(|child| wait_ready(child, *port, certs))
        })
    }

    /// `redis-cli --tls` trusting the CA, with the client certificate.
    fn cli_command(&self) -> Command {
        let mut command = Command::new("redis-cli");
        command
            .args(["--tls", "--cacert"])
            .arg(self.certs.path("ca.crt"))
            .arg("--cert")
            .arg(self.certs.path("client.crt"))
            .arg("--key")
            .arg(self.certs.path("client.key"));
        command
    }

    /// Runs one command on the node on `port`; its output ("" when it does not answer).
    pub fn cli(&self, port: u16, args: &[&str]) -> String {
        cli(port, &self.certs, args).unwrap_or_default()
    }

    /// Seed URLs: every node, `rediss://127.0.0.1:P`.
    pub fn urls(&self) -> Vec<String> {
        self.live()
            .iter()
            .map(|port| format!("rediss://127.0.0.1:{port}"))
            .collect()
    }

    /// Ports of the live nodes.
    pub fn live(&self) -> Vec<u16> {
        self.nodes
            .iter()
            .filter(|(_, child, _)| child.is_some())
            .map(|(port, _, _)| *port)
            .collect()
    }

    /// Ports of the live primaries that own slots, by the first live node's view.
    pub fn primaries(&self) -> Vec<u16> {
        let nodes = self.cli(self.live()[0], &["CLUSTER", "NODES"]);
        let mut ports: Vec<u16> = nodes
            .lines()
            .map(|line| line.split_whitespace().collect::<Vec<_>>())
            .filter(|f| f.len() > 8 && f[2].contains("master") && !f[2].contains("fail"))
            .filter_map(|f| f[1].split([':', '@']).nth(1)?.parse().ok())
            .collect();
        ports.sort_unstable();
        ports
    }

    /// The live nodes that answer `EXISTS key` with 1 (a node that does not own the key's
    /// slot answers `MOVED`).
    pub fn holders_of(&self, key: &str) -> Vec<u16> {
        self.live()
            .into_iter()
            .filter(|&port| self.cli(port, &["EXISTS", key]) == "1")
            .collect()
    }

    /// The port of the replica of the primary on `primary`.
    pub fn replica_of(&self, primary: u16) -> u16 {
        let id = self.cli(primary, &["CLUSTER", "MYID"]);
        let replicas = self.cli(primary, &["CLUSTER", "REPLICAS", &id]);
        replicas
            .split_whitespace()
            .nth(1)
            .and_then(|addr| addr.split(['@', ':']).nth(1))
            .and_then(|p| p.parse().ok())
            .expect("CLUSTER REPLICAS names a replica")
    }

    /// Whether the replica of the primary on `primary` has acknowledged every write the
    /// primary has made (its offset in `INFO replication` is the primary's own).
    pub fn replica_caught_up(&self, primary: u16) -> bool {
        super::replica_caught_up(&self.cli(primary, &["INFO", "replication"]))
    }

    /// Waits until the node on `port` is a primary (its replica's failover won).
    pub fn wait_until_promoted(&self, port: u16) {
        wait_until(&format!("node {port} is promoted"), || {
            self.cli(port, &["INFO", "replication"])
                .contains("role:master")
        });
    }

    /// Waits until every live node says `cluster_state:ok` with every slot served.
    pub fn wait_until_ok(&self) {
        for node in self.live() {
            wait_until(&format!("node {node} sees every slot served"), || {
                let info = self.cli(node, &["CLUSTER", "INFO"]);
                info.contains("cluster_state:ok") && info.contains("cluster_slots_ok:16384")
            });
        }
    }

    /// SIGKILL of the node on `port`, as a crash would.
    pub fn kill(&mut self, port: u16) {
        for (_, child, _) in self.nodes.iter_mut().filter(|(p, _, _)| *p == port) {
            if let Some(mut child) = child.take() {
                let _ = child.kill();
                let _ = child.wait();
            }
        }
    }

    fn kill_all(&mut self) {
        for port in self.live() {
            self.kill(port);
        }
        self.nodes.clear();
    }
}

impl Drop for TlsCluster {
    fn drop(&mut self) {
        self.kill_all();
    }
}

fn wait_until(what: &str, mut check: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !check() {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

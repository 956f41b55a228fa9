//! A Sentinel deployment that speaks only TLS, on free loopback ports: a master, its replica
//! (replicating over TLS) and one sentinel (quorum 1), all with certificates from one CA
//! (see [`Certs`]), none demanding client certificates. Killed on drop.

use std::process::{Child, Command, Stdio};

use super::tls::{Certs, cli, wait_ready};
use super::{free_port, redis_tool};

/// The name the sentinel monitors the master under.
pub const TLS_MASTER_NAME: &str = "towerlock-tls";

/// One TLS process of the set.
struct TlsProcess {
    child: Child,
    port: u16,
    _dir: tempfile::TempDir,
}

impl Drop for TlsProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The TLS deployment: `servers[0]` starts as master, `servers[1]` as its replica.
pub struct TlsSentinelSet {
    pub certs: Certs,
    servers: Vec<TlsProcess>,
    sentinel: TlsProcess,
}

impl TlsSentinelSet {
    /// Starts the data nodes, then the sentinel, and waits until the sentinel sees the
    /// replica.
    pub fn start() -> Self {
        let certs = Certs::new();
        let master = start(&certs, |_, _| Vec::new());
        let master_port = master.port.to_string();
        let replica = start(&certs, |_, _| {
            ["--replicaof", "127.0.0.1", &master_port]
                .map(str::to_owned)
                .to_vec()
        });
        let sentinel = start(&certs, |port, dir| {
            // Sentinel rewrites its config file, so it gets its own, writable.
            let config = dir.join("sentinel.conf");
            let name = TLS_MASTER_NAME;
            std::fs::write(
                &config,
                format!(
                    "sentinel monitor {name} 127.0.0.1 {master_port} 1\n\
                     sentinel down-after-milliseconds {name} 1000\n\
                     sentinel failover-timeout {name} 5000\n\
                     tls-port {port}\n"
                ),
            )
            .expect("write sentinel config");
            vec![config.display().to_string(), "--sentinel".to_owned()]
        });
        let set = TlsSentinelSet {
            certs,
            servers: vec![master, replica],
            sentinel,
        };
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        while !set.sentinel_sees_the_replica() {
            assert!(
                std::time::Instant::now() < deadline,
                "the sentinel sees the replica"
            );
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        set
    }

    fn sentinel_sees_the_replica(&self) -> bool {
        let replicas = self.sentinel_cli(&["SENTINEL", "REPLICAS", TLS_MASTER_NAME]);
        replicas.is_some_and(|r| r.lines().any(|l| l == "slave"))
            && self
                .cli(self.servers[1].port, &["INFO", "replication"])
                .is_some_and(|info| info.contains("master_link_status:up"))
    }

    /// The sentinel's URL (`rediss://`).
    pub fn sentinel_url(&self) -> String {
        format!("rediss://127.0.0.1:{}", self.sentinel.port)
    }

    /// The port of the master the sentinel names now.
    pub fn master_port(&self) -> u16 {
        let addr = self
            .sentinel_cli(&["SENTINEL", "GET-MASTER-ADDR-BY-NAME", TLS_MASTER_NAME])
            .expect("the sentinel answers");
        addr.lines()
            .nth(1)
            .and_then(|p| p.trim().parse().ok())
            .expect("the sentinel names the master")
    }

    /// SIGKILL of the data node at `port`, as a crash would.
    pub fn kill(&mut self, port: u16) {
        self.servers.retain(|server| server.port != port);
    }

    /// Whether the replica of the master at `port` has acknowledged every write the master
    /// made (its offset in `INFO replication` is the master's own).
    pub fn replica_caught_up(&self, port: u16) -> bool {
        super::replica_caught_up(&self.cli(port, &["INFO", "replication"]).unwrap_or_default())
    }

    /// Runs a command on the data node at `port`.
    pub fn cli(&self, port: u16, args: &[&str]) -> Option<String> {
        cli(port, &self.certs, args)
    }

    /// Runs a command on the sentinel.
    pub fn sentinel_cli(&self, args: &[&str]) -> Option<String> {
        cli(self.sentinel.port, &self.certs, args)
    }
}

/// Starts a TLS-only `redis-server` on a free port with `extra(port, dir)` arguments first
/// (a config file, for the sentinel).
fn start(certs: &Certs, extra: impl Fn(u16, &std::path::Path) -> Vec<String>) -> TlsProcess {
    // Another process may take the free port before redis-server binds it: retry.
    for _ in 0..20 {
        let dir = tempfile::tempdir().expect("temp dir");
        let port = free_port();
        let mut child = redis_tool(
            Command::new("redis-server")
                .args(extra(port, dir.path()))
                .args(["--port", "0", "--bind", "127.0.0.1"])
                .args(["--tls-port", &port.to_string()])
                .args(certs.server_args())
                .args(["--tls-auth-clients", "no", "--tls-replication", "yes"])
                .args(["--save", "", "--appendonly", "no"])
                .arg("--dir")
                .arg(dir.path())
                .stdout(Stdio::null())
                .stderr(Stdio::null()),
            Command::spawn,
        )
        .expect("spawn redis-server");
        if wait_ready(&mut child, port, certs) {
            return TlsProcess {
                child,
                port,
                _dir: dir,
            };
        }
        let _ = child.kill();
        let _ = child.wait();
    }
    panic!("could not start a TLS redis-server on a free port");
}

//! A Sentinel deployment on free loopback ports: one master, one replica, three sentinels
//! (`redis-server FILE --sentinel`, each with its own writable config file in a temp dir).
//! Every process is killed when the set is dropped.

use std::collections::HashMap;
use std::net::Ipv4Addr;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::test_conn as connect;
use super::{RedisServer, eventually, redis_tool};

// The partitions between sentinels and data nodes: another `impl SentinelSet`.
#[path = "sentinel_partition.rs"]
mod partition;

/// The name the sentinels monitor the master under.
pub const MASTER_NAME: &str = "towerlock";

/// The ACL user sentinel `i` authenticates as once the data nodes require a password: one
/// each, so that a partition can cut some sentinels off a data node and not the others.
fn sentinel_user(i: usize) -> String {
    format!("sentinel-user-{i}")
}

/// One master, one replica and three sentinels watching them with quorum 2.
pub struct SentinelSet {
    /// The data nodes; either may be master after a failover.
    servers: Vec<RedisServer>,
    sentinels: Vec<SentinelProcess>,
    /// The data nodes' password, once [`require_password`](Self::require_password) set one.
    password: Option<String>,
    /// The address every process of the set listens on (and on 127.0.0.1) and announces.
    ip: Ipv4Addr,
    /// The data nodes' extra arguments (see [`start_on`](Self::start_on)).
    node_args: Vec<String>,
}

impl SentinelSet {
    /// Starts the data nodes, then the sentinels, and waits until they are
    /// [ready](Self::wait_until_ready).
    pub async fn start() -> Self {
        Self::start_on(Ipv4Addr::LOCALHOST).await
    }

    /// [`start`](Self::start) with every process listening on `ip` too and announcing it
    /// (for clients in other network namespaces that reach this one's `ip`).
    pub async fn start_on(ip: Ipv4Addr) -> Self {
        // Diskless sync without its 5 s delay: a replica links at once.
        let mut node_args = "--repl-diskless-sync-delay 0".to_owned();
        if !ip.is_loopback() {
            node_args +=
                &format!(" --bind 127.0.0.1 {ip} --replica-announce-ip {ip} --protected-mode no");
        }
        let node_args: Vec<String> = node_args.split(' ').map(Into::into).collect();
        let args: Vec<&str> = node_args.iter().map(String::as_str).collect();
        let master = RedisServer::start_with(&args);
        let (ip_text, master_port) = (ip.to_string(), master.port().to_string());
        let mut replica_args = args.clone();
        replica_args.extend(["--replicaof", &ip_text, &master_port]);
        let replica = RedisServer::start_with(&replica_args);
        let sentinels = (0..3)
            .map(|_| SentinelProcess::start(ip, master.port()))
            .collect();
        let set = SentinelSet {
            servers: vec![master, replica],
            sentinels,
            password: None,
            ip,
            node_args,
        };
        set.wait_until_ready().await;
        set
    }

    /// Waits until the replica is linked to the master and every sentinel sees it healthy
    /// and knows the two other sentinels, so that a failover can be voted and go to it.
    pub async fn wait_until_ready(&self) {
        let master = self.master_port().await;
        for server in self.servers.iter().filter(|s| s.port() != master) {
            eventually("the replica is linked to the master", || async {
                let info: String = redis::cmd("INFO")
                    .arg("replication")
                    .query_async(&mut self.data_conn(server).await)
                    .await
                    .expect("INFO replication");
                info.contains("master_link_status:up")
            })
            .await;
        }
        for sentinel in self.sentinel_urls() {
            eventually("every sentinel sees the replica and its peers", || {
                knows_everyone(&sentinel)
            })
            .await;
        }
    }

    /// Makes the data nodes require `password` (the sentinels keep none). Each sentinel
    /// authenticates as its own ACL user ([`sentinel_user`]) with it, so that
    /// [`cut_sentinels_off`](Self::cut_sentinels_off) can lock them out alone; a replica
    /// authenticates to its master as the default user.
    pub async fn require_password(&mut self, password: &str) {
        for server in &self.servers {
            let mut conn = self.data_conn(server).await;
            for i in 0..self.sentinels.len() {
                let _: () = redis::cmd("ACL")
                    .arg("SETUSER")
                    .arg(sentinel_user(i))
                    .arg("on")
                    .arg(format!(">{password}"))
                    .arg("+@all")
                    .arg("~*")
                    .arg("&*")
                    .query_async(&mut conn)
                    .await
                    .expect("ACL SETUSER");
            }
            for name in ["masterauth", "requirepass"] {
                let _: () = redis::cmd("CONFIG")
                    .arg("SET")
                    .arg(name)
                    .arg(password)
                    .query_async(&mut conn)
                    .await
                    .expect("CONFIG SET");
            }
        }
        for (i, sentinel) in self.sentinel_urls().iter().enumerate() {
            let mut conn = connect(sentinel).await.expect("sentinel");
            let user = sentinel_user(i);
            for (name, value) in [("auth-user", user.as_str()), ("auth-pass", password)] {
                let _: () = redis::cmd("SENTINEL")
                    .arg("SET")
                    .arg(MASTER_NAME)
                    .arg(name)
                    .arg(value)
                    .query_async(&mut conn)
                    .await
                    .expect("SENTINEL SET");
            }
        }
        self.password = Some(password.to_owned());
        // The sentinels reconnect to the data nodes with the password.
        self.wait_until_ready().await;
    }

    /// A connection to a data node, with its password if it has one.
    pub async fn data_conn(&self, server: &RedisServer) -> redis::aio::MultiplexedConnection {
        let password = self.password.as_deref().unwrap_or_default();
        connect(&format!("redis://:{password}@127.0.0.1:{}", server.port()))
            .await
            .expect("connect to a data node")
    }

    /// Asks the first sentinel for a planned failover (`SENTINEL FAILOVER`): the replica is
    /// promoted while the old master stays up, to be turned into its replica.
    ///
    /// A sentinel refuses (`NOGOODSLAVE`) until its view of the replica is fresh enough;
    /// such refusals are retried for a few seconds.
    pub async fn switchover(&self) {
        self.switchover_by(0).await;
    }

    /// [`switchover`](Self::switchover) asked of sentinel `i`.
    pub async fn switchover_by(&self, i: usize) {
        let mut sentinel = connect(&self.sentinel_urls()[i]).await.expect("sentinel");
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let asked: redis::RedisResult<()> = redis::cmd("SENTINEL")
                .arg("FAILOVER")
                .arg(MASTER_NAME)
                .query_async(&mut sentinel)
                .await;
            match asked {
                Ok(()) => return,
                Err(e) if e.code() == Some("NOGOODSLAVE") && Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err(e) => panic!("SENTINEL FAILOVER: {e}"),
            }
        }
    }

    /// Sets how long every sentinel waits before it flags an unresponsive data node down,
    /// or a master that reports itself a replica (that one 20 s later).
    pub async fn set_down_after(&self, after: Duration) {
        for url in self.sentinel_urls() {
            let _: () = redis::cmd("SENTINEL")
                .arg("SET")
                .arg(MASTER_NAME)
                .arg("down-after-milliseconds")
                .arg(after.as_millis() as u64)
                .query_async(&mut connect(&url).await.expect("sentinel"))
                .await
                .expect("SENTINEL SET down-after-milliseconds");
        }
    }

    /// The sentinels' URLs, for [`tower_lock::RedisBackend::sentinel`].
    pub fn sentinel_urls(&self) -> Vec<String> {
        self.sentinels
            .iter()
            .map(|s| format!("redis://{}:{}", self.ip, s.port))
            .collect()
    }

    /// The port of the master the sentinels name now (asked of the first that answers).
    pub async fn master_port(&self) -> u16 {
        for url in self.sentinel_urls() {
            let Ok(mut conn) = connect(&url).await else {
                continue;
            };
            let addr: Result<Option<(String, u16)>, _> = redis::cmd("SENTINEL")
                .arg("get-master-addr-by-name")
                .arg(MASTER_NAME)
                .query_async(&mut conn)
                .await;
            if let Ok(Some((_, port))) = addr {
                return port;
            }
        }
        panic!("no sentinel names the master");
    }

    /// The flags each sentinel that answers reports for the replica on `port` (`slave`,
    /// `slave,s_down`, ...); none from a sentinel that does not list it.
    pub async fn replica_flags(&self, port: u16) -> Vec<String> {
        let mut flags = Vec::new();
        for url in self.sentinel_urls() {
            let Ok(mut conn) = connect(&url).await else {
                continue;
            };
            let replicas: Vec<HashMap<String, String>> = redis::cmd("SENTINEL")
                .arg("REPLICAS")
                .arg(MASTER_NAME)
                .query_async(&mut conn)
                .await
                .unwrap_or_default();
            let port = port.to_string();
            flags.extend(
                replicas
                    .into_iter()
                    .filter(|r| r.get("port") == Some(&port))
                    .filter_map(|mut r| r.remove("flags")),
            );
        }
        flags
    }

    /// The data nodes (master and replica, in either role).
    pub fn servers(&self) -> &[RedisServer] {
        &self.servers
    }

    /// The data node serving on `port`.
    pub fn server(&self, port: u16) -> &RedisServer {
        self.servers
            .iter()
            .find(|s| s.port() == port)
            .expect("a data node of the set")
    }
}

/// A `redis-server --sentinel` process, killed on drop.
struct SentinelProcess {
    child: Child,
    port: u16,
    _dir: tempfile::TempDir,
}

impl SentinelProcess {
    fn start(ip: Ipv4Addr, master_port: u16) -> Self {
        // Another process may take the free port before the sentinel binds it: retry.
        for _ in 0..20 {
            if let Some(sentinel) = Self::try_start(ip, master_port) {
                return sentinel;
            }
        }
        panic!("could not start a sentinel on a free port");
    }

    fn try_start(ip: Ipv4Addr, master_port: u16) -> Option<Self> {
        let dir = tempfile::tempdir().expect("temp dir");
        let port = super::free_port();
        // Sentinel rewrites its config file (discovered peers, the new master after a
        // failover), so each gets its own, writable.
        let config = dir.path().join("sentinel.conf");
        let name = MASTER_NAME;
        let bind = if ip.is_loopback() {
            "bind 127.0.0.1".to_owned()
        } else {
            format!("bind 127.0.0.1 {ip}\nsentinel announce-ip {ip}")
        };
        std::fs::write(
            &config,
            format!(
                "port {port}\n{bind}\ndir {dir}\n\
                 sentinel monitor {name} {ip} {master_port} 2\n\
                 sentinel down-after-milliseconds {name} 1000\n\
                 sentinel failover-timeout {name} 5000\n\
                 sentinel parallel-syncs {name} 1\n",
                dir = dir.path().display(),
            ),
        )
        .expect("write sentinel config");
        let child = redis_tool(
            Command::new("redis-server")
                .arg(&config)
                .arg("--sentinel")
                .stdout(Stdio::null())
                .stderr(Stdio::null()),
            Command::spawn,
        )
        .expect("spawn redis-server");
        let mut sentinel = SentinelProcess {
            child,
            port,
            _dir: dir,
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = sentinel.child.try_wait() {
                return None;
            }
            if sentinel.answers() {
                return Some(sentinel);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        None
    }

    /// Whether this process (not another that won the port) answers as a sentinel.
    fn answers(&self) -> bool {
        let Ok(client) = redis::Client::open(format!("redis://127.0.0.1:{}", self.port)) else {
            return false;
        };
        let Ok(mut conn) = client.get_connection() else {
            return false;
        };
        let info: Result<String, _> = redis::cmd("INFO").arg("server").query(&mut conn);
        info.is_ok_and(|info| {
            info.contains(&format!("process_id:{}\r\n", self.child.id()))
                && info.contains("redis_mode:sentinel")
        })
    }
}

impl Drop for SentinelProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn knows_everyone(sentinel: &str) -> bool {
    let Ok(conn) = connect(sentinel).await else {
        return false;
    };
    let nodes = |what: &'static str| {
        let mut conn = conn.clone();
        async move {
            let nodes: Result<Vec<HashMap<String, String>>, _> = redis::cmd("SENTINEL")
                .arg(what)
                .arg(MASTER_NAME)
                .query_async(&mut conn)
                .await;
            nodes.unwrap_or_default()
        }
    };
    let replicas = nodes("replicas").await;
    // A healthy replica is flagged `slave` alone (no s_down, disconnected, ...).
    let healthy =
        replicas.len() == 1 && replicas[0].get("flags").map(String::as_str) == Some("slave");
    healthy && nodes("sentinels").await.len() == 2
}

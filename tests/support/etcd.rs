//! A throwaway etcd: one member (or a cluster of three) on free loopback ports with its
//! data in a temp dir, killed when dropped. Nothing here touches an etcd it did not start.

use std::net::Ipv4Addr;
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use super::free_port;
use super::process::{NetHost, lan_ip, uplink_ip};

/// Ports tried: between picking a free port and etcd binding it, another process may take
/// it.
const ATTEMPTS: usize = 10;

/// One `etcd` member this process started and owns.
pub struct EtcdMember {
    name: String,
    child: Option<Child>,
    client_port: u16,
    peer_port: u16,
    /// `--initial-cluster` of its cluster.
    cluster: String,
    /// TLS on the client port (certificate, key, CA for client certificates), with
    /// `/health` and `/metrics` served in plain HTTP on a port of their own.
    tls: Option<(std::path::PathBuf, std::path::PathBuf, std::path::PathBuf)>,
    metrics_port: Option<u16>,
    /// The host it runs in (see `netns.rs`), or `None` for the test's own loopback.
    host: Option<NetHost>,
    // Removed after the member is killed (fields drop after `Drop::drop`).
    dir: tempfile::TempDir,
    /// A reaper, and with it the write end of its stdin (see [`shared`]).
    reaper: Option<Child>,
}

/// A single-member etcd.
pub struct EtcdServer(pub EtcdMember);

impl EtcdServer {
    /// Starts a one-member cluster and waits until it serves; panics with the cause if it
    /// cannot (etcd not installed, ...).
    pub fn start() -> Self {
        let mut last = String::new();
        for _ in 0..ATTEMPTS {
            let (client_port, peer_port) = (free_port(), free_port());
            let cluster = format!("n1=http://127.0.0.1:{peer_port}");
            let mut member = EtcdMember::new("n1", client_port, peer_port, cluster);
            match member.spawn() {
                Ok(()) if member.wait_until_serving(Duration::from_secs(60)) => {
                    return EtcdServer(member);
                }
                Ok(()) => last = member.log(),
                Err(e) => panic!("{e}"),
            }
        }
        panic!("etcd did not start ({ATTEMPTS} ports tried); its log ends: {last:.2000}");
    }

    pub fn endpoint(&self) -> String {
        self.0.endpoint()
    }

    /// A one-member cluster whose client port speaks only TLS, with the server
    /// certificate of `certs` (for `localhost` and `127.0.0.1`), and requires a client
    /// certificate signed by its CA.
    pub fn start_tls(certs: &super::tls::Certs) -> Self {
        let (client_port, peer_port, metrics_port) = (free_port(), free_port(), free_port());
        let cluster = format!("n1=http://127.0.0.1:{peer_port}");
        let mut member = EtcdMember::new("n1", client_port, peer_port, cluster);
        member.tls = Some((
            certs.path("server.crt"),
            certs.path("server.key"),
            certs.path("ca.crt"),
        ));
        member.metrics_port = Some(metrics_port);
        member.spawn().unwrap_or_else(|e| panic!("{e}"));
        assert!(
            member.wait_until_serving(Duration::from_secs(60)),
            "etcd with TLS did not start; its log ends: {:.2000}",
            member.log()
        );
        EtcdServer(member)
    }

    /// A counter of etcd's `/metrics` (Prometheus text), summed over the lines of `name`
    /// whose labels contain every one of `labels`.
    pub fn metric(&self, name: &str, labels: &[&str]) -> f64 {
        self.0.metric(name, labels)
    }

    pub fn kill(&mut self) {
        self.0.kill();
    }

    pub fn start_again(&mut self) {
        self.0.start_again();
    }
}

impl EtcdMember {
    fn new(name: &str, client_port: u16, peer_port: u16, cluster: String) -> Self {
        EtcdMember {
            name: name.to_owned(),
            child: None,
            client_port,
            peer_port,
            cluster,
            tls: None,
            metrics_port: None,
            host: None,
            dir: tempfile::tempdir().expect("temp dir"),
            reaper: None,
        }
    }

    /// The port `/health` and `/metrics` answer on.
    fn health_port(&self) -> u16 {
        self.metrics_port.unwrap_or(self.client_port)
    }

    fn spawn(&mut self) -> Result<(), String> {
        let (mut command, listen, client, peer) = match &self.host {
            Some(host) => {
                let mut command = host.exec();
                command.arg("etcd");
                let listen = format!("http://0.0.0.0:{}", self.client_port);
                let client = format!("http://{}:{}", host.lan, self.client_port);
                let peer = format!("http://{}:{}", host.lan, self.peer_port);
                (command, listen, client, peer)
            }
            None => {
                let client = self.endpoint();
                let peer = format!("http://127.0.0.1:{}", self.peer_port);
                (Command::new("etcd"), client.clone(), client, peer)
            }
        };
        let log = std::fs::File::create(self.dir.path().join("etcd.log"))
            .map_err(|e| format!("etcd log: {e}"))?;
        if let (Some((cert, key, ca)), Some(metrics)) = (&self.tls, self.metrics_port) {
            command
                .arg("--cert-file")
                .arg(cert)
                .arg("--key-file")
                .arg(key)
                .arg("--trusted-ca-file")
                .arg(ca)
                .arg("--client-cert-auth")
                .args([
                    "--listen-metrics-urls",
                    &format!("http://127.0.0.1:{metrics}"),
                ]);
        }
        let child = command
            .args(["--name", &self.name])
            .arg("--data-dir")
            .arg(self.dir.path().join("data"))
            .args(["--listen-client-urls", &listen])
            .args(["--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer])
            .args(["--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &self.cluster])
            .args(["--initial-cluster-state", "new"])
            .args(["--initial-cluster-token", "tower-lock-test"])
            // Throwaway data.
            .args(["--unsafe-no-fsync"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .map_err(|e| {
                format!(
                    "could not run etcd ({e}): install it (Debian/Ubuntu: apt-get install \
                     etcd-server)"
                )
            })?;
        self.child = Some(child);
        Ok(())
    }

    /// Waits until the member's `/health` answers healthy (it has a leader); false if it
    /// exited first (its port was taken) or did not within `bound`.
    fn wait_until_serving(&mut self, bound: Duration) -> bool {
        let deadline = Instant::now() + bound;
        while Instant::now() < deadline {
            let Some(child) = self.child.as_mut() else {
                return false;
            };
            if let Ok(Some(_)) = child.try_wait() {
                self.child = None;
                return false;
            }
            if http_get(self.reach(), self.health_port(), "/health")
                .is_some_and(|b| b.contains("\"true\""))
            {
                return true;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        false
    }

    /// What the member logged so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("etcd.log")).unwrap_or_default()
    }

    /// Where the test reaches the member.
    pub fn endpoint(&self) -> String {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        format!("{scheme}://{}:{}", self.reach(), self.client_port)
    }

    /// Where a client on another host reaches a member on a host of its own (see
    /// [`EtcdCluster::start_in`]).
    pub fn lan_endpoint(&self) -> String {
        format!("http://{}:{}", lan_ip(self.host.as_ref()), self.client_port)
    }

    /// The address the test reaches the member at.
    fn reach(&self) -> Ipv4Addr {
        uplink_ip(self.host.as_ref())
    }

    /// The member's pid while it runs (`ip netns exec` execs etcd).
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    pub fn metric(&self, name: &str, labels: &[&str]) -> f64 {
        let body =
            http_get(self.reach(), self.health_port(), "/metrics").expect("etcd serves /metrics");
        body.lines()
            .filter(|l| !l.starts_with('#'))
            .filter(|l| {
                let (series, _) = l.rsplit_once(' ').unwrap_or((l, ""));
                (series == name || series.starts_with(&format!("{name}{{")))
                    && labels.iter().all(|label| series.contains(label))
            })
            .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
            .sum()
    }

    /// Kills the member with SIGKILL; returns once it is gone.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts a killed member again on its ports and data; waits until it serves.
    pub fn start_again(&mut self) {
        self.kill();
        self.cluster_state_existing();
        self.spawn().expect("etcd runs again");
        assert!(
            self.wait_until_serving(Duration::from_secs(60)),
            "etcd did not serve again; its log ends: {:.2000}",
            self.log()
        );
    }

    /// A member restarted on its data rejoins as it was (`--initial-cluster-state` is
    /// ignored once the data dir exists, so nothing to change).
    fn cluster_state_existing(&self) {}

    /// Hands this member to a reaper that kills it and removes its files once this process
    /// has exited (its end of the reaper's stdin closes then): for a server in a `static`,
    /// which is never dropped.
    fn reap_at_exit(&mut self) {
        let (Some(child), dir) = (&self.child, self.dir.path()) else {
            return;
        };
        let reaper = super::process::reaper(child, dir, "KILL", "etcd");
        self.reaper = Some(reaper);
    }
}

impl Drop for EtcdMember {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A cluster of three members on loopback, each its own process and data dir.
pub struct EtcdCluster {
    pub members: Vec<EtcdMember>,
}

impl EtcdCluster {
    /// Three members on loopback.
    pub fn start() -> Self {
        Self::start_on(vec![None, None, None])
    }

    /// One member on each of `hosts` (on `net`'s switch, see `netns.rs`), listening on
    /// every address of its host: peers and other hosts dial it on the switch, the test on
    /// its uplink.
    pub fn start_in(net: &super::netns::Net, hosts: &[&str]) -> Self {
        Self::start_on(hosts.iter().map(|h| Some(net.server_host(h))).collect())
    }

    fn start_on(hosts: Vec<Option<NetHost>>) -> Self {
        let ports: Vec<(u16, u16)> = hosts.iter().map(|_| (free_port(), free_port())).collect();
        let peer_ip = |host: &Option<NetHost>| lan_ip(host.as_ref());
        let cluster = ports
            .iter()
            .zip(&hosts)
            .enumerate()
            .map(|(i, ((_, peer), host))| format!("n{}=http://{}:{peer}", i + 1, peer_ip(host)))
            .collect::<Vec<_>>()
            .join(",");
        let mut members: Vec<EtcdMember> = ports
            .iter()
            .zip(hosts)
            .enumerate()
            .map(|(i, (&(client, peer), host))| {
                let mut member =
                    EtcdMember::new(&format!("n{}", i + 1), client, peer, cluster.clone());
                member.host = host;
                member
            })
            .collect();
        for member in &mut members {
            member.spawn().unwrap_or_else(|e| panic!("{e}"));
        }
        for member in &mut members {
            assert!(
                member.wait_until_serving(Duration::from_secs(60)),
                "the etcd cluster did not come up; {} logged: {:.2000}",
                member.name,
                member.log()
            );
        }
        EtcdCluster { members }
    }

    pub fn endpoints(&self) -> Vec<String> {
        self.members.iter().map(EtcdMember::endpoint).collect()
    }

    /// The index of the member that leads, by its `etcd_server_is_leader` gauge.
    pub fn leader(&self) -> Option<usize> {
        self.members.iter().position(|m| {
            m.child.is_some()
                && http_get(m.reach(), m.client_port, "/metrics")
                    .is_some_and(|body| body.lines().any(|l| l == "etcd_server_is_leader 1"))
        })
    }
}

/// One plain HTTP/1.0 GET; the body, or `None` when nothing answers.
fn http_get(ip: Ipv4Addr, port: u16, path: &str) -> Option<String> {
    use std::io::{Read, Write};
    let addr = std::net::SocketAddr::from((ip, port));
    let mut stream = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(1)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(stream, "GET {path} HTTP/1.0\r\nHost: {ip}\r\n\r\n").ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).ok()?;
    let (head, body) = response.split_once("\r\n\r\n")?;
    head.starts_with("HTTP/1.").then(|| body.to_owned())
}

/// The etcd this test binary's tests share: started by the first test that asks, and
/// killed (its files removed) when the binary exits. Tests keep apart by namespace.
pub fn shared() -> &'static EtcdServer {
    static SERVER: OnceLock<EtcdServer> = OnceLock::new();
    SERVER.get_or_init(|| {
        let mut server = EtcdServer::start();
        server.0.reap_at_exit();
        server
    })
}

/// A namespace no other test uses.
pub fn fresh_namespace() -> String {
    format!("test-{}", uuid::Uuid::new_v4().simple())
}

/// The builder of a backend on [`shared`] in `namespace`, with a connect timeout that only
/// catches hangs (a loaded machine).
pub fn builder(namespace: &str) -> tower_lock::EtcdBackendBuilder {
    builder_on(&[shared().endpoint()]).namespace(namespace)
}

/// A builder for the etcd at `endpoints`.
pub fn builder_on(endpoints: &[String]) -> tower_lock::EtcdBackendBuilder {
    tower_lock::EtcdBackend::builder(endpoints.to_vec()).connect_timeout(Duration::from_secs(10))
}

/// A backend on [`shared`] in its own namespace.
pub async fn backend() -> tower_lock::EtcdBackend {
    backend_in(&fresh_namespace()).await
}

/// A backend on [`shared`] in `namespace`: several of them are instances of one service.
pub async fn backend_in(namespace: &str) -> tower_lock::EtcdBackend {
    builder(namespace)
        .build()
        .await
        .expect("backend connects to the test etcd")
}

/// An etcd client of the test's own, on the binary's etcd.
pub async fn admin() -> tower_lock::etcd_client::Client {
    tower_lock::etcd_client::Client::connect([shared().endpoint()], None)
        .await
        .expect("the test's etcd client connects")
}

/// Every key under `prefix` in the binary's etcd.
pub async fn keys_under(prefix: String) -> Vec<tower_lock::etcd_client::KeyValue> {
    let options = tower_lock::etcd_client::GetOptions::new().with_prefix();
    let mut found = admin()
        .await
        .get(prefix, Some(options))
        .await
        .expect("read");
    found.take_kvs()
}

/// The keys of `namespace`'s lock (or semaphore) directory `dir`.
pub async fn keys_in(namespace: &str, dir: &str) -> Vec<String> {
    let found = keys_under(format!("{namespace}:{{{dir}/")).await;
    found
        .iter()
        .map(|kv| String::from_utf8_lossy(kv.key()).into_owned())
        .collect()
}

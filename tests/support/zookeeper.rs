//! A throwaway ZooKeeper: one standalone server on a free loopback port with its data in a
//! temp dir, killed when dropped; or an ensemble of three, on loopback or each on a host of
//! its own (`netns.rs`). Nothing here touches a ZooKeeper it did not start.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Child, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use super::process::{NetHost, command_on, lan_ip, uplink_ip};

/// Ports tried: between picking a free port and the server binding it, another process
/// may take it.
const ATTEMPTS: usize = 10;

/// Debian's `zookeeper` package: the server's jar, whose manifest names its dependencies.
pub const CLASSPATH: &str = "/usr/share/java/zookeeper.jar";

/// Debian's slf4j binding that writes to stderr (the package's `libslf4j-java`): without a
/// binding on the class path the server logs nothing. A missing jar is skipped by java.
/// Only on a server asked to log: logging every connection and election message slows an
/// ensemble's failover (in the Jepsen workload, a leader's failure cost seconds more).
const LOGGER: &str = "/usr/share/java/slf4j-simple.jar";

/// One standalone ZooKeeper this process started and owns.
pub struct ZkServer {
    child: Option<Child>,
    port: u16,
    // Removed after the server is killed (fields drop after `Drop::drop`).
    dir: tempfile::TempDir,
    /// A reaper, and with it the write end of its stdin (see [`shared`]).
    reaper: Option<Child>,
    /// In an ensemble: its id and the ensemble's `server.N=` lines.
    ensemble: Option<(usize, String)>,
    /// The host it runs in (see `netns.rs`), or `None` for the test's own loopback.
    host: Option<NetHost>,
    /// Whether it logs (to `zookeeper.log` in its dir, see [`log`](Self::log)).
    logged: bool,
}

impl ZkServer {
    /// Starts a server (ticks of 250 ms: sessions of 0.5 s to 5 s) and waits until it
    /// serves; panics with the cause if it cannot (ZooKeeper not installed, ...).
    pub fn start() -> Self {
        Self::start_logging(false)
    }

    /// [`start`](Self::start), with a server that logs what it does (at INFO), for a test
    /// that reads its log.
    pub fn start_logged() -> Self {
        Self::start_logging(true)
    }

    fn start_logging(logged: bool) -> Self {
        let mut last = String::new();
        for _ in 0..ATTEMPTS {
            let mut server = ZkServer {
                child: None,
                port: super::free_port(),
                dir: tempfile::tempdir().expect("temp dir"),
                reaper: None,
                ensemble: None,
                host: None,
                logged,
            };
            server.spawn().unwrap_or_else(|e| panic!("{e}"));
            if server.wait_until_serving(Duration::from_secs(60)) {
                return server;
            }
            last = server.log();
        }
        panic!("ZooKeeper did not start ({ATTEMPTS} ports tried); its log ends: {last:.2000}");
    }

    fn spawn(&mut self) -> Result<(), String> {
        let dir = self.dir.path();
        // On a host of its own, on every address: the instances dial it on the switch, the
        // test on the uplink.
        let address = if self.host.is_some() {
            "0.0.0.0"
        } else {
            "127.0.0.1"
        };
        let mut config = format!(
            "tickTime=250\ndataDir={}\nclientPort={}\nclientPortAddress={address}\n\
             admin.enableServer=false\n4lw.commands.whitelist=*\nforceSync=no\n",
            dir.join("data").display(),
            self.port
        );
        if let Some((id, servers)) = &self.ensemble {
            std::fs::create_dir_all(dir.join("data")).map_err(|e| format!("data dir: {e}"))?;
            std::fs::write(dir.join("data").join("myid"), id.to_string())
                .map_err(|e| format!("myid: {e}"))?;
            // Sessions of up to 20 s: the default bound (20 ticks, 5 s) is shorter than
            // an election under faults takes. A leader cut off or silent is noticed
            // within syncLimit ticks (1 s), as etcd's members notice their leader's silence
            // within its election timeout; the ensemble serves again after the election
            // and the followers' sync, within a layer's wait.
            config.push_str("initLimit=20\nsyncLimit=4\nmaxSessionTimeout=20000\n");
            config.push_str(servers);
        }
        std::fs::write(dir.join("zoo.cfg"), config).map_err(|e| format!("zoo.cfg: {e}"))?;
        let log = std::fs::File::create(dir.join("zookeeper.log"))
            .map_err(|e| format!("ZooKeeper log: {e}"))?;
        let classpath = if self.logged {
            format!("{CLASSPATH}:{LOGGER}")
        } else {
            CLASSPATH.to_owned()
        };
        // `ip netns exec` execs java: the child's pid is the server's.
        let child = command_on(self.host.as_ref(), "java")
            .args(["-cp", &classpath, "-Xmx256m"])
            .args([
                "-Dorg.slf4j.simpleLogger.showDateTime=true",
                "-Dorg.slf4j.simpleLogger.dateTimeFormat=HH:mm:ss.SSS",
            ])
            .arg("org.apache.zookeeper.server.quorum.QuorumPeerMain")
            .arg(dir.join("zoo.cfg"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .map_err(|e| {
                format!("could not run java ({e}): install ZooKeeper (apt-get install zookeeper)")
            })?;
        if !std::path::Path::new(CLASSPATH).exists() {
            return Err(format!(
                "{CLASSPATH} is missing: install ZooKeeper (apt-get install zookeeper)"
            ));
        }
        self.child = Some(child);
        Ok(())
    }

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
            // `ruok` answers as soon as the process runs; `srvr` names the mode once the
            // server takes sessions.
            if self.four("srvr").is_some_and(|r| r.contains("Mode: ")) {
                return true;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        false
    }

    /// The answer to the four-letter word `word` (`ruok`, `mntr`, `cons`).
    pub fn four(&self, word: &str) -> Option<String> {
        let ip = uplink_ip(self.host.as_ref());
        let mut stream = TcpStream::connect((ip, self.port)).ok()?;
        stream.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
        stream.write_all(word.as_bytes()).ok()?;
        let mut answer = String::new();
        stream.read_to_string(&mut answer).ok()?;
        Some(answer)
    }

    /// A counter of `mntr` (`zk_packets_received`, ...).
    pub fn mntr(&self, name: &str) -> u64 {
        let answer = self.four("mntr").expect("ZooKeeper answers mntr");
        answer
            .lines()
            .find_map(|l| l.strip_prefix(name)?.trim().parse().ok())
            .unwrap_or_else(|| panic!("mntr has no {name}: {answer}"))
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("zookeeper.log")).unwrap_or_default()
    }

    /// The connection string of this server (where clients on other hosts dial one on a
    /// host of its own).
    pub fn hosts(&self) -> String {
        format!("{}:{}", lan_ip(self.host.as_ref()), self.port)
    }

    /// `kill -9`; returns once it is gone.
    pub fn kill(&mut self) {
        super::process::kill(&mut self.child, &[]);
    }

    /// The server's pid while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Starts the server again on its port and data (its sessions survive, as they do a
    /// restart, until their timeouts run out).
    pub fn start_again(&mut self) {
        self.kill();
        self.spawn().expect("ZooKeeper runs again");
        assert!(
            self.wait_until_serving(Duration::from_secs(60)),
            "ZooKeeper did not serve again; its log ends: {:.2000}",
            self.log()
        );
    }

    fn reap_at_exit(&mut self) {
        let (Some(child), dir) = (&self.child, self.dir.path()) else {
            return;
        };
        self.reaper = Some(super::process::reaper(child, dir, "KILL", "ZooKeeper"));
    }
}

impl Drop for ZkServer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Three servers on loopback, each in a temp dir of its own, killed when dropped.
pub struct ZkEnsemble {
    pub members: Vec<ZkServer>,
}

impl ZkEnsemble {
    /// Starts the three on loopback and waits until each serves (a quorum has formed).
    pub fn start() -> Self {
        Self::start_on(vec![None, None, None])
    }

    /// One member on each of `hosts` (on `net`'s switch, see `netns.rs`): members and
    /// clients on other hosts dial it on the switch, the test on its uplink.
    pub fn start_in(net: &super::netns::Net, hosts: &[&str]) -> Self {
        Self::start_on(hosts.iter().map(|h| Some(net.server_host(h))).collect())
    }

    /// The members log (see [`ZkServer::log`]) when `JEPSEN_SERVER_LOGS` is set.
    fn start_on(hosts: Vec<Option<NetHost>>) -> Self {
        let logged = std::env::var_os("JEPSEN_SERVER_LOGS").is_some();
        let port = super::free_port;
        let ports: Vec<(u16, u16, u16)> = hosts.iter().map(|_| (port(), port(), port())).collect();
        let servers: String = ports
            .iter()
            .zip(&hosts)
            .enumerate()
            .map(|(i, ((_, peer, election), host))| {
                let ip = lan_ip(host.as_ref());
                format!("server.{}={ip}:{peer}:{election}\n", i + 1)
            })
            .collect();
        let mut members: Vec<ZkServer> = ports
            .iter()
            .zip(hosts)
            .enumerate()
            .map(|(i, (&(client, _, _), host))| ZkServer {
                child: None,
                port: client,
                dir: tempfile::tempdir().expect("temp dir"),
                reaper: None,
                ensemble: Some((i + 1, servers.clone())),
                host,
                logged,
            })
            .collect();
        for member in &mut members {
            member.spawn().unwrap_or_else(|e| panic!("{e}"));
        }
        for member in &mut members {
            assert!(
                member.wait_until_serving(Duration::from_secs(90)),
                "the ZooKeeper ensemble did not come up; a member logged: {:.2000}",
                member.log()
            );
        }
        ZkEnsemble { members }
    }

    /// The connection string of the three.
    pub fn hosts(&self) -> String {
        let hosts: Vec<String> = self.members.iter().map(ZkServer::hosts).collect();
        hosts.join(",")
    }

    /// The member that leads, if any.
    pub fn leader(&self) -> Option<usize> {
        self.members.iter().position(|m| {
            m.child.is_some() && m.four("srvr").is_some_and(|r| r.contains("Mode: leader"))
        })
    }
}

/// The ZooKeeper this test binary's tests share: started by the first test that asks,
/// and killed (its files removed) when the binary exits. Tests keep apart by namespace.
pub fn shared() -> &'static ZkServer {
    static SERVER: OnceLock<ZkServer> = OnceLock::new();
    SERVER.get_or_init(|| {
        let mut server = ZkServer::start();
        server.reap_at_exit();
        server
    })
}

/// A namespace no other test uses.
pub fn fresh_namespace() -> String {
    format!("test-{}", uuid::Uuid::new_v4().simple())
}

/// A builder for the ZooKeeper at `hosts`, with a connect timeout that only catches hangs
/// (a loaded machine).
pub fn builder_on(hosts: &str) -> tower_lock::ZooKeeperBackendBuilder {
    tower_lock::ZooKeeperBackend::builder(hosts).connect_timeout(Duration::from_secs(10))
}

/// A backend on [`shared`] in `namespace`: several of them are instances of one service.
pub async fn backend_in(namespace: &str) -> tower_lock::ZooKeeperBackend {
    builder_on(&shared().hosts())
        .namespace(namespace)
        .build()
        .await
        .expect("backend connects to the test ZooKeeper")
}

/// A backend on [`shared`] in its own namespace.
pub async fn backend() -> tower_lock::ZooKeeperBackend {
    backend_in(&fresh_namespace()).await
}

/// The ZooKeeper arm of [`for_each_store!`](crate::for_each_store): `on_zookeeper::NAME`
/// runs a body `async fn NAME<B: LockBackend>(b: [B; 3])` with three backends (three
/// sessions: three processes, as far as the locks can tell) of [`shared`], in a namespace
/// of the test's own.
#[macro_export]
macro_rules! on_zookeeper_stores {
    ($($name:ident),* $(,)?) => {
        $crate::on_three_backends_of!(on_zookeeper, zookeeper, ZooKeeper; $($name),*);
    };
}

/// A ZooKeeper client of the test's own (a session apart from every backend's), on
/// [`shared`].
pub async fn admin() -> zookeeper_client::Client {
    zookeeper_client::Client::connect(&shared().hosts())
        .await
        .expect("the test's ZooKeeper client connects")
}

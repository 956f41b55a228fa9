//! Test hosts built from network namespaces and veth pairs (`ip netns`, `ip link`), so a
//! test can cut the network between two processes of one machine.
//!
//! Every host is a namespace with an uplink to the test's own (root) namespace: the test
//! reaches each host there, and each host reaches services the test runs. `link` adds a
//! direct link between two hosts, which `partition` sets down and `heal` up again. Names
//! carry the test's pid and a generation ([`generation`]); namespaces of dead pids are
//! deleted at start, ours on drop (also after a panic).

use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use std::io::{Read, Write};

/// Every namespace and interface name of these tests starts with this.
const PREFIX: &str = "tlj";

/// Hosts (network namespaces) of one test, deleted on drop.
pub struct Net {
    tag: String,
    /// Second octet of every address: 10.OCTET.LINK.{1,2}/30.
    octet: u8,
    hosts: Vec<String>,
    links: Vec<Link>,
    /// The hosts on the switch ([`lan`](Self::lan)), in the order of their addresses.
    lan: Vec<String>,
    // Released after `Drop::drop` has deleted the hosts (fields drop after it).
    _turn: Turn,
}

/// One [`Net`] at a time in a process: two sets of hosts built at once could both take the
/// address range found free ([`free_octet`]), and the tests that build them measure
/// margins that a second workload on the same cores would skew. A test waits here for the
/// one before.
struct Turn;

static TURN: (Mutex<bool>, Condvar) = (Mutex::new(false), Condvar::new());

impl Turn {
    fn take() -> Turn {
        let (taken, freed) = &TURN;
        let mut taken = taken.lock().unwrap_or_else(|e| e.into_inner());
        while *taken {
            taken = freed.wait(taken).unwrap_or_else(|e| e.into_inner());
        }
        *taken = true;
        Turn
    }
}

impl Drop for Turn {
    fn drop(&mut self) {
        let (taken, freed) = &TURN;
        *taken.lock().unwrap_or_else(|e| e.into_inner()) = false;
        freed.notify_one();
    }
}

/// A veth pair. `a` is `None` for the root end of an uplink.
struct Link {
    a: Option<String>,
    b: String,
    if_a: String,
    if_b: String,
    ip_a: Ipv4Addr,
    ip_b: Ipv4Addr,
}

impl Net {
    /// Whether this process may build hosts: root, with iproute2's `ip netns`. A test
    /// that gets `false` must say it skipped (see [`skip`]), never pass silently.
    pub fn available() -> bool {
        let root = Command::new("id")
            .arg("-u")
            .output()
            .is_ok_and(|out| String::from_utf8_lossy(&out.stdout).trim() == "0");
        root && run_ok(Command::new("ip").args(["netns", "list"]))
    }

    /// One namespace per name in `hosts`, each with an uplink to the root namespace.
    pub fn new(hosts: &[&str]) -> Net {
        let turn = Turn::take();
        delete_stale();
        let pid = std::process::id();
        let mut net = Net {
            tag: format!("{PREFIX}{pid}g{}", generation()),
            octet: free_octet(pid),
            hosts: Vec::new(),
            links: Vec::new(),
            lan: Vec::new(),
            _turn: turn,
        };
        for host in hosts {
            let ns = net.ns(host);
            ip(&["netns", "add", &ns]);
            net.hosts.push((*host).to_owned());
            ip(&["-n", &ns, "link", "set", "lo", "up"]);
            net.add_link(None, host);
        }
        net
    }

    /// A direct link between hosts `a` and `b` (which [`partition`](Self::partition) cuts).
    pub fn link(&mut self, a: &str, b: &str) {
        self.add_link(Some(a), b);
    }

    fn add_link(&mut self, a: Option<&str>, b: &str) {
        let n = self.links.len();
        let index = u8::try_from(n).expect("at most 255 links");
        let (if_a, if_b) = match a {
            // The root end lives among the machine's own interfaces: unique by our tag.
            None => (format!("{}u{n}", self.tag), "uplink".to_owned()),
            Some(_) => (format!("l{n}"), format!("l{n}")),
        };
        let ip_a = Ipv4Addr::new(10, self.octet, index, 1);
        let ip_b = Ipv4Addr::new(10, self.octet, index, 2);
        let ns_b = self.ns(b);
        let mut add = vec!["link", "add", &if_a, "type", "veth", "peer", "name", &if_b];
        add.extend(["netns", &ns_b]);
        ip(&in_ns(a.map(|a| self.ns(a)).as_deref(), &add));
        for (ns, dev, addr) in [
            (a.map(|a| self.ns(a)), &if_a, ip_a),
            (Some(ns_b.clone()), &if_b, ip_b),
        ] {
            let addr = format!("{addr}/30");
            ip(&in_ns(ns.as_deref(), &["addr", "add", &addr, "dev", dev]));
            ip(&in_ns(ns.as_deref(), &["link", "set", dev, "up"]));
        }
        self.links.push(Link {
            a: a.map(str::to_owned),
            b: b.to_owned(),
            if_a,
            if_b,
            ip_a,
            ip_b,
        });
    }

    /// A switch (a bridge in a namespace of its own) that each of `hosts` plugs into: each
    /// reaches every other at its [`lan_ip`](Self::lan_ip), as the members of a cluster and
    /// their clients reach each other on one network. [`blackhole`](Self::blackhole) drops
    /// what two of them send each other.
    pub fn lan(&mut self, hosts: &[&str]) {
        const SWITCH: &str = "lan";
        let switch = self.ns(SWITCH);
        ip(&["netns", "add", &switch]);
        self.hosts.push(SWITCH.to_owned());
        ip(&["-n", &switch, "link", "set", "lo", "up"]);
        ip(&["-n", &switch, "link", "add", "br0", "type", "bridge"]);
        ip(&["-n", &switch, "link", "set", "br0", "up"]);
        for host in hosts {
            let port = format!("p{}", self.lan.len());
            self.lan.push((*host).to_owned());
            let ns = self.ns(host);
            let add = ["link", "add", &port, "type", "veth", "peer", "name", "lan"];
            ip(&in_ns(
                Some(&switch),
                &[&add[..], &["netns", ns.as_str()]].concat(),
            ));
            ip(&["-n", &switch, "link", "set", &port, "master", "br0", "up"]);
            let addr = format!("{}/24", self.lan_ip(host));
            ip(&["-n", &ns, "addr", "add", &addr, "dev", "lan"]);
            ip(&["-n", &ns, "link", "set", "lan", "up"]);
        }
    }

    /// The address of `host` on the switch ([`lan`](Self::lan)).
    pub fn lan_ip(&self, host: &str) -> Ipv4Addr {
        let at = self.lan.iter().position(|h| h == host);
        let at = at.unwrap_or_else(|| panic!("{host} is not on the switch"));
        Ipv4Addr::new(
            10,
            self.octet,
            255,
            u8::try_from(at + 1).expect("254 hosts"),
        )
    }

    /// Where a server on `host` runs (its namespace) and is reached (on the switch, and by
    /// the test on the uplink), for the throwaway servers' `start_in`.
    pub fn server_host(&self, host: &str) -> super::process::NetHost {
        super::process::NetHost {
            netns: self.ns(host),
            lan: self.lan_ip(host),
            uplink: self.host_ip(host),
        }
    }

    /// Drops every packet that `a` and `b` send each other on the switch (a route to a
    /// blackhole on each side): connections stay open and their packets go nowhere, as
    /// across a partition, until [`unblackhole`](Self::unblackhole).
    pub fn blackhole(&self, a: &str, b: &str) {
        for (from, to) in [(a, b), (b, a)] {
            let to = format!("{}/32", self.lan_ip(to));
            ip(&["-n", &self.ns(from), "route", "add", "blackhole", &to]);
        }
    }

    /// Ends a [`blackhole`](Self::blackhole).
    pub fn unblackhole(&self, a: &str, b: &str) {
        for (from, to) in [(a, b), (b, a)] {
            let to = format!("{}/32", self.lan_ip(to));
            ip(&["-n", &self.ns(from), "route", "del", "blackhole", &to]);
        }
    }

    /// The namespace name of `host`.
    pub fn ns(&self, host: &str) -> String {
        format!("{}-{host}", self.tag)
    }

    /// The address of `host` on its uplink: where the test reaches it.
    pub fn host_ip(&self, host: &str) -> Ipv4Addr {
        self.find(None, host).ip_b
    }

    /// The root end of `host`'s uplink: where `host` reaches what the test serves (bind
    /// test services to it).
    pub fn root_ip(&self, host: &str) -> Ipv4Addr {
        self.find(None, host).ip_a
    }

    /// The address `from` dials to reach `to` over their direct link.
    pub fn link_ip(&self, from: &str, to: &str) -> Ipv4Addr {
        let link = self.direct(from, to);
        if link.b == to { link.ip_b } else { link.ip_a }
    }

    /// Cuts the direct link between `a` and `b`: both ends down, packets go nowhere.
    pub fn partition(&self, a: &str, b: &str) {
        self.set_link(a, b, "down");
    }

    /// Sets the link cut by [`partition`](Self::partition) up again.
    pub fn heal(&self, a: &str, b: &str) {
        self.set_link(a, b, "up");
    }

    /// Cuts `host` off from the network: its end of its uplink goes down, so what it sends
    /// goes nowhere and nothing reaches it, while the root end (and every service the test
    /// binds there) stays up for the test. For good: the host's routes go with the link.
    pub fn isolate(&self, host: &str) {
        let uplink = self.find(None, host);
        ip(&in_ns(
            Some(&self.ns(host)),
            &["link", "set", &uplink.if_b, "down"],
        ));
    }

    fn set_link(&self, a: &str, b: &str, state: &str) {
        let link = self.direct(a, b);
        let a_ns = link.a.as_ref().map(|a| self.ns(a));
        ip(&in_ns(a_ns.as_deref(), &["link", "set", &link.if_a, state]));
        ip(&in_ns(
            Some(&self.ns(&link.b)),
            &["link", "set", &link.if_b, state],
        ));
    }

    fn find(&self, a: Option<&str>, b: &str) -> &Link {
        self.links
            .iter()
            .find(|l| l.a.as_deref() == a && l.b == b)
            .unwrap_or_else(|| panic!("no link {a:?} - {b}"))
    }

    fn direct(&self, a: &str, b: &str) -> &Link {
        self.links
            .iter()
            .find(|l| {
                let ends = (l.a.as_deref(), l.b.as_str());
                ends == (Some(a), b) || ends == (Some(b), a)
            })
            .unwrap_or_else(|| panic!("no link between {a} and {b}"))
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        // Deleting a namespace deletes its veths, and so their peers.
        for host in &self.hosts {
            let _ = run_ok(Command::new("ip").args(["netns", "del", &self.ns(host)]));
        }
    }
}

/// The wall clock in microseconds since the epoch: the clock a test and the children it
/// runs on other hosts of one machine share.
pub fn now_micros() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
}

/// A holder process on a host of its own (`app`) whose only way to its store is a
/// forwarder on the root end of the host's uplink: the test cuts it off with [`cut`].
///
/// [`cut`]: CutOffHolder::cut
pub struct CutOffHolder {
    // The child goes before the hosts and the forwarder.
    child: super::child::ChildProcess,
    /// The grant's fencing token the child reported (`held N`).
    pub token: u64,
    _proxy: super::proxy::FaultProxy,
    net: Net,
}

impl CutOffHolder {
    /// Starts the host and the forwarder to `store`, then the child `spawn` starts in the
    /// host's namespace, given the forwarder's address; waits for its `held N`.
    pub async fn start(
        store: SocketAddr,
        spawn: impl FnOnce(&str, SocketAddr) -> super::child::ChildProcess,
    ) -> Self {
        let net = Net::new(&["app"]);
        let proxy =
            super::proxy::FaultProxy::start(SocketAddr::from((net.root_ip("app"), 0)), store).await;
        let mut child = spawn(&net.ns("app"), proxy.addr());
        let token = child.next_number("held").await;
        CutOffHolder {
            child,
            token,
            _proxy: proxy,
            net,
        }
    }

    /// Cuts the host off, and returns when the child says its hold was lost (`lost T`,
    /// [`now_micros`] in the child).
    pub async fn cut(&mut self) -> u64 {
        self.net.isolate("app");
        self.child.next_number("lost").await
    }
}

/// Prints how long before the store freed a partitioned holder's lock (seen at `freed`)
/// the holder stopped (its `lost()` at `lost`), and checks that it stopped first.
pub fn report_margin(store: &str, lost: u64, freed: u64) {
    let margin = freed as i64 - lost as i64;
    println!(
        "{store}: the partitioned holder stopped {:.1} ms before the store freed its lock",
        margin as f64 / 1000.0
    );
    assert!(
        lost < freed,
        "{store}: the holder stopped {} µs after the store freed its lock",
        -margin
    );
}

/// Prints why a test that needs hosts did not run (visible with `--nocapture`, and on
/// stderr), for a test to return after.
pub fn skip(test: &str) {
    println!("{test}: skipped: needs root and iproute2");
    eprintln!("{test}: skipped: needs root and iproute2");
}

/// `ip` with `args` inside `ns` (the root namespace for `None`).
fn in_ns<'a>(ns: Option<&'a str>, args: &[&'a str]) -> Vec<&'a str> {
    let mut all = Vec::new();
    if let Some(ns) = ns {
        all.extend(["-n", ns]);
    }
    all.extend_from_slice(args);
    all
}

/// Runs `ip` with `args` (`-n NS` first to run it inside a host); panics if it fails.
pub fn ip(args: &[&str]) {
    let out = Command::new("ip")
        .args(args)
        .output()
        .expect("ip (iproute2)");
    assert!(
        out.status.success(),
        "ip {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
}

fn run_ok(command: &mut Command) -> bool {
    command
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// A character that tells this process's sets of hosts apart: the kernel deletes a
/// namespace's interfaces after `ip netns del` returns, so the next set of hosts of this
/// process must not reuse the names of the last. (`tlj` + pid + `g` + this + `u` + link
/// stays within the 15 characters of an interface name.)
fn generation() -> char {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NETS: AtomicU32 = AtomicU32::new(0);
    let n = NETS.fetch_add(1, Ordering::Relaxed) % 36;
    char::from_digit(n, 36).unwrap_or('z')
}

/// Deletes the namespaces left by test processes that are gone (a `kill -9`ed run).
fn delete_stale() {
    let Ok(out) = Command::new("ip").args(["netns", "list"]).output() else {
        return;
    };
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let Some(name) = line.split_whitespace().next() else {
            continue;
        };
        let Some(pid) = name.strip_prefix(PREFIX).and_then(|rest| {
            let digits = rest
                .find(|c: char| !c.is_ascii_digit())
                .unwrap_or(rest.len());
            rest[..digits].parse::<u32>().ok()
        }) else {
            continue;
        };
        if !Path::new(&format!("/proc/{pid}")).exists() {
            let _ = run_ok(Command::new("ip").args(["netns", "del", name]));
        }
    }
}

/// A second octet for 10.x.0.0/16 that no address of this machine uses yet (parallel
/// runs start from different pids).
fn free_octet(pid: u32) -> u8 {
    let used = Command::new("ip")
        .args(["-4", "-o", "addr"])
        .output()
        .map(|out| String::from_utf8_lossy(&out.stdout).into_owned())
        .unwrap_or_default();
    (0..128)
        .map(|i| u8::try_from(64 + (pid + i) % 128).expect("below 192"))
        .find(|octet| !used.contains(&format!(" 10.{octet}.")))
        .expect("a free 10.x.0.0/16")
}

/// A `redis-server` in a host (or in the root namespace), killed on drop.
pub struct HostRedis {
    command: Box<dyn Fn() -> Command + Send + Sync>,
    /// Where the test reaches it.
    addr: SocketAddr,
    child: Option<Child>,
    _dir: tempfile::TempDir,
}

impl HostRedis {
    /// Starts `redis-server` on `port`, listening on `bind`, with `extra` arguments; `host`
    /// is where it runs (`None`: the root namespace), `addr` where the test reaches it.
    pub fn start(
        net: &Net,
        host: Option<&str>,
        bind: &[Ipv4Addr],
        addr: SocketAddr,
        extra: &[&str],
    ) -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let mut args: Vec<String> = vec!["--port".into(), addr.port().to_string()];
        args.push("--bind".into());
        args.extend(bind.iter().map(ToString::to_string));
        // Reached from other namespaces, without a password.
        args.extend(["--protected-mode", "no", "--save", "", "--appendonly", "no"].map(Into::into));
        args.push("--dir".into());
        args.push(dir.path().display().to_string());
        args.extend(extra.iter().map(|a| (*a).to_owned()));
        let ns = host.map(|h| net.ns(h));
        let command = move || {
            let mut command = match &ns {
                Some(ns) => {
                    let mut c = Command::new("ip");
                    c.args(["netns", "exec", ns, "redis-server"]);
                    c
                }
                None => Command::new("redis-server"),
            };
            command
                .args(&args)
                .stdout(Stdio::null())
                .stderr(Stdio::null());
            command
        };
        let mut redis = HostRedis {
            command: Box::new(command),
            addr,
            child: None,
            _dir: dir,
        };
        redis.spawn();
        redis
    }

    fn spawn(&mut self) {
        // `ip netns exec` execs the program: this pid is redis-server's own.
        self.child = Some((self.command)().spawn().expect("redis-server is installed"));
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if ping(self.addr) {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        panic!("redis-server on {} did not answer PING", self.addr);
    }

    /// Where the test reaches it.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// SIGKILL, as a crash would.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// The server's pid (for `SIGSTOP`), while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Starts again, empty, on the same address (after `kill`).
    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
    }
}

impl Drop for HostRedis {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Whether a Redis answers PING on `addr`.
fn ping(addr: SocketAddr) -> bool {
    let Ok(mut stream) = TcpStream::connect_timeout(&addr, Duration::from_millis(200)) else {
        return false;
    };
    let _ = stream.set_read_timeout(Some(Duration::from_millis(200)));
    let mut reply = [0u8; 7];
    stream.write_all(b"PING\r\n").is_ok()
        && stream.read_exact(&mut reply).is_ok()
        && &reply == b"+PONG\r\n"
}

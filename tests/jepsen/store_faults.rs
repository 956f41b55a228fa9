//! The faults of the stores workload (`stores.rs`) and the servers they hit: each store's
//! deployment says how its servers are reached, killed, restarted and paused, which of
//! them leads, and which faults it is put through.

use std::time::Duration;

use support::netns::Net;

use super::*;

/// One fault, healed before the next.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(super) enum Fault {
    /// The leader (the server, of a store of one) killed with `kill -9`, started again
    /// on its data after 0.5-2 s.
    KillLeader,
    /// A follower killed and started again the same way.
    KillFollower,
    /// The leader (the server) paused with `SIGSTOP` for 1.5-3 s: past etcd's election
    /// timeout (1 s) and ZooKeeper's tick-based one.
    PauseLeader,
    /// The leader cut off from the other servers (blackhole routes both ways) for 2-4 s,
    /// while the instances still reach it.
    IsolateLeader,
    /// An instance cut off from every server for 0.5-2 leases (the first fault: 2) while
    /// it holds a probe, and another instance asking for the probe's lock meanwhile.
    CutInstance,
    /// An instance frozen (`SIGSTOP`) for 0.1-0.5 leases: its renewals recover.
    Freeze,
    /// An instance frozen while it holds a probe, until another instance holds the probe's
    /// lock (the store freed it): fencing's case, its write must be refused.
    FreezePastLease,
    /// The instances' wake connections (PostgreSQL's `LISTEN`, MySQL's parked connection)
    /// ended by the server while their pools stay.
    CutWake,
    /// A minority of the quorum's masters (two of five) killed with `kill -9`, started
    /// again after 1-3 s: empty, as the masters keep nothing on disk.
    KillMinority,
    /// A minority of the quorum's masters cut off from every instance (blackhole routes)
    /// for 2-4 s.
    CutMinority,
    /// One of the quorum's masters killed and started again at once, empty: the holds it
    /// kept are forgotten.
    RestartEmpty,
    /// A probe's hold that only three of the quorum's five masters have (its instance was
    /// cut off from the other two as it took it), another instance asking for its lock,
    /// then one of the three restarted empty: the three free masters make a majority, but
    /// the restarted one's guard grants nothing until the probe, left on two, has stopped.
    RestartUnderHold,
}

impl Fault {
    /// Whether a store of `servers` servers survives the fault: then it must cost no
    /// request.
    pub(super) fn survived(self, servers: usize) -> bool {
        servers >= 3
            && matches!(
                self,
                Fault::KillLeader
                    | Fault::KillFollower
                    | Fault::PauseLeader
                    | Fault::IsolateLeader
                    | Fault::KillMinority
                    | Fault::CutMinority
                    | Fault::RestartEmpty
            )
    }

    /// Whether the fault holds a probe (whose key's other requests queue behind it).
    pub(super) fn probes(self) -> bool {
        matches!(
            self,
            Fault::CutInstance | Fault::FreezePastLease | Fault::RestartUnderHold
        )
    }
}

/// The faults of a store of three (or five) servers.
pub(super) const CLUSTER_FAULTS: [Fault; 7] = [
    Fault::KillLeader,
    Fault::KillFollower,
    Fault::PauseLeader,
    Fault::IsolateLeader,
    Fault::CutInstance,
    Fault::Freeze,
    Fault::FreezePastLease,
];

/// The faults of a store of one server.
pub(super) const SERVER_FAULTS: [Fault; 6] = [
    Fault::KillLeader,
    Fault::PauseLeader,
    Fault::CutInstance,
    Fault::Freeze,
    Fault::FreezePastLease,
    Fault::CutWake,
];

/// The faults of the quorum's five masters.
pub(super) const QUORUM_FAULTS: [Fault; 7] = [
    Fault::KillMinority,
    Fault::CutMinority,
    Fault::RestartEmpty,
    Fault::RestartUnderHold,
    Fault::CutInstance,
    Fault::Freeze,
    Fault::FreezePastLease,
];

/// The servers of one store, each on a host of its own.
pub(super) trait Servers {
    /// The app's store setting (`JEPSEN_TOPOLOGY`), and the store's name in the summary.
    fn store(&self) -> &'static str;
    /// The hosts of the servers.
    fn hosts(&self) -> &[&'static str];
    /// The URL the instances are given: the servers on the switch.
    fn url(&self) -> String;
    /// The server that leads now, if one does (the only server of a store of one).
    fn leader(&self) -> Option<usize> {
        (self.hosts().len() == 1).then_some(0)
    }
    /// `kill -9`; returns once it is gone.
    fn kill(&mut self, server: usize);
    /// Starts a killed server again on its data; returns once it serves.
    fn start_again(&mut self, server: usize);
    /// The processes that pausing `server` stops.
    fn pids(&self, server: usize) -> Vec<u32>;
    /// The faults drawn from: a store of one server's, or of several.
    fn faults(&self) -> &'static [Fault] {
        if self.hosts().len() == 1 {
            &SERVER_FAULTS
        } else {
            &CLUSTER_FAULTS
        }
    }
    /// Whether the servers elect a leader, whose failure confirms nothing until the next
    /// one is in (etcd, ZooKeeper; not one server, nor a quorum of independent masters).
    fn elects(&self) -> bool {
        self.hosts().len() > 1
    }
    /// Whether the faults the store survives ([`Fault::survived`]) must cost no request:
    /// the run fails if one was answered otherwise than 200. On servers that elect (etcd,
    /// ZooKeeper), whose calls wait an election out.
    fn serves_through_survived_faults(&self) -> bool {
        self.elects()
    }
    /// The instances' lease on this store: [`LEASE`], or 8 s on servers that elect: a
    /// hold lives half its etcd lease or ZooKeeper session past its last confirmation,
    /// and a leader's failure confirms nothing until the next leader is in: the fault
    /// (a pause of up to 3 s), the election after it (one to two seconds with etcd's
    /// defaults, ZooKeeper's at 250 ms ticks) and the client's move to another server. A
    /// 6 s lease (3 s for a hold) lost a hold to a leader paused for 2.5 s in a 300 s run.
    fn lease(&self) -> Duration {
        if self.elects() {
            Duration::from_secs(8)
        } else {
            LEASE
        }
    }
    /// How long the instances' requests wait: [`WAIT`], or on servers that elect the
    /// layer's default, which an election and the releases and wake-ups it held up fit in.
    fn wait(&self) -> Duration {
        if self.elects() {
            tower_lock::layer::DEFAULT_WAIT
        } else {
            WAIT
        }
    }
    /// What the servers logged (printed when `JEPSEN_SERVER_LOGS` is set).
    fn logs(&self) -> String;
    /// Ends the instances' wake connections (for [`Fault::CutWake`]); how many.
    fn cut_wake(&self) -> usize {
        0
    }
}

/// Runs `f` to its end from the nemesis's (synchronous) fault calls.
fn blocking<F: std::future::Future>(f: F) -> F::Output {
    tokio::task::block_in_place(|| tokio::runtime::Handle::current().block_on(f))
}

/// A PostgreSQL server.
pub(super) struct Postgres {
    server: support::postgres::PostgresServer,
}

impl Postgres {
    pub(super) const HOSTS: [&'static str; 1] = ["pg"];

    pub(super) fn start(net: &Net) -> Self {
        Postgres {
            server: support::postgres::PostgresServer::start_in(net.server_host(Self::HOSTS[0])),
        }
    }
}

impl Servers for Postgres {
    fn store(&self) -> &'static str {
        "postgres"
    }

    fn hosts(&self) -> &[&'static str] {
        &Self::HOSTS
    }

    fn url(&self) -> String {
        self.server.lan_url()
    }

    fn kill(&mut self, _: usize) {
        self.server.kill();
    }

    fn start_again(&mut self, _: usize) {
        self.server.start_again();
    }

    fn pids(&self, _: usize) -> Vec<u32> {
        self.server.pids()
    }

    fn logs(&self) -> String {
        format!("--- postgres:\n{}", self.server.log())
    }

    fn cut_wake(&self) -> usize {
        let ended = blocking(self.server.terminate("tower-lock listener"));
        usize::try_from(ended).unwrap_or(0)
    }
}

/// A MariaDB server.
pub(super) struct MariaDb {
    server: support::mariadb::MariaDbServer,
}

impl MariaDb {
    pub(super) const HOSTS: [&'static str; 1] = ["mariadb"];

    pub(super) fn start(net: &Net) -> Self {
        MariaDb {
            server: support::mariadb::MariaDbServer::start_in(net.server_host(Self::HOSTS[0])),
        }
    }
}

impl Servers for MariaDb {
    fn store(&self) -> &'static str {
        "mysql"
    }

    fn hosts(&self) -> &[&'static str] {
        &Self::HOSTS
    }

    fn url(&self) -> String {
        self.server.lan_url()
    }

    fn kill(&mut self, _: usize) {
        self.server.kill();
    }

    fn start_again(&mut self, _: usize) {
        self.server.start_again();
    }

    fn pids(&self, _: usize) -> Vec<u32> {
        self.server.pid().into_iter().collect()
    }

    fn logs(&self) -> String {
        format!("--- mariadb:\n{}", self.server.log())
    }

    fn cut_wake(&self) -> usize {
        blocking(self.server.kill_wake_connections())
    }
}

/// An etcd cluster of three members.
#[cfg(feature = "etcd")]
pub(super) struct Etcd {
    cluster: support::etcd::EtcdCluster,
}

#[cfg(feature = "etcd")]
impl Etcd {
    pub(super) const HOSTS: [&'static str; 3] = ["etcd0", "etcd1", "etcd2"];

    pub(super) fn start(net: &Net) -> Self {
        Etcd {
            cluster: support::etcd::EtcdCluster::start_in(net, &Self::HOSTS),
        }
    }
}

#[cfg(feature = "etcd")]
impl Servers for Etcd {
    fn store(&self) -> &'static str {
        "etcd"
    }

    fn hosts(&self) -> &[&'static str] {
        &Self::HOSTS
    }

    fn url(&self) -> String {
        let endpoints: Vec<String> = self
            .cluster
            .members
            .iter()
            .map(support::etcd::EtcdMember::lan_endpoint)
            .collect();
        endpoints.join(",")
    }

    fn leader(&self) -> Option<usize> {
        self.cluster.leader()
    }

    fn kill(&mut self, server: usize) {
        self.cluster.members[server].kill();
    }

    fn start_again(&mut self, server: usize) {
        self.cluster.members[server].start_again();
    }

    fn pids(&self, server: usize) -> Vec<u32> {
        self.cluster.members[server].pid().into_iter().collect()
    }

    fn logs(&self) -> String {
        let logs = self.cluster.members.iter().enumerate();
        logs.map(|(i, m)| format!("--- etcd{i}:\n{}", m.log()))
            .collect()
    }
}

/// A ZooKeeper ensemble of three servers.
pub(super) struct ZooKeeper {
    ensemble: support::zookeeper::ZkEnsemble,
}

impl ZooKeeper {
    pub(super) const HOSTS: [&'static str; 3] = ["zk0", "zk1", "zk2"];

    pub(super) fn start(net: &Net) -> Self {
        ZooKeeper {
            ensemble: support::zookeeper::ZkEnsemble::start_in(net, &Self::HOSTS),
        }
    }
}

impl Servers for ZooKeeper {
    fn store(&self) -> &'static str {
        "zookeeper"
    }

    fn hosts(&self) -> &[&'static str] {
        &Self::HOSTS
    }

    fn url(&self) -> String {
        self.ensemble.hosts()
    }

    fn leader(&self) -> Option<usize> {
        self.ensemble.leader()
    }

    fn kill(&mut self, server: usize) {
        self.ensemble.members[server].kill();
    }

    fn start_again(&mut self, server: usize) {
        self.ensemble.members[server].start_again();
    }

    fn pids(&self, server: usize) -> Vec<u32> {
        self.ensemble.members[server].pid().into_iter().collect()
    }

    /// The servers log nothing (Debian's package has no SLF4J binding): their counters
    /// (`mntr`: latencies, packets, sessions) instead.
    fn logs(&self) -> String {
        let logs = self.ensemble.members.iter().enumerate();
        logs.map(|(i, m)| {
            let mntr = m.four("mntr").unwrap_or_else(|| "(no answer)".to_owned());
            format!("--- zk{i}:\n{mntr}\n{}", m.log())
        })
        .collect()
    }
}

/// A RedLock quorum of five masters (`RedisBackend::quorum`, whose restart guard is always
/// on), which keep nothing on disk.
pub(super) struct Quorum {
    masters: Vec<support::netns::HostRedis>,
    lan: Vec<std::net::Ipv4Addr>,
}

impl Quorum {
    pub(super) const HOSTS: [&'static str; 5] = ["r0", "r1", "r2", "r3", "r4"];
    const PORT: u16 = 6379;

    pub(super) fn start(net: &Net) -> Self {
        let (masters, lan) = Self::HOSTS
            .iter()
            .map(|&host| {
                // On the switch for the instances, on the uplink for the test.
                let (lan, uplink) = (net.lan_ip(host), net.host_ip(host));
                let master = support::netns::HostRedis::start(
                    net,
                    Some(host),
                    &[lan, uplink],
                    std::net::SocketAddr::from((uplink, Self::PORT)),
                    &["--hz", "100"],
                );
                (master, lan)
            })
            .unzip();
        Quorum { masters, lan }
    }
}

impl Servers for Quorum {
    fn store(&self) -> &'static str {
        "quorum"
    }

    fn hosts(&self) -> &[&'static str] {
        &Self::HOSTS
    }

    fn url(&self) -> String {
        let urls: Vec<String> = (self.lan.iter())
            .map(|ip| format!("redis://{ip}:{}", Self::PORT))
            .collect();
        urls.join(",")
    }

    fn kill(&mut self, server: usize) {
        self.masters[server].kill();
    }

    fn start_again(&mut self, server: usize) {
        self.masters[server].restart();
    }

    fn pids(&self, server: usize) -> Vec<u32> {
        self.masters[server].pid().into_iter().collect()
    }

    fn faults(&self) -> &'static [Fault] {
        &QUORUM_FAULTS
    }

    /// No election holds a confirmation up: a hold lives on while a majority renews it.
    fn elects(&self) -> bool {
        false
    }

    /// The masters log nothing (their log goes nowhere): their `INFO` would say little
    /// that the summary does not.
    fn logs(&self) -> String {
        String::new()
    }
}

/// When a fault began and ended (µs), to count the requests sent meanwhile.
#[derive(Debug, Clone, Copy)]
pub(super) struct Window {
    pub(super) fault: Fault,
    pub(super) began: u64,
    pub(super) ended: u64,
}

/// A probe held while its instance was cut off (or frozen).
#[derive(Debug, Clone)]
pub(super) struct CutOff {
    pub(super) fault: Fault,
    pub(super) probe: (usize, String, u64),
}

/// An instance frozen past its lease, from when to when (µs).
#[derive(Debug, Clone, Copy)]
pub(super) struct Frozen {
    pub(super) instance: usize,
    pub(super) began: u64,
    pub(super) ended: u64,
}

/// What the nemesis did.
#[derive(Default)]
pub(super) struct Faults {
    pub(super) windows: Vec<Window>,
    pub(super) cut_offs: Vec<CutOff>,
    pub(super) frozen: Vec<Frozen>,
}

/// Injects faults one at a time, in random order from the store's list (each kind once
/// before any twice), until `deadline`; the first cuts an instance off for two leases, so
/// that every run sees a holder stopped.
pub(super) async fn run_nemesis(
    servers: &mut dyn Servers,
    net: &Net,
    addrs: &[SocketAddr],
    pids: &[u32],
    log: &SharedLog,
    deadline: tokio::time::Instant,
) -> Faults {
    let mut done = Faults::default();
    let between = |range: std::ops::Range<u64>| Duration::from_millis(fastrand::u64(range));
    let the_lease = servers.lease();
    let lease = |factor: f64| the_lease.mul_f64(factor);
    let probe_hold = scaled(PROBE_HOLD, the_lease);
    // Dealt from a shuffled deck of the store's faults, every kind once per deck.
    let mut deck = Vec::new();
    while tokio::time::Instant::now() < deadline {
        // Time for the store to settle after the last fault (a new leader's first round).
        tokio::time::sleep(between(1000..2000)).await;
        let first = done.cut_offs.is_empty();
        if deck.is_empty() {
            deck = chosen(servers.faults());
            fastrand::shuffle(&mut deck);
        }
        let fault = if first {
            Fault::CutInstance
        } else {
            deck.pop().expect("a full deck")
        };
        let began = now_micros();
        if std::env::var_os("JEPSEN_LOG").is_some() {
            let leader = tokio::task::block_in_place(|| servers.leader());
            eprintln!(
                "nemesis: {fault:?} at {} (UTC), leader {leader:?}",
                clock(began)
            );
        }
        match fault {
            Fault::KillLeader | Fault::KillFollower => {
                let Some(server) = pick(servers, fault == Fault::KillLeader) else {
                    continue;
                };
                servers.kill(server);
                tokio::time::sleep(between(500..2000)).await;
                tokio::task::block_in_place(|| servers.start_again(server));
            }
            Fault::PauseLeader => {
                let Some(server) = servers.leader() else {
                    continue;
                };
                // PostgreSQL's backends come and go (a wake connection ended, a client
                // gone): one that exited meanwhile is passed over.
                let pids = servers.pids(server);
                let signal_all = |signal| {
                    for &pid in &pids {
                        support::process::signal(pid, signal);
                    }
                };
                signal_all("-STOP");
                tokio::time::sleep(between(1500..3000)).await;
                signal_all("-CONT");
            }
            Fault::IsolateLeader => {
                let Some(server) = servers.leader() else {
                    continue;
                };
                let hosts = servers.hosts().to_vec();
                let (leader, others) =
                    (hosts[server], hosts.iter().filter(|h| **h != hosts[server]));
                let others: Vec<&str> = others.copied().collect();
                others.iter().for_each(|other| net.blackhole(leader, other));
                tokio::time::sleep(between(2000..4000)).await;
                others
                    .iter()
                    .for_each(|other| net.unblackhole(leader, other));
            }
            Fault::CutInstance => {
                let instance = fastrand::usize(..INSTANCES.len());
                let Some(probe) = start_probe(addrs, instance, log).await else {
                    continue;
                };
                let host = INSTANCES[instance];
                let hosts = servers.hosts().to_vec();
                hosts.iter().for_each(|server| net.blackhole(host, server));
                ask_for(addrs, instance, &probe, the_lease);
                let cut_for = lease(if first {
                    2.0
                } else {
                    0.5 + 1.5 * fastrand::f64()
                });
                tokio::time::sleep(cut_for).await;
                hosts
                    .iter()
                    .for_each(|server| net.unblackhole(host, server));
                done.cut_offs.push(CutOff { fault, probe });
                // The probe's end, before the next fault.
                tokio::time::sleep(probe_hold.saturating_sub(cut_for)).await;
            }
            Fault::KillMinority => {
                let minority = minority(servers);
                minority.iter().for_each(|&server| servers.kill(server));
                tokio::time::sleep(between(1000..3000)).await;
                for &server in &minority {
                    tokio::task::block_in_place(|| servers.start_again(server));
                }
            }
            Fault::CutMinority => {
                let hosts = servers.hosts().to_vec();
                let cut: Vec<&str> = minority(servers).iter().map(|&m| hosts[m]).collect();
                let links = || {
                    INSTANCES
                        .iter()
                        .flat_map(|i| cut.iter().map(move |m| (*i, *m)))
                };
                links().for_each(|(instance, master)| net.blackhole(instance, master));
                tokio::time::sleep(between(2000..4000)).await;
                links().for_each(|(instance, master)| net.unblackhole(instance, master));
            }
            Fault::RestartEmpty => {
                let server = fastrand::usize(..servers.hosts().len());
                servers.kill(server);
                tokio::task::block_in_place(|| servers.start_again(server));
            }
            Fault::RestartUnderHold => {
                let instance = fastrand::usize(..INSTANCES.len());
                let (host, hosts) = (INSTANCES[instance], servers.hosts().to_vec());
                // A minority cut off from the instance while it takes the probe: only the
                // others hold it.
                let cut = minority(servers);
                let holding: Vec<usize> = (0..hosts.len()).filter(|m| !cut.contains(m)).collect();
                let restarted = holding[fastrand::usize(..holding.len())];
                cut.iter().for_each(|&m| net.blackhole(host, hosts[m]));
                let probe = start_probe(addrs, instance, log).await;
                cut.iter().for_each(|&m| net.unblackhole(host, hosts[m]));
                let Some(probe) = probe else {
                    continue;
                };
                ask_for(addrs, instance, &probe, the_lease);
                // Most often the successor waits by now; one that asks after the restart
                // must be refused all the same.
                tokio::time::sleep(Duration::from_millis(100)).await;
                servers.kill(restarted);
                tokio::task::block_in_place(|| servers.start_again(restarted));
                // The probe's end, before the next fault.
                tokio::time::sleep(probe_hold).await;
            }
            Fault::CutWake => {
                servers.cut_wake();
                tokio::time::sleep(between(500..1500)).await;
            }
            Fault::Freeze => {
                let pid = pids[fastrand::usize(..pids.len())];
                support::send_signal(pid, "-STOP");
                tokio::time::sleep(lease(0.1 + 0.4 * fastrand::f64())).await;
                support::send_signal(pid, "-CONT");
            }
            Fault::FreezePastLease => {
                let instance = fastrand::usize(..INSTANCES.len());
                let Some(probe) = start_probe(addrs, instance, log).await else {
                    continue;
                };
                support::send_signal(pids[instance], "-STOP");
                let frozen = now_micros();
                ask_for(addrs, instance, &probe, the_lease);
                // Until the store gave the lock to the other instance (bounded, should it
                // not: the checker then says why).
                let until = tokio::time::Instant::now() + lease(4.0);
                while tokio::time::Instant::now() < until && !taken_over(log, &probe) {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                support::send_signal(pids[instance], "-CONT");
                done.frozen.push(Frozen {
                    instance,
                    began: frozen,
                    ended: now_micros(),
                });
                done.cut_offs.push(CutOff { fault, probe });
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
        done.windows.push(Window {
            fault,
            began,
            ended: now_micros(),
        });
    }
    done
}

/// The faults of `all` that `JEPSEN_FAULTS` names (comma-separated, as in the summary),
/// or all of them.
fn chosen(all: &[Fault]) -> Vec<Fault> {
    let Ok(names) = std::env::var("JEPSEN_FAULTS") else {
        return all.to_vec();
    };
    let names: Vec<&str> = names.split(',').map(str::trim).collect();
    let chosen: Vec<Fault> = all
        .iter()
        .copied()
        .filter(|f| names.contains(&format!("{f:?}").as_str()))
        .collect();
    assert!(!chosen.is_empty(), "JEPSEN_FAULTS names none of {all:?}");
    chosen
}

/// A minority of the servers, drawn at random.
fn minority(servers: &dyn Servers) -> Vec<usize> {
    let n = servers.hosts().len();
    let mut all: Vec<usize> = (0..n).collect();
    fastrand::shuffle(&mut all);
    all.truncate((n - 1) / 2);
    all
}

/// The leader, or a follower (`leader` false), if one leads now.
fn pick(servers: &dyn Servers, leader: bool) -> Option<usize> {
    let at = servers.leader()?;
    if leader {
        return Some(at);
    }
    let followers: Vec<usize> = (0..servers.hosts().len()).filter(|&s| s != at).collect();
    Some(followers[fastrand::usize(..followers.len())])
}

/// A probe on a random key of the namespace at `instance`, once it holds its lock.
async fn start_probe(
    addrs: &[SocketAddr],
    instance: usize,
    log: &SharedLog,
) -> Option<(usize, String, u64)> {
    let key = KEYS[fastrand::usize(..KEYS.len())];
    start_probe_on(addrs, instance, NAMESPACES[0], key, log).await
}

/// Sends the next instance after `instance` an increment of the probe's key that waits
/// for up to three leases (the successor), in the background.
fn ask_for(addrs: &[SocketAddr], instance: usize, probe: &(usize, String, u64), lease: Duration) {
    let (ns, key) = probe.1.split_once('-').expect("ns-key");
    let next = addrs[(instance + 1) % addrs.len()];
    let request = support::post_request(next, &format!("/{ns}/next/{key}"));
    tokio::spawn(async move {
        let client = support::http_client();
        let _ = tokio::time::timeout(4 * lease, support::try_send(&client, request)).await;
    });
}

/// Whether another instance has held the probe's key after the probe (with a higher
/// token).
fn taken_over(log: &SharedLog, probe: &(usize, String, u64)) -> bool {
    lock(log)
        .holds
        .iter()
        .any(|h| h.key == probe.1 && h.instance != probe.0 && h.token > probe.2)
}

//! The Sentinel nemesis: failovers of the master (killed, cut off from the sentinels,
//! restarted empty, paused past `down-after`) and faults of the instances (cut off from the
//! data nodes, frozen), one at a time, each healed (and the set whole again: a master, its
//! replica linked, every sentinel agreeing) before the next.

use std::net::Ipv4Addr;
use std::process::Command;

use support::RedisServer;
use support::sentinel::SentinelSet;

use redis::Value;
use redis::aio::MultiplexedConnection;
use tokio_util::sync::CancellationToken;

use super::nemesis::{CutOff, Expiry, SharedLog, lock, start_probe};
use super::*;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(super) enum Fault {
    /// An instance's routes to the data nodes and the sentinels dropped; the database of
    /// registers stays reachable.
    Partition,
    /// An instance frozen for 0.1-0.5 leases.
    Sigstop,
    /// The master SIGKILLed while its replica lags (frozen for 0.2-0.8 s); once the
    /// sentinels promote the replica, the old master comes back empty (no persistence) as
    /// the new one's replica.
    KillMaster,
    /// The sentinels locked out of the master while the instances still reach it: they
    /// promote the replica, and the old master takes writes for 0.5-2 s more (the
    /// instances still on it), until it is made the new one's replica and loses them.
    CutMaster,
    /// The master SIGKILLed and started again at once, empty, with `down-after` raised
    /// meanwhile: no failover; the replica resyncs from it and is emptied too.
    RestartMaster,
    /// The master SIGSTOPped until the sentinels promote the replica (past `down-after`),
    /// then resumed: it answers as a master, with its data, for 0.3-1.5 s until it is made
    /// the new one's replica.
    PauseMaster,
}

/// Every kind once: the order of the first faults of a run (so that each kind is seen in
/// the default run), and of the summary.
pub(super) const KINDS: [Fault; 6] = [
    Fault::Partition,
    Fault::Sigstop,
    Fault::KillMaster,
    Fault::PauseMaster,
    Fault::CutMaster,
    Fault::RestartMaster,
];

/// The sentinels' `down-after-milliseconds` (tests/support/sentinel.rs).
const DOWN_AFTER: Duration = Duration::from_secs(1);

/// When a fault began and when it was healed (µs).
pub(super) struct Window {
    pub(super) fault: Fault,
    pub(super) began: u64,
    pub(super) ended: u64,
}

/// What the nemesis acts on.
pub(super) struct Deployment {
    pub(super) net: Net,
    pub(super) set: SentinelSet,
    /// The address in the test's namespace where the data nodes and the sentinels listen.
    pub(super) data_ip: Ipv4Addr,
    pub(super) pids: Vec<u32>,
}

impl Deployment {
    /// Routes `host`'s traffic to the data nodes and the sentinels over its uplink.
    pub(super) fn reach(&self, host: &str) {
        let via = self.net.root_ip(host).to_string();
        self.route(host, &["via", &via]);
    }

    /// Drops what `host` sends to the data nodes and the sentinels.
    fn cut(&self, host: &str) {
        self.route(host, &["blackhole"]);
    }

    fn route(&self, host: &str, how: &[&str]) {
        let ns = self.net.ns(host);
        let to = format!("{}/32", self.data_ip);
        let mut args = vec!["-n", &ns, "route", "replace"];
        match how {
            ["blackhole"] => args.extend(["blackhole", &to]),
            _ => {
                args.push(&to);
                args.extend(how);
            }
        }
        let status = Command::new("ip").args(&args).status().expect("ip");
        assert!(status.success(), "ip {}", args.join(" "));
    }
}

/// Injects faults one at a time until `deadline`, and at least one of every kind: first
/// every kind once, then at random.
/// Each but a frozen instance is aimed at a probe (a long hold of a random instance),
/// whose lock's expiry on the master is watched until the fault is healed.
pub(super) async fn run(
    deployment: &mut Deployment,
    addrs: &[SocketAddr],
    log: &SharedLog,
    deadline: tokio::time::Instant,
) -> (Vec<Window>, Vec<CutOff<Fault>>) {
    let nodes: Vec<String> = deployment
        .set
        .servers()
        .iter()
        .map(|s| format!("redis://:{MASTER_PASSWORD}@127.0.0.1:{}", s.port()))
        .collect();
    let mut windows = Vec::new();
    let mut cut_offs = Vec::new();
    let lease = |factor: f64| LEASE.mul_f64(factor);
    while tokio::time::Instant::now() < deadline || windows.len() < KINDS.len() {
        tokio::time::sleep(Duration::from_millis(fastrand::u64(200..800))).await;
        let fault = KINDS
            .get(windows.len())
            .copied()
            .unwrap_or_else(|| KINDS[fastrand::usize(..KINDS.len())]);
        let instance = fastrand::usize(..INSTANCES.len());
        let probe = match fault {
            Fault::Sigstop => None,
            _ => start_probe(addrs, instance, log).await,
        };
        let held_since = tokio::time::Instant::now();
        let watch = match &probe {
            Some(probe) => Some(Watch::start(&nodes, probe).await),
            None => None,
        };
        let began = now_micros();
        match fault {
            Fault::Partition => {
                // The first cuts a holder off for two leases, so that every run sees one
                // stopped.
                let first = !windows.iter().any(|w: &Window| w.fault == fault);
                let cut_for = lease(if first {
                    2.0
                } else {
                    0.5 + 1.5 * fastrand::f64()
                });
                deployment.cut(INSTANCES[instance]);
                tokio::time::sleep(cut_for).await;
                deployment.reach(INSTANCES[instance]);
            }
            Fault::Sigstop => {
                // Shorter than the lease minus a renewal period (see tests/jepsen/redis.rs).
                let pid = deployment.pids[instance];
                support::send_signal(pid, "-STOP");
                tokio::time::sleep(lease(0.1 + 0.4 * fastrand::f64())).await;
                support::send_signal(pid, "-CONT");
            }
            Fault::KillMaster => {
                let set = &mut deployment.set;
                // The replica frozen first: writes of the last 0.2-0.8 s are on the master
                // alone when it dies ("a" acquisitions; "s" ones wait for the replica and
                // fail).
                let master = set.master_port().await;
                let replica = set.servers().iter().find(|s| s.port() != master);
                let replica = replica
                    .and_then(RedisServer::pid)
                    .expect("the replica runs");
                support::send_signal(replica, "-STOP");
                tokio::time::sleep(Duration::from_millis(fastrand::u64(200..800))).await;
                let old = set.kill_master().await;
                support::send_signal(replica, "-CONT");
                let new = promoted(set, old).await;
                set.restart_empty(old, Some(new)).await;
                set.wait_until_ready().await;
            }
            Fault::CutMaster => {
                let set = &deployment.set;
                let old = set.cut_sentinels_off().await;
                promoted(set, old).await;
                tokio::time::sleep(Duration::from_millis(fastrand::u64(500..2000))).await;
                set.reconnect_sentinels(old).await;
            }
            Fault::RestartMaster => {
                let set = &mut deployment.set;
                // No failover, whatever the restart takes on a busy machine: one that began
                // late would demote the restarted master during a later fault.
                set.set_down_after(Duration::from_secs(60)).await;
                let port = set.kill_master().await;
                set.restart_empty(port, None).await;
                set.wait_until_ready().await;
                set.set_down_after(DOWN_AFTER).await;
            }
            Fault::PauseMaster => {
                let set = &deployment.set;
                let old = set.master_port().await;
                let pid = set.server(old).pid().expect("the master runs");
                support::send_signal(pid, "-STOP");
                promoted(set, old).await;
                support::send_signal(pid, "-CONT");
                tokio::time::sleep(Duration::from_millis(fastrand::u64(300..1500))).await;
                set.demote(old).await;
                set.wait_until_ready().await;
            }
        }
        windows.push(Window {
            fault,
            began,
            ended: now_micros(),
        });
        if let (Some(probe), Some(watch)) = (probe, watch) {
            // The probe's end (the hold and its write), before the next fault. The expiry is
            // watched until then: a probe may renew after the fault and lose its lock later
            // (a renewal that the replica, linked again, did not acknowledge in time), and its
            // margin counts from its last lease.
            let until = held_since + PROBE_HOLD + Duration::from_secs(10);
            while tokio::time::Instant::now() < until && !lock(log).probe_ends.contains_key(&probe)
            {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            let (ns, key) = probe.1.split_once('-').expect("ns-key");
            cut_offs.push(CutOff {
                fault,
                expiries: watch.stop().await,
                lock_key: lock_key(ns, key),
                probe,
                began,
            });
        }
    }
    (windows, cut_offs)
}

/// Waits until the sentinels name a master other than `old`; returns its port.
async fn promoted(set: &SentinelSet, old: u16) -> u16 {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let master = set.master_port().await;
        if master != old {
            return master;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the sentinels promote the replica"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The expiry of a probe's lock on the data nodes that answer as masters (the earliest
/// when two do: where a second holder could take it first), every 25 ms.
struct Watch {
    stop: CancellationToken,
    task: tokio::task::JoinHandle<Vec<Expiry>>,
}

impl Watch {
    /// Starts watching once the expiry has been observed (or no master answered).
    async fn start(nodes: &[String], probe: &(usize, String, u64)) -> Watch {
        let (ns, key) = probe.1.split_once('-').expect("ns-key");
        let lock_key = lock_key(ns, key);
        let mut conns: Vec<(String, Option<MultiplexedConnection>)> =
            nodes.iter().map(|url| (url.clone(), None)).collect();
        let mut expiries: Vec<Expiry> = observe(&mut conns, &lock_key).await.into_iter().collect();
        let stop = CancellationToken::new();
        let stopped = stop.clone();
        let task = tokio::spawn(async move {
            while !stopped.is_cancelled() {
                tokio::time::sleep(Duration::from_millis(25)).await;
                expiries.extend(observe(&mut conns, &lock_key).await);
            }
            expiries
        });
        Watch { stop, task }
    }

    async fn stop(self) -> Vec<Expiry> {
        self.stop.cancel();
        self.task.await.expect("watch")
    }
}

/// One round of [`Watch`]: `ROLE` and `PTTL` on every node, within 200 ms each.
async fn observe(
    conns: &mut [(String, Option<MultiplexedConnection>)],
    lock_key: &str,
) -> Option<Expiry> {
    const WITHIN: Duration = Duration::from_millis(200);
    let mut earliest: Option<Expiry> = None;
    for (url, conn) in conns.iter_mut() {
        if conn.is_none() {
            let client = redis::Client::open(url.as_str()).expect("url");
            let connected = tokio::time::timeout(WITHIN, client.get_multiplexed_async_connection());
            *conn = connected.await.ok().and_then(Result::ok);
        }
        let Some(c) = conn.as_mut() else { continue };
        let asked = now_micros();
        let mut pipe = redis::pipe();
        pipe.cmd("ROLE").cmd("PTTL").arg(lock_key);
        let reply = tokio::time::timeout(WITHIN, pipe.query_async::<(Value, i64)>(c)).await;
        let Ok(Ok((role, pttl))) = reply else {
            *conn = None;
            continue;
        };
        let master = matches!(&role, Value::Array(r) if r.first() == Some(&Value::BulkString(b"master".to_vec())));
        let expiry = Expiry::from_pttl(asked, now_micros(), pttl).filter(|_| master);
        if let Some(e) = expiry.filter(|e| earliest.is_none_or(|o| e.latest < o.latest)) {
            earliest = Some(e);
        }
    }
    earliest
}

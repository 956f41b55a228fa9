//! The Sentinel nemesis: failovers of the master (killed, cut off from the sentinels,
//! restarted empty, paused past `down-after`) and faults of the instances (cut off from the
//! data nodes, frozen), one at a time, each healed (and the set whole again: a master, its
//! replica linked, every sentinel agreeing) before the next.

use std::net::Ipv4Addr;
use std::process::Command;

use support::sentinel::SentinelSet;

use super::nemesis::{CutOff, Expiry, SharedLog, start_probe};
use super::*;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(super) enum Fault {
    /// An instance's routes to the data nodes and the sentinels dropped; the database of
    /// registers stays reachable.
    Partition,
    /// An instance frozen for 0.1-0.5 leases.
    Sigstop,
    /// The master SIGKILLed; once the sentinels promote the replica, the old master comes
    /// back empty (no persistence) as the new one's replica.
    KillMaster,
    /// The sentinels locked out of the master while the instances still reach it: they
    /// promote the replica, and the old master takes writes for 0.5-2 s more (the
    /// instances still on it), until it is made the new one's replica and loses them.
    CutMaster,
    /// The master SIGKILLed and started again at once, empty, before `down-after`: no
    /// failover; the replica resyncs from it and is emptied too.
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
    Fault::KillMaster,
    Fault::PauseMaster,
    Fault::CutMaster,
    Fault::RestartMaster,
    Fault::Sigstop,
];

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

/// Injects faults one at a time until `deadline`: first every kind once, then at random.
pub(super) async fn run(
    deployment: &mut Deployment,
    addrs: &[SocketAddr],
    log: &SharedLog,
    deadline: tokio::time::Instant,
) -> (Vec<Window>, Vec<CutOff<Fault>>) {
    let mut windows = Vec::new();
    let mut cut_offs = Vec::new();
    let lease = |factor: f64| LEASE.mul_f64(factor);
    while tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(fastrand::u64(200..800))).await;
        let fault = KINDS
            .get(windows.len())
            .copied()
            .unwrap_or_else(|| KINDS[fastrand::usize(..KINDS.len())]);
        let began = now_micros();
        match fault {
            Fault::Partition => {
                let instance = fastrand::usize(..INSTANCES.len());
                // The first cuts a holder off for two leases, so that every run sees one
                // stopped.
                let first = cut_offs.is_empty();
                let cut_for = lease(if first {
                    2.0
                } else {
                    0.5 + 1.5 * fastrand::f64()
                });
                let Some(cut_off) = partition(deployment, addrs, log, instance, cut_for).await
                else {
                    continue;
                };
                cut_offs.push(cut_off);
                // The probe's end, before the next fault.
                tokio::time::sleep(PROBE_HOLD.saturating_sub(cut_for)).await;
            }
            Fault::Sigstop => {
                // Shorter than the lease minus a renewal period (see tests/jepsen.rs).
                let pid = deployment.pids[fastrand::usize(..deployment.pids.len())];
                support::send_signal(pid, "-STOP");
                tokio::time::sleep(lease(0.1 + 0.4 * fastrand::f64())).await;
                support::send_signal(pid, "-CONT");
            }
            Fault::KillMaster => {
                let set = &mut deployment.set;
                let old = set.kill_master().await;
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
                let port = set.kill_master().await;
                set.restart_empty(port, None).await;
                set.wait_until_ready().await;
                assert_eq!(set.master_port().await, port, "no failover");
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

/// Cuts `instance` off from the data nodes and the sentinels for `cut_for` while it holds
/// a probe, watching the lock's expiry on the master; `None` if no probe got its lock.
async fn partition(
    deployment: &Deployment,
    addrs: &[SocketAddr],
    log: &SharedLog,
    instance: usize,
    cut_for: Duration,
) -> Option<CutOff<Fault>> {
    let probe = start_probe(addrs, instance, log).await?;
    let began = now_micros();
    let host = INSTANCES[instance];
    let set = &deployment.set;
    let mut master = set.data_conn(set.server(set.master_port().await)).await;
    deployment.cut(host);
    let (ns, key) = probe.1.split_once('-').expect("ns-key");
    let redis_key = lock_key(ns, key);
    let until = tokio::time::Instant::now() + cut_for;
    let mut expiries = Vec::new();
    while tokio::time::Instant::now() < until {
        let asked = now_micros();
        let pttl: Result<i64, _> = redis::cmd("PTTL")
            .arg(&redis_key)
            .query_async(&mut master)
            .await;
        if let Some(at) = pttl
            .ok()
            .and_then(|pttl| Expiry::from_pttl(asked, now_micros(), pttl))
        {
            expiries.push(at);
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    deployment.reach(host);
    Some(CutOff {
        fault: Fault::Partition,
        probe,
        lock_key: redis_key,
        began,
        expiries,
    })
}

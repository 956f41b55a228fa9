//! The cluster Jepsen test's nemesis: failover faults of the primary that serves a probe's
//! key, and faults of the instances; each (but the pause of an instance) aimed at a probe
//! that holds its lock through it. The probes' margins: the server-side expiry of their
//! lock, as read on the node that serves it after the fault, minus their stop.

use tokio_util::sync::CancellationToken;

use super::cluster_net::Deployment;
use super::*;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(super) enum ClusterFault {
    /// An instance cut from every node for 0.5-2 leases (2 the first time).
    InstancePartition,
    /// `kill -9` of the primary; 0-1.5 leases after its replica is promoted, it starts
    /// again, empty, and rejoins as the replica.
    KillPrimary,
    /// The primary frozen (`SIGSTOP`) until its replica is promoted, past
    /// `cluster-node-timeout`, then resumed: it rejoins as the replica.
    PausePrimary,
    /// The primary cut from every other node (the cluster bus and the replication link)
    /// while the instances still reach it, until its replica is promoted and 0-500 ms
    /// more: split brain.
    PartitionPrimary,
    /// `kill -9` of the primary and a restart, empty, after 0-300 ms: back before its
    /// replica is promoted, which then copies the empty data set.
    RestartEmpty,
    /// An instance frozen for 0.1-0.5 leases (renewal recovers).
    InstancePause,
}

/// Every kind, in the order of the first round (every run has each at least once); the
/// rounds after are drawn at random.
pub(super) const KINDS: [ClusterFault; 6] = [
    ClusterFault::InstancePartition,
    ClusterFault::KillPrimary,
    ClusterFault::PausePrimary,
    ClusterFault::PartitionPrimary,
    ClusterFault::RestartEmpty,
    ClusterFault::InstancePause,
];

impl ClusterFault {
    /// Whether the fault fails the primary over (or empties it): what asynchronous
    /// replication loses.
    pub(super) fn failover(self) -> bool {
        !matches!(
            self,
            ClusterFault::InstancePartition | ClusterFault::InstancePause
        )
    }
}

/// A fault, from its start until the cluster was healthy again (µs).
pub(super) struct Window {
    pub(super) kind: ClusterFault,
    /// The instance partitioned or frozen, if any.
    pub(super) instance: Option<usize>,
    /// What it hit, for the summary: the instance, or the primary and its replica.
    pub(super) target: String,
    pub(super) began: u64,
    pub(super) ended: u64,
}

/// A probe that held its lock through a fault, and its lock's expiries as observed.
pub(super) struct Cut {
    pub(super) kind: ClusterFault,
    pub(super) probe: (usize, String, u64),
    pub(super) expiries: Vec<Expiry>,
}

/// Injects faults one at a time until `deadline` (the first round in full); the cluster
/// is healthy again before each next one.
pub(super) async fn run(
    deployment: &mut Deployment,
    addrs: &[SocketAddr],
    pids: &[u32],
    log: &SharedLog,
    deadline: tokio::time::Instant,
) -> (Vec<Window>, Vec<Cut>) {
    let (mut windows, mut cuts) = (Vec::new(), Vec::new());
    let lease = |factor: f64| LEASE.mul_f64(factor);
    // A probe may not get its lock (contended): the first round is given a minute more.
    let last_chance = deadline + Duration::from_secs(60);
    loop {
        let now = tokio::time::Instant::now();
        if now >= last_chance || (windows.len() >= KINDS.len() && now >= deadline) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(fastrand::u64(200..800))).await;
        let kind = KINDS
            .get(windows.len())
            .copied()
            .unwrap_or_else(|| KINDS[fastrand::usize(..KINDS.len())]);
        let began = now_micros();
        let (target, instance);
        if kind == ClusterFault::InstancePause {
            let frozen = fastrand::usize(..pids.len());
            (target, instance) = (INSTANCES[frozen].to_owned(), Some(frozen));
            let pid = pids[frozen];
            support::send_signal(pid, "-STOP");
            tokio::time::sleep(lease(0.1 + 0.4 * fastrand::f64())).await;
            support::send_signal(pid, "-CONT");
        } else {
            // A probe in each namespace on one key (so on one shard): on the instance to
            // be cut off, or on any. A partitioned primary gets the "a" probe during the
            // split brain instead.
            let cut_off = fastrand::usize(..addrs.len());
            let key = KEYS[fastrand::usize(..KEYS.len())];
            let before: &[&str] = match kind {
                ClusterFault::PartitionPrimary => &["s"],
                _ => &NAMESPACES,
            };
            let on = (kind == ClusterFault::InstancePartition).then_some(cut_off);
            let probes = start_probes(addrs, on, before, key, log).await;
            if probes.is_empty() {
                continue;
            }
            let shard = deployment.shard_of(&lock_key(NAMESPACES[0], key)).await;
            // The node that serves the lock after the fault: the replica is promoted.
            let serving = deployment.node_addr(if kind.failover() {
                shard.replica
            } else {
                shard.primary
            });
            let stop = CancellationToken::new();
            let watch = |probe: (usize, String, u64)| {
                let (ns, key) = probe.1.split_once('-').expect("ns-key");
                let observer = observe(serving, lock_key(ns, key), stop.clone());
                (probe, tokio::spawn(observer))
            };
            let mut probes: Vec<_> = probes.into_iter().map(watch).collect();
            let primary = shard.primary;
            (target, instance) = match kind {
                ClusterFault::InstancePartition => (INSTANCES[cut_off].to_owned(), Some(cut_off)),
                _ => (format!("n{primary} (replica n{})", shard.replica), None),
            };
            match kind {
                ClusterFault::InstancePartition => {
                    let host = INSTANCES[cut_off];
                    deployment.partition_instance(host, true);
                    let first = cuts.is_empty();
                    tokio::time::sleep(lease(if first {
                        2.0
                    } else {
                        0.5 + 1.5 * fastrand::f64()
                    }))
                    .await;
                    deployment.partition_instance(host, false);
                }
                ClusterFault::KillPrimary => {
                    deployment.kill(primary);
                    deployment.wait_until_primary(shard.replica).await;
                    // Until it is back, "s" has no replica to acknowledge its renewals.
                    tokio::time::sleep(lease(1.5 * fastrand::f64())).await;
                    deployment.restart(primary);
                }
                ClusterFault::PausePrimary => {
                    deployment.signal(primary, "-STOP");
                    deployment.wait_until_primary(shard.replica).await;
                    deployment.signal(primary, "-CONT");
                }
                ClusterFault::PartitionPrimary => {
                    deployment.partition_node(primary, true);
                    // Sent at once: the old primary takes writes until it misses the other
                    // primaries for `cluster-node-timeout`.
                    let (during, ()) = tokio::join!(
                        start_probes(addrs, None, &["a"], key, log),
                        deployment.wait_until_primary(shard.replica)
                    );
                    probes.extend(during.into_iter().map(watch));
                    tokio::time::sleep(Duration::from_millis(fastrand::u64(0..500))).await;
                    deployment.partition_node(primary, false);
                }
                ClusterFault::RestartEmpty => {
                    deployment.kill(primary);
                    tokio::time::sleep(Duration::from_millis(fastrand::u64(0..300))).await;
                    deployment.restart(primary);
                }
                ClusterFault::InstancePause => unreachable!("no probe"),
            }
            for (probe, _) in &probes {
                probe_end(log, probe).await;
            }
            stop.cancel();
            for (probe, observer) in probes {
                cuts.push(Cut {
                    kind,
                    probe,
                    expiries: observer.await.expect("observer"),
                });
            }
        }
        deployment.wait_until_healthy().await;
        windows.push(Window {
            kind,
            instance,
            target,
            began,
            ended: now_micros(),
        });
    }
    (windows, cuts)
}

/// Starts a probe on `key` in each of the namespaces `nss` at once, on `instance` or each
/// on a random one; the probes that got their lock.
async fn start_probes(
    addrs: &[SocketAddr],
    instance: Option<usize>,
    nss: &[&str],
    key: &str,
    log: &SharedLog,
) -> Vec<(usize, String, u64)> {
    let starts = nss.iter().map(|ns| {
        let instance = instance.unwrap_or_else(|| fastrand::usize(..addrs.len()));
        start_probe_on(addrs, instance, ns, key, log)
    });
    futures_util::future::join_all(starts)
        .await
        .into_iter()
        .flatten()
        .collect()
}

/// Waits until the probe has reported its end (it holds for [`PROBE_HOLD`] at most).
async fn probe_end(log: &SharedLog, probe: &(usize, String, u64)) {
    let until = tokio::time::Instant::now() + PROBE_HOLD + Duration::from_secs(5);
    while !lock(log).probe_ends.contains_key(probe) && tokio::time::Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The expiry of `lock_key` on the node on `addr` every 25 ms until `stop` (a replica
/// answers with `READONLY`; a node down or frozen is skipped).
async fn observe(addr: SocketAddr, lock_key: String, stop: CancellationToken) -> Vec<Expiry> {
    let client = redis::Client::open(format!("redis://{addr}")).expect("url");
    let mut conn = None;
    let mut expiries = Vec::new();
    let limit = Duration::from_millis(200);
    while !stop.is_cancelled() {
        if conn.is_none() {
            if let Ok(Ok(mut c)) =
                tokio::time::timeout(limit, client.get_multiplexed_async_connection()).await
            {
                let readonly = redis::cmd("READONLY");
                let readonly = readonly.query_async::<()>(&mut c);
                if let Ok(Ok(())) = tokio::time::timeout(limit, readonly).await {
                    conn = Some(c);
                }
            }
        }
        if let Some(c) = conn.as_mut() {
            let asked = now_micros();
            let mut pttl = redis::cmd("PTTL");
            let pttl = pttl.arg(&lock_key).query_async::<i64>(c);
            match tokio::time::timeout(limit, pttl).await {
                Ok(Ok(pttl)) => expiries.extend(Expiry::from_pttl(asked, now_micros(), pttl)),
                _ => conn = None,
            }
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    expiries
}

/// A probe's stop before the server-side expiry of its lock.
#[derive(Debug)]
pub(super) struct ClusterMargin {
    pub(super) kind: ClusterFault,
    /// The namespace label ("s" or "a").
    pub(super) ns: String,
    /// Expiry (at the latest) minus the stop, µs; `None` when the lock was not on the
    /// serving node before the stop (lost in the failover).
    pub(super) margin: Option<i64>,
    /// Expiry at the earliest minus the stop.
    pub(super) proven: Option<i64>,
    /// The probe, and how long before its stop the expiry was read (µs).
    pub(super) probe: (usize, String, u64),
    pub(super) read_before: Option<u64>,
}

/// How long before a probe's stop its lock's expiry must have been read for the margin to
/// count (two reads' time): a renewal after an older read may have moved the expiry later
/// (those that the promoted replica ran but no replica acknowledged do), so a negative
/// margin from it proves nothing. Older reads come from an observer held up by a busy
/// machine; their margins are printed, not asserted.
pub(super) const FRESH: u64 = 50_000;

impl ClusterMargin {
    /// Whether the margin counts: the expiry was read, at most [`FRESH`] before the stop.
    pub(super) fn measured(&self) -> bool {
        self.read_before.is_some_and(|us| us <= FRESH)
    }
}

/// The margin of every probe that was stopped (not those that completed), except after a
/// restart, empty, which takes the lock with it (the restart guard waits it out).
pub(super) fn margins(cuts: &[Cut], log: &Log) -> Vec<ClusterMargin> {
    cuts.iter()
        .filter(|c| c.kind != ClusterFault::RestartEmpty)
        .filter_map(|c| {
            let &(end, completed) = log.probe_ends.get(&c.probe)?;
            if completed {
                return None;
            }
            let expiry = c.expiries.iter().rev().find(|e| e.asked < end);
            let ns = c.probe.1.split_once('-').expect("ns-key").0;
            Some(ClusterMargin {
                kind: c.kind,
                ns: ns.to_owned(),
                margin: expiry.map(|e| e.latest as i64 - end as i64),
                proven: expiry.map(|e| e.earliest as i64 - end as i64),
                probe: c.probe.clone(),
                read_before: expiry.map(|e| end - e.asked),
            })
        })
        .collect()
}

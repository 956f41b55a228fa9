//! The nemesis test's moving parts: what the children report, the load, the faults, the
//! probes cut off from Redis, and their margins.

use std::collections::HashMap;

use futures_util::StreamExt;
use support::child::ChildProcess;
use support::history::{Hold, Registers};
use support::netns::{HostRedis, Net};
use support::proxy::FaultProxy;
use tokio_util::sync::CancellationToken;
use tower_lock::redis::FencedStore;

use super::*;

// The stop-before-expiry margins.
#[path = "margins.rs"]
mod margins;
pub(super) use margins::*;

/// What the children reported, as it arrives.
#[derive(Default)]
pub(super) struct Log {
    pub(super) holds: Vec<Hold>,
    /// `(instance, key, token)` of probes that got their lock.
    pub(super) probes_held: Vec<(usize, String, u64)>,
    /// `(instance, key, token) -> (end, completed)`.
    pub(super) probe_ends: HashMap<(usize, String, u64), (u64, bool)>,
    /// `(redis key, µs)` of every `expired` keyspace event.
    pub(super) expired: Vec<(String, u64)>,
}

pub(super) type SharedLog = Arc<Mutex<Log>>;

pub(super) fn lock(log: &SharedLog) -> std::sync::MutexGuard<'_, Log> {
    log.lock().unwrap_or_else(|e| e.into_inner())
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(super) enum Fault {
    /// An instance's link to Redis down.
    Partition,
    /// The proxy forwards nothing; connections stay open.
    Stall,
    /// Every reply through the proxy is cut in the middle (its connection closed).
    CutEveryReply,
    /// The proxy delays every chunk by 20-400 ms each way (a round trip past the 500 ms
    /// command timeout or not).
    Latency,
    /// A few replies cut in the middle while the load runs.
    CutReplies,
    /// `kill -9` and a restart, empty, after 0-300 ms (both lock namespaces: with and
    /// without `.restart_guard()`).
    RedisRestart,
    /// An instance frozen for 0.1-0.5 leases.
    Sigstop,
}

/// What the nemesis draws from: the faults that cut a holder off (and measure its margin)
/// twice as often as the others.
pub(super) const FAULTS: [Fault; 10] = [
    Fault::Partition,
    Fault::Partition,
    Fault::Stall,
    Fault::Stall,
    Fault::CutEveryReply,
    Fault::CutEveryReply,
    Fault::Latency,
    Fault::CutReplies,
    Fault::RedisRestart,
    Fault::Sigstop,
];

/// Every kind once, in the order of the summary.
pub(super) const KINDS: [Fault; 7] = [
    Fault::Partition,
    Fault::Stall,
    Fault::CutEveryReply,
    Fault::Latency,
    Fault::CutReplies,
    Fault::RedisRestart,
    Fault::Sigstop,
];

/// A holder cut off from Redis (partition, stall, every reply cut) while it held `probe`;
/// `F` is the kind of fault (the topologies' binaries have their own).
pub(super) struct CutOff<F = Fault> {
    pub(super) fault: F,
    pub(super) probe: (usize, String, u64),
    pub(super) lock_key: String,
    /// When the fault began (µs).
    pub(super) began: u64,
    /// The server-side expiry as observed during the cut (see [`server_expiry`]). The last
    /// one observed before the holder stopped counts: until then the lock was its own (the
    /// checker verifies that), and later renewals of it could only have moved the expiry
    /// later.
    pub(super) expiries: Vec<Expiry>,
}

/// What the nemesis acts on.
pub(super) struct Cluster {
    pub(super) net: Net,
    pub(super) redis: HostRedis,
    pub(super) db: HostRedis,
    pub(super) proxy: FaultProxy,
    pub(super) pids: Vec<u32>,
}

/// Forwards a child's reports into the log until `stop`.
pub(super) async fn read_reports(mut app: ChildProcess, log: SharedLog, stop: CancellationToken) {
    loop {
        let report = tokio::select! {
            _ = stop.cancelled() => break,
            report = app.next_report() => report,
        };
        let Some(report) = report else { break };
        let mut log = lock(&log);
        if let Some(hold) = Hold::decode(&report) {
            log.holds.push(hold);
        } else if let Some(rest) = report.strip_prefix("probe-held ") {
            let parts: Vec<&str> = rest.split(' ').collect();
            let probe = (parts[0].parse().expect("instance"), parts[1].to_owned());
            log.probes_held
                .push((probe.0, probe.1, parts[2].parse().expect("token")));
        } else if let Some(rest) = report.strip_prefix("probe-end ") {
            let parts: Vec<&str> = rest.split(' ').collect();
            let probe = (
                parts[0].parse().expect("instance"),
                parts[1].to_owned(),
                parts[2].parse().expect("token"),
            );
            let end = (parts[3].parse().expect("end"), parts[4] == "true");
            log.probe_ends.insert(probe, end);
        } else {
            panic!("unexpected report {report:?}");
        }
    }
    app.kill().await;
}

/// Timestamps every `expired` keyspace event (reconnecting after Redis restarts).
pub(super) async fn observe_expiries(redis: SocketAddr, log: SharedLog) {
    let client = redis::Client::open(format!("redis://{redis}")).expect("url");
    loop {
        if let Ok(mut pubsub) = client.get_async_pubsub().await {
            if pubsub.subscribe("__keyevent@0__:expired").await.is_ok() {
                let mut messages = pubsub.on_message();
                while let Some(message) = messages.next().await {
                    let at = now_micros();
                    if let Ok(key) = message.get_payload::<String>() {
                        lock(&log).expired.push((key, at));
                    }
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Random guarded increments on random instances, until `deadline`.
pub(super) async fn load(
    addrs: Vec<SocketAddr>,
    deadline: tokio::time::Instant,
    statuses: Arc<Mutex<HashMap<String, usize>>>,
) {
    load_until(addrs, || tokio::time::Instant::now() >= deadline, statuses).await;
}

/// [`load`] until `done` says so (asked before each request).
pub(super) async fn load_until(
    addrs: Vec<SocketAddr>,
    done: impl Fn() -> bool,
    statuses: Arc<Mutex<HashMap<String, usize>>>,
) {
    load_recorded(addrs, done, |_, _, outcome| {
        let mut statuses = statuses.lock().unwrap_or_else(|e| e.into_inner());
        *statuses.entry(outcome).or_default() += 1;
    })
    .await;
}

/// Random guarded increments on random instances until `done` says so, each one's send
/// time (µs), instance and outcome (the status and the problem's title, `error` or
/// `timeout`) given to `record`.
pub(super) async fn load_recorded(
    addrs: Vec<SocketAddr>,
    done: impl Fn() -> bool,
    record: impl Fn(u64, usize, String),
) {
    let client = support::http_client();
    while !done() {
        let instance = fastrand::usize(..addrs.len());
        let addr = addrs[instance];
        let ns = NAMESPACES[fastrand::usize(..NAMESPACES.len())];
        let key = KEYS[fastrand::usize(..KEYS.len())];
        let request = support::post_request(addr, &format!("/{ns}/rmw/{key}"));
        let sent = now_micros();
        let outcome = match tokio::time::timeout(
            Duration::from_secs(12),
            support::try_send(&client, request),
        )
        .await
        {
            Ok(Ok(reply)) if reply.status == 200 => reply.status.to_string(),
            // A rejection, with the problem's title.
            Ok(Ok(reply)) => match serde_json::from_str::<serde_json::Value>(&reply.body) {
                Ok(problem) => format!("{} {}", reply.status, problem["title"]),
                Err(_) => reply.status.to_string(),
            },
            Ok(Err(_)) => "error".to_owned(),
            Err(_) => "timeout".to_owned(),
        };
        record(sent, instance, outcome);
    }
}

/// Injects faults one at a time, at random, until `deadline`; every fault is healed
/// before the next.
pub(super) async fn run_nemesis(
    cluster: &mut Cluster,
    addrs: &[SocketAddr],
    log: &SharedLog,
    deadline: tokio::time::Instant,
) -> (Vec<Fault>, Vec<CutOff>) {
    let observer = redis::Client::open(format!("redis://{}", cluster.redis.addr()))
        .expect("url")
        .get_multiplexed_async_connection()
        .await
        .expect("observer connects");
    let mut observer = Some(observer);
    let mut faults = Vec::new();
    let mut cut_offs = Vec::new();
    let lease = |factor: f64| LEASE.mul_f64(factor);
    while tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(fastrand::u64(200..800))).await;
        // The first fault cuts a holder off for two leases, so that every run sees one
        // stopped; the rest are drawn at random.
        let first = cut_offs.is_empty();
        let fault = if first {
            Fault::Partition
        } else {
            FAULTS[fastrand::usize(..FAULTS.len())]
        };
        match fault {
            Fault::Partition | Fault::Stall | Fault::CutEveryReply => {
                let instance = if fault == Fault::Partition {
                    PARTITIONABLE[fastrand::usize(..PARTITIONABLE.len())]
                } else {
                    PROXIED
                };
                let Some(probe) = start_probe(addrs, instance, log).await else {
                    continue;
                };
                let began = now_micros();
                let host = INSTANCES[instance];
                match fault {
                    Fault::Partition => cluster.net.partition(host, "redis"),
                    Fault::Stall => cluster.proxy.stall(),
                    _ => cluster.proxy.cut_replies(usize::MAX),
                }
                let cut_for = lease(if first {
                    2.0
                } else {
                    0.5 + 1.5 * fastrand::f64()
                });
                let (ns, key) = probe.1.split_once('-').expect("ns-key");
                let redis_key = lock_key(ns, key);
                // The expiry as of the last renewal that reached Redis (with replies cut,
                // requests still get through and extend the lease).
                let until = tokio::time::Instant::now() + cut_for;
                let mut expiries = Vec::new();
                while tokio::time::Instant::now() < until {
                    if let Some(at) = server_expiry(&mut observer, cluster, &redis_key).await {
                        expiries.push(at);
                    }
                    tokio::time::sleep(Duration::from_millis(25)).await;
                }
                match fault {
                    Fault::Partition => cluster.net.heal(host, "redis"),
                    Fault::Stall => cluster.proxy.resume(),
                    _ => cluster.proxy.cut_replies(0),
                }
                cut_offs.push(CutOff {
                    fault,
                    probe,
                    lock_key: redis_key,
                    began,
                    expiries,
                });
                // The probe's end, before the next fault.
                tokio::time::sleep(PROBE_HOLD.saturating_sub(cut_for)).await;
            }
            Fault::Latency => {
                cluster
                    .proxy
                    .set_latency(Duration::from_millis(fastrand::u64(20..400)));
                tokio::time::sleep(Duration::from_millis(fastrand::u64(1000..3000))).await;
                cluster.proxy.set_latency(Duration::ZERO);
            }
            Fault::CutReplies => {
                cluster.proxy.cut_replies(fastrand::usize(1..=3));
                tokio::time::sleep(Duration::from_secs(1)).await;
                cluster.proxy.cut_replies(0);
            }
            Fault::RedisRestart => {
                cluster.redis.kill();
                tokio::time::sleep(Duration::from_millis(fastrand::u64(0..300))).await;
                cluster.redis.restart();
                observer = None;
            }
            Fault::Sigstop => {
                // Shorter than the lease minus a renewal period, so a frozen holder is not
                // overtaken (a holder frozen past its lease is fencing's case, which
                // `tests/it/faults.rs` covers): this checks that renewal recovers.
                let pid = cluster.pids[fastrand::usize(..cluster.pids.len())];
                support::send_signal(pid, "-STOP");
                tokio::time::sleep(lease(0.1 + 0.4 * fastrand::f64())).await;
                support::send_signal(pid, "-CONT");
            }
        }
        faults.push(fault);
    }
    (faults, cut_offs)
}

/// Sends a probe to `instance` and waits until it holds its lock; `None` if it does not
/// get it in time (contended, or the instance is still recovering).
pub(super) async fn start_probe(
    addrs: &[SocketAddr],
    instance: usize,
    log: &SharedLog,
) -> Option<(usize, String, u64)> {
    let ns = NAMESPACES[fastrand::usize(..NAMESPACES.len())];
    let key = KEYS[fastrand::usize(..KEYS.len())];
    start_probe_on(addrs, instance, ns, key, log).await
}

/// [`start_probe`] on the lock of `key` in lock namespace label `ns`.
pub(super) async fn start_probe_on(
    addrs: &[SocketAddr],
    instance: usize,
    ns: &str,
    key: &str,
    log: &SharedLog,
) -> Option<(usize, String, u64)> {
    let seen = lock(log).probes_held.len();
    let request = support::post_request(addrs[instance], &format!("/{ns}/hold/{key}"));
    tokio::spawn(async move {
        let client = support::http_client();
        let _ = tokio::time::timeout(Duration::from_secs(15), support::try_send(&client, request))
            .await;
    });
    let until = tokio::time::Instant::now() + WAIT + Duration::from_millis(500);
    while tokio::time::Instant::now() < until {
        let held = lock(log).probes_held[seen..]
            .iter()
            .find(|p| p.0 == instance && p.1 == format!("{ns}-{key}"))
            .cloned();
        if held.is_some() {
            return held;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    None
}

/// Every register as the database holds it at the end.
pub(super) async fn read_registers(cluster: &Cluster) -> Registers {
    read_registers_at(cluster.db.addr()).await
}

/// [`read_registers`] from the database on `db`.
pub(super) async fn read_registers_at(db: SocketAddr) -> Registers {
    // Generous timeouts: a busy machine must not fail the run after the load.
    let backend = support::builder(&format!("redis://{db}"))
        .connect_timeout(Duration::from_secs(5))
        .command_timeout(Duration::from_secs(5))
        .build()
        .await
        .expect("the registers' database answers");
    let store = FencedStore::new(backend);
    let mut registers = Registers::new();
    for ns in NAMESPACES {
        // The leaders' register too (none where the instances do not campaign).
        for key in KEYS.into_iter().chain(["leader"]) {
            let register = format!("{ns}-{key}");
            let value = store.read(&register).await.expect("read register");
            let value = value.map(|v| (v.token, v.value.parse().expect("a number")));
            registers.insert(register, value);
        }
    }
    registers
}

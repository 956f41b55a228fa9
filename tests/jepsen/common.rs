//! What the three Jepsen binaries (one server, Sentinel, a cluster) share: the workload's
//! shape and the settings passed to the app instances.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use super::nemesis::{SharedLog, read_reports};
use super::support;
use super::support::child::ChildProcess;
use super::support::netns::{HostRedis, Net};

/// The lease of every hold: short, so that many faults fit in a run, yet long enough that
/// the margin by which a cut-off holder stops before its lease ends on the server (2% of
/// it) is not eaten up by a loaded machine's scheduling (up to about 35 ms was seen).
pub(crate) const LEASE: Duration = Duration::from_secs(3);
/// How long a request waits for its lock.
pub(crate) const WAIT: Duration = Duration::from_secs(2);
pub(crate) const INSTANCES: [&str; 3] = ["app0", "app1", "app2"];
pub(crate) const KEYS: [&str; 2] = ["k0", "k1"];
pub(crate) const HTTP_PORT: u16 = 8080;

/// The settings of an app instance (see `app.rs`).
pub(crate) const STORE_URL: &str = "JEPSEN_STORE_URL";
pub(crate) const DB_URL: &str = "JEPSEN_DB_URL";
pub(crate) const LISTEN: &str = "JEPSEN_LISTEN";
pub(crate) const INSTANCE: &str = "JEPSEN_INSTANCE";
/// Which store the instances lock on (see `app.rs`).
pub(crate) const TOPOLOGY: &str = "JEPSEN_TOPOLOGY";
/// Set: every instance also campaigns for the leadership of each lock namespace.
pub(crate) const LEADERS: &str = "JEPSEN_LEADERS";
/// The instances' lease in milliseconds, where a store's is not [`LEASE`].
pub(crate) const LEASE_MS: &str = "JEPSEN_LEASE_MS";

/// How long the instances' requests wait for their lock, where a store's is not [`WAIT`].
pub(crate) const WAIT_MS: &str = "JEPSEN_WAIT_MS";

/// The lease of this instance's holds: [`LEASE_MS`] if the test set it, else [`LEASE`].
pub(crate) fn lease() -> Duration {
    static SET: std::sync::OnceLock<Duration> = std::sync::OnceLock::new();
    *SET.get_or_init(|| millis_or(LEASE_MS, LEASE))
}

/// How long this instance's requests wait: [`WAIT_MS`] if the test set it, else [`WAIT`].
pub(crate) fn wait() -> Duration {
    static SET: std::sync::OnceLock<Duration> = std::sync::OnceLock::new();
    *SET.get_or_init(|| millis_or(WAIT_MS, WAIT))
}

/// The milliseconds of the setting `name`, or `default`.
fn millis_or(name: &str, default: Duration) -> Duration {
    std::env::var(name)
        .ok()
        .and_then(|ms| ms.parse().ok())
        .map_or(default, Duration::from_millis)
}

/// `hold` (a time of the workload at [`LEASE`]) at the lease `lease`.
pub(crate) fn scaled(hold: Duration, lease: Duration) -> Duration {
    hold.mul_f64(lease.as_secs_f64() / LEASE.as_secs_f64())
}

pub(crate) use super::support::netns::now_micros;

/// The lock namespace of lock namespace label `ns`.
pub(crate) fn namespace(ns: &str) -> String {
    format!("jepsen-{ns}")
}

/// The Redis key of the lock on `key` in label `ns`.
pub(crate) fn lock_key(ns: &str, key: &str) -> String {
    format!("{}:{{{key}}}", namespace(ns))
}

/// The start of the Jepsen test `test`: when it started and its seconds of load
/// (`JEPSEN_SECS`, or `default`); `None` where it cannot build its hosts (not root, or no
/// iproute2), having said that it skipped.
pub(crate) fn begin(test: &str, default: u64) -> Option<(Instant, u64)> {
    if !Net::available() {
        support::netns::skip(test);
        return None;
    }
    support::init_tracing();
    let secs = std::env::var("JEPSEN_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default);
    Some((Instant::now(), secs))
}

/// The database of the fenced registers, in the test's namespace: every instance reaches
/// it over its uplink (at the uplink's root end), and no fault touches it (a partition
/// from Redis leaves it reachable, which is what makes a holder that does not stop
/// dangerous). The server, and the port it listens on at each of those addresses.
pub(crate) fn start_db(net: &Net) -> (HostRedis, u16) {
    let ips: Vec<_> = INSTANCES.iter().map(|h| net.root_ip(h)).collect();
    let port = std::net::TcpListener::bind((ips[0], 0))
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("free port");
    let db = HostRedis::start(net, None, &ips, SocketAddr::from((ips[0], port)), &[]);
    (db, port)
}

/// Starts every app instance on its host, each with `store(i)`'s settings for the lock's
/// store and the common ones (the database on `db_port`, the listen address, its
/// number), and forwards their reports into `log` until `stop`: their pids, and the
/// tasks that forward.
pub(crate) async fn spawn_apps(
    net: &Net,
    db_port: u16,
    store: impl Fn(usize) -> Vec<(&'static str, String)>,
    log: &SharedLog,
    stop: &CancellationToken,
) -> (Vec<u32>, Vec<tokio::task::JoinHandle<()>>) {
    let (mut pids, mut readers) = (Vec::new(), Vec::new());
    for (i, host) in INSTANCES.iter().enumerate() {
        let mut settings = store(i);
        settings.extend([
            (DB_URL, format!("redis://{}:{db_port}", net.root_ip(host))),
            (LISTEN, format!("0.0.0.0:{HTTP_PORT}")),
            (INSTANCE, i.to_string()),
        ]);
        let mut app = ChildProcess::spawn_in(&net.ns(host), &app_entry(), "app", &settings);
        assert_eq!(app.next_report().await.as_deref(), Some("ready"));
        pids.push(app.pid());
        readers.push(tokio::spawn(read_reports(app, log.clone(), stop.clone())));
    }
    (pids, readers)
}

/// Waits for the `load` tasks, then for the instances' last reports: every request has
/// been answered, so every handler has stopped; its report follows within moments.
pub(crate) async fn drain(
    load: Vec<tokio::task::JoinHandle<()>>,
    readers: Vec<tokio::task::JoinHandle<()>>,
    stop_readers: &CancellationToken,
) {
    for task in load {
        task.await.expect("load task");
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop_readers.cancel();
    for reader in readers {
        reader.await.expect("reader");
    }
}

/// Where the test reaches each app instance.
pub(crate) fn app_addrs(net: &Net) -> Vec<SocketAddr> {
    INSTANCES
        .iter()
        .map(|h| SocketAddr::from((net.host_ip(h), HTTP_PORT)))
        .collect()
}

/// The child app's entry test, `app::jepsen_child` beside this module in the workload that
/// runs (`redis::app::jepsen_child`: the binary holds one workload per topology).
fn app_entry() -> String {
    let workload = module_path!().split("::").nth(1).unwrap_or_default();
    format!("{workload}::app::jepsen_child")
}

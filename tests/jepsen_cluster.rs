//! Jepsen on a Redis Cluster: the nemesis workload of `tests/jepsen.rs` (three app
//! instances as child processes on hosts of their own, guarded read-modify-write
//! increments of fenced registers, every hold recorded and checked) against a cluster of
//! three primaries with a replica each, started once, each node on a host of its own.
//! The nemesis fails over the primary that serves a probe's key (`kill -9`, `SIGSTOP`
//! past `cluster-node-timeout`, a partition from the other nodes while the instances still
//! reach it, a restart, empty) and partitions or freezes instances.
//!
//! Two lock namespaces on every instance: "s" with `sync_replicas(1, ..)`, the restart
//! guard and `max_lease`, where every violation fails the test, and "a" with neither,
//! where the overlaps that asynchronous replication allows are counted and printed
//! separately. Margins (the server-side expiry of a stopped probe's lock minus its stop)
//! are printed per fault kind; a negative one fails the test, but in "a" after a failover.
//!
//! Runs 30 s of load by default (every fault kind at least once, so up to a minute);
//! `JEPSEN_SECS=600 cargo test --test jepsen_cluster -- --nocapture` runs longer. Needs
//! root and iproute2 (it says it skipped otherwise).

mod support;

#[path = "jepsen/app.rs"]
mod app;
#[path = "jepsen/cluster_faults.rs"]
mod cluster_faults;
#[path = "jepsen/cluster_net.rs"]
mod cluster_net;
#[path = "jepsen/cluster_summary.rs"]
mod cluster_summary;
// The single-server nemesis is not run here: only its log, load and probes are used.
#[allow(dead_code)]
#[path = "jepsen/nemesis.rs"]
mod nemesis;

use std::collections::HashMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use support::child::{self, ChildProcess};
use support::history::{Hold, Write};
use support::netns::{HostRedis, Net};
use tokio_util::sync::CancellationToken;

use cluster_net::Deployment;
use nemesis::*;

/// The lease of every hold (as `tests/jepsen.rs`).
const LEASE: Duration = Duration::from_secs(3);
/// How long a request waits for its lock.
const WAIT: Duration = Duration::from_secs(2);
/// How long a probe holds when not stopped: longer than a failover and a lease.
const PROBE_HOLD: Duration = Duration::from_millis(6000);
const INSTANCES: [&str; 3] = ["app0", "app1", "app2"];
/// Every instance is partitioned from the nodes alike; none goes through a proxy (the
/// single-server nemesis's names).
const PARTITIONABLE: [usize; 3] = [0, 1, 2];
const PROXIED: usize = 2;
/// Lock namespaces: safe ("s": replica acknowledgement and the restart guard) and
/// asynchronous ("a").
const NAMESPACES: [&str; 2] = ["s", "a"];
const KEYS: [&str; 2] = ["k0", "k1"];
const HTTP_PORT: u16 = 8080;

const REDIS_URL: &str = "JEPSEN_REDIS_URL";
const DB_URL: &str = "JEPSEN_DB_URL";
const LISTEN: &str = "JEPSEN_LISTEN";
const INSTANCE: &str = "JEPSEN_INSTANCE";

fn now_micros() -> u64 {
    support::netns::now_micros()
}

/// The lock namespace of lock namespace label `ns`.
fn namespace(ns: &str) -> String {
    format!("jepsen-{ns}")
}

/// The Redis key of the lock on `key` in label `ns`.
fn lock_key(ns: &str, key: &str) -> String {
    format!("{}:{{{key}}}", namespace(ns))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_failovers_keep_safe_holds_exclusive_and_count_what_async_replication_loses() {
    const TEST: &str = "cluster_nemesis_workload";
    if !Net::available() {
        support::netns::skip(TEST);
        return;
    }
    support::init_tracing();
    let started = Instant::now();
    let secs: u64 = std::env::var("JEPSEN_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(30);

    let mut deployment = Deployment::start(&INSTANCES).await;
    // The database of the fenced registers, in the test's namespace, reached by every
    // instance over its uplink and never faulted (as in `tests/jepsen.rs`).
    let net = &deployment.net;
    let db_ips: Vec<Ipv4Addr> = INSTANCES.iter().map(|h| net.root_ip(h)).collect();
    let db_port = std::net::TcpListener::bind((db_ips[0], 0))
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("free port");
    let db = HostRedis::start(
        net,
        None,
        &db_ips,
        SocketAddr::from((db_ips[0], db_port)),
        &[],
    );

    let log: SharedLog = Arc::default();
    let stop_readers = CancellationToken::new();
    let mut readers = Vec::new();
    let mut pids = Vec::new();
    for (i, host) in INSTANCES.iter().enumerate() {
        let settings = [
            ("JEPSEN_TOPOLOGY", "cluster".to_owned()),
            (REDIS_URL, deployment.seeds()),
            (DB_URL, format!("redis://{}:{db_port}", net.root_ip(host))),
            (LISTEN, format!("0.0.0.0:{HTTP_PORT}")),
            (INSTANCE, i.to_string()),
        ];
        let mut app = ChildProcess::spawn_in(&net.ns(host), "app::jepsen_child", "app", &settings);
        assert_eq!(app.next_report().await.as_deref(), Some("ready"));
        pids.push(app.pid());
        readers.push(tokio::spawn(read_reports(
            app,
            log.clone(),
            stop_readers.clone(),
        )));
    }
    let addrs: Vec<SocketAddr> = INSTANCES
        .iter()
        .map(|h| SocketAddr::from((net.host_ip(h), HTTP_PORT)))
        .collect();

    let deadline = tokio::time::Instant::now() + Duration::from_secs(secs);
    let statuses: Arc<Mutex<HashMap<String, usize>>> = Arc::default();
    let load_until = CancellationToken::new();
    let load: Vec<_> = (0..6)
        .map(|_| {
            let (addrs, statuses, until) = (addrs.clone(), statuses.clone(), load_until.clone());
            // Until the nemesis is done (its first round may outlast the deadline).
            tokio::spawn(async move {
                while !until.is_cancelled() {
                    let soon = tokio::time::Instant::now() + Duration::from_millis(500);
                    nemesis::load(addrs.clone(), soon, statuses.clone()).await;
                }
            })
        })
        .collect();
    let (windows, cuts) = cluster_faults::run(&mut deployment, &addrs, &pids, &log, deadline).await;
    load_until.cancel();
    for task in load {
        task.await.expect("load task");
    }
    // Every request has been answered: every handler has stopped and reported.
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop_readers.cancel();
    for reader in readers {
        reader.await.expect("reader");
    }

    let registers = read_registers_at(db.addr()).await;
    let log = std::mem::take(&mut *lock(&log));
    let statuses = statuses.lock().unwrap_or_else(|e| e.into_inner()).clone();
    println!(
        "jepsen cluster: {secs} s of load, run time {:.1?}, requests: {statuses:?}",
        started.elapsed()
    );
    cluster_summary::report(&log, &registers, &windows, &cuts);
}

//! Jepsen on a Redis Cluster: the nemesis workload of `tests/jepsen/redis.rs` (three app
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
//! `JEPSEN_SECS=600 cargo test --test jepsen cluster:: -- --nocapture` runs longer. Needs
//! root and iproute2 (it says it skipped otherwise).

use crate::support;

#[path = "app.rs"]
mod app;
#[path = "cluster_faults.rs"]
mod cluster_faults;
#[path = "cluster_net.rs"]
mod cluster_net;
#[path = "cluster_summary.rs"]
mod cluster_summary;
#[path = "common.rs"]
mod common;
// The single-server nemesis is not run here: only its log, load and probes are used.
#[allow(dead_code)]
#[path = "nemesis.rs"]
mod nemesis;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use support::child;
use support::history::{Hold, Write};
use tokio_util::sync::CancellationToken;

use cluster_net::Deployment;
use common::*;
use nemesis::*;

/// How long a probe holds when not stopped: longer than a failover and a lease.
const PROBE_HOLD: Duration = Duration::from_millis(6000);
/// Every instance is partitioned from the nodes alike; none goes through a proxy (the
/// single-server nemesis's names).
const PARTITIONABLE: [usize; 3] = [0, 1, 2];
const PROXIED: usize = 2;
/// Lock namespaces: safe ("s": replica acknowledgement and the restart guard) and
/// asynchronous ("a").
const NAMESPACES: [&str; 2] = ["s", "a"];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_failovers_keep_safe_holds_exclusive_and_count_what_async_replication_loses() {
    let Some((started, secs)) = begin("cluster_nemesis_workload", 30) else {
        return;
    };

    let mut deployment = Deployment::start(&INSTANCES).await;
    let net = &deployment.net;
    let (db, db_port) = start_db(net);

    let log: SharedLog = Arc::default();
    let stop_readers = CancellationToken::new();
    let seeds = deployment.seeds();
    let store = |_| vec![(TOPOLOGY, "cluster".to_owned()), (STORE_URL, seeds.clone())];
    let (pids, readers) = spawn_apps(net, db_port, store, &log, &stop_readers).await;
    let addrs = app_addrs(net);

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
    drain(load, readers, &stop_readers).await;

    let registers = read_registers_at(db.addr()).await;
    let log = std::mem::take(&mut *lock(&log));
    let statuses = statuses.lock().unwrap_or_else(|e| e.into_inner()).clone();
    println!(
        "jepsen cluster: {secs} s of load, run time {:.1?}, requests: {statuses:?}",
        started.elapsed()
    );
    cluster_summary::report(&log, &registers, &windows, &cuts);
}

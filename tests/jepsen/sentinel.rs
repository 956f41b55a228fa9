//! Jepsen on Redis Sentinel: the nemesis workload of `tests/jepsen/redis.rs` (three app
//! instances as child processes, each in its own network namespace, guarded
//! read-modify-write increments of fenced registers) against a master, its replica and
//! three sentinels, started once, while a nemesis kills the master, cuts it off from the
//! sentinels, restarts it empty, pauses it past `down-after`, cuts instances off from the
//! data nodes and freezes them (`sentinel_faults.rs`).
//!
//! Two lock namespaces: "s" (`sync_replicas(1, ..)`, `restart_guard()`, `max_lease`) must
//! keep every hold exclusive and every fenced write; "a" (neither) may overlap after a
//! failover or a restart, as asynchronous replication allows: its violations are counted
//! and printed apart. Every instance cut off from the data nodes must stop before its
//! lease ends on the master (the margins, printed per fault kind).
//!
//! Runs 30 s of load by default; `JEPSEN_SECS=600 cargo test --test jepsen sentinel:: --
//! --nocapture` runs longer. Needs root and iproute2 (it says it skipped otherwise).

use crate::support;

#[path = "app.rs"]
mod app;
#[path = "common.rs"]
mod common;
// The single-server faults of this file (`Cluster`, `run_nemesis`) are tests/jepsen/redis.rs';
// this binary takes the log, the load, the probes and the margins from it.
#[allow(dead_code)]
#[path = "nemesis.rs"]
mod nemesis;
#[path = "sentinel_faults.rs"]
mod sentinel_faults;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use support::child;
use support::history::{self, Hold, Registers, Violation, Write};
use support::netns::Net;
use support::sentinel::SentinelSet;
use tokio_util::sync::CancellationToken;

use common::*;
use nemesis::{Margin, SharedLog};
use sentinel_faults::{Deployment, Fault, KINDS, Window};

/// How long a probe holds when not stopped: longer than the longest cut-off (2 leases).
const PROBE_HOLD: Duration = Duration::from_millis(7000);
/// What `nemesis.rs`' single-server faults partition and proxy; unused here (every instance
/// can be cut off, none has a proxy: the sentinels name the data nodes' own addresses).
const PARTITIONABLE: [usize; 3] = [0, 1, 2];
const PROXIED: usize = 2;
/// Lock namespaces: safe ("s") and asynchronous ("a").
const NAMESPACES: [&str; 2] = ["s", "a"];
/// The data nodes' password (the sentinels keep none): each sentinel logs in as its own
/// user, so that it can be locked out of the master alone.
const MASTER_PASSWORD: &str = "jepsen-data-secret";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sentinel_failovers_keep_safe_holds_exclusive_and_stop_cut_off_holders_before_expiry() {
    let Some((started, secs)) = begin("sentinel nemesis_workload", 30) else {
        return;
    };

    // "data" holds nothing: the root end of its uplink is the address, in the test's
    // namespace, where the data nodes and the sentinels listen and that they announce.
    let net = Net::new(&["data", "app0", "app1", "app2"]);
    let data_ip = net.root_ip("data");
    let mut set = SentinelSet::start_on(data_ip).await;
    set.require_password(MASTER_PASSWORD).await;
    let (db, db_port) = start_db(&net);
    let mut deployment = Deployment {
        net,
        set,
        data_ip,
        pids: Vec::new(),
    };

    let log: SharedLog = Arc::default();
    let stop_readers = CancellationToken::new();
    let sentinels = deployment.set.sentinel_urls().join(",");
    for host in INSTANCES {
        deployment.reach(host);
    }
    let store = |_| {
        vec![
            (STORE_URL, sentinels.clone()),
            (TOPOLOGY, "sentinel".to_owned()),
            ("JEPSEN_MASTER_PASSWORD", MASTER_PASSWORD.to_owned()),
        ]
    };
    let (pids, readers) = spawn_apps(&deployment.net, db_port, store, &log, &stop_readers).await;
    deployment.pids = pids;
    let addrs = app_addrs(&deployment.net);

    let load_started = Instant::now();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(secs);
    let statuses: Arc<Mutex<HashMap<String, usize>>> = Arc::default();
    // The load runs as long as the nemesis, which may go past `deadline` to inject every
    // kind of fault once.
    let stop_load = CancellationToken::new();
    let load: Vec<_> = (0..6)
        .map(|_| {
            let stop = stop_load.clone();
            let done = move || stop.is_cancelled();
            tokio::spawn(nemesis::load_until(addrs.clone(), done, statuses.clone()))
        })
        .collect();
    let (windows, cut_offs) = sentinel_faults::run(&mut deployment, &addrs, &log, deadline).await;
    stop_load.cancel();
    let loaded = load_started.elapsed();
    drain(load, readers, &stop_readers).await;

    let registers = nemesis::read_registers_at(db.addr()).await;
    let log = std::mem::take(&mut *nemesis::lock(&log));
    // The margins of each namespace apart: in "a" a failover may lose a renewal (or the
    // lock) that the holder saw acknowledged.
    let (cut_offs_s, cut_offs_a): (Vec<_>, Vec<_>) = cut_offs
        .into_iter()
        .partition(|c| c.probe.1.starts_with("s-"));
    let margins_s = nemesis::margins(&cut_offs_s, &log);
    let margins_a = nemesis::margins(&cut_offs_a, &log);
    let statuses = statuses.lock().unwrap_or_else(|e| e.into_inner()).clone();
    println!(
        "jepsen on sentinel: load for {loaded:.1?} (JEPSEN_SECS={secs}, then until every kind \
         of fault ran), run time {:.1?}, requests: {statuses:?}",
        started.elapsed()
    );
    let mut safe = Vec::new();
    for ns in NAMESPACES {
        let violations = summarize(ns, &log.holds, &registers, &windows);
        if ns == "s" {
            safe = violations;
        }
    }
    println!("  margins (server-side expiry minus the cut-off holder's stop):");
    print_margins("s", &margins_s, &cut_offs_s);
    print_margins("a", &margins_a, &cut_offs_a);

    assert!(
        safe.is_empty(),
        "{} violations in \"s\" (sync_replicas + restart guard)",
        safe.len()
    );
    // In "a" only the faults of an instance promise a margin.
    let promised = margins_a
        .iter()
        .filter(|m| matches!(m.fault, Fault::Partition | Fault::Sigstop));
    for m in margins_s.iter().chain(promised) {
        assert!(
            m.margin >= 0,
            "a cut-off holder certainly ran past the server-side expiry: {m:?}"
        );
    }
    assert!(
        margins_s
            .iter()
            .chain(&margins_a)
            .any(|m| m.fault == Fault::Partition),
        "no cut-off holder was stopped: the promise was not exercised"
    );
}

/// Checks the holds of namespace `ns` and prints, per fault kind, the faults, the holds
/// that overlapped them and the violations; returns the violations.
fn summarize(
    ns: &str,
    holds: &[Hold],
    registers: &Registers,
    windows: &[Window],
) -> Vec<Violation> {
    let prefix = format!("{ns}-");
    let holds: Vec<Hold> = holds
        .iter()
        .filter(|h| h.key.starts_with(&prefix))
        .cloned()
        .collect();
    let registers: Registers = registers
        .iter()
        .filter(|(key, _)| key.starts_with(&prefix))
        .map(|(key, value)| (key.clone(), *value))
        .collect();
    let violations = history::check(&holds, &registers);
    let written = holds
        .iter()
        .filter(|h| matches!(h.write, Write::Written(_)))
        .count();
    let kind = if ns == "s" {
        "sync_replicas + restart guard"
    } else {
        "asynchronous replication: violations allowed"
    };
    println!(
        "  \"{ns}\" ({kind}): {} holds checked ({written} acknowledged writes), {} violations",
        holds.len(),
        violations.len()
    );
    // A hold or a violation counts under every fault it overlapped.
    let during = |fault: Fault, start: u64, end: u64| {
        windows
            .iter()
            .any(|w| w.fault == fault && start < w.ended && end > w.began)
    };
    let span = |v: &Violation| {
        let start = v.holds.iter().map(|h| h.start).min().unwrap_or(0);
        let end = v.holds.iter().map(|h| h.end).max().unwrap_or(u64::MAX);
        (start, end)
    };
    for fault in KINDS {
        let faults = windows.iter().filter(|w| w.fault == fault).count();
        let held = holds
            .iter()
            .filter(|h| during(fault, h.start, h.end))
            .count();
        let violated = violations
            .iter()
            .filter(|v| {
                let (start, end) = span(v);
                during(fault, start, end)
            })
            .count();
        println!("    {fault:?}: {faults} faults, {held} holds during them, {violated} violations");
    }
    for v in &violations {
        println!("    VIOLATION in \"{ns}\": {v}");
    }
    violations
}

/// The margins of namespace `ns`'s probes per fault kind.
fn print_margins(ns: &str, margins: &[Margin<Fault>], cut_offs: &[nemesis::CutOff<Fault>]) {
    let ms =
        |us: Option<i64>| us.map_or("-".to_owned(), |us| format!("{:.1} ms", us as f64 / 1000.0));
    for kind in KINDS {
        let of_kind: Vec<&Margin<Fault>> = margins.iter().filter(|m| m.fault == kind).collect();
        let cut = cut_offs.iter().filter(|c| c.fault == kind).count();
        if cut == 0 {
            continue;
        }
        let min = of_kind.iter().map(|m| m.margin).min();
        let min_proven = of_kind.iter().map(|m| m.proven).min();
        println!(
            "    \"{ns}\" {kind:?}: {cut} probes, stopped {} times, min margin {} (at least {})",
            of_kind.len(),
            ms(min),
            ms(min_proven),
        );
    }
}

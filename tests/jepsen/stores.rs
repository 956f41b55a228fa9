//! Jepsen on the stores beside Redis: the nemesis workload of `tests/jepsen/redis.rs`
//! (three app instances as child processes, each on a host of its own, guarded
//! read-modify-write increments of fenced registers, every instance campaigning for a
//! leadership whose terms make fenced increments too) against each store's servers (an
//! etcd cluster and a ZooKeeper ensemble of three, one PostgreSQL server, one MariaDB, a
//! RedLock quorum of five Redis masters), each on a host of its own on one switch, while a
//! nemesis kills, pauses, isolates and restarts servers empty, ends wake connections, cuts
//! instances off from every server (or from a minority of them) and freezes them
//! (`store_faults.rs`).
//!
//! Every hold and every leader's term is checked (`support::history`): none overlaps
//! another, tokens increase, no fenced write is lost or refused as stale, but for the holds
//! of an instance frozen past its lease, whose writes fencing refuses (that is what they
//! show). A holder cut off from the servers must stop before the store gives its lock to
//! another instance (the margins, printed per fault kind). Requests are counted per fault
//! kind, and apart those of the faults the store survives (a minority of its servers
//! killed, paused, isolated or restarted empty), which must cost none on etcd and
//! ZooKeeper (asserted) and are printed for the others (see the reliability guide).
//!
//! Runs 30 s of load by default; `JEPSEN_SECS=300 cargo test --all-features --test jepsen
//! stores::etcd -- --nocapture` runs longer. Needs root and iproute2 (it says it skipped
//! otherwise).

use crate::support;

#[path = "app.rs"]
mod app;
#[path = "common.rs"]
mod common;
// The Redis faults of this file (`Cluster`, `run_nemesis`) are tests/jepsen/redis.rs'; this
// workload takes the log, the load, the probes and the registers from it.
#[allow(dead_code)]
#[path = "nemesis.rs"]
mod nemesis;
#[path = "store_faults.rs"]
mod store_faults;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use support::child;
use support::history::{self, Hold, Violation, Write};
use support::netns::Net;
use tokio_util::sync::CancellationToken;

use common::*;
use nemesis::{SharedLog, load_recorded, lock, read_registers_at, start_probe_on};
use store_faults::{Fault, Faults, Frozen, Servers};

/// How long a probe holds when not stopped: longer than the longest cut-off (2 leases).
const PROBE_HOLD: Duration = Duration::from_millis(7000);
/// What `nemesis.rs`' Redis faults partition and proxy; unused here.
const PARTITIONABLE: [usize; 3] = [0, 1, 2];
const PROXIED: usize = 2;
/// One lock namespace: every store keeps its holds exclusive by its own guarantees.
const NAMESPACES: [&str; 1] = ["x"];

#[cfg(feature = "etcd")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_keeps_holds_exclusive_through_kills_pauses_and_partitions() {
    run("etcd nemesis_workload", &store_faults::Etcd::HOSTS, |net| {
        Box::new(store_faults::Etcd::start(net))
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_keeps_holds_exclusive_through_restarts_pauses_and_partitions() {
    run(
        "postgres nemesis_workload",
        &store_faults::Postgres::HOSTS,
        |net| Box::new(store_faults::Postgres::start(net)),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_keeps_holds_exclusive_through_restarts_pauses_and_partitions() {
    run(
        "mariadb nemesis_workload",
        &store_faults::MariaDb::HOSTS,
        |net| Box::new(store_faults::MariaDb::start(net)),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quorum_keeps_holds_exclusive_through_kills_partitions_and_empty_restarts() {
    run(
        "quorum nemesis_workload",
        &store_faults::Quorum::HOSTS,
        |net| Box::new(store_faults::Quorum::start(net)),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zookeeper_keeps_holds_exclusive_through_kills_pauses_and_partitions() {
    run(
        "zookeeper nemesis_workload",
        &store_faults::ZooKeeper::HOSTS,
        |net| Box::new(store_faults::ZooKeeper::start(net)),
    )
    .await;
}

/// The workload against the servers that `start` starts on `hosts` (each on the switch,
/// with the instances).
async fn run(test: &str, hosts: &[&str], start: impl FnOnce(&Net) -> Box<dyn Servers>) {
    let Some((started, secs)) = begin(test, 30) else {
        return;
    };
    let all: Vec<&str> = hosts.iter().chain(&INSTANCES).copied().collect();
    let mut net = Net::new(&all);
    net.lan(&all);
    let mut servers = start(&net);
    let (db, db_port) = start_db(&net);

    let log: SharedLog = Arc::default();
    let stop_readers = CancellationToken::new();
    let (store, url) = (servers.store(), servers.url());
    let (servers_lease, servers_wait) = (servers.lease(), servers.wait());
    let serves_through = servers.serves_through_survived_faults();
    let settings = |_| {
        vec![
            (STORE_URL, url.clone()),
            (TOPOLOGY, store.to_owned()),
            (LEADERS, "1".to_owned()),
            (LEASE_MS, servers_lease.as_millis().to_string()),
            (WAIT_MS, servers_wait.as_millis().to_string()),
        ]
    };
    let (pids, readers) = spawn_apps(&net, db_port, settings, &log, &stop_readers).await;
    let addrs = app_addrs(&net);

    let deadline = tokio::time::Instant::now() + Duration::from_secs(secs);
    let requests: Arc<Mutex<Vec<Request>>> = Arc::default();
    let load: Vec<_> = (0..6)
        .map(|_| {
            let (addrs, requests) = (addrs.clone(), requests.clone());
            tokio::spawn(load_recorded(
                addrs,
                move || tokio::time::Instant::now() >= deadline,
                move |sent, instance, outcome| {
                    lock_vec(&requests).push(Request {
                        sent,
                        instance,
                        outcome,
                    });
                },
            ))
        })
        .collect();
    let faults =
        store_faults::run_nemesis(&mut *servers, &net, &addrs, &pids, &log, deadline).await;
    // Every term ends (and is reported) before the instances are drained.
    let client = support::http_client();
    for addr in &addrs {
        let stop = support::post_request(*addr, "/stop-leading");
        support::try_send(&client, stop)
            .await
            .expect("the instance stops leading");
    }
    drain(load, readers, &stop_readers).await;

    if std::env::var_os("JEPSEN_SERVER_LOGS").is_some() {
        println!("{}", servers.logs());
    }
    let registers = read_registers_at(db.addr()).await;
    let log = std::mem::take(&mut *lock(&log));
    let violations = history::check(&log.holds, &registers);
    let (allowed, violations): (Vec<_>, Vec<_>) = violations
        .into_iter()
        .partition(|v| allowed_by_fencing(v, &faults.frozen));
    let requests = std::mem::take(&mut *lock_vec(&requests));
    if std::env::var_os("JEPSEN_HISTORY").is_some() {
        print_history(&requests, &log.holds);
    }

    // The summary.
    println!(
        "jepsen on {store}: {secs} s of load, run time {:.1?}",
        started.elapsed()
    );
    let written = log
        .holds
        .iter()
        .filter(|h| matches!(h.write, Write::Written(_)))
        .count();
    let terms = log
        .holds
        .iter()
        .filter(|h| h.key.ends_with("-leader"))
        .count();
    println!(
        "  holds checked: {} ({written} acknowledged writes, {terms} leader terms)",
        log.holds.len()
    );
    // Holds that kept their key for a whole wait (probes and leaders' terms apart).
    let wait_us = u64::try_from(servers_wait.as_micros()).unwrap_or(u64::MAX);
    let long: Vec<&Hold> = log
        .holds
        .iter()
        .filter(|h| h.end - h.start >= wait_us && !h.key.ends_with("-leader"))
        .filter(|h| {
            !log.probe_ends
                .contains_key(&(h.instance, h.key.clone(), h.token))
        })
        .collect();
    for h in long.iter().take(5) {
        println!(
            "  long hold: app{} {} token {} from {} to {}",
            h.instance,
            h.key,
            h.token,
            clock(h.start),
            clock(h.end)
        );
    }
    for w in &faults.windows {
        println!(
            "  {:?} from {} to {} (UTC)",
            w.fault,
            clock(w.began),
            clock(w.ended)
        );
    }
    let by_kind = requests_by_fault(&requests, &faults, servers_wait);
    for (kind, outcomes) in &by_kind {
        let count = faults
            .windows
            .iter()
            .filter(|w| Some(w.fault) == *kind)
            .count();
        let name = kind.map_or("no fault".to_owned(), |k| format!("{k:?}"));
        println!("  {name} ({count} times): requests {outcomes:?}");
    }
    let margins = margins(&faults, &log);
    let cut = faults
        .cut_offs
        .iter()
        .filter(|c| c.fault == Fault::CutInstance)
        .count();
    println!(
        "  CutInstance: the holder stopped {} times, at least {} before the next holder \
         began; {} outlived the cut",
        margins.len(),
        ms(margins.iter().min().copied()),
        cut - margins.len(),
    );
    println!(
        "  FreezePastLease: the frozen holders' writes {:?}",
        frozen_writes(&faults, &log.holds)
    );
    for v in &allowed {
        println!("  allowed by fencing (a frozen holder's): {}", v.rule);
    }
    history::assert_none(&violations);
    for margin in &margins {
        assert!(
            *margin >= 0,
            "a cut-off holder ran {} µs into the next one's hold",
            -margin
        );
    }
    assert!(
        !margins.is_empty(),
        "no cut-off holder was stopped: the promise was not exercised"
    );
    assert!(written > 0, "the workload made progress");
    assert!(terms > 0, "a leader was elected");
    // The faults the store survives (a minority of its servers down, paused, isolated):
    // what they cost is printed, and on servers that elect it must be nothing.
    let survived: Vec<&Request> = requests
        .iter()
        .filter(|r| during(r, &faults, servers_wait).is_some_and(|k| k.survived(hosts.len())))
        .collect();
    let failed: Vec<String> = survived
        .iter()
        .filter(|r| r.outcome != "200")
        .map(|r| format!("{} to app{}: {}", clock(r.sent), r.instance, r.outcome))
        .collect();
    println!(
        "  faults {store} survives: {} requests served, {} answered 503",
        survived.len() - failed.len(),
        failed.len()
    );
    for line in failed.iter().take(10) {
        println!("    {line}");
    }
    if serves_through {
        assert!(
            failed.is_empty(),
            "{} of the requests sent during faults {store} survives were not served",
            failed.len()
        );
    }
}

/// Every request (when sent, to which instance, its outcome) and every hold (its span,
/// instance, key and token), in the order of their times, on stderr.
fn print_history(requests: &[Request], holds: &[Hold]) {
    let requests = (requests.iter()).map(|r| {
        let line = format!("request {} app{}: {}", clock(r.sent), r.instance, r.outcome);
        (r.sent, line)
    });
    let holds = holds.iter().map(|h| {
        let (start, end) = (clock(h.start), clock(h.end));
        let line = format!(
            "hold {start} to {end} app{} {} token {}",
            h.instance, h.key, h.token
        );
        (h.start, line)
    });
    let mut lines: Vec<(u64, String)> = requests.chain(holds).collect();
    lines.sort();
    for (_, line) in lines {
        eprintln!("{line}");
    }
}

/// A violation that fencing answers: an overlap with, or a refused write of, a hold of an
/// instance frozen past its lease, which ran on unaware once resumed.
fn allowed_by_fencing(v: &Violation, frozen: &[Frozen]) -> bool {
    let was_frozen = |h: &Hold| {
        frozen
            .iter()
            .any(|f| f.instance == h.instance && h.start < f.ended && h.end > f.began)
    };
    matches!(v.rule, "holds overlap" | "write refused as stale") && v.holds.iter().any(was_frozen)
}

/// How long after a fault is healed its requests are counted as its own: the store may
/// take a moment to recover.
const AFTERMATH: u64 = 1_000_000;

/// One request of the load.
struct Request {
    /// When it was sent (µs).
    sent: u64,
    instance: usize,
    outcome: String,
}

/// The fault during which (or in whose aftermath) `request` was sent. A probe holds a key
/// of the load for seconds: a request sent up to a wait before it, queued behind it, is
/// its fault's too.
fn during(request: &Request, faults: &Faults, wait: Duration) -> Option<Fault> {
    let sent = request.sent;
    let wait = u64::try_from(wait.as_micros()).unwrap_or(u64::MAX);
    // The latest: a fault's aftermath ends where the next fault begins.
    faults
        .windows
        .iter()
        .rev()
        .find(|w| {
            let began = if w.fault.probes() {
                w.began.saturating_sub(wait)
            } else {
                w.began
            };
            began <= sent && sent <= w.ended + AFTERMATH
        })
        .map(|w| w.fault)
}

/// The requests sent during each kind of fault or its aftermath (or neither), by outcome.
fn requests_by_fault(
    requests: &[Request],
    faults: &Faults,
    wait: Duration,
) -> BTreeMap<Option<Fault>, BTreeMap<String, usize>> {
    let mut by_kind: BTreeMap<Option<Fault>, BTreeMap<String, usize>> = BTreeMap::new();
    for request in requests {
        let outcomes = by_kind.entry(during(request, faults, wait)).or_default();
        *outcomes.entry(request.outcome.clone()).or_default() += 1;
    }
    by_kind
}

/// For every probe that a cut-off stopped (not those that outlived it), by how long (µs)
/// it stopped before the next holder of its key began: negative if they overlapped.
fn margins(faults: &Faults, log: &nemesis::Log) -> Vec<i64> {
    faults
        .cut_offs
        .iter()
        .filter(|c| c.fault == Fault::CutInstance)
        .filter_map(|c| {
            let &(end, completed) = log.probe_ends.get(&c.probe)?;
            let (key, token) = (&c.probe.1, c.probe.2);
            let next = log
                .holds
                .iter()
                .filter(|h| h.key == *key && h.token > token)
                .min_by_key(|h| h.start)?;
            (!completed).then(|| next.start as i64 - end as i64)
        })
        .collect()
}

/// The writes of the probes frozen past their leases, by kind.
fn frozen_writes(faults: &Faults, holds: &[Hold]) -> BTreeMap<&'static str, usize> {
    let mut kinds = BTreeMap::new();
    for c in faults
        .cut_offs
        .iter()
        .filter(|c| c.fault == Fault::FreezePastLease)
    {
        let (instance, key, token) = (c.probe.0, &c.probe.1, c.probe.2);
        let Some(probe) = holds
            .iter()
            .find(|h| h.instance == instance && h.key == *key && h.token == token)
        else {
            continue;
        };
        let kind = match probe.write {
            Write::Written(_) => "written",
            Write::Stale => "refused as stale",
            Write::Unknown(_) => "unanswered",
            Write::Skipped => "not sent",
        };
        *kinds.entry(kind).or_default() += 1;
    }
    kinds
}

/// A wall-clock time (µs since the epoch) as `hh:mm:ss.mmm`, as the instances' log lines
/// show it.
pub(super) fn clock(us: u64) -> String {
    let ms = us / 1000;
    let (h, m, s) = (ms / 3_600_000 % 24, ms / 60_000 % 60, ms / 1000 % 60);
    format!("{h:02}:{m:02}:{s:02}.{:03}", ms % 1000)
}

fn ms(us: Option<i64>) -> String {
    us.map_or("-".to_owned(), |us| format!("{:.1} ms", us as f64 / 1000.0))
}

fn lock_vec<T>(v: &Mutex<Vec<T>>) -> std::sync::MutexGuard<'_, Vec<T>> {
    v.lock().unwrap_or_else(|e| e.into_inner())
}

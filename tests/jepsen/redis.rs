//! Jepsen on one machine: three app instances (real child processes, each an axum app
//! behind the lock layer, each on its own network namespace) run guarded
//! read-modify-write increments of fenced registers, while a nemesis partitions an
//! instance from Redis, stalls and slows its proxy, cuts replies in the middle, restarts
//! Redis empty with `kill -9`, and freezes instances with `SIGSTOP`. Every hold is
//! recorded and checked (`support::history`), and every holder cut off from Redis for
//! longer than its lease must stop before the lease ends on the server: the margin
//! (server-side expiry minus the holder's stop) is measured each time and must never be
//! negative (the expiry taken at the latest that the `PTTL` read allows).
//!
//! Runs 60 s of load by default; `JEPSEN_SECS=600 cargo test --test jepsen redis:: -- --nocapture`
//! runs longer. Needs root and iproute2 (it says it skipped otherwise).

use crate::support;

#[path = "app.rs"]
mod app;
#[path = "common.rs"]
mod common;
#[path = "nemesis.rs"]
mod nemesis;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use support::child;
use support::history::{self, Hold, Registers, Write};
use support::netns::{HostRedis, Net};
use support::proxy::FaultProxy;
use tokio_util::sync::CancellationToken;

use common::*;
use nemesis::*;

/// How long a probe (the hold a partition or stall is aimed at) holds when not stopped:
/// longer than the longest cut-off (2 leases).
const PROBE_HOLD: Duration = Duration::from_millis(7000);
/// The instances with a direct (partitionable) link to Redis; the last one goes through
/// the fault proxy.
const PARTITIONABLE: [usize; 2] = [0, 1];
const PROXIED: usize = 2;
/// Lock namespaces: every instance has a backend with the delayed-restart guard (`g`) and
/// one without (`n`), so each Redis restart hits both.
const NAMESPACES: [&str; 2] = ["g", "n"];
const REDIS_PORT: u16 = 6379;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nemesis_workload_keeps_holds_exclusive_and_stops_cut_off_holders_before_expiry() {
    let Some((started, secs)) = begin("nemesis_workload", 60) else {
        return;
    };

    let mut net = Net::new(&["redis", "app0", "app1", "app2"]);
    for &i in &PARTITIONABLE {
        net.link(INSTANCES[i], "redis");
    }
    let mut bind = vec![net.host_ip("redis")];
    bind.extend(
        PARTITIONABLE
            .iter()
            .map(|&i| net.link_ip(INSTANCES[i], "redis")),
    );
    let redis = HostRedis::start(
        &net,
        Some("redis"),
        &bind,
        SocketAddr::from((net.host_ip("redis"), REDIS_PORT)),
        &["--notify-keyspace-events", "Ex", "--hz", "100"],
    );
    let (db, db_port) = start_db(&net);
    let proxy = FaultProxy::start(
        SocketAddr::from((net.root_ip(INSTANCES[PROXIED]), 0)),
        redis.addr(),
    )
    .await;

    let log: SharedLog = Arc::default();
    let stop_readers = CancellationToken::new();
    let observer = tokio::spawn(observe_expiries(redis.addr(), log.clone()));
    let store = |i| {
        let redis_url = if i == PROXIED {
            format!("redis://{}", proxy.addr())
        } else {
            format!(
                "redis://{}:{REDIS_PORT}",
                net.link_ip(INSTANCES[i], "redis")
            )
        };
        vec![(STORE_URL, redis_url)]
    };
    let (pids, readers) = spawn_apps(&net, db_port, store, &log, &stop_readers).await;
    let addrs = app_addrs(&net);
    let mut cluster = Cluster {
        net,
        redis,
        db,
        proxy,
        pids,
    };

    let deadline = tokio::time::Instant::now() + Duration::from_secs(secs);
    let statuses: Arc<Mutex<HashMap<String, usize>>> = Arc::default();
    let load: Vec<_> = (0..6)
        .map(|_| tokio::spawn(load(addrs.clone(), deadline, statuses.clone())))
        .collect();
    let (faults, cut_offs) = run_nemesis(&mut cluster, &addrs, &log, deadline).await;
    drain(load, readers, &stop_readers).await;
    observer.abort();

    let registers = read_registers(&cluster).await;
    let log = std::mem::take(&mut *lock(&log));
    let violations = history::check(&log.holds, &registers);
    let margins = margins(&cut_offs, &log);

    // The summary.
    let by_kind = |kind| faults.iter().filter(|f| **f == kind).count();
    println!(
        "jepsen: {secs} s of load, run time {:.1?}",
        started.elapsed()
    );
    for kind in KINDS {
        println!("  faults {kind:?}: {}", by_kind(kind));
    }
    println!("  replies cut: {}", cluster.proxy.cuts_done());
    let written = log
        .holds
        .iter()
        .filter(|h| matches!(h.write, Write::Written(_)))
        .count();
    println!(
        "  holds checked: {} ({written} acknowledged writes), requests: {:?}",
        log.holds.len(),
        lock_map(&statuses)
    );
    for kind in [Fault::Partition, Fault::Stall, Fault::CutEveryReply] {
        let of_kind: Vec<&Margin> = margins.iter().filter(|m| m.fault == kind).collect();
        let min = of_kind.iter().map(|m| m.margin).min();
        let min_proven = of_kind.iter().map(|m| m.proven).min();
        let min_event = of_kind.iter().filter_map(|m| m.by_event).min();
        let survived = cut_offs.iter().filter(|c| c.fault == kind).count() - of_kind.len();
        println!(
            "  {kind:?}: holder stopped before expiry {} times, min margin {} (at least {}; \
             by the expired event {}), {survived} cut-offs too short to lose the lock",
            of_kind.len(),
            ms(min),
            ms(min_proven),
            ms(min_event),
        );
    }
    history::assert_none(&violations);
    for m in &margins {
        assert!(
            m.margin >= 0,
            "a cut-off holder certainly ran past the server-side expiry: {m:?}"
        );
    }
    assert!(
        !margins.is_empty(),
        "no cut-off holder was stopped: the promise was not exercised"
    );
    assert!(written > 0, "the workload made progress");
}

fn ms(us: Option<i64>) -> String {
    us.map_or("-".to_owned(), |us| format!("{:.1} ms", us as f64 / 1000.0))
}

fn lock_map<T: Clone>(map: &Mutex<T>) -> T {
    map.lock().unwrap_or_else(|e| e.into_inner()).clone()
}

// ---------------------------------------------------------------------------------------
// The promise alone, without namespaces

/// Holders cut off from Redis with every call failing at once (as behind a link that is
/// down) are given up before their leases end on the server. The watchdog used to look at
/// a hold again only when its retry was due, up to lease/10 after the lease had run out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn holders_cut_off_from_redis_stop_before_the_server_expires_their_locks() {
    const HOLDERS: usize = 4;
    let server = support::RedisServer::start();
    let proxy = FaultProxy::start(
        SocketAddr::from(([127, 0, 0, 1], 0)),
        SocketAddr::from(([127, 0, 0, 1], server.port())),
    )
    .await;
    let backend = support::backend(&format!("redis://{}", proxy.addr())).await;
    let mut guards = Vec::new();
    for i in 0..HOLDERS {
        // Acquired at different points of the renewal period.
        let guard = backend
            .lock(format!("cut-{i}"))
            .lease(LEASE)
            .try_once()
            .await
            .expect("uncontended");
        guards.push(guard);
        tokio::time::sleep(LEASE / 3 / HOLDERS as u32).await;
    }
    proxy.reject();
    let mut observer = server.conn().await;
    let mut stops = Vec::new();
    for (i, guard) in guards.iter().enumerate() {
        let asked = now_micros();
        let pttl: i64 = redis::cmd("PTTL")
            .arg(support::lock_key(&format!("cut-{i}")))
            .query_async(&mut observer)
            .await
            .expect("PTTL");
        assert!(pttl > 0, "cut-{i} is still held on the server");
        let expiry = Expiry::from_pttl(asked, now_micros(), pttl).expect("an expiry");
        stops.push(async move {
            tokio::time::timeout(2 * LEASE, guard.lost())
                .await
                .expect("lost() fires");
            let lost = now_micros() as i64;
            (
                i,
                expiry.latest as i64 - lost,
                expiry.earliest as i64 - lost,
            )
        });
    }
    for (i, margin, proven) in futures_util::future::join_all(stops).await {
        println!(
            "cut-{i}: lost() {:.1} ms before the server-side expiry (at least {:.1} ms)",
            margin as f64 / 1000.0,
            proven as f64 / 1000.0
        );
        // Negative only when lost() certainly fired after the expiry (Redis answered PTTL
        // somewhere between sending and receiving).
        assert!(
            margin >= 0,
            "cut-{i}: lost() fired {} µs after the expiry",
            -margin
        );
    }
}

// ---------------------------------------------------------------------------------------
// The checker, fed bad histories

fn hold(instance: usize, token: u64, (start, end): (u64, u64), write: Write) -> Hold {
    Hold {
        instance,
        key: "g-k0".to_owned(),
        token,
        start,
        end,
        write,
    }
}

fn registers(stored: Option<(u64, u64)>) -> Registers {
    Registers::from([("g-k0".to_owned(), stored)])
}

fn rules(holds: &[Hold], stored: Option<(u64, u64)>) -> Vec<&'static str> {
    let violations = history::check(holds, &registers(stored));
    for v in &violations {
        println!("{v}");
    }
    violations.iter().map(|v| v.rule).collect()
}

#[test]
fn checker_accepts_a_history_of_exclusive_holds_and_their_writes() {
    let holds = [
        hold(0, 10, (0, 5), Write::Written(1)),
        hold(1, 11, (5, 9), Write::Skipped),
        hold(2, 12, (10, 20), Write::Unknown(2)),
        hold(0, 13, (21, 30), Write::Written(3)),
        hold(1, 14, (31, 40), Write::Unknown(4)),
    ];
    assert!(rules(&holds, Some((13, 3))).is_empty());
    // The last write's reply was lost but it happened.
    assert!(rules(&holds, Some((14, 4))).is_empty());
}

#[test]
fn checker_reports_overlapping_holds_with_the_offending_pair() {
    let first = hold(0, 10, (0, 50), Write::Written(1));
    let second = hold(1, 11, (20, 30), Write::Skipped);
    // The overlap is found although a short hold lies in between.
    let third = hold(2, 12, (40, 60), Write::Written(2));
    let violations = history::check(
        &[first.clone(), second.clone(), third.clone()],
        &registers(Some((12, 2))),
    );
    let overlaps: Vec<_> = violations
        .iter()
        .filter(|v| v.rule == "holds overlap")
        .collect();
    assert_eq!(overlaps.len(), 2, "{violations:?}");
    assert_eq!(overlaps[0].holds, [first.clone(), second]);
    assert_eq!(overlaps[1].holds, [first, third]);
    assert!(overlaps[0].to_string().contains("token: 11"));
}

#[test]
fn checker_reports_tokens_that_do_not_increase_in_hold_order() {
    let holds = [
        hold(0, 11, (0, 5), Write::Skipped),
        hold(1, 10, (6, 9), Write::Skipped),
    ];
    assert_eq!(
        rules(&holds, None),
        ["tokens do not increase in hold order"]
    );
}

#[test]
fn checker_reports_a_lost_update_and_a_stale_write() {
    // Both read 0 and wrote 1: the second increment overwrote the first.
    let holds = [
        hold(0, 10, (0, 5), Write::Written(1)),
        hold(1, 11, (6, 9), Write::Written(1)),
    ];
    assert_eq!(rules(&holds, Some((11, 1))), ["lost update"]);
    let holds = [
        hold(0, 10, (0, 5), Write::Stale),
        hold(1, 11, (6, 9), Write::Written(1)),
    ];
    assert_eq!(rules(&holds, Some((11, 1))), ["write refused as stale"]);
}

#[test]
fn checker_reports_a_register_without_the_acknowledged_writes() {
    let holds = [
        hold(0, 10, (0, 5), Write::Written(1)),
        hold(1, 11, (6, 9), Write::Written(2)),
    ];
    let lost = "register does not hold the acknowledged writes";
    // An acknowledged write is missing, a value nobody wrote, nothing at all.
    assert_eq!(rules(&holds, Some((10, 1))), [lost]);
    assert_eq!(rules(&holds, Some((11, 7))), [lost]);
    assert_eq!(rules(&holds, None), [lost]);
    // A write nobody acknowledged and older than the last acknowledged one.
    let holds = [
        hold(0, 10, (0, 5), Write::Unknown(1)),
        hold(1, 11, (6, 9), Write::Written(1)),
    ];
    assert_eq!(rules(&holds, Some((10, 1))), [lost]);
}

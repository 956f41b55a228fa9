//! Jepsen on one machine: holders cut off from Redis, checked against the server.

mod support;

use std::net::SocketAddr;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use support::history::{self, Hold, Registers, Write};
use support::proxy::FaultProxy;

/// The lease of every hold: short, so that many faults fit in a run.
const LEASE: Duration = Duration::from_millis(1500);

fn now_micros() -> u64 {
    let since_epoch = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock after 1970");
    u64::try_from(since_epoch.as_micros()).expect("fits")
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
        let before = now_micros();
        let pttl: i64 = redis::cmd("PTTL")
            .arg(support::lock_key(&format!("cut-{i}")))
            .query_async(&mut observer)
            .await
            .expect("PTTL");
        assert!(pttl > 0, "cut-{i} is still held on the server");
        let expiry = before + 1000 * pttl as u64;
        stops.push(async move {
            tokio::time::timeout(2 * LEASE, guard.lost())
                .await
                .expect("lost() fires");
            (i, expiry as i64 - now_micros() as i64)
        });
    }
    for (i, margin) in futures_util::future::join_all(stops).await {
        println!(
            "cut-{i}: lost() {:.1} ms before the server-side expiry",
            margin as f64 / 1000.0
        );
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

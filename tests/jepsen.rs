//! Jepsen on one machine: holders cut off from Redis, checked against the server.

mod support;

use std::net::SocketAddr;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

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

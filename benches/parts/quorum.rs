//! A quorum of five masters (RedLock): tower-lock's `RedisBackend::quorum` next to rslock,
//! a RedLock client, on the same five throwaway redis-servers, measured in the same run.

use std::fmt::Write as _;
use std::time::{Duration, Instant};

use tower_lock::RedisBackend;

use super::support::RedisServer;
use super::{Contender, HotBench, HotRun, INSTANCES, Percentiles, ROUNDS, hot_table, us};

/// The longest lease of the bench's namespace: what the masters' restart guard outwaits
/// after their start (a longer lease asked for is shortened to it).
const MAX_LEASE: Duration = Duration::from_secs(2);

pub async fn quorum(secs: Duration) -> String {
    let servers: Vec<RedisServer> = (0..5).map(|_| RedisServer::start()).collect();
    let urls: Vec<String> = servers.iter().map(RedisServer::url).collect();
    let backend = || async {
        RedisBackend::quorum(&urls)
            .max_lease(MAX_LEASE)
            .build()
            .await
            .expect("quorum backend")
    };
    let first = backend().await;
    // Fresh masters grant nothing until their guard has passed: a waiting lock waits it out.
    first
        .lock("bench:warm-up")
        .wait(Duration::from_secs(20))
        .await
        .expect("past the restart guard")
        .release()
        .await
        .expect("released");
    let mut out = String::from("## A quorum of five masters (RedLock) on loopback\n\n");
    out += &uncontended(&servers[0], &first, rslock::LockManager::new(urls.clone())).await;
    let section = Duration::from_millis(1);
    let bench = HotBench {
        server: &servers[0],
        section,
        secs: secs / ROUNDS,
    };
    let mut towers = Vec::new();
    let mut managers = Vec::new();
    for _ in 0..INSTANCES {
        towers.push(Contender::TowerLock(backend().await));
        managers.push(Contender::Rslock(rslock::LockManager::new(urls.clone())));
    }
    let mutex = std::sync::Arc::new(tokio::sync::Mutex::new(()));
    let mut runs = [
        HotRun::new(
            "tokio::sync::Mutex (in-process ideal)",
            vec![Contender::Mutex(mutex); INSTANCES],
        ),
        HotRun::new("tower-lock on the quorum", towers),
        HotRun::new("rslock 0.10 on the same masters", managers),
    ];
    for _ in 0..ROUNDS {
        for run in &mut runs {
            bench.round(run).await;
        }
    }
    out += &hot_table(section, &runs);
    out += "(Redis CPU and commands are the first master's; each of the five does as much.)\n\n";
    out
}

/// Uncontended acquire + release on the quorum, next to rslock's and a PING of one master.
async fn uncontended(
    master: &RedisServer,
    backend: &RedisBackend,
    manager: rslock::LockManager,
) -> String {
    const N: usize = 1000;
    let mut conn = master.conn().await;
    let (mut pings, mut towers, mut rslocks) = (Vec::new(), Vec::new(), Vec::new());
    // Interleaved, so that all three see the same machine load.
    for i in 0..N + 100 {
        let t = Instant::now();
        let _: String = redis::cmd("PING").query_async(&mut conn).await.unwrap();
        let ping = t.elapsed();
        let t = Instant::now();
        let guard = backend.lock("bench:solo").try_once().await.unwrap();
        guard.release().await.unwrap();
        let tower = t.elapsed();
        let t = Instant::now();
        let lock = manager
            .lock(b"bench:rslock-solo", Duration::from_secs(30))
            .await
            .unwrap();
        manager.unlock(&lock).await;
        let rslock = t.elapsed();
        if i >= 100 {
            pings.push(ping);
            towers.push(tower);
            rslocks.push(rslock);
        }
    }
    let mut out = String::from("### Uncontended acquire + release on five masters\n\n");
    out += "| | p50 | p99 |\n|---|---|---|\n";
    for (name, samples) in [
        ("PING round trip to one master", pings),
        ("tower-lock `try_once` + `release` (quorum)", towers),
        ("rslock 0.10 `lock` + `unlock`", rslocks),
    ] {
        let latency = Percentiles::of(samples);
        let _ = writeln!(
            out,
            "| {name} | {} | {} |",
            us(latency.p50),
            us(latency.p99)
        );
    }
    out += "\n";
    out
}

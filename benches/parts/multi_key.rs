//! Multi-key locks (`lock_many`) next to one key, in the same run: uncontended latency, and
//! 32 tasks over 4 instances on one pair of keys, each naming the pair in a random order.

use std::fmt::Write as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tower_lock::RedisBackend;

use crate::support::RedisServer;
use crate::{INSTANCES, Percentiles, TASKS, WAIT, ms, rate_and_p99, us};

pub async fn multi_key(server: &RedisServer, secs: Duration) -> String {
    const N: usize = 2000;
    let backend = server.backend().await;
    let (mut one, mut two) = (Vec::with_capacity(N), Vec::with_capacity(N));
    for i in 0..N + 200 {
        let t = Instant::now();
        let guard = backend.lock("bench:one").try_once().await.unwrap();
        guard.release().await.unwrap();
        let single = t.elapsed();
        let t = Instant::now();
        let guard = backend
            .lock_many(["bench:pair:a", "bench:pair:b"])
            .try_once()
            .await
            .unwrap();
        guard.release().await.unwrap();
        if i >= 200 {
            one.push(single);
            two.push(t.elapsed());
        }
    }
    let (one, two) = (Percentiles::of(one), Percentiles::of(two));
    let mut out = String::from("### Multi-key locks (`lock_many`)\n\n");
    out += "| | p50 | p99 | 32 tasks over 4 instances: acq/s | wait p99 | overlaps |\n";
    out += "|---|---|---|---|---|---|\n";
    let single = contended(server, secs, 1).await;
    let pair = contended(server, secs, 2).await;
    for (name, latency, (rate, wait_p99, overlaps)) in [
        ("one key", &one, single),
        ("two keys, any order", &two, pair),
    ] {
        let _ = writeln!(
            out,
            "| {name} | {} | {} | {rate:.0} | {} | {overlaps} |",
            us(latency.p50),
            us(latency.p99),
            ms(wait_p99),
        );
    }
    out.push('\n');
    out
}

/// Acquisitions per second, wait p99 and overlapping holds of 32 tasks over 4 backends on
/// `keys` keys (the same ones for every task, each task naming them in its own order).
async fn contended(server: &RedisServer, secs: Duration, keys: usize) -> (f64, Duration, u64) {
    let mut backends: Vec<RedisBackend> = Vec::new();
    for _ in 0..INSTANCES {
        backends.push(server.backend().await);
    }
    let inside = Arc::new(AtomicBool::new(false));
    let overlaps = Arc::new(AtomicU64::new(0));
    let until = Instant::now() + secs;
    let tasks: Vec<_> = (0..TASKS)
        .map(|t| {
            let backend = backends[t % INSTANCES].clone();
            let (inside, overlaps) = (inside.clone(), overlaps.clone());
            tokio::spawn(async move {
                let mut waits = Vec::new();
                while Instant::now() < until {
                    let mut names: Vec<String> =
                        (0..keys).map(|k| format!("bench:hot:{k}")).collect();
                    if t % 2 == 1 {
                        names.reverse();
                    }
                    let started = Instant::now();
                    let guard = backend.lock_many(names).wait(WAIT).await.unwrap();
                    waits.push(started.elapsed());
                    if inside.swap(true, Ordering::SeqCst) {
                        overlaps.fetch_add(1, Ordering::Relaxed);
                    }
                    tokio::task::yield_now().await;
                    inside.store(false, Ordering::SeqCst);
                    guard.release().await.unwrap();
                }
                waits
            })
        })
        .collect();
    let (rate, p99) = rate_and_p99(tasks).await;
    (rate, p99, overlaps.load(Ordering::Relaxed))
}

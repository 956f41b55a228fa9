//! Shared holds (`lock(key).shared()`) and permits (`lock(key).permits(n)`) next to the
//! lock, in the same run: uncontended latency, and 32 tasks over 4 instances on one key,
//! with the most holders seen inside at once (the lock: 1; shared holds: up to 32;
//! permits: up to n).

use std::fmt::Write as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use tower_lock::{LockRequest, RedisBackend};

use crate::support::RedisServer;
use crate::{INSTANCES, Percentiles, TASKS, WAIT, ms, rate_and_p99, us};

/// The permits of the contended semaphore: fewer than the tasks, so that they queue.
const PERMITS: u32 = 4;

#[derive(Clone, Copy)]
enum Hold {
    Lock,
    Shared,
    Permit,
}

impl Hold {
    fn request(self, backend: &RedisBackend, key: &str) -> LockRequest {
        let request = backend.lock(key);
        match self {
            Hold::Lock => request,
            Hold::Shared => request.shared(),
            Hold::Permit => request.permits(PERMITS),
        }
    }
}

pub async fn family(server: &RedisServer, secs: Duration) -> String {
    const N: usize = 2000;
    let holds = [
        ("lock (exclusive)", Hold::Lock),
        ("shared hold", Hold::Shared),
        ("permit (of 4)", Hold::Permit),
    ];
    let backend = server.backend().await;
    let mut latencies = [(); 3].map(|()| Vec::with_capacity(N));
    // Interleaved, so that all three see the same machine load.
    for i in 0..N + 200 {
        for ((_, hold), latency) in holds.iter().zip(&mut latencies) {
            let t = Instant::now();
            let guard = hold
                .request(&backend, "bench:family:solo")
                .try_once()
                .await
                .unwrap();
            guard.release().await.unwrap();
            if i >= 200 {
                latency.push(t.elapsed());
            }
        }
    }
    let mut out = String::from("### Shared holds and permits\n\n");
    out += "| | p50 | p99 | 32 tasks over 4 instances: acq/s | wait p99 | most inside at once |\n";
    out += "|---|---|---|---|---|---|\n";
    for ((name, hold), latency) in holds.into_iter().zip(latencies) {
        let latency = Percentiles::of(latency);
        let (rate, wait_p99, most) = contended(server, secs, hold).await;
        let _ = writeln!(
            out,
            "| {name} | {} | {} | {rate:.0} | {} | {most} |",
            us(latency.p50),
            us(latency.p99),
            ms(wait_p99),
        );
    }
    out.push('\n');
    out
}

/// Acquisitions per second, wait p99 and the most holders inside at once of 32 tasks over
/// 4 backends taking `hold` of one key.
async fn contended(server: &RedisServer, secs: Duration, hold: Hold) -> (f64, Duration, usize) {
    let mut backends: Vec<RedisBackend> = Vec::new();
    for _ in 0..INSTANCES {
        backends.push(server.backend().await);
    }
    let inside = Arc::new(AtomicUsize::new(0));
    let most = Arc::new(AtomicUsize::new(0));
    let until = Instant::now() + secs;
    let tasks: Vec<_> = (0..TASKS)
        .map(|t| {
            let backend = backends[t % INSTANCES].clone();
            let (inside, most) = (inside.clone(), most.clone());
            tokio::spawn(async move {
                let mut waits = Vec::new();
                while Instant::now() < until {
                    let started = Instant::now();
                    let guard = hold
                        .request(&backend, "bench:family:hot")
                        .wait(WAIT)
                        .await
                        .unwrap();
                    waits.push(started.elapsed());
                    let now = inside.fetch_add(1, Ordering::SeqCst) + 1;
                    most.fetch_max(now, Ordering::SeqCst);
                    tokio::task::yield_now().await;
                    inside.fetch_sub(1, Ordering::SeqCst);
                    guard.release().await.unwrap();
                }
                waits
            })
        })
        .collect();
    let (rate, p99) = rate_and_p99(tasks).await;
    (rate, p99, most.load(Ordering::SeqCst))
}

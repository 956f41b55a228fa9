//! A soak: every primitive (exclusive locks, try-once, read locks, permits, multi-key
//! locks, waits given up half-way, guards dropped without a release) from many tasks over
//! three instances on one Redis, with a fault every two seconds (command connections
//! killed, subscriber connections killed, the server paused). When the load stops,
//! everything must go back to how it was before it: no lock, line, writer or permit key
//! left in Redis (fence counters stay, by design, for `fence_ttl`), no channel subscribed,
//! no lock watched or queued in any instance; and no two tasks may have held one key at
//! once. Process RSS and Redis `used_memory` are printed before and after (figures, not
//! assertions: allocators keep what they freed).
//!
//! Runs for `SOAK_SECS` (10 s by default); `SOAK_SECS=1800 cargo test --release --test soak
//! -- --nocapture` is the 30-minute run.

mod support;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use support::RedisServer;
use tokio::time::{Instant, sleep, timeout};
use tower_lock::{LockError, LockGuard, RedisBackend};

const INSTANCES: usize = 3;
const TASKS_PER_INSTANCE: usize = 8;
/// Keys per primitive: few, so that tasks meet on them.
const KEYS: usize = 4;
const LEASE: Duration = Duration::from_secs(2);
const WAIT: Duration = Duration::from_secs(1);
/// A pause of the server: well under the lease, so no hold is lost to it.
const PAUSE: Duration = Duration::from_millis(300);

fn soak_secs() -> u64 {
    std::env::var("SOAK_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(10)
}

/// What the load did, by outcome.
#[derive(Default)]
struct Tally {
    outcomes: std::sync::Mutex<BTreeMap<&'static str, u64>>,
    /// Times a task got an exclusive key another task held.
    overlaps: AtomicU64,
}

impl Tally {
    fn count(&self, outcome: &'static str) {
        let mut outcomes = self.outcomes.lock().unwrap_or_else(|e| e.into_inner());
        *outcomes.entry(outcome).or_default() += 1;
    }

    fn of<T>(&self, result: &Result<T, LockError>) {
        self.count(match result {
            Ok(_) => "held",
            Err(LockError::Contended { .. }) => "contended",
            Err(LockError::TimedOut { .. }) => "timed out",
            Err(LockError::Backend(_)) => "store error",
            Err(_) => "other error",
        });
    }

    /// Counts what `taken` was, and gives back the hold it got.
    async fn release(&self, taken: Result<LockGuard, LockError>) {
        self.of(&taken);
        if let Ok(guard) = taken {
            self.give_back(guard).await;
        }
    }

    async fn give_back(&self, guard: LockGuard) {
        tokio::task::yield_now().await;
        let released = guard.release().await;
        self.count(if released.is_ok() {
            "released"
        } else {
            "release failed"
        });
    }
}

/// Holders of each exclusive key, to see two at once.
struct Inside(Vec<AtomicU32>);

impl Inside {
    /// Counts what `taken` (of exclusive key `key`) was; a hold it got is checked for
    /// another holder, then released, or dropped unreleased (the release goes on in the
    /// background).
    async fn hold(
        &self,
        key: usize,
        taken: Result<LockGuard, LockError>,
        tally: &Tally,
        release: bool,
    ) {
        tally.of(&taken);
        let Ok(guard) = taken else {
            return;
        };
        if self.0[key].fetch_add(1, Ordering::SeqCst) != 0 && !guard.is_lost() {
            tally.overlaps.fetch_add(1, Ordering::Relaxed);
        }
        tokio::task::yield_now().await;
        self.0[key].fetch_sub(1, Ordering::SeqCst);
        if release {
            tally.give_back(guard).await;
        } else {
            drop(guard);
        }
    }
}

/// One task's loop: a primitive at random, until `stop`.
async fn load(
    backend: RedisBackend,
    inside: Arc<Inside>,
    tally: Arc<Tally>,
    stop: Arc<AtomicBool>,
) {
    while !stop.load(Ordering::Relaxed) {
        let key = fastrand::usize(..KEYS);
        let exclusive = backend.lock(format!("ex:{key}")).lease(LEASE);
        match fastrand::u8(..7) {
            0 => {
                inside
                    .hold(key, exclusive.wait(WAIT).await, &tally, true)
                    .await
            }
            1 => {
                inside
                    .hold(key, exclusive.try_once().await, &tally, true)
                    .await
            }
            2 => {
                let shared = backend.lock(format!("rw:{key}")).shared().lease(LEASE);
                tally.release(shared.wait(WAIT).await).await;
            }
            3 => {
                let permit = backend.lock(format!("sem:{key}")).permits(3).lease(LEASE);
                tally.release(permit.wait(WAIT).await).await;
            }
            4 => {
                let other = (key + 1) % KEYS;
                let keys = [format!("many:{key}"), format!("many:{other}")];
                tally
                    .release(backend.lock_many(keys).lease(LEASE).wait(WAIT).await)
                    .await;
            }
            5 => {
                // A request that goes away while it waits.
                let gone = Duration::from_millis(fastrand::u64(1..20));
                match timeout(gone, exclusive.wait(WAIT)).await {
                    Err(_) => tally.count("given up"),
                    Ok(taken) => inside.hold(key, taken, &tally, true).await,
                }
            }
            // Dropped, not released: the release goes on in the background.
            _ => {
                inside
                    .hold(key, exclusive.wait(WAIT).await, &tally, false)
                    .await
            }
        }
    }
}

/// A fault every two seconds, in turn, until `stop`.
async fn nemesis(server: &RedisServer, stop: Arc<AtomicBool>, tally: Arc<Tally>) {
    let mut turn = 0u32;
    while !stop.load(Ordering::Relaxed) {
        sleep(Duration::from_secs(2)).await;
        match turn % 3 {
            0 => {
                let mut conn = server.conn().await;
                let _: redis::RedisResult<i64> = redis::cmd("CLIENT")
                    .arg("KILL")
                    .arg("TYPE")
                    .arg("normal")
                    .query_async(&mut conn)
                    .await;
                tally.count("fault: command connections killed");
            }
            1 => {
                server.kill_subscribers().await;
                tally.count("fault: subscribers killed");
            }
            _ => {
                server.pause();
                sleep(PAUSE).await;
                server.resume();
                tally.count("fault: server paused");
            }
        }
        turn += 1;
    }
}

/// This process's resident set, from `/proc/self/status`, in KiB.
fn rss_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

async fn used_memory(server: &RedisServer) -> u64 {
    let info: String = redis::cmd("INFO")
        .arg("memory")
        .query_async(&mut server.conn().await)
        .await
        .expect("INFO memory");
    info.lines()
        .find_map(|l| l.strip_prefix("used_memory:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

/// Redis keys that must not outlive the load: all but the fence counters.
async fn leftovers(server: &RedisServer) -> Vec<String> {
    let mut keys = server.keys().await;
    keys.retain(|k| !k.ends_with(":fence"));
    keys
}

/// Whether an instance keeps anything of the load: watched, queued or subscribed.
fn busy(backend: &RedisBackend) -> bool {
    let stats = backend.stats();
    stats.watched_locks + stats.local_queues + stats.local_waiters + stats.channels_with_waiters > 0
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mixed_load_with_faults_leaves_nothing_behind() {
    support::init_tracing();
    let server = RedisServer::start();
    let mut backends = Vec::new();
    for _ in 0..INSTANCES {
        backends.push(support::backend(&server.url()).await);
    }
    let (rss_before, memory_before) = (rss_kib(), used_memory(&server).await);
    assert!(
        leftovers(&server).await.is_empty(),
        "nothing before the load"
    );
    assert!(server.channels().await.is_empty());

    let stop = Arc::new(AtomicBool::new(false));
    let tally = Arc::new(Tally::default());
    let inside = Arc::new(Inside((0..KEYS).map(|_| AtomicU32::new(0)).collect()));
    let mut tasks = Vec::new();
    for backend in &backends {
        for _ in 0..TASKS_PER_INSTANCE {
            let load = load(backend.clone(), inside.clone(), tally.clone(), stop.clone());
            tasks.push(tokio::spawn(load));
        }
    }
    let secs = soak_secs();
    let started = Instant::now();
    let faults = nemesis(&server, stop.clone(), tally.clone());
    let _ = timeout(Duration::from_secs(secs), faults).await;
    stop.store(true, Ordering::Relaxed);
    server.resume();
    for task in tasks {
        task.await.expect("a load task ends");
    }
    let loaded = started.elapsed();

    let settled = Instant::now();
    support::eventually(
        "Redis keeps no lock, line, writer or permit key",
        || async { leftovers(&server).await.is_empty() },
    )
    .await;
    support::eventually("no channel is subscribed", || async {
        server.channels().await.is_empty()
    })
    .await;
    support::eventually("no instance watches, queues or waits", || async {
        !backends.iter().any(busy)
    })
    .await;
    let (rss_after, memory_after) = (rss_kib(), used_memory(&server).await);
    let outcomes = tally
        .outcomes
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clone();
    println!(
        "soak: {loaded:?} of load ({INSTANCES} instances x {TASKS_PER_INSTANCE} tasks), settled \
         {:?} after it; outcomes {outcomes:?}; RSS {rss_before} -> {rss_after} KiB; Redis \
         used_memory {memory_before} -> {memory_after} bytes ({} fence counters kept)",
        settled.elapsed(),
        server.keys().await.len(),
    );
    assert_eq!(
        tally.overlaps.load(Ordering::Relaxed),
        0,
        "two holders of one key"
    );
    assert!(
        outcomes.get("held").copied().unwrap_or(0) > 0,
        "the load took locks"
    );
}

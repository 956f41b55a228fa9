//! Contention benchmark: tower-lock against an in-process mutex and two Redis peers.
//!
//! `cargo bench --bench contention` starts its own throwaway redis-server on a free port
//! (never 6379), measures every figure in the same run, and prints markdown tables. The
//! issue's targets are printed next to the figures; nothing is asserted (machines are
//! noisy). Set `BENCH_SECS` to change the length of each hot-key run (default 3).

#[path = "../tests/support/mod.rs"]
mod support;

use std::alloc::{GlobalAlloc, Layout, System};
use std::fmt::Write as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::extract::Request;
use axum::routing::post;
use redis::aio::MultiplexedConnection;
use support::RedisServer;
use tower::ServiceExt;
use tower_lock::{LockLayer, RedisBackend};

/// Counts live heap bytes, to report the memory one waiter costs.
struct CountingAlloc;

static LIVE_BYTES: AtomicUsize = AtomicUsize::new(0);

// SAFETY (why unsafe is needed): a global allocator can only be written with unsafe; this
// one forwards every call to the system allocator unchanged and only counts sizes.
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded as is.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            LIVE_BYTES.fetch_add(layout.size(), Ordering::Relaxed);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded as is.
        unsafe { System.dealloc(ptr, layout) };
        LIVE_BYTES.fetch_sub(layout.size(), Ordering::Relaxed);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: forwarded as is.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            LIVE_BYTES.fetch_add(new_size, Ordering::Relaxed);
            LIVE_BYTES.fetch_sub(layout.size(), Ordering::Relaxed);
        }
        p
    }
}

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

const HOT_KEY: &str = "bench:hot";
const TASKS: usize = 32;
const INSTANCES: usize = 4;
const LEASE: Duration = Duration::from_secs(30);
const WAIT: Duration = Duration::from_secs(60);

fn main() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime");
    let started = Instant::now();
    let report = runtime.block_on(run());
    println!("{report}");
    println!(
        "(whole benchmark: {:.0} s)",
        started.elapsed().as_secs_f64()
    );
}

async fn run() -> String {
    let server = RedisServer::start();
    let version: String = info(&server, "server")
        .await
        .lines()
        .find_map(|l| l.strip_prefix("redis_version:").map(str::to_owned))
        .unwrap_or_default();
    let secs = std::env::var("BENCH_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(3.0);
    let mut out = String::new();
    let _ = writeln!(
        out,
        "Redis {version} on loopback, {} cores, tokio with 2 workers, {TASKS} tasks over \
         {INSTANCES} instances for the hot key, {secs} s per run.\n",
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    out += &uncontended(&server).await;
    out += &hot_key(&server, Duration::from_secs_f64(secs)).await;
    out += &http(&server).await;
    out += &scale(&server).await;
    out
}

// ---------------------------------------------------------------------------------------
// Uncontended acquire + release next to the PING round trip.

async fn uncontended(server: &RedisServer) -> String {
    const N: usize = 3000;
    let backend = server.backend().await;
    let mut conn = server.conn().await;
    let empty = redis::Script::new("return 1");
    let mut pings = Vec::with_capacity(N);
    let mut scripts = Vec::with_capacity(N);
    let mut locks = Vec::with_capacity(N);
    // Interleaved, so that all three see the same machine load.
    for i in 0..N + 200 {
        let t = Instant::now();
        let _: String = redis::cmd("PING").query_async(&mut conn).await.unwrap();
        let ping = t.elapsed();
        let t = Instant::now();
        for _ in 0..2 {
            let _: i64 = empty.invoke_async(&mut conn).await.unwrap();
        }
        let script = t.elapsed();
        let t = Instant::now();
        let guard = backend.lock("bench:solo").try_once().await.unwrap();
        guard.release().await.unwrap();
        let lock = t.elapsed();
        if i >= 200 {
            pings.push(ping);
            scripts.push(script);
            locks.push(lock);
        }
    }
    let usage = RedisUsage::now(server).await;
    for _ in 0..N {
        let guard = backend.lock("bench:solo").try_once().await.unwrap();
        guard.release().await.unwrap();
    }
    let (cpu, calls) = RedisUsage::now(server).await.per_op(usage, N as u64);
    let usage = RedisUsage::now(server).await;
    for _ in 0..N {
        let _: String = redis::cmd("PING").query_async(&mut conn).await.unwrap();
    }
    let (ping_cpu, _) = RedisUsage::now(server).await.per_op(usage, N as u64);
    let (ping, script, lock) = (
        Percentiles::of(pings),
        Percentiles::of(scripts),
        Percentiles::of(locks),
    );
    let mut out = String::from("### Uncontended acquire + release\n\n");
    out += "| | p50 | p99 |\n|---|---|---|\n";
    let _ = writeln!(
        out,
        "| Redis PING round trip | {} | {} |",
        us(ping.p50),
        us(ping.p99)
    );
    let _ = writeln!(
        out,
        "| two EVALSHA of `return 1` (the floor of one script per step) | {} | {} |",
        us(script.p50),
        us(script.p99)
    );
    let _ = writeln!(
        out,
        "| tower-lock `try_once` + `release` | {} | {} |",
        us(lock.p50),
        us(lock.p99)
    );
    let _ = writeln!(
        out,
        "\nRound trips per acquire + release (p50 / PING p50): **{:.2}** (target <= 2.5); \
         Redis: {calls:.2} commands (scripts count their calls), {cpu:.1} us CPU per pair, \
         {ping_cpu:.1} us CPU per PING.\n",
        lock.p50.as_secs_f64() / ping.p50.as_secs_f64()
    );
    out
}

// ---------------------------------------------------------------------------------------
// One hot key.

/// One way of taking the hot key; each task gets its own handle (its "instance").
#[derive(Clone)]
enum Contender {
    Mutex(Arc<tokio::sync::Mutex<()>>),
    TowerLock(RedisBackend),
    Rslock(rslock::LockManager),
    SetNx(MultiplexedConnection),
}

/// Compare-and-delete for the SET NX peer: the usual release of a SET NX lock.
const SETNX_UNLOCK: &str =
    "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0";

impl Contender {
    /// Takes the lock, records how long that took, runs the critical section, releases.
    async fn round(&mut self, section: Duration, shared: &Shared, waits: &mut Vec<Duration>) {
        let t = Instant::now();
        match self {
            Contender::Mutex(mutex) => {
                let guard = mutex.lock().await;
                waits.push(t.elapsed());
                shared.critical(section).await;
                drop(guard);
            }
            Contender::TowerLock(backend) => {
                let guard = backend.lock(HOT_KEY).lease(LEASE).wait(WAIT).await.unwrap();
                waits.push(t.elapsed());
                shared.critical(section).await;
                guard.release().await.unwrap();
            }
            Contender::Rslock(manager) => {
                let guard = manager.acquire(HOT_KEY.as_bytes(), LEASE).await.unwrap();
                waits.push(t.elapsed());
                shared.critical(section).await;
                guard.release().await;
            }
            Contender::SetNx(conn) => {
                let token = uuid::Uuid::new_v4().to_string();
                loop {
                    let set: Option<String> = redis::cmd("SET")
                        .arg(HOT_KEY)
                        .arg(&token)
                        .arg("NX")
                        .arg("PX")
                        .arg(LEASE.as_millis() as u64)
                        .query_async(conn)
                        .await
                        .unwrap();
                    if set.is_some() {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                waits.push(t.elapsed());
                shared.critical(section).await;
                let _: i64 = redis::Script::new(SETNX_UNLOCK)
                    .key(HOT_KEY)
                    .arg(&token)
                    .invoke_async(conn)
                    .await
                    .unwrap();
            }
        }
    }
}

/// The state the critical sections guard: a read-modify-write that loses updates unless
/// the lock excludes the other tasks.
struct Shared {
    counter: AtomicU64,
    stop: AtomicBool,
}

impl Shared {
    async fn critical(&self, section: Duration) {
        let read = self.counter.load(Ordering::SeqCst);
        // Busy, not asleep: tokio's timer has 1 ms granularity.
        let t = Instant::now();
        while t.elapsed() < section {
            std::hint::spin_loop();
        }
        tokio::task::yield_now().await;
        self.counter.store(read + 1, Ordering::SeqCst);
    }
}

struct HotRun {
    name: &'static str,
    acquisitions: u64,
    rate: f64,
    waits: Percentiles,
    /// Redis CPU microseconds and commands per acquisition.
    redis: Option<(f64, f64)>,
    lost: u64,
}

async fn hot_key(server: &RedisServer, secs: Duration) -> String {
    let mut out = String::new();
    for section in [Duration::ZERO, Duration::from_millis(1)] {
        let bench = HotBench {
            server,
            section,
            secs,
        };
        let mutex = Arc::new(tokio::sync::Mutex::new(()));
        let mut towers = Vec::new();
        let mut queue_only = Vec::new();
        let mut managers = Vec::new();
        let mut conns = Vec::new();
        for _ in 0..INSTANCES {
            towers.push(Contender::TowerLock(server.backend().await));
            let backend = RedisBackend::builder(server.url()).max_local_handoffs(0);
            queue_only.push(Contender::TowerLock(backend.build().await.unwrap()));
            managers.push(Contender::Rslock(rslock::LockManager::new(vec![
                server.url(),
            ])));
            conns.push(Contender::SetNx(server.conn().await));
        }
        let runs = [
            bench
                .run(
                    "tokio::sync::Mutex (in-process ideal)",
                    vec![Contender::Mutex(mutex); INSTANCES],
                )
                .await,
            bench.run("tower-lock", towers).await,
            bench
                .run("tower-lock, handoff off (queue only)", queue_only)
                .await,
            bench.run("rslock 0.10 (default retry)", managers).await,
            bench.run("SET NX PX + 10 ms sleep", conns).await,
        ];
        out += &hot_table(section, &runs);
    }
    out
}

/// One critical-section length on one server.
struct HotBench<'a> {
    server: &'a RedisServer,
    section: Duration,
    secs: Duration,
}

impl HotBench<'_> {
    /// Runs `TASKS` tasks spread over `instances` for `secs`.
    async fn run(&self, name: &'static str, instances: Vec<Contender>) -> HotRun {
        let on_redis = !matches!(instances[0], Contender::Mutex(_));
        let shared = Arc::new(Shared {
            counter: AtomicU64::new(0),
            stop: AtomicBool::new(false),
        });
        let section = self.section;
        let usage = RedisUsage::now(self.server).await;
        let started = Instant::now();
        let tasks: Vec<_> = (0..TASKS)
            .map(|i| {
                let mut contender = instances[i % instances.len()].clone();
                let shared = shared.clone();
                tokio::spawn(async move {
                    let mut waits = Vec::new();
                    while !shared.stop.load(Ordering::Relaxed) {
                        contender.round(section, &shared, &mut waits).await;
                    }
                    waits
                })
            })
            .collect();
        tokio::time::sleep(self.secs).await;
        shared.stop.store(true, Ordering::Relaxed);
        let mut waits = Vec::new();
        for task in tasks {
            waits.extend(task.await.unwrap());
        }
        let elapsed = started.elapsed();
        let acquisitions = waits.len() as u64;
        let redis = RedisUsage::now(self.server)
            .await
            .per_op(usage, acquisitions);
        HotRun {
            name,
            acquisitions,
            rate: acquisitions as f64 / elapsed.as_secs_f64(),
            waits: Percentiles::of(waits),
            redis: on_redis.then_some(redis),
            lost: acquisitions - shared.counter.load(Ordering::SeqCst),
        }
    }
}

fn hot_table(section: Duration, runs: &[HotRun]) -> String {
    let mutex_rate = runs[0].rate;
    let mut out = format!(
        "### One hot key, {TASKS} tasks over {INSTANCES} instances, {} ms busy critical section\n\n",
        section.as_millis()
    );
    out += "| lock | acq/s | vs mutex | wait p50 | wait p99 | wait max | p99/p50 | Redis CPU us/acq | Redis cmds/acq | lost updates |\n";
    out += "|---|---|---|---|---|---|---|---|---|---|\n";
    for run in runs {
        let _ = writeln!(
            out,
            "| {} | {:.0} | {:.0}% | {} | {} | {} | {:.1} | {} | {} | {} |",
            run.name,
            run.rate,
            100.0 * run.rate / mutex_rate,
            ms(run.waits.p50),
            ms(run.waits.p99),
            ms(run.waits.max),
            run.waits.p99.as_secs_f64() / run.waits.p50.as_secs_f64().max(1e-9),
            run.redis
                .map_or("-".to_owned(), |(cpu, _)| format!("{cpu:.1}")),
            run.redis
                .map_or("-".to_owned(), |(_, calls)| format!("{calls:.2}")),
            run.lost,
        );
    }
    let _ = writeln!(
        out,
        "\n({} acquisitions in total)\n",
        runs.iter().map(|r| r.acquisitions).sum::<u64>()
    );
    out
}

// ---------------------------------------------------------------------------------------
// HTTP: axum with and without the layer.

async fn http(server: &RedisServer) -> String {
    let backend = server.backend().await;
    let handler = post(|| async { "ok" });
    let plain = Router::new().route("/item/{id}", handler.clone());
    let unlocked = Router::new()
        .route("/item/{id}", handler.clone())
        .route_layer(LockLayer::new(
            backend.clone(),
            |_: &Request| None::<String>,
        ));
    let locked = Router::new()
        .route("/item/{id}", handler)
        .route_layer(LockLayer::new(backend.clone(), |req: &Request| {
            Some(req.uri().path().to_owned())
        }));
    let mut out = String::from("### HTTP (axum, hyper client, 32 concurrent connections)\n\n");
    out += "| route | req/s over HTTP | in-process ns/request |\n|---|---|---|\n";
    let mut in_process = Vec::new();
    for (name, app) in [
        ("no layer", plain),
        ("layer, key fn returns None", unlocked),
        ("layer, locked, distinct keys", locked),
    ] {
        let ns = in_process_ns(app.clone()).await;
        in_process.push(ns);
        let rate = http_rate(app).await;
        let _ = writeln!(out, "| {name} | {rate:.0} | {ns:.0} |");
    }
    let _ = writeln!(
        out,
        "\nUnlocked route overhead: **{:.0} ns** per request (target < 1 us)\n",
        in_process[1] - in_process[0]
    );
    out
}

/// Mean time of one request through the router without a network, sequentially.
async fn in_process_ns(app: Router) -> f64 {
    const N: u64 = 20_000;
    let mut total = Duration::ZERO;
    for i in 0..N + 1000 {
        let request = Request::post(format!("/item/{i}"))
            .body(Body::empty())
            .unwrap();
        let t = Instant::now();
        let response = app.clone().oneshot(request).await.unwrap();
        let elapsed = t.elapsed();
        assert!(response.status().is_success());
        if i >= 1000 {
            total += elapsed;
        }
    }
    total.as_nanos() as f64 / N as f64
}

async fn http_rate(app: Router) -> f64 {
    let addr = support::serve(app).await;
    let client = support::http_client();
    let next = Arc::new(AtomicU64::new(0));
    let until = Instant::now() + Duration::from_secs(2);
    let started = Instant::now();
    let tasks: Vec<_> = (0..32)
        .map(|_| {
            let (client, next) = (client.clone(), next.clone());
            tokio::spawn(async move {
                let mut done = 0u64;
                while Instant::now() < until {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let reply = support::post(&client, addr, &format!("/item/{i}")).await;
                    assert_eq!(reply.status, 200);
                    done += 1;
                }
                done
            })
        })
        .collect();
    let mut done = 0;
    for task in tasks {
        done += task.await.unwrap();
    }
    done as f64 / started.elapsed().as_secs_f64()
}

// ---------------------------------------------------------------------------------------
// Scale: 10k waiters over 1k keys.

async fn scale(server: &RedisServer) -> String {
    const KEYS: usize = 1000;
    const WAITERS: usize = 10_000;
    let (connections_before, _) = connections(server).await;
    let holder = server.backend().await;
    let waiting = server.backend().await;
    let mut guards = Vec::new();
    for k in 0..KEYS {
        guards.push(holder.lock(format!("scale:{k}")).try_once().await.unwrap());
    }
    let before = LIVE_BYTES.load(Ordering::Relaxed);
    let tasks: Vec<_> = (0..WAITERS)
        .map(|i| {
            let backend = waiting.clone();
            tokio::spawn(async move {
                let guard = backend
                    .lock(format!("scale:{}", i % KEYS))
                    .wait(WAIT)
                    .await
                    .unwrap();
                guard.release().await.unwrap();
            })
        })
        .collect();
    let settle = Instant::now() + Duration::from_secs(30);
    loop {
        let stats = waiting.stats();
        if stats.local_waiters == WAITERS - KEYS && stats.channels_with_waiters == KEYS {
            break;
        }
        assert!(Instant::now() < settle, "waiters did not settle: {stats:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Let the subscriber finish confirming channels before counting.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let after = LIVE_BYTES.load(Ordering::Relaxed);
    let (connections_after, subscribed) = connections(server).await;
    let drain = Instant::now();
    for guard in guards {
        guard.release().await.unwrap();
    }
    for task in tasks {
        task.await.unwrap();
    }
    let drained = drain.elapsed();
    let per_waiter = after.saturating_sub(before) as f64 / WAITERS as f64;
    let mut out = String::from("### Scale: 10k concurrent waiters over 1k keys\n\n");
    out += "| | value | target |\n|---|---|---|\n";
    let _ = writeln!(
        out,
        "| heap per waiter (task + acquisition + queue entry) | {per_waiter:.0} B | < 2048 B |"
    );
    let _ = writeln!(
        out,
        "| Redis connections of the two backends (one holding, one with the 10k waiters) | {} | |",
        connections_after - connections_before
    );
    let _ = writeln!(
        out,
        "| connections subscribed to channels, and their channels | {} | 1 subscriber per backend |",
        subscribed
            .iter()
            .map(|n| format!("1 with {n}"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    let _ = writeln!(
        out,
        "| time to serve all 10k after the holders released | {} | |",
        ms(drained)
    );
    out
}

// ---------------------------------------------------------------------------------------
// Helpers.

/// Connections open on the server (not counting the one asking), and the channel counts
/// of those subscribed to any.
async fn connections(server: &RedisServer) -> (usize, Vec<usize>) {
    let clients: String = redis::cmd("CLIENT")
        .arg("LIST")
        .query_async(&mut server.conn().await)
        .await
        .unwrap();
    let subscribed = clients
        .lines()
        .filter_map(|l| l.split(' ').find_map(|f| f.strip_prefix("sub=")))
        .filter_map(|n| n.parse::<usize>().ok())
        .filter(|&n| n > 0)
        .collect();
    (clients.lines().count() - 1, subscribed)
}

struct Percentiles {
    p50: Duration,
    p99: Duration,
    max: Duration,
}

impl Percentiles {
    fn of(mut samples: Vec<Duration>) -> Self {
        samples.sort_unstable();
        let at = |q: f64| {
            samples
                .get(((samples.len() as f64 * q) as usize).min(samples.len().saturating_sub(1)))
                .copied()
                .unwrap_or_default()
        };
        Percentiles {
            p50: at(0.5),
            p99: at(0.99),
            max: samples.last().copied().unwrap_or_default(),
        }
    }
}

fn us(d: Duration) -> String {
    format!("{:.0} us", d.as_secs_f64() * 1e6)
}

fn ms(d: Duration) -> String {
    format!("{:.1} ms", d.as_secs_f64() * 1e3)
}

async fn info(server: &RedisServer, section: &str) -> String {
    redis::cmd("INFO")
        .arg(section)
        .query_async(&mut server.conn().await)
        .await
        .unwrap()
}

/// What the redis-server process has done so far.
#[derive(Clone, Copy)]
struct RedisUsage {
    /// Seconds of CPU (user + system).
    cpu: f64,
    /// Commands run, counting those run by scripts.
    calls: u64,
}

impl RedisUsage {
    async fn now(server: &RedisServer) -> Self {
        let cpu = info(server, "cpu")
            .await
            .lines()
            .filter_map(|l| {
                l.strip_prefix("used_cpu_sys:")
                    .or_else(|| l.strip_prefix("used_cpu_user:"))
            })
            .filter_map(|v| v.trim().parse::<f64>().ok())
            .sum();
        let calls = info(server, "commandstats")
            .await
            .lines()
            .filter_map(|l| {
                l.split_once(':')?
                    .1
                    .split(',')
                    .find_map(|kv| kv.strip_prefix("calls="))
            })
            .filter_map(|n| n.parse::<u64>().ok())
            .sum();
        RedisUsage { cpu, calls }
    }

    /// CPU microseconds and commands per operation since `before`.
    fn per_op(self, before: RedisUsage, ops: u64) -> (f64, f64) {
        let ops = ops.max(1) as f64;
        (
            (self.cpu - before.cpu) * 1e6 / ops,
            (self.calls - before.calls) as f64 / ops,
        )
    }
}

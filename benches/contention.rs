//! Contention benchmark: tower-lock against an in-process mutex and two Redis peers.
//!
//! `cargo bench --bench contention` starts its own throwaway redis-server on a free port
//! (never 6379), measures every figure in the same run, and prints markdown tables. The
//! issue's targets are printed next to the figures; nothing is asserted (machines are
//! noisy). Set `BENCH_SECS` to change the length of each hot-key run (default 3).
//!
//! Arguments after `--` pick tables by name: `cargo bench --bench contention --
//! uncontended` prints only the uncontended table (a few seconds). The names are
//! `uncontended`, `instructions` (needs valgrind), `hot_key`, `multi_key`, `family`, `http`, `scale`, `postgres`, `mysql`,
//! `etcd` (with `--features etcd`), `zookeeper`, `quorum` and `metrics`; a table runs when its name contains one of the arguments, and
//! every table runs when none is given.

#[path = "../tests/support/mod.rs"]
mod support;

#[path = "parts/multi_key.rs"]
mod multi_key;

#[path = "parts/family.rs"]
mod family;

#[path = "parts/sweep.rs"]
mod sweep;

#[path = "parts/sql.rs"]
mod sql;

#[path = "parts/postgres.rs"]
mod postgres;

#[path = "parts/mysql.rs"]
mod mysql;

#[cfg(feature = "etcd")]
#[path = "parts/etcd.rs"]
mod etcd;
#[path = "parts/instructions.rs"]
mod instructions;
#[path = "parts/quorum.rs"]
mod quorum;
#[path = "parts/zookeeper.rs"]
mod zookeeper;

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
use tower_lock::{
    LockBackend, LockLayer, MySqlBackend, PostgresBackend, RedisBackend, ZooKeeperBackend,
};

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
         {INSTANCES} instances for the hot key, {secs} s per lock and section in {ROUNDS} rounds.\n",
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    let wanted = Tables::from_args();
    if wanted.has("uncontended") {
        out += &uncontended(&server).await;
    }
    if wanted.has("instructions") {
        out += &instructions::instructions().await;
    }
    if wanted.has("hot_key") {
        out += &hot_key(&server, Duration::from_secs_f64(secs)).await;
    }
    if wanted.has("multi_key") {
        out += &multi_key::multi_key(&server, Duration::from_secs_f64(secs)).await;
    }
    if wanted.has("family") {
        out += &family::family(&server, Duration::from_secs_f64(secs)).await;
    }
    if wanted.has("http") {
        out += &http(&server).await;
    }
    if wanted.has("scale") {
        out += &scale(&server).await;
    }
    if wanted.has("postgres") {
        out += &postgres::postgres(&server, Duration::from_secs_f64(secs)).await;
    }
    if wanted.has("mysql") {
        out += &mysql::mysql(&server, Duration::from_secs_f64(secs)).await;
    }
    if wanted.has("etcd") {
        #[cfg(feature = "etcd")]
        {
            out += &etcd::etcd(&server, Duration::from_secs_f64(secs)).await;
        }
        #[cfg(not(feature = "etcd"))]
        eprintln!("the etcd table needs `--features etcd` (its client's build needs protoc)");
    }
    if wanted.has("zookeeper") {
        out += &zookeeper::zookeeper(&server, Duration::from_secs_f64(secs)).await;
    }
    if wanted.has("quorum") {
        out += &quorum::quorum(Duration::from_secs_f64(secs)).await;
    }
    // Last: it installs the process's metrics recorder, which every later figure would pay.
    if wanted.has("metrics") {
        out += &metrics_cost().await;
    }
    out
}

/// The tables named on the command line (`cargo bench --bench contention -- NAME..`).
struct Tables(Vec<String>);

impl Tables {
    /// Cargo passes `--bench` to every bench target; other flags are ignored too.
    fn from_args() -> Self {
        Tables(
            std::env::args()
                .skip(1)
                .filter(|arg| !arg.starts_with('-'))
                .collect(),
        )
    }

    fn has(&self, table: &str) -> bool {
        self.0.is_empty() || self.0.iter().any(|name| table.contains(name.as_str()))
    }
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
    out += &latency_table(&[
        ("Redis PING round trip", &ping),
        (
            "two EVALSHA of `return 1` (the floor of one script per step)",
            &script,
        ),
        ("tower-lock `try_once` + `release`", &lock),
    ]);
    let _ = writeln!(
        out,
        "\nRound trips per acquire + release (p50 / PING p50): **{:.2}** (target <= 2.2); \
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
    Postgres(PostgresBackend),
    MySql(MySqlBackend),
    #[cfg(feature = "etcd")]
    Etcd(tower_lock::EtcdBackend),
    ZooKeeper(ZooKeeperBackend),
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
            Contender::TowerLock(backend) => tower_round(backend, t, section, shared, waits).await,
            Contender::Postgres(backend) => tower_round(backend, t, section, shared, waits).await,
            Contender::MySql(backend) => tower_round(backend, t, section, shared, waits).await,
            #[cfg(feature = "etcd")]
            Contender::Etcd(backend) => tower_round(backend, t, section, shared, waits).await,
            Contender::ZooKeeper(backend) => {
                tower_round(backend, t, section, shared, waits).await;
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

/// One round of tower-lock on any store (`t`: when the round started).
async fn tower_round(
    backend: &impl LockBackend,
    t: Instant,
    section: Duration,
    shared: &Shared,
    waits: &mut Vec<Duration>,
) {
    let guard = backend.lock(HOT_KEY).lease(LEASE).wait(WAIT).await.unwrap();
    waits.push(t.elapsed());
    shared.critical(section).await;
    guard.release().await.unwrap();
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

/// What the rounds of one lock added up to.
struct HotRun {
    name: &'static str,
    instances: Vec<Contender>,
    acquisitions: u64,
    elapsed: Duration,
    waits: Vec<Duration>,
    /// Redis CPU seconds and commands over the rounds (`None` for the in-process mutex).
    redis: Option<(f64, u64)>,
    lost: u64,
    /// Acquisitions made by each instance.
    per_instance: Vec<u64>,
}

/// Rounds per critical-section length: the locks take turns, so that a burst of load
/// from elsewhere on the machine does not fall on one of them only.
const ROUNDS: u32 = 3;

async fn hot_key(server: &RedisServer, secs: Duration) -> String {
    let mut out = String::new();
    let mut points = Vec::new();
    for section in sweep::SECTIONS {
        let bench = HotBench {
            server,
            section,
            secs: secs / ROUNDS,
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
        let mut runs = [
            HotRun::new(
                "tokio::sync::Mutex (in-process ideal)",
                vec![Contender::Mutex(mutex); INSTANCES],
            ),
            HotRun::new("tower-lock", towers),
            HotRun::new("tower-lock, handoff off (queue only)", queue_only),
            HotRun::new("rslock 0.10 (default retry)", managers),
            HotRun::new("SET NX PX + 10 ms sleep", conns),
        ];
        for _ in 0..ROUNDS {
            for run in &mut runs {
                bench.round(run).await;
            }
        }
        if [Duration::ZERO, Duration::from_millis(1)].contains(&section) {
            out += &hot_table(section, &runs);
        }
        points.extend(runs.iter().map(|run| sweep::Point::of(section, run)));
    }
    out += &sweep::report(&points);
    out
}

impl HotRun {
    fn new(name: &'static str, instances: Vec<Contender>) -> Self {
        let on_redis = matches!(
            instances[0],
            Contender::TowerLock(_) | Contender::Rslock(_) | Contender::SetNx(_)
        );
        HotRun {
            name,
            instances,
            acquisitions: 0,
            elapsed: Duration::ZERO,
            waits: Vec::new(),
            redis: on_redis.then_some((0.0, 0)),
            lost: 0,
            per_instance: vec![0; INSTANCES],
        }
    }
}

/// One critical-section length on one server.
struct HotBench<'a> {
    server: &'a RedisServer,
    section: Duration,
    secs: Duration,
}

impl HotBench<'_> {
    /// Runs `TASKS` tasks spread over the run's instances for `secs`, adding to `run`.
    async fn round(&self, run: &mut HotRun) {
        let shared = Arc::new(Shared {
            counter: AtomicU64::new(0),
            stop: AtomicBool::new(false),
        });
        let section = self.section;
        let usage = RedisUsage::now(self.server).await;
        let started = Instant::now();
        let tasks: Vec<_> = (0..TASKS)
            .map(|i| {
                let mut contender = run.instances[i % run.instances.len()].clone();
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
        let mut acquisitions = 0;
        for (i, task) in tasks.into_iter().enumerate() {
            let waits = task.await.unwrap();
            acquisitions += waits.len() as u64;
            run.per_instance[i % INSTANCES] += waits.len() as u64;
            run.waits.extend(waits);
        }
        run.elapsed += started.elapsed();
        run.acquisitions += acquisitions;
        run.lost += acquisitions - shared.counter.load(Ordering::SeqCst);
        let now = RedisUsage::now(self.server).await;
        if let Some((cpu, calls)) = &mut run.redis {
            *cpu += now.cpu - usage.cpu;
            *calls += now.calls - usage.calls;
        }
    }
}

fn hot_table(section: Duration, runs: &[HotRun]) -> String {
    let rate = |run: &HotRun| run.acquisitions as f64 / run.elapsed.as_secs_f64();
    let mutex_rate = rate(&runs[0]);
    // The tail a request behind the key feels, next to the fair in-process lock's.
    let mutex_p99 = Percentiles::of(runs[0].waits.clone()).p99;
    let mut out = format!(
        "### One hot key, {TASKS} tasks over {INSTANCES} instances, {} ms busy critical section\n\n",
        section.as_millis()
    );
    out += "| lock | acq/s | vs mutex | wait p50 | wait p99 | wait p99 vs mutex | wait max | p99/p50 | Redis CPU us/acq | Redis cmds/acq | lost updates |\n";
    out += "|---|---|---|---|---|---|---|---|---|---|---|\n";
    for run in runs {
        let waits = Percentiles::of(run.waits.clone());
        let per_acq = |x: f64| x / run.acquisitions.max(1) as f64;
        let _ = writeln!(
            out,
            "| {} | {:.0} | {:.0}% | {} | {} | {:.1}x | {} | {:.1} | {} | {} | {} |",
            run.name,
            rate(run),
            100.0 * rate(run) / mutex_rate,
            ms(waits.p50),
            ms(waits.p99),
            waits.p99.as_secs_f64() / mutex_p99.as_secs_f64().max(1e-9),
            ms(waits.max),
            waits.p99.as_secs_f64() / waits.p50.as_secs_f64().max(1e-9),
            run.redis.map_or("-".to_owned(), |(cpu, _)| format!(
                "{:.1}",
                per_acq(cpu * 1e6)
            )),
            run.redis.map_or("-".to_owned(), |(_, calls)| format!(
                "{:.2}",
                per_acq(calls as f64)
            )),
            run.lost,
        );
    }
    let _ = writeln!(
        out,
        "\n({} acquisitions in total, the locks taking turns in {ROUNDS} rounds)\n",
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
    // Without a network, one request at a time; the two unlocked routes take turns in
    // batches so that both see the same machine load.
    const BATCH: u64 = 1000;
    const BATCHES: u64 = 20;
    in_process(&plain, BATCH).await;
    in_process(&unlocked, BATCH).await;
    let (mut plain_total, mut unlocked_total) = (Duration::ZERO, Duration::ZERO);
    for _ in 0..BATCHES {
        plain_total += in_process(&plain, BATCH).await;
        unlocked_total += in_process(&unlocked, BATCH).await;
    }
    let locked_n = 2000;
    let locked_total = in_process(&locked, locked_n).await;
    let per_request = |total: Duration, n: u64| total.as_nanos() as f64 / n as f64;
    let in_process_ns = [
        per_request(plain_total, BATCH * BATCHES),
        per_request(unlocked_total, BATCH * BATCHES),
        per_request(locked_total, locked_n),
    ];
    for ((name, app), ns) in [
        ("no layer", plain),
        ("layer, key fn returns None", unlocked),
        ("layer, locked, distinct keys", locked),
    ]
    .into_iter()
    .zip(in_process_ns)
    {
        let rate = http_rate(app).await;
        let _ = writeln!(out, "| {name} | {rate:.0} | {ns:.0} |");
    }
    let _ = writeln!(
        out,
        "\nUnlocked route overhead: **{:.0} ns** per request (target < 1 us)\n",
        in_process_ns[1] - in_process_ns[0]
    );
    out
}

/// What recording the crate's metrics costs a locked request: one route on
/// `MemoryBackend` (its locks cost no round trip to hide the cost in), in batches that
/// take turns with a Prometheus recorder switched on and off.
async fn metrics_cost() -> String {
    let prometheus = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
    let handle = prometheus.handle();
    let recorder: &'static Switched = Box::leak(Box::new(Switched {
        on: AtomicBool::new(false),
        inner: prometheus,
    }));
    metrics::set_global_recorder(recorder).expect("the only recorder of the benchmark");
    let backend = tower_lock::MemoryBackend::new();
    let app = Router::new()
        .route("/item/{id}", post(|| async { "ok" }))
        .route_layer(
            LockLayer::new(backend, |req: &Request| Some(req.uri().path().to_owned()))
                .metrics_label("item"),
        );
    const BATCH: u64 = 2000;
    const BATCHES: u64 = 10;
    in_process(&app, BATCH).await;
    let (mut off, mut on) = (Duration::ZERO, Duration::ZERO);
    for _ in 0..BATCHES {
        recorder.on.store(false, Ordering::Relaxed);
        off += in_process(&app, BATCH).await;
        recorder.on.store(true, Ordering::Relaxed);
        on += in_process(&app, BATCH).await;
    }
    let per = |d: Duration| d.as_nanos() as f64 / (BATCH * BATCHES) as f64;
    let series = handle
        .render()
        .lines()
        .filter(|l| l.starts_with("tower_lock_"))
        .count();
    format!(
        "### Metrics (feature `metrics`)\n\nA locked route on `MemoryBackend`, distinct keys, \
         in-process: {:.0} ns per request with no recorder, {:.0} ns with a Prometheus \
         recorder (**{:+.0} ns**, {series} `tower_lock_` series rendered).\n",
        per(off),
        per(on),
        per(on) - per(off),
    )
}

/// A recorder that passes to `inner` while `on`, and drops everything otherwise (as the
/// `metrics` facade does with no recorder installed).
struct Switched {
    on: AtomicBool,
    inner: metrics_exporter_prometheus::PrometheusRecorder,
}

impl metrics::Recorder for Switched {
    fn describe_counter(
        &self,
        k: metrics::KeyName,
        u: Option<metrics::Unit>,
        d: metrics::SharedString,
    ) {
        self.inner.describe_counter(k, u, d)
    }
    fn describe_gauge(
        &self,
        k: metrics::KeyName,
        u: Option<metrics::Unit>,
        d: metrics::SharedString,
    ) {
        self.inner.describe_gauge(k, u, d)
    }
    fn describe_histogram(
        &self,
        k: metrics::KeyName,
        u: Option<metrics::Unit>,
        d: metrics::SharedString,
    ) {
        self.inner.describe_histogram(k, u, d)
    }
    fn register_counter(&self, key: &metrics::Key, m: &metrics::Metadata<'_>) -> metrics::Counter {
        match self.on.load(Ordering::Relaxed) {
            true => self.inner.register_counter(key, m),
            false => metrics::Counter::noop(),
        }
    }
    fn register_gauge(&self, key: &metrics::Key, m: &metrics::Metadata<'_>) -> metrics::Gauge {
        match self.on.load(Ordering::Relaxed) {
            true => self.inner.register_gauge(key, m),
            false => metrics::Gauge::noop(),
        }
    }
    fn register_histogram(
        &self,
        key: &metrics::Key,
        m: &metrics::Metadata<'_>,
    ) -> metrics::Histogram {
        match self.on.load(Ordering::Relaxed) {
            true => self.inner.register_histogram(key, m),
            false => metrics::Histogram::noop(),
        }
    }
}

/// Time taken by `n` requests through the router without a network, one at a time, each
/// on a path (and so a lock key) of its own.
async fn in_process(app: &Router, n: u64) -> Duration {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let mut total = Duration::ZERO;
    for _ in 0..n {
        let i = NEXT.fetch_add(1, Ordering::Relaxed);
        let request = Request::post(format!("/item/{i}"))
            .body(Body::empty())
            .unwrap();
        let t = Instant::now();
        let response = app.clone().oneshot(request).await.unwrap();
        total += t.elapsed();
        assert!(response.status().is_success());
    }
    total
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

/// Waits for every task of a timed run, each returning its acquisitions' waits: their
/// rate per second and wait p99.
async fn rate_and_p99(tasks: Vec<tokio::task::JoinHandle<Vec<Duration>>>) -> (f64, Duration) {
    let started = Instant::now();
    let mut waits = Vec::new();
    for task in tasks {
        waits.extend(task.await.unwrap());
    }
    let rate = waits.len() as f64 / started.elapsed().as_secs_f64();
    (rate, Percentiles::of(waits).p99)
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

/// A `| | p50 | p99 |` table with a row per named latency.
fn latency_table(rows: &[(&str, &Percentiles)]) -> String {
    let mut out = String::from("| | p50 | p99 |\n|---|---|---|\n");
    for (name, latency) in rows {
        let _ = writeln!(
            out,
            "| {name} | {} | {} |",
            us(latency.p50),
            us(latency.p99)
        );
    }
    out
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

//! A soak, on Redis and on PostgreSQL: every primitive (exclusive locks, try-once, read
//! locks, permits, multi-key locks, waits given up half-way, guards dropped without a
//! release) from 24 tasks over three instances of one throwaway server, while each
//! instance also serves HTTP behind a `LockLayer` (requests that hold a key briefly, that
//! fail fast, that go away while they wait) to a steady stream of clients, with a fault
//! every two seconds:
//!
//! - Redis: command connections killed, subscriber connections killed, the server paused;
//! - PostgreSQL: command connections terminated (`pg_terminate_backend`), listening
//!   connections terminated, the postmaster and every backend paused (`SIGSTOP`).
//!
//! When the load stops, everything must go back to how it was before it: nothing held in
//! the store (Redis: no lock, line, writer or permit key; PostgreSQL: no row of
//! `tower_lock` with an owner, readers or waiting writers, no row of `tower_lock_holders`;
//! the names' fence counters stay, by design, for `fence_ttl`), one listening connection
//! per instance and no other (on Redis subscribed to the admin channel only), no lock
//! watched, queued or listened for in any instance; no two tasks or handlers may have held
//! one key at once, and the layer answers 200, 409 or 503 only.
//!
//! Figures (not assertions: allocators keep what they freed, and servers their caches):
//! at the start, every `SOAK_REPORT_SECS` (60 by default) while the load runs, and at the
//! end, the holds and requests so far, the process's RSS and the store's memory (Redis
//! `used_memory`, its keys and clients; PostgreSQL the summed PSS of the postmaster and
//! its backends, which counts their shared memory once, the lock tables' rows and
//! `pg_total_relation_size`, the crate's connections); then the change from the first
//! figure after warm-up (the first report) to the last.
//!
//! Each arm runs for `SOAK_SECS` (10 s by default), one arm after the other; the
//! 30-minute runs, one arm each:
//!
//! ```text
//! SOAK_SECS=1800 cargo test --release --test soak on_redis -- --nocapture
//! SOAK_SECS=1800 cargo test --release --test soak on_postgres -- --nocapture
//! ```

mod support;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use axum::Router;
use axum::extract::{Path, Request, State};
use axum::routing::post;
use support::RedisServer;
use support::postgres::PostgresServer;
use tokio::time::{Instant, sleep, sleep_until, timeout};
use tower_lock::{
    BackendStats, LockBackend, LockError, LockGuard, LockLayer, PostgresBackend, RedisBackend,
};

const INSTANCES: usize = 3;
const TASKS_PER_INSTANCE: usize = 8;
/// HTTP clients of each instance, each sending one request after the other.
const CLIENTS_PER_INSTANCE: usize = 2;
/// Keys per primitive: few, so that tasks meet on them.
const KEYS: usize = 4;
/// Keys of the HTTP routes: fewer, so that requests meet on them.
const HTTP_KEYS: usize = 2;
const LEASE: Duration = Duration::from_secs(2);
const WAIT: Duration = Duration::from_secs(1);
/// How long a handler holds its key.
const HANDLER_HOLD: Duration = Duration::from_millis(2);
/// A pause of the server: well under the lease, so no hold is lost to it.
const PAUSE: Duration = Duration::from_millis(300);

/// The arms take turns: the process's RSS is then one arm's.
static TURN: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn secs_from(variable: &str, default: u64) -> Duration {
    let secs = std::env::var(variable)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default);
    Duration::from_secs(secs)
}

/// A store the soak runs on: a server of the test's own, its instances, its faults, and
/// what it keeps.
trait Soaked {
    type Backend: LockBackend;
    /// The store's name in the figures.
    const NAME: &'static str;

    /// Starts a server and waits until it takes connections.
    fn start() -> Self;
    /// A new instance on the server.
    async fn instance(&self) -> Self::Backend;
    /// The instance's connections and bookkeeping.
    fn stats(backend: &Self::Backend) -> BackendStats;
    /// Ends the instances' connections of one kind (`which`: 0 or 1, the store's two);
    /// returns the fault's name.
    async fn end_connections(&self, which: u32) -> &'static str;
    /// Stops the server (`SIGSTOP`): it keeps its sockets and answers nothing.
    fn pause(&self);
    /// Resumes it (also one that a pause cut short left stopped).
    fn resume(&self);
    /// The server's memory in bytes, and what else it says of itself.
    async fn memory(&self) -> (u64, String);
    /// What the load must not leave behind: holds, lines, waiting writers, permits.
    async fn leftovers(&self) -> Vec<String>;
    /// What is listened to beyond each of `instances` listening to its admin channel on
    /// a connection of its own.
    async fn listening(&self, instances: usize) -> Vec<String>;
    /// What stays by design, for the last line.
    async fn kept(&self) -> String;
}

impl Soaked for RedisServer {
    type Backend = RedisBackend;
    const NAME: &'static str = "Redis";

    fn start() -> Self {
        RedisServer::start()
    }

    async fn instance(&self) -> RedisBackend {
        self.backend().await
    }

    fn stats(backend: &RedisBackend) -> BackendStats {
        backend.stats()
    }

    async fn end_connections(&self, which: u32) -> &'static str {
        if which == 0 {
            let _: redis::RedisResult<i64> = redis::cmd("CLIENT")
                .arg("KILL")
                .arg("TYPE")
                .arg("normal")
                .query_async(&mut self.conn().await)
                .await;
            "fault: command connections killed"
        } else {
            self.kill_subscribers().await;
            "fault: subscribers killed"
        }
    }

    fn pause(&self) {
        RedisServer::pause(self);
    }

    fn resume(&self) {
        RedisServer::resume(self);
    }

    async fn memory(&self) -> (u64, String) {
        let mut conn = self.conn().await;
        let info: String = redis::cmd("INFO")
            .arg("memory")
            .arg("clients")
            .query_async(&mut conn)
            .await
            .expect("INFO");
        let used = field(&info, "used_memory:");
        // SCAN, not DBSIZE, which counts keys expired but not yet reclaimed.
        let (mut keys, mut fences) = (0, 0);
        let mut cursor = 0u64;
        loop {
            let (next, page): (u64, Vec<String>) = redis::cmd("SCAN")
                .arg(cursor)
                .arg("COUNT")
                .arg(1000)
                .query_async(&mut conn)
                .await
                .expect("SCAN");
            keys += page.len();
            fences += page.iter().filter(|k| k.ends_with(":fence")).count();
            cursor = next;
            if cursor == 0 {
                break;
            }
        }
        let text = format!(
            "Redis used_memory {}; {keys} keys ({fences} fence counters), {} clients",
            mib(used),
            field(&info, "connected_clients:"),
        );
        (used, text)
    }

    async fn leftovers(&self) -> Vec<String> {
        let mut keys = self.keys().await;
        keys.retain(|k| !k.ends_with(":fence"));
        keys
    }

    async fn listening(&self, instances: usize) -> Vec<String> {
        let mut beyond = self.channels().await;
        let subscribers = self.numsub(support::ADMIN_CHANNEL).await;
        if subscribers != instances as i64 {
            beyond.push(format!(
                "{subscribers} subscribers of the admin channel for {instances} instances"
            ));
        }
        beyond
    }

    async fn kept(&self) -> String {
        format!("{} fence counters kept", self.keys().await.len())
    }
}

/// `name` (`used_memory:`) in the text of `INFO`.
fn field(info: &str, name: &str) -> u64 {
    info.lines()
        .find_map(|l| l.strip_prefix(name))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

/// The `application_name`s of the PostgreSQL backend's connections.
const COMMANDS: &str = "tower-lock";
const LISTENER: &str = "tower-lock listener";

impl Soaked for PostgresServer {
    type Backend = PostgresBackend;
    const NAME: &'static str = "PostgreSQL";

    fn start() -> Self {
        PostgresServer::start()
    }

    async fn instance(&self) -> PostgresBackend {
        support::postgres::builder_at(&self.url(), "soak")
            .build()
            .await
            .expect("backend connects to the test PostgreSQL")
    }

    fn stats(backend: &PostgresBackend) -> BackendStats {
        backend.stats()
    }

    async fn end_connections(&self, which: u32) -> &'static str {
        if which == 0 {
            self.terminate(COMMANDS).await;
            "fault: command connections terminated"
        } else {
            self.terminate(LISTENER).await;
            "fault: listeners terminated"
        }
    }

    fn pause(&self) {
        PostgresServer::pause(self);
    }

    fn resume(&self) {
        PostgresServer::resume(self);
    }

    async fn memory(&self) -> (u64, String) {
        let pids = self.pids();
        let pss: u64 = pids.iter().map(|pid| pss_kib(*pid) * 1024).sum();
        let (names, holders, size, commands, listeners, queue): (i64, i64, i64, i64, i64, f64) =
            sqlx::query_as(
                "SELECT (SELECT count(*) FROM tower_lock), \
                 (SELECT count(*) FROM tower_lock_holders), \
                 pg_total_relation_size('tower_lock') \
                 + pg_total_relation_size('tower_lock_holders'), \
                 (SELECT count(*) FROM pg_stat_activity WHERE application_name = $1), \
                 (SELECT count(*) FROM pg_stat_activity WHERE application_name = $2), \
                 pg_notification_queue_usage()",
            )
            .bind(COMMANDS)
            .bind(LISTENER)
            .fetch_one(&mut self.conn().await)
            .await
            .expect("the lock tables' figures");
        let text = format!(
            "PostgreSQL {} over {} processes (PSS); tower_lock {names} rows, \
             tower_lock_holders {holders}, {} KiB with indexes; {commands} command and \
             {listeners} listening connections, notification queue {:.0}% used",
            mib(pss),
            pids.len(),
            size / 1024,
            queue * 100.0,
        );
        (pss, text)
    }

    async fn leftovers(&self) -> Vec<String> {
        sqlx::query_scalar(
            "SELECT format('%s: owner %s, %s readers, %s writers', name, owner, readers, \
             writers) FROM tower_lock WHERE owner IS NOT NULL OR readers > 0 OR writers > 0 \
             UNION ALL \
             SELECT format('%s: holder %s of kind %s', name, holder, kind) \
             FROM tower_lock_holders",
        )
        .fetch_all(&mut self.conn().await)
        .await
        .expect("the lock tables' held rows")
    }

    async fn listening(&self, instances: usize) -> Vec<String> {
        let listeners: i64 =
            sqlx::query_scalar("SELECT count(*) FROM pg_stat_activity WHERE application_name = $1")
                .bind(LISTENER)
                .fetch_one(&mut self.conn().await)
                .await
                .expect("the listening connections");
        if listeners == instances as i64 {
            return Vec::new();
        }
        vec![format!(
            "{listeners} listening connections for {instances} instances"
        )]
    }

    async fn kept(&self) -> String {
        let names: i64 = sqlx::query_scalar("SELECT count(*) FROM tower_lock")
            .fetch_one(&mut self.conn().await)
            .await
            .expect("the names' rows");
        format!("{names} names' rows kept for their fence counters")
    }
}

/// A process's proportional set size, from `/proc/PID/smaps_rollup`, in KiB: its private
/// pages, and its share of those it shares (PostgreSQL's shared buffers), so that the
/// server's processes add up to its memory. Its RSS where that file cannot be read.
fn pss_kib(pid: u32) -> u64 {
    proc_kib(&format!("/proc/{pid}/smaps_rollup"), "Pss:")
        .or_else(|| proc_kib(&format!("/proc/{pid}/status"), "VmRSS:"))
        .unwrap_or(0)
}

/// This process's resident set, from `/proc/self/status`, in KiB.
fn rss_kib() -> u64 {
    proc_kib("/proc/self/status", "VmRSS:").unwrap_or(0)
}

/// The figure in KiB of the line `name` (`VmRSS:`) of the `/proc` file at `path`.
fn proc_kib(path: &str, name: &str) -> Option<u64> {
    let text = std::fs::read_to_string(path).ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix(name))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
}

fn mib(bytes: u64) -> String {
    format!("{:.2} MiB", bytes as f64 / (1024.0 * 1024.0))
}

/// What the load did, by outcome.
#[derive(Default)]
struct Tally {
    outcomes: std::sync::Mutex<BTreeMap<&'static str, u64>>,
    /// Times a task or handler got an exclusive key another one held.
    overlaps: AtomicU64,
}

impl Tally {
    fn count(&self, outcome: &'static str) {
        *self.outcomes().entry(outcome).or_default() += 1;
    }

    fn outcomes(&self) -> std::sync::MutexGuard<'_, BTreeMap<&'static str, u64>> {
        self.outcomes.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The count of each of `outcomes`, summed.
    fn sum(&self, outcomes: &[&str]) -> u64 {
        let counted = self.outcomes();
        outcomes.iter().filter_map(|o| counted.get(o)).sum()
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

    /// Counts an HTTP request's answer by status.
    fn answered(&self, reply: Result<support::Reply, axum::BoxError>) {
        self.count(match reply.map(|r| r.status) {
            Ok(200) => "http 200",
            Ok(409) => "http 409",
            Ok(503) => "http 503",
            Ok(_) => "http other status",
            Err(_) => "http failed",
        });
    }
}

/// The HTTP answers the figures count as requests.
const ANSWERS: [&str; 4] = ["http 200", "http 409", "http 503", "http other status"];

/// Holders of each exclusive key, to see two at once.
struct Inside(Vec<AtomicU32>);

/// A key marked in use by [`Inside::enter`], until it drops.
struct InUse<'a>(&'a AtomicU32);

impl Drop for InUse<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Inside {
    fn new(keys: usize) -> Arc<Self> {
        Arc::new(Inside((0..keys).map(|_| AtomicU32::new(0)).collect()))
    }

    /// Marks `key` in use; whether another holder had it in use already.
    fn enter(&self, key: usize) -> (InUse<'_>, bool) {
        let before = self.0[key].fetch_add(1, Ordering::SeqCst);
        (InUse(&self.0[key]), before != 0)
    }

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
        let (in_use, shared) = self.enter(key);
        if shared && !guard.is_lost() {
            tally.overlaps.fetch_add(1, Ordering::Relaxed);
        }
        tokio::task::yield_now().await;
        drop(in_use);
        if release {
            tally.give_back(guard).await;
        } else {
            drop(guard);
        }
    }
}

/// One task's loop: a primitive at random, until `stop`.
async fn load<B: LockBackend>(
    backend: B,
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

/// What an instance's handlers share.
#[derive(Clone)]
struct Served {
    inside: Arc<Inside>,
    tally: Arc<Tally>,
}

/// A handler: holds its key (`/hold/{key}` or `/try/{key}`) briefly, checked for another
/// handler holding it.
async fn handle(State(served): State<Served>, Path(key): Path<usize>) {
    let (_in_use, shared) = served.inside.enter(key);
    if shared {
        served.tally.overlaps.fetch_add(1, Ordering::Relaxed);
    }
    sleep(HANDLER_HOLD).await;
}

/// Serves `backend`'s routes on a loopback port: `/hold/{key}` waits for its key's lock,
/// `/try/{key}` fails fast (409) while another request holds it.
async fn serve<B: LockBackend>(backend: &B, served: Served) -> SocketAddr {
    let key = |req: &Request| {
        let key = req.uri().path().rsplit('/').next()?;
        Some(format!("http:{key}"))
    };
    let waits = Router::new()
        .route("/hold/{key}", post(handle))
        .route_layer(LockLayer::new(backend.clone(), key).wait(WAIT).lease(LEASE));
    let fails_fast = Router::new().route("/try/{key}", post(handle)).route_layer(
        LockLayer::new(backend.clone(), key)
            .fail_fast()
            .lease(LEASE),
    );
    support::serve(waits.merge(fails_fast).with_state(served)).await
}

/// One client's loop, until `stop`: requests to `addr` on a key at random, that wait,
/// that fail fast, or that go away while they wait.
async fn requests(addr: SocketAddr, tally: Arc<Tally>, stop: Arc<AtomicBool>) {
    let client = support::http_client();
    while !stop.load(Ordering::Relaxed) {
        let key = fastrand::usize(..HTTP_KEYS);
        let route = if fastrand::u8(..3) == 0 {
            "try"
        } else {
            "hold"
        };
        let sent = support::try_send(
            &client,
            support::post_request(addr, &format!("/{route}/{key}")),
        );
        if fastrand::u8(..4) == 0 {
            let gone = Duration::from_millis(fastrand::u64(1..20));
            match timeout(gone, sent).await {
                Err(_) => tally.count("http given up"),
                Ok(reply) => tally.answered(reply),
            }
        } else {
            tally.answered(sent.await);
        }
    }
}

/// A fault every two seconds until `stop`, in turn: the store's two kinds of connections
/// ended, the server paused for [`PAUSE`].
async fn nemesis<S: Soaked>(server: &S, stop: &AtomicBool, tally: &Tally) {
    let mut turn = 0u32;
    while !stop.load(Ordering::Relaxed) {
        sleep(Duration::from_secs(2)).await;
        let fault = match turn % 3 {
            2 => {
                server.pause();
                sleep(PAUSE).await;
                server.resume();
                "fault: server paused"
            }
            which => server.end_connections(which).await,
        };
        tally.count(fault);
        turn += 1;
    }
}

/// One line of figures.
struct Figure {
    label: String,
    rss_kib: u64,
    store_bytes: u64,
}

/// Takes and prints the figures: the holds and requests so far, this process's RSS and
/// the store's memory.
async fn figure<S: Soaked>(server: &S, tally: &Tally, label: String) -> Figure {
    let (store_bytes, store) = server.memory().await;
    let rss_kib = rss_kib();
    println!(
        "soak on {}, {label}: {} holds, {} requests answered; RSS {}; {store}",
        S::NAME,
        tally.sum(&["held", "http 200"]),
        tally.sum(&ANSWERS),
        mib(rss_kib * 1024),
    );
    Figure {
        label,
        rss_kib,
        store_bytes,
    }
}

/// Takes the figures every `SOAK_REPORT_SECS` from `started` on, into `figures`.
async fn report<S: Soaked>(server: &S, tally: &Tally, started: Instant, figures: &mut Vec<Figure>) {
    let every = secs_from("SOAK_REPORT_SECS", 60).max(Duration::from_secs(1));
    let mut next = started + every;
    loop {
        sleep_until(next).await;
        let label = format!("{} s", started.elapsed().as_secs());
        figures.push(figure(server, tally, label).await);
        next += every;
    }
}

/// The change from the first figure after warm-up (the first report; the start in a run
/// shorter than one) to the last.
fn verdict(figures: &[Figure]) -> String {
    let (Some(start), Some(last)) = (figures.first(), figures.last()) else {
        return "no figures".to_owned();
    };
    let (first, warm) = match figures.get(1) {
        Some(first) if figures.len() > 2 => (first, "after warm-up"),
        _ => (start, "no report after warm-up in a run this short"),
    };
    let change = |from: u64, to: u64| {
        let percent = (to as f64 - from as f64) / from.max(1) as f64 * 100.0;
        format!("{} -> {} ({percent:+.1}%)", mib(from), mib(to))
    };
    format!(
        "from {} ({warm}) to {}: RSS {}, store {}",
        first.label,
        last.label,
        change(first.rss_kib * 1024, last.rss_kib * 1024),
        change(first.store_bytes, last.store_bytes),
    )
}

/// What an instance keeps of the load: watched, queued or listened to.
fn kept_by(stats: BackendStats) -> Option<String> {
    let kept = stats.watched_locks
        + stats.local_queues
        + stats.local_waiters
        + stats.channels_with_waiters;
    (kept > 0).then(|| format!("{stats:?}"))
}

/// Waits (generously: this catches hangs, not slowness) until `left` finds nothing; fails
/// naming what it still finds.
async fn settles(what: &str, left: impl AsyncFn() -> Vec<String>) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let found = left().await;
        if found.is_empty() {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: still {found:?} after 10 s"
        );
        sleep(Duration::from_millis(20)).await;
    }
}

/// The soak on a server of `S`.
async fn soak<S: Soaked>() {
    support::init_tracing();
    let _turn = TURN.lock().await;
    let server = S::start();
    let mut backends = Vec::new();
    for _ in 0..INSTANCES {
        backends.push(server.instance().await);
    }
    assert_eq!(
        server.leftovers().await,
        Vec::<String>::new(),
        "nothing before the load"
    );
    settles("every instance listens on its own connection", async || {
        server.listening(INSTANCES).await
    })
    .await;

    let stop = Arc::new(AtomicBool::new(false));
    let tally = Arc::new(Tally::default());
    let mut figures = vec![figure(&server, &tally, "start".to_owned()).await];
    let inside = Inside::new(KEYS);
    let served = Served {
        inside: Inside::new(HTTP_KEYS),
        tally: tally.clone(),
    };
    let mut tasks = Vec::new();
    for backend in &backends {
        for _ in 0..TASKS_PER_INSTANCE {
            let load = load(backend.clone(), inside.clone(), tally.clone(), stop.clone());
            tasks.push(tokio::spawn(load));
        }
        let addr = serve(backend, served.clone()).await;
        for _ in 0..CLIENTS_PER_INSTANCE {
            tasks.push(tokio::spawn(requests(addr, tally.clone(), stop.clone())));
        }
    }
    let started = Instant::now();
    let run = async {
        tokio::join!(
            nemesis(&server, &stop, &tally),
            report(&server, &tally, started, &mut figures),
        )
    };
    let _ = timeout(secs_from("SOAK_SECS", 10), run).await;
    stop.store(true, Ordering::Relaxed);
    server.resume();
    for task in tasks {
        task.await.expect("a load task ends");
    }
    let loaded = started.elapsed();

    let settled = Instant::now();
    settles("the store keeps no hold", async || server.leftovers().await).await;
    settles(
        "nothing is listened to but the admin channels",
        async || server.listening(INSTANCES).await,
    )
    .await;
    settles("no instance watches, queues or waits", async || {
        backends
            .iter()
            .filter_map(|b| kept_by(S::stats(b)))
            .collect()
    })
    .await;
    let settled = settled.elapsed();
    let label = format!("end ({} s)", loaded.as_secs());
    figures.push(figure(&server, &tally, label).await);
    let outcomes = tally.outcomes().clone();
    println!(
        "soak on {}: {loaded:?} of load ({INSTANCES} instances x {TASKS_PER_INSTANCE} tasks \
         and {CLIENTS_PER_INSTANCE} HTTP clients), settled {settled:?} after it; outcomes \
         {outcomes:?}; {}",
        S::NAME,
        server.kept().await,
    );
    println!(
        "soak on {}: {} (figures, not assertions)",
        S::NAME,
        verdict(&figures)
    );
    assert_eq!(
        tally.overlaps.load(Ordering::Relaxed),
        0,
        "two holders of one key"
    );
    assert!(tally.sum(&["held"]) > 0, "the load took locks");
    assert!(tally.sum(&["http 200"]) > 0, "the layer served requests");
    assert_eq!(
        tally.sum(&["http other status"]),
        0,
        "the layer answers 200, 409 or 503"
    );
}

mod on_redis {
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_mixed_load_and_requests_under_faults_leave_nothing_behind() {
        crate::needs!(Redis);
        super::soak::<super::RedisServer>().await;
    }
}

mod on_postgres {
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_mixed_load_and_requests_under_faults_leave_nothing_behind() {
        crate::needs!(Postgres);
        super::soak::<super::PostgresServer>().await;
    }
}

//! Test bodies the SQL stores share: tests/it/postgres.rs and tests/it/mysql.rs,
//! tests/it/postgres_faults.rs and tests/it/mysql_faults.rs call them with what differs (which
//! server, how its rows are counted, how a connection is cut). Each test keeps its own name
//! in its binary.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use axum::Router;
use axum::extract::{Request, State};
use axum::routing::post;
use tokio::task::JoinHandle;
use tower_lock::{
    BackendStats, LockBackend, LockError, LockGuard, LockLayer, MySqlBackend, PostgresBackend,
};

use super::child::{self, ChildProcess};
use super::mariadb::{self, MariaDbServer};
use super::postgres::PostgresServer;

/// Generous bound on anything that should happen at once: catches hangs only.
const HANG: Duration = Duration::from_secs(20);
/// The child holder's lease.
const CHILD_LEASE: Duration = Duration::from_secs(2);

/// What the shared bodies need of a store's throwaway server and its backend.
pub trait SqlServer: Sized {
    type Backend: LockBackend;

    /// A server of the test's own.
    fn start() -> Self;
    fn url(&self) -> String;
    /// Stops the server (clients are cut off); returns once it is gone.
    fn stop(&mut self);
    /// Starts it again on the same port and data.
    fn start_again(&mut self);
    /// A backend on the database at `url`, creating the lock tables if needed.
    fn backend_on(url: &str) -> impl Future<Output = Self::Backend>;
    /// A backend on the database at `url` as an application connects one (no migration).
    fn connect(url: &str) -> impl Future<Output = Self::Backend>;
    /// The backend's wake-up connection and bookkeeping.
    fn stats(backend: &Self::Backend) -> BackendStats;
    /// The time in `column` of the row of the key `shared` in the database at `url`, in
    /// microseconds of the server's clock.
    fn micros(url: &str, column: &str) -> impl Future<Output = i64>;
}

impl SqlServer for PostgresServer {
    type Backend = PostgresBackend;

    fn start() -> Self {
        PostgresServer::start()
    }

    fn url(&self) -> String {
        PostgresServer::url(self)
    }

    fn stop(&mut self) {
        PostgresServer::stop(self);
    }

    fn start_again(&mut self) {
        PostgresServer::start_again(self);
    }

    async fn backend_on(url: &str) -> PostgresBackend {
        PostgresBackend::builder(url)
            .migrate()
            .build()
            .await
            .expect("backend")
    }

    async fn connect(url: &str) -> PostgresBackend {
        PostgresBackend::connect(url).await.expect("backend")
    }

    fn stats(backend: &PostgresBackend) -> BackendStats {
        backend.stats()
    }

    async fn micros(url: &str, column: &str) -> i64 {
        use sqlx::Connection;
        let sql = format!(
            "SELECT (extract(epoch FROM {column}) * 1000000)::bigint FROM tower_lock \
             WHERE name LIKE '%{{shared}}'"
        );
        let mut conn = sqlx::PgConnection::connect(url).await.expect("connect");
        sqlx::query_scalar(&sql)
            .fetch_one(&mut conn)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"))
    }
}

impl SqlServer for MariaDbServer {
    type Backend = MySqlBackend;

    fn start() -> Self {
        MariaDbServer::start()
    }

    fn url(&self) -> String {
        MariaDbServer::url(self)
    }

    fn stop(&mut self) {
        MariaDbServer::stop(self);
    }

    fn start_again(&mut self) {
        MariaDbServer::start_again(self);
    }

    async fn backend_on(url: &str) -> MySqlBackend {
        mariadb::builder_on(url).build().await.expect("backend")
    }

    async fn connect(url: &str) -> MySqlBackend {
        MySqlBackend::connect(url).await.expect("backend")
    }

    fn stats(backend: &MySqlBackend) -> BackendStats {
        backend.stats()
    }

    async fn micros(url: &str, column: &str) -> i64 {
        use sqlx::Connection;
        let sql = format!(
            "SELECT TIMESTAMPDIFF(MICROSECOND, '1970-01-01', {column}) FROM tower_lock \
             WHERE name LIKE '%{{shared}}'"
        );
        let mut conn = sqlx::MySqlConnection::connect(url).await.expect("connect");
        sqlx::query_scalar(&sql)
            .fetch_one(&mut conn)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"))
    }
}

/// The child process of [`holder_killed_loses_its_lock_at_its_expiry_and_no_sooner`]:
/// holds the key `shared` on the database at the setting `url_var` until it is killed.
pub async fn hold_until_killed<S: SqlServer>(url_var: &str) {
    let backend = S::connect(&child::setting(url_var)).await;
    let guard = backend
        .lock("shared")
        .lease(CHILD_LEASE)
        .try_once()
        .await
        .expect("uncontended");
    child::report(&format!("held {}", guard.fencing_token()));
    std::future::pending::<()>().await;
}

/// A holder process (the binary's `entry` test, running
/// [`hold_until_killed`] with `url` as the setting `url_var`) killed with SIGKILL: its
/// lock is taken again once its lease ran out on the server's clock, and no sooner.
pub async fn holder_killed_loses_its_lock_at_its_expiry_and_no_sooner<S: SqlServer>(
    entry: &str,
    url: String,
    url_var: &str,
) {
    let backend = S::backend_on(&url).await;
    let mut holder = ChildProcess::spawn(entry, "holder", &[(url_var, url.clone())]);
    let report = holder
        .next_report()
        .await
        .expect("the child reports its lock");
    let killed_token: u64 = report
        .strip_prefix("held ")
        .and_then(|t| t.parse().ok())
        .unwrap_or_else(|| panic!("unexpected report {report:?}"));
    let lease_end = S::micros(&url, "expires").await;
    holder.kill().await;

    let guard = backend
        .lock("shared")
        .wait(CHILD_LEASE + HANG)
        .await
        .expect("the lease frees the dead holder's lock");
    // Taken on the server's clock no sooner than the dead holder's lease ended there.
    let taken_at = S::micros(&url, "touched").await;
    assert!(
        taken_at >= lease_end,
        "taken at {taken_at}, before the lease's end {lease_end}"
    );
    assert!(guard.fencing_token() > killed_token);
}

fn path_key(req: &Request) -> Option<String> {
    req.uri().path().strip_prefix("/lock/").map(str::to_owned)
}

async fn serve_locked(backend: impl LockBackend, wait: Duration) -> SocketAddr {
    let app = Router::new()
        .route("/lock/{key}", post(|| async { "done" }))
        .route_layer(LockLayer::new(backend, path_key).wait(wait));
    super::serve(app).await
}

fn spawn_post(addr: SocketAddr, path: String) -> JoinHandle<u16> {
    tokio::spawn(async move { super::post(&super::http_client(), addr, &path).await.status })
}

async fn statuses(requests: Vec<JoinHandle<u16>>) -> Vec<u16> {
    let mut statuses = Vec::new();
    for request in requests {
        let status = tokio::time::timeout(HANG, request)
            .await
            .expect("answered (no hang)")
            .expect("no panic");
        statuses.push(status);
    }
    statuses
}

/// Requests wait through `waiting` for five keys that `holders` hold; `cut` cuts the
/// connection `waiting` is woken through (and must cut one), once with the reconnect
/// waited for before the release, once racing the release: every request is served after
/// the release, within waits far below the holders' lease.
pub async fn wake_connection_cut_while_requests_wait_all_are_served_after_the_release<S>(
    holders: S::Backend,
    waiting: S::Backend,
    cut: impl AsyncFn(),
) where
    S: SqlServer,
{
    // Waits far below the holders' lease: a waiter that is served was woken by the release
    // (or the registration after the reconnect), not by the lease running out.
    let addr = serve_locked(waiting.clone(), Duration::from_secs(15)).await;
    let keys = ["a", "b", "c", "d", "e"];
    for registered_before_release in [false, true] {
        let mut held: Vec<LockGuard> = Vec::new();
        let mut requests = Vec::new();
        for key in keys {
            let guard = holders.lock(key).lease(Duration::from_secs(60)).try_once();
            held.push(guard.await.expect("uncontended"));
            requests.extend((0..3).map(|_| spawn_post(addr, format!("/lock/{key}"))));
        }
        let registered = |n| {
            let waiting = waiting.clone();
            async move {
                let stats = S::stats(&waiting);
                stats.channels_with_waiters == n && stats.local_waiters == 2 * n
            }
        };
        super::eventually("every key's waiters are registered", || {
            registered(keys.len())
        })
        .await;
        let connections = S::stats(&waiting).subscriber_connections_made;
        cut().await;
        if registered_before_release {
            super::eventually("the wake connection reconnected", || async {
                let stats = S::stats(&waiting);
                stats.subscriber_connected && stats.subscriber_connections_made > connections
            })
            .await;
        }
        for guard in held {
            guard.release().await.expect("release");
        }
        assert_eq!(statuses(requests).await, [200; 15]);
    }
}

/// Three instances on a server of their own serve a hot key from six clients; the server
/// stops (every request fails closed: 503 with `Retry-After`) and starts again (requests
/// are served again), and no two handlers ever run at once.
pub async fn server_restarted_mid_run_answers_503_then_serves_with_no_double_hold<S>()
where
    S: SqlServer,
{
    let mut server = S::start();
    // Three instances whose handler counts who is inside: two at once is a double hold.
    let inside = Arc::new(AtomicU64::new(0));
    let overlaps = Arc::new(AtomicU64::new(0));
    let mut addrs = Vec::new();
    for _ in 0..3 {
        let backend = S::backend_on(&server.url()).await;
        let app = Router::new()
            .route(
                "/lock/{key}",
                post(|State((inside, overlaps)): State<(Arc<AtomicU64>, Arc<AtomicU64>)>| async move {
                    if inside.fetch_add(1, Ordering::SeqCst) > 0 {
                        overlaps.fetch_add(1, Ordering::SeqCst);
                    }
                    tokio::task::yield_now().await;
                    inside.fetch_sub(1, Ordering::SeqCst);
                    "done"
                }),
            )
            .route_layer(LockLayer::new(backend, path_key).wait(Duration::from_secs(2)))
            .with_state((inside.clone(), overlaps.clone()));
        addrs.push(super::serve(app).await);
    }
    let stop = Arc::new(AtomicBool::new(false));
    let served = Arc::new(AtomicU64::new(0));
    let clients: Vec<_> = (0..6)
        .map(|i| {
            let (stop, served, addr) = (stop.clone(), served.clone(), addrs[i % 3]);
            tokio::spawn(async move {
                let client = super::http_client();
                while !stop.load(Ordering::Relaxed) {
                    let reply = super::post(&client, addr, "/lock/hot").await;
                    assert!([200, 503].contains(&reply.status), "{reply:?}");
                    if reply.status == 200 {
                        served.fetch_add(1, Ordering::Relaxed);
                    }
                }
            })
        })
        .collect();
    let until_served = |n: u64| {
        let served = served.clone();
        async move {
            tokio::time::timeout(HANG, async {
                while served.load(Ordering::Relaxed) < n {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            })
            .await
            .expect("requests are served");
        }
    };
    until_served(50).await;
    server.stop();
    // Down: every request fails closed.
    let reply = super::post(&super::http_client(), addrs[0], "/lock/other").await;
    assert_eq!(reply.status, 503, "{reply:?}");
    assert!(reply.headers.contains_key("retry-after"));
    server.start_again();
    let before = served.load(Ordering::Relaxed);
    until_served(before + 50).await;
    stop.store(true, Ordering::Relaxed);
    for client in clients {
        client.await.expect("no panic");
    }
    assert_eq!(overlaps.load(Ordering::SeqCst), 0, "no two holders at once");
}

/// `backend` runs on the application's `pool` of one connection: while the test holds that
/// connection a request answers 503 within its wait (not the pool's own 30 s), and once
/// it is given back requests are served.
pub async fn exhausted_pool_answers_503_within_the_wait_and_recovers<B, DB>(
    backend: B,
    pool: sqlx::Pool<DB>,
) where
    B: LockBackend,
    DB: sqlx::Database,
{
    let addr = serve_locked(backend.clone(), Duration::from_millis(500)).await;
    let taken = pool.acquire().await.expect("the pool's only connection");
    let reply = tokio::time::timeout(HANG, super::post(&super::http_client(), addr, "/lock/k"))
        .await
        .expect("answered within the wait, not the pool's own 30 s");
    assert_eq!(reply.status, 503, "{reply:?}");
    assert!(reply.headers.contains_key("retry-after"));
    drop(taken);
    let reply = super::post(&super::http_client(), addr, "/lock/k").await;
    assert_eq!(reply.status, 200, "{reply:?}");
    assert!(matches!(
        backend.lock("k").try_once().await.map(drop),
        Ok(()) | Err(LockError::Contended { .. })
    ));
}

/// Ten thousand names held and released, and ten semaphores' permits, through `backend`
/// (built with a fence TTL of one second): no holder row stays, and the janitor deletes
/// every name's row (`rows` counts a table's rows); tokens then still increase, floored by
/// the server's clock.
pub async fn names_leave_rows_only_until_the_janitor_sweeps_them<B: LockBackend>(
    backend: B,
    rows: impl AsyncFn(&str) -> i64,
) {
    const NAMES: usize = 10_000;
    let tasks: Vec<_> = (0..8)
        .map(|t| {
            let backend = backend.clone();
            tokio::spawn(async move {
                for i in (t..NAMES).step_by(8) {
                    let guard = backend.lock(format!("name-{i}")).try_once().await;
                    guard
                        .expect("uncontended")
                        .release()
                        .await
                        .expect("release");
                }
            })
        })
        .collect();
    let mut permits = Vec::new();
    for i in 0..10 {
        permits.push(backend.lock(format!("sem-{i}")).permits(2).try_once().await);
    }
    for task in tasks {
        task.await.expect("no panic");
    }
    for permit in permits {
        permit
            .expect("a free permit")
            .release()
            .await
            .expect("release");
    }
    // What the fencing design keeps: one row per name used within the fence TTL, nothing
    // of its holders.
    assert_eq!(rows("tower_lock_holders").await, 0);
    // The janitor runs every second (a quarter of the TTL, at least a second): generous.
    tokio::time::timeout(Duration::from_secs(60), async {
        while rows("tower_lock").await > 0 {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await
    .expect("the janitor deletes every name unused for the fence TTL");
    // Tokens go on increasing without the counters: the clock floors them.
    let token = backend
        .lock("name-0")
        .try_once()
        .await
        .expect("free")
        .fencing_token();
    assert!(
        token > 1_000_000_000_000_000,
        "a clock-floored token: {token}"
    );
}

/// `url` (a real server's, of scheme `own`) with each of `others` in its place is refused
/// by `build` before connecting, naming what the store takes (`takes`: "a PostgreSQL URL
/// starts with ..."); with `also` (the store's other scheme) it builds.
pub async fn urls_of_other_schemes_are_refused<B, F>(
    url: &str,
    (own, also, others): (&str, &str, &[&str]),
    takes: &str,
    build: impl Fn(String) -> F,
) where
    B: std::fmt::Debug,
    F: Future<Output = Result<B, tower_lock::BuildError>>,
{
    for scheme in others {
        let wrong = url.replacen(&format!("{own}://"), &format!("{scheme}://"), 1);
        let refused = build(wrong).await;
        let Err(error @ tower_lock::BuildError::Url { .. }) = &refused else {
            panic!("{scheme}:// is refused: {refused:?}");
        };
        assert_eq!(
            format!("{error:?}"),
            format!("invalid URL\n\nCaused by:\n    the URL's scheme is `{scheme}`; {takes}")
        );
    }
    let other = url.replacen(&format!("{own}://"), &format!("{also}://"), 1);
    build(other)
        .await
        .unwrap_or_else(|e| panic!("{also}:// is the store's too: {e:?}"));
}

//! MySQL/MariaDB faults: a holder process killed with -9, the wake connection killed
//! (`KILL CONNECTION`) while requests wait, the server restarted mid-run, the pool
//! exhausted.

mod support;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use axum::Router;
use axum::extract::{Request, State};
use axum::routing::post;
use sqlx::Connection;
use support::child::{self, ChildProcess};
use support::mariadb::{self, MariaDbServer, fresh_database};
use tokio::task::JoinHandle;
use tower_lock::{LockError, LockGuard, LockLayer, MySqlBackend};

/// Generous bound on anything that should happen at once: catches hangs only.
const HANG: Duration = Duration::from_secs(20);
/// The child holder's lease.
const CHILD_LEASE: Duration = Duration::from_secs(2);
const URL: &str = "TOWER_LOCK_TEST_MYSQL_URL";

#[tokio::test]
#[ignore = "entry point of the child processes that the tests spawn"]
async fn child_process() {
    if child::role().as_deref() == Some("holder") {
        let backend = MySqlBackend::connect(&child::setting(URL))
            .await
            .expect("backend");
        let guard = backend
            .lock("shared")
            .lease(CHILD_LEASE)
            .try_once()
            .await
            .expect("uncontended");
        child::report(&format!("held {}", guard.fencing_token()));
        std::future::pending::<()>().await;
    }
}

/// One integer that `sql` selects, on a connection to `url`.
async fn scalar(url: &str, sql: &str) -> i64 {
    let mut conn = sqlx::MySqlConnection::connect(url).await.expect("connect");
    sqlx::query_scalar(sql)
        .fetch_one(&mut conn)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"))
}

#[tokio::test]
async fn a_holder_killed_with_sigkill_loses_its_lock_at_its_expiry_and_no_sooner() {
    let url = fresh_database().await;
    let backend = mariadb::builder_on(&url).build().await.expect("backend");
    let mut holder = ChildProcess::spawn("child_process", "holder", &[(URL, url.clone())]);
    let report = holder
        .next_report()
        .await
        .expect("the child reports its lock");
    let killed_token: u64 = report
        .strip_prefix("held ")
        .and_then(|t| t.parse().ok())
        .unwrap_or_else(|| panic!("unexpected report {report:?}"));
    let micros = |column: &str| {
        format!(
            "SELECT TIMESTAMPDIFF(MICROSECOND, '1970-01-01', {column}) FROM tower_lock \
             WHERE name LIKE '%{{shared}}'"
        )
    };
    let lease_end = scalar(&url, &micros("expires")).await;
    holder.kill().await;

    let guard = backend
        .lock("shared")
        .wait(CHILD_LEASE + HANG)
        .await
        .expect("the lease frees the dead holder's lock");
    // Taken on the server's clock no sooner than the dead holder's lease ended there.
    let taken_at = scalar(&url, &micros("touched")).await;
    assert!(
        taken_at >= lease_end,
        "taken at {taken_at}, before the lease's end {lease_end}"
    );
    assert!(guard.fencing_token() > killed_token);
}

fn path_key(req: &Request) -> Option<String> {
    req.uri().path().strip_prefix("/lock/").map(str::to_owned)
}

async fn serve_locked(backend: MySqlBackend, wait: Duration) -> SocketAddr {
    let app = Router::new()
        .route("/lock/{key}", post(|| async { "done" }))
        .route_layer(LockLayer::new(backend, path_key).wait(wait));
    support::serve(app).await
}

fn spawn_post(addr: SocketAddr, path: String) -> JoinHandle<u16> {
    tokio::spawn(async move {
        support::post(&support::http_client(), addr, &path)
            .await
            .status
    })
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_wake_connection_killed_while_requests_wait_all_are_served_after_the_release() {
    // A database of its own: every waiter row in it is one of this test's backends'.
    let url = fresh_database().await;
    let instance = || async {
        mariadb::builder_on(&url)
            // Parks longer than the test: only a wake-up or a reconnect ends one.
            .wake_ping_interval(Duration::from_secs(120))
            .build()
            .await
            .expect("backend")
    };
    let holders = instance().await;
    let waiting = instance().await;
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
                let stats = waiting.stats();
                stats.channels_with_waiters == n && stats.local_waiters == 2 * n
            }
        };
        support::eventually("every key's waiters are registered", || {
            registered(keys.len())
        })
        .await;
        let connections = waiting.stats().subscriber_connections_made;
        // The waiting backend's wake connection: the one registered for more than the
        // admin channel.
        let wake = scalar(
            &url,
            "SELECT CAST(conn AS SIGNED) FROM tower_lock_waiters GROUP BY conn HAVING COUNT(*) > 1",
        )
        .await;
        mariadb::shared()
            .execute(&format!("KILL CONNECTION {wake}"))
            .await;
        if registered_before_release {
            support::eventually("the wake connection reconnected", || async {
                let stats = waiting.stats();
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_server_restarted_mid_run_answers_503_then_serves_with_no_double_hold() {
    let mut server = MariaDbServer::start();
    // Three instances whose handler counts who is inside: two at once is a double hold.
    let inside = Arc::new(AtomicU64::new(0));
    let overlaps = Arc::new(AtomicU64::new(0));
    let mut addrs = Vec::new();
    for _ in 0..3 {
        let backend = mariadb::builder_on(&server.url())
            .build()
            .await
            .expect("backend");
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
        addrs.push(support::serve(app).await);
    }
    let stop = Arc::new(AtomicBool::new(false));
    let served = Arc::new(AtomicU64::new(0));
    let clients: Vec<_> = (0..6)
        .map(|i| {
            let (stop, served, addr) = (stop.clone(), served.clone(), addrs[i % 3]);
            tokio::spawn(async move {
                let client = support::http_client();
                while !stop.load(Ordering::Relaxed) {
                    let reply = support::post(&client, addr, "/lock/hot").await;
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
    let reply = support::post(&support::http_client(), addrs[0], "/lock/other").await;
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exhausted_pool_answers_503_within_the_wait_and_recovers() {
    mariadb::backend().await; // the schema
    let url = mariadb::shared().url();
    let pool = sqlx::mysql::MySqlPoolOptions::new()
        .max_connections(1)
        .connect(&url)
        .await
        .expect("pool");
    let backend = MySqlBackend::from_pool(pool.clone())
        .namespace(mariadb::fresh_namespace())
        .build()
        .await
        .expect("backend on the application's pool");
    let addr = serve_locked(backend.clone(), Duration::from_millis(500)).await;
    let taken = pool.acquire().await.expect("the pool's only connection");
    let reply = tokio::time::timeout(
        HANG,
        support::post(&support::http_client(), addr, "/lock/k"),
    )
    .await
    .expect("answered within the wait, not the pool's own 30 s");
    assert_eq!(reply.status, 503, "{reply:?}");
    assert!(reply.headers.contains_key("retry-after"));
    drop(taken);
    let reply = support::post(&support::http_client(), addr, "/lock/k").await;
    assert_eq!(reply.status, 200, "{reply:?}");
    assert!(matches!(
        backend.lock("k").try_once().await.map(drop),
        Ok(()) | Err(LockError::Contended { .. })
    ));
}

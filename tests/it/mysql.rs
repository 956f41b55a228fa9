//! MySQL/MariaDB: what `build()` refuses, the tables and what they keep, no polling, and
//! the oversell test across three instances. The semantics every store keeps run in
//! semantics.rs, rwlock.rs, semaphore.rs, many.rs and inspect.rs; faults in
//! mysql_faults.rs.

use crate::support;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::Router;
use axum::extract::{Request, State};
use axum::routing::post;
use support::mariadb::{self, MariaDbServer, fresh_database};
use support::sql;
use tower_lock::{BuildError, LockLayer, MySqlBackend};

/// Generous bound on anything that should happen at once: catches hangs only.
const HANG: Duration = Duration::from_secs(10);

async fn rows(url: &str, table: &str) -> i64 {
    use sqlx::Connection;
    let mut conn = sqlx::MySqlConnection::connect(url).await.expect("connect");
    sqlx::query_scalar(&format!("SELECT COUNT(*) FROM {table}"))
        .fetch_one(&mut conn)
        .await
        .expect("count rows")
}

#[tokio::test]
async fn build_refuses_a_database_without_the_table_naming_the_sql_and_migrate_creates_it() {
    crate::needs!(MariaDb);
    let url = fresh_database().await;
    let refused = MySqlBackend::builder(&url).build().await;
    let Err(error @ BuildError::Schema { found: None, .. }) = &refused else {
        panic!("a database without the table is refused: {refused:?}");
    };
    let message = error.to_string();
    assert!(
        message.contains("src/mysql/schema.sql")
            && message.contains("MySqlBackend::schema_sql")
            && message.contains("migrate()"),
        "{message}"
    );
    // migrate() creates it, and running it again (another instance starting) changes
    // nothing; a backend without migrate() then builds.
    for _ in 0..2 {
        mariadb::builder_on(&url)
            .build()
            .await
            .expect("migrate creates the schema");
    }
    MySqlBackend::connect(&url)
        .await
        .expect("the schema is there");
    // The shipped SQL is what migrate() runs, for another table name too: through the
    // client, as an operator would run it.
    let sql = MySqlBackend::schema_sql("locks").expect("a plain table name");
    let server = mariadb::shared();
    let database = url.rsplit('/').next().expect("a database");
    let mut client = std::process::Command::new("mariadb")
        .args(["--no-defaults", "-uroot", "-h127.0.0.1"])
        .arg(format!("-P{}", server.port()))
        .arg(database)
        .stdin(std::process::Stdio::piped())
        .spawn()
        .expect("the mariadb client runs");
    std::io::Write::write_all(&mut client.stdin.take().expect("stdin"), sql.as_bytes())
        .expect("the SQL is sent");
    assert!(client.wait().expect("the client ends").success());
    let backend = MySqlBackend::builder(&url)
        .table("locks")
        .connect_timeout(Duration::from_secs(10))
        .build()
        .await
        .expect("the schema applied by hand");
    let guard = backend
        .lock("k")
        .try_once()
        .await
        .expect("a lock in `locks`");
    assert_eq!(rows(&url, "locks").await, 1);
    guard.release().await.expect("release");
    assert!(MySqlBackend::schema_sql("locks; drop table x").is_err());
}

#[tokio::test]
async fn build_refuses_an_older_schema_a_user_without_rights_and_a_read_only_server() {
    crate::needs!(MariaDb);
    let server = MariaDbServer::start();
    server
        .execute(
            "CREATE DATABASE old; \
             CREATE USER reader@'%' IDENTIFIED BY 'pw'; \
             GRANT SELECT ON test.* TO reader@'%'; \
             CREATE PROCEDURE old.tower_lock_schema_version() SELECT 0",
        )
        .await;
    mariadb::builder_on(&server.url())
        .build()
        .await
        .expect("the schema");

    let refused = MySqlBackend::connect(&server.url_as("reader", "pw")).await;
    let Err(error @ BuildError::Rights { user, .. }) = &refused else {
        panic!("a user without rights on the procedures is refused: {refused:?}");
    };
    assert_eq!(user, "reader");
    assert!(error.to_string().contains("tower_lock"), "{error}");

    let refused = MySqlBackend::connect(&server.url().replace("/test", "/old")).await;
    assert!(
        matches!(
            refused,
            Err(BuildError::Schema {
                found: Some(0),
                expected: 2,
                ..
            })
        ),
        "an older schema is refused: {refused:?}"
    );

    // A replica's URL given by mistake (replicas run with read_only): refused even for a
    // user whose privileges would let it write there.
    server.execute("SET GLOBAL read_only = 1").await;
    let refused = MySqlBackend::connect(&server.url()).await;
    let Err(error @ BuildError::ReadOnly { .. }) = &refused else {
        panic!("a read-only server is refused: {refused:?}");
    };
    assert!(error.to_string().contains("replica"), "{error}");
}

#[tokio::test]
async fn names_held_and_released_leave_rows_only_until_the_janitor_sweeps_them() {
    crate::needs!(MariaDb);
    let url = fresh_database().await;
    let backend = mariadb::builder_on(&url)
        .fence_ttl(Duration::from_secs(1))
        .build()
        .await
        .expect("backend");
    sql::names_leave_rows_only_until_the_janitor_sweeps_them(backend, async |table| {
        rows(&url, table).await
    })
    .await;
}

/// One instance's shop: POST /buy sells one item of the stock kept in MariaDB, read and
/// written in two statements with a pause between, as a careless handler would.
fn shop(backend: MySqlBackend, db: sqlx::MySqlPool, sold: Arc<AtomicU64>) -> Router {
    async fn buy(State((db, sold)): State<(sqlx::MySqlPool, Arc<AtomicU64>)>) -> &'static str {
        let stock: i64 = sqlx::query_scalar("SELECT stock FROM shop WHERE id = 1")
            .fetch_one(&db)
            .await
            .expect("read the stock");
        if stock <= 0 {
            return "sold out";
        }
        tokio::task::yield_now().await;
        sqlx::query("UPDATE shop SET stock = ? WHERE id = 1")
            .bind(stock - 1)
            .execute(&db)
            .await
            .expect("write the stock");
        sold.fetch_add(1, Ordering::Relaxed);
        "sold"
    }
    Router::new()
        .route("/buy", post(buy))
        .route_layer(
            LockLayer::new(backend, |_: &Request| Some("stock")).wait(Duration::from_secs(30)),
        )
        .with_state((db, sold))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_instances_sell_exactly_the_stock() {
    crate::needs!(MariaDb);
    const STOCK: i64 = 50;
    const BUYERS: usize = 150;
    let url = fresh_database().await;
    let db = sqlx::MySqlPool::connect(&url).await.expect("pool");
    sqlx::raw_sql(&format!(
        "CREATE TABLE shop (id INT PRIMARY KEY, stock BIGINT); \
         INSERT INTO shop VALUES (1, {STOCK})"
    ))
    .execute(&db)
    .await
    .expect("stock");
    let sold = Arc::new(AtomicU64::new(0));
    let mut addrs = Vec::new();
    let namespace = mariadb::fresh_namespace();
    for _ in 0..3 {
        let backend = mariadb::builder_on(&url)
            .namespace(&namespace)
            .build()
            .await
            .expect("backend");
        addrs.push(support::serve(shop(backend, db.clone(), sold.clone())).await);
    }
    support::all_served(support::buy_all(&addrs, BUYERS)).await;
    let left: i64 = sqlx::query_scalar("SELECT stock FROM shop WHERE id = 1")
        .fetch_one(&db)
        .await
        .expect("stock");
    assert_eq!((sold.load(Ordering::Relaxed), left), (STOCK as u64, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_do_not_poll_while_the_lock_is_held() {
    crate::needs!(MariaDb);
    // A server of its own: its global counters count this test's statements only.
    let server = MariaDbServer::start();
    let instance = || async {
        mariadb::builder_on(&server.url())
            // The wake connections' park, their one statement per interval, lasts longer
            // than the test: any statement in the window below is a poll.
            .wake_ping_interval(Duration::from_secs(120))
            .build()
            .await
            .expect("backend")
    };
    let holder = instance().await;
    let waiting = [instance().await, instance().await];
    let guard = holder
        .lock("k")
        .lease(Duration::from_secs(120))
        .try_once()
        .await
        .expect("uncontended");
    let calls = server.status("Com_call_procedure").await;
    let waiters: Vec<_> = (0..10)
        .map(|i| {
            let backend = waiting[i % 2].clone();
            tokio::spawn(async move {
                let guard = backend.lock("k").wait(Duration::from_secs(60)).await?;
                guard.release().await
            })
        })
        .collect();
    // Both instances are registered for the key, four tasks of each queued behind its
    // contender.
    for backend in &waiting {
        support::eventually("the waiters are queued and registered", || async move {
            let stats = backend.stats();
            stats.local_waiters == 4 && stats.channels_with_waiters == 1
        })
        .await;
    }
    // Each instance's contender tried, registered and tried again: eight procedure calls
    // for the two, which may still be on their way when the registration shows in the
    // stats (a ninth never comes: seen waiting out the bound).
    support::eventually("both contenders tried again after registering", || async {
        server.status("Com_call_procedure").await >= calls + 8
    })
    .await;
    let counters = || async {
        (
            server.status("Com_call_procedure").await,
            server.status("Com_select").await,
        )
    };
    let before = counters().await;
    // Far longer than any polling interval, far shorter than the lease and the parks: a
    // statement in this window was not asked for by the lock.
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        counters().await,
        before,
        "no call and no select while the lock is held"
    );
    guard.release().await.expect("release");
    for waiter in waiters {
        tokio::time::timeout(HANG, waiter)
            .await
            .expect("served")
            .expect("no panic")
            .expect("acquired after the release, and released");
    }
    // Woken by the release through the parked connections, which stayed up: a wake-up
    // that broke them would have served the waiters through the reconnect instead.
    for backend in &waiting {
        assert_eq!(backend.stats().subscriber_connections_made, 1);
    }
}

#[tokio::test]
async fn build_names_the_address_and_the_kind_of_a_connection_failure() {
    crate::needs!(MariaDb);
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port");
    let refused = MySqlBackend::connect(&format!("mysql://app@127.0.0.1:{port}/app")).await;
    let Err(error @ BuildError::Connect { .. }) = &refused else {
        panic!("nothing listens: {refused:?}");
    };
    let message = error.to_string();
    assert!(
        message.contains(&format!("127.0.0.1:{port}")) && message.contains("refused"),
        "{message}"
    );
    let server = mariadb::shared();
    let refused = MySqlBackend::connect(&server.url_as("nobody", "wrong")).await;
    let Err(error @ BuildError::Auth { user, .. }) = &refused else {
        panic!("unknown credentials: {refused:?}");
    };
    assert_eq!(user, "nobody");
    assert!(error.to_string().contains(&server.port().to_string()));
}

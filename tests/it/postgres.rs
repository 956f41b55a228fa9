//! PostgreSQL: what `build()` refuses, the table and what it keeps, no polling, and the
//! oversell test across three instances. The semantics every store keeps run in
//! semantics.rs, rwlock.rs, semaphore.rs and many.rs; faults in postgres_faults.rs.

use crate::support;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::Router;
use axum::extract::{Request, State};
use axum::routing::post;
use support::postgres::{self, PostgresServer};
use support::sql;
use tower_lock::{BuildError, LockLayer, PathParams, PostgresBackend};

/// Generous bound on anything that should happen at once: catches hangs only.
const HANG: Duration = Duration::from_secs(10);

async fn exec(server: &PostgresServer, sql: &str) {
    sqlx::raw_sql(sql)
        .execute(&mut server.conn().await)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
}

async fn rows(server: &PostgresServer, table: &str) -> i64 {
    sqlx::query_scalar(&format!("SELECT count(*) FROM {table}"))
        .fetch_one(&mut server.conn().await)
        .await
        .expect("count rows")
}

#[tokio::test]
async fn build_refuses_a_database_without_the_table_naming_the_sql_and_migrate_creates_it() {
    crate::needs!(Postgres);
    let server = PostgresServer::start();
    let refused = PostgresBackend::builder(server.url()).build().await;
    let Err(error @ BuildError::Schema { found: None, .. }) = &refused else {
        panic!("a database without the table is refused: {refused:?}");
    };
    let message = error.to_string();
    assert!(
        message.contains("src/postgres/schema.sql") && message.contains("migrate()"),
        "{message}"
    );
    // migrate() creates it, and running it again (another instance starting) changes
    // nothing; a backend without migrate() then builds.
    for _ in 0..2 {
        PostgresBackend::builder(server.url())
            .migrate()
            .build()
            .await
            .expect("migrate creates the schema");
    }
    PostgresBackend::connect(&server.url())
        .await
        .expect("the schema is there");
    // The shipped SQL is what migrate() runs, for another table name too.
    let sql = PostgresBackend::schema_sql("locks").expect("a plain table name");
    exec(&server, &sql).await;
    PostgresBackend::builder(server.url())
        .table("locks")
        .build()
        .await
        .expect("the schema applied by hand");
    assert!(PostgresBackend::schema_sql("locks; drop table x").is_err());
}

#[tokio::test]
async fn build_refuses_an_older_schema_a_user_without_rights_a_read_only_session_and_a_replica() {
    crate::needs!(Postgres);
    let server = postgres::shared();
    postgres::backend().await; // the schema
    exec(
        server,
        "DROP ROLE IF EXISTS outsider; CREATE ROLE outsider LOGIN; \
         DROP ROLE IF EXISTS reader; CREATE ROLE reader LOGIN; \
         GRANT SELECT, INSERT, UPDATE, DELETE ON tower_lock, tower_lock_holders TO reader; \
         ALTER ROLE reader SET default_transaction_read_only = on",
    )
    .await;
    let url_as = |user: &str| server.url().replace("postgres@", &format!("{user}@"));

    let refused = PostgresBackend::connect(&url_as("outsider")).await;
    let Err(error @ BuildError::Rights { user, .. }) = &refused else {
        panic!("a user without rights on the table is refused: {refused:?}");
    };
    assert_eq!(user, "outsider");
    assert!(error.to_string().contains("tower_lock"), "{error}");

    let refused = PostgresBackend::connect(&url_as("reader")).await;
    assert!(
        matches!(refused, Err(BuildError::ReadOnly { .. })),
        "a read-only session is refused: {refused:?}"
    );
    // A replica's URL given by mistake: it has the schema (replicated), and takes no writes.
    let replica = server.replica();
    let refused = PostgresBackend::connect(&replica.url()).await;
    let Err(error @ BuildError::ReadOnly { .. }) = &refused else {
        panic!("a replica is refused: {refused:?}");
    };
    assert!(error.to_string().contains("replica"), "{error}");

    exec(
        server,
        "CREATE SCHEMA old; CREATE FUNCTION old.tower_lock_schema_version() RETURNS integer \
         LANGUAGE sql AS 'SELECT 0'",
    )
    .await;
    let old = format!("{}?options=-c%20search_path%3Dold", server.url());
    let refused = PostgresBackend::connect(&old).await;
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
}

#[tokio::test]
async fn names_held_and_released_leave_rows_only_until_the_janitor_sweeps_them() {
    crate::needs!(Postgres);
    let server = PostgresServer::start();
    let backend = PostgresBackend::builder(server.url())
        .migrate()
        .fence_ttl(Duration::from_secs(1))
        .build()
        .await
        .expect("backend");
    sql::names_leave_rows_only_until_the_janitor_sweeps_them(backend, async |table| {
        rows(&server, table).await
    })
    .await;
}

/// One instance's shop: POST /buy sells one item of the stock kept in PostgreSQL, read and
/// written in two statements with a pause between, as a careless handler would.
fn shop(backend: PostgresBackend, db: sqlx::PgPool, sold: Arc<AtomicU64>) -> Router {
    async fn buy(State((db, sold)): State<(sqlx::PgPool, Arc<AtomicU64>)>) -> &'static str {
        let stock: i64 = sqlx::query_scalar("SELECT stock FROM shop WHERE id = 1")
            .fetch_one(&db)
            .await
            .expect("read the stock");
        if stock <= 0 {
            return "sold out";
        }
        tokio::task::yield_now().await;
        sqlx::query("UPDATE shop SET stock = $1 WHERE id = 1")
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
    crate::needs!(Postgres);
    const STOCK: i64 = 50;
    const BUYERS: usize = 150;
    let server = postgres::shared();
    let namespace = postgres::fresh_namespace();
    let db = sqlx::PgPool::connect(&server.url()).await.expect("pool");
    sqlx::raw_sql(&format!(
        "CREATE TABLE IF NOT EXISTS shop (id int PRIMARY KEY, stock bigint); \
         INSERT INTO shop VALUES (1, {STOCK}) ON CONFLICT (id) DO UPDATE SET stock = {STOCK}"
    ))
    .execute(&db)
    .await
    .expect("stock");
    let sold = Arc::new(AtomicU64::new(0));
    let mut addrs = Vec::new();
    for _ in 0..3 {
        let backend = postgres::backend_in(&namespace).await;
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
    crate::needs!(Postgres);
    // Every statement the server runs is logged, with the connection's name.
    let server = PostgresServer::start_with(&["log_statement=all", "log_line_prefix=%a| "]);
    let instance = || async {
        PostgresBackend::builder(server.url())
            .migrate()
            .build()
            .await
            .expect("backend")
    };
    let holder = instance().await;
    let waiting = [instance().await, instance().await];
    let guard = holder.lock("k").try_once().await.expect("uncontended");
    let acquisitions = || server.log().matches("_acquire(").count();
    let built = acquisitions();
    let waiters: Vec<_> = (0..10)
        .map(|i| {
            let backend = waiting[i % 2].clone();
            tokio::spawn(async move {
                let guard = backend.lock("k").wait(Duration::from_secs(20)).await?;
                guard.release().await
            })
        })
        .collect();
    // Both instances listen for the key, four tasks of each queued behind its contender.
    for backend in &waiting {
        support::eventually("the waiters are queued and listening", || async move {
            let stats = backend.stats();
            stats.local_waiters == 4 && stats.channels_with_waiters == 1
        })
        .await;
    }
    // Each instance's contender tried, listened and tried again: two attempts each, in a
    // log the server writes behind the statements it runs.
    support::eventually("both contenders' attempts are logged", || async {
        acquisitions() >= built + 4
    })
    .await;
    let before = acquisitions();
    // Far longer than any polling interval, far shorter than the lease (30 s): a waiter
    // that wakes in this window was not woken by the lock.
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        acquisitions(),
        before,
        "no acquisition attempt while the lock is held"
    );
    guard.release().await.expect("release");
    for waiter in waiters {
        tokio::time::timeout(HANG, waiter)
            .await
            .expect("served")
            .expect("no panic")
            .expect("acquired after the release, and released");
    }
    // Each waiter took the lock once, through the table or in memory.
    let after = acquisitions() - before;
    assert!(after <= 20, "{after} acquisition calls for 10 waiters");
}

/// Moves money between two accounts kept in PostgreSQL, reading both, yielding, then
/// writing both: without both locks, concurrent transfers lose money or overdraw.
async fn transfer(
    State(db): State<sqlx::PgPool>,
    axum::extract::Path((from, to, amount)): axum::extract::Path<(i32, i32, i64)>,
) -> http::StatusCode {
    let balance = |id: i32| {
        sqlx::query_scalar::<_, i64>("SELECT balance FROM accounts WHERE id = $1")
            .bind(id)
            .fetch_one(&db)
    };
    let (Ok(from_balance), Ok(to_balance)) = (balance(from).await, balance(to).await) else {
        return http::StatusCode::INTERNAL_SERVER_ERROR;
    };
    if from_balance < amount {
        return http::StatusCode::UNPROCESSABLE_ENTITY;
    }
    tokio::task::yield_now().await;
    for (id, value) in [(from, from_balance - amount), (to, to_balance + amount)] {
        let written = sqlx::query("UPDATE accounts SET balance = $2 WHERE id = $1")
            .bind(id)
            .bind(value)
            .execute(&db)
            .await;
        if written.is_err() {
            return http::StatusCode::INTERNAL_SERVER_ERROR;
        }
    }
    http::StatusCode::OK
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_transfers_over_three_instances_neither_deadlock_nor_lose_money() {
    crate::needs!(Postgres);
    const ACCOUNTS: i32 = 5;
    const OPENING: i64 = 100;
    let server = postgres::shared();
    let namespace = postgres::fresh_namespace();
    let db = sqlx::PgPool::connect(&server.url()).await.expect("pool");
    sqlx::raw_sql(&format!(
        "CREATE TABLE IF NOT EXISTS accounts (id int PRIMARY KEY, balance bigint); \
         DELETE FROM accounts; \
         INSERT INTO accounts SELECT i, {OPENING} FROM generate_series(0, {ACCOUNTS} - 1) i"
    ))
    .execute(&db)
    .await
    .expect("accounts");
    let mut addrs = Vec::new();
    for _ in 0..3 {
        let backend = postgres::backend_in(&namespace).await;
        // Both accounts, in the order the request names them (the layer sorts them).
        let layer = LockLayer::new(backend, PathParams::new(["from", "to"]).prefix("account"))
            .wait(Duration::from_secs(30));
        let app = Router::new()
            .route("/transfer/{from}/{to}/{amount}", post(transfer))
            .route_layer(layer)
            .with_state(db.clone());
        addrs.push(support::serve(app).await);
    }
    let client = support::http_client();
    let transfers: Vec<_> = (0..150)
        .map(|n| {
            let from = fastrand::i32(0..ACCOUNTS);
            let to = (from + fastrand::i32(1..ACCOUNTS)) % ACCOUNTS;
            let amount = fastrand::i64(1..=60);
            let (client, addr) = (client.clone(), addrs[n % 3]);
            tokio::spawn(async move {
                let path = format!("/transfer/{from}/{to}/{amount}");
                support::post(&client, addr, &path).await.status
            })
        })
        .collect();
    for transfer in transfers {
        let status = tokio::time::timeout(Duration::from_secs(60), transfer)
            .await
            .expect("no deadlock: every transfer finishes")
            .expect("no panic");
        assert!([200, 422].contains(&status), "{status}");
    }
    let balances: Vec<i64> = sqlx::query_scalar("SELECT balance FROM accounts ORDER BY id")
        .fetch_all(&db)
        .await
        .expect("balances");
    assert!(balances.iter().all(|b| *b >= 0), "overdrawn: {balances:?}");
    assert_eq!(balances.iter().sum::<i64>(), OPENING * i64::from(ACCOUNTS));
}

#[tokio::test]
async fn build_names_the_address_and_the_kind_of_a_connection_failure() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port");
    let refused = PostgresBackend::connect(&format!("postgres://app@127.0.0.1:{port}/app")).await;
    let Err(error @ BuildError::Connect { .. }) = &refused else {
        panic!("nothing listens: {refused:?}");
    };
    let message = error.to_string();
    assert!(
        message.contains(&format!("127.0.0.1:{port}")) && message.contains("refused"),
        "{message}"
    );
    let unknown = PostgresBackend::connect("postgres://app@no-such-host.invalid/app").await;
    let Err(error @ BuildError::Connect { .. }) = &unknown else {
        panic!("an unknown host: {unknown:?}");
    };
    let message = error.to_string();
    assert!(
        message.contains("no-such-host.invalid:5432") && message.contains("does not resolve"),
        "{message}"
    );
}

//! Fencing tokens end to end, against a PostgreSQL the test starts (`support::postgres`)
//! and a throwaway redis-server: the guarded `UPDATE` of `examples/fencing_postgres`
//! refuses the late write of a holder that lost its lock, once a newer holder wrote, and
//! the row keeps the newer write.

use crate::support;

#[path = "../../examples/fencing_postgres/orders.rs"]
mod orders;

use std::sync::Arc;
use std::time::Duration;

use http::Method;
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;
use support::postgres::PostgresServer;
use support::{RedisServer, eventually};
use tokio::sync::Notify;
use tokio::time::timeout;
use tower_lock::LockMode;

use self::orders::{SCHEMA, Shop, Written, set_status};

const HANG: Duration = Duration::from_secs(10);

/// A PostgreSQL of the test's own with the orders table and orders `ids`, status "new".
async fn database(ids: &[i64]) -> (PostgresServer, PgPool) {
    let server = tokio::task::spawn_blocking(PostgresServer::start)
        .await
        .expect("start PostgreSQL");
    let db = PgPoolOptions::new()
        .max_connections(4)
        .connect(&server.url())
        .await
        .expect("connect to the test PostgreSQL");
    sqlx::query(SCHEMA).execute(&db).await.expect("schema");
    for &id in ids {
        sqlx::query("INSERT INTO fencing_demo_orders (id, status) VALUES ($1, 'new')")
            .bind(id)
            .execute(&db)
            .await
            .expect("insert");
    }
    (server, db)
}

async fn row(db: &PgPool, id: i64) -> (String, i64) {
    sqlx::query_as("SELECT status, token FROM fencing_demo_orders WHERE id = $1")
        .bind(id)
        .fetch_one(db)
        .await
        .expect("the order's row")
}

/// Instance A holds an order's lock, waiting for its payment provider, when an operator
/// frees the key by force; B pays under a newer token; then A writes: 409, and the row
/// keeps B's payment and token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_force_released_holders_late_write_is_refused_and_the_newer_write_stays() {
    crate::needs!(Redis, Postgres);
    let (_postgres, db) = database(&[1]).await;
    let redis = RedisServer::start();
    let operator = redis.backend().await;
    let provider = Arc::new(Notify::new());
    let shop = |name, slow_provider| Shop {
        db: db.clone(),
        name,
        slow_provider,
    };
    let a = orders::router(redis.backend().await, shop("A", Some(provider.clone())));
    let b = orders::router(redis.backend().await, shop("B", None));
    let first = tokio::spawn(async move { support::call(&a, Method::POST, "/orders/1/pay").await });
    eventually("A holds the order's lock", || async {
        !operator
            .inspect("order:1")
            .await
            .expect("inspect")
            .is_free()
    })
    .await;

    let freed = operator
        .force_release("order:1")
        .await
        .expect("force_release");
    assert_eq!(freed.mode, LockMode::Exclusive);
    let second = support::call(&b, Method::POST, "/orders/1/pay").await;
    assert_eq!(second.status, 200, "{second:?}");
    provider.notify_one();
    let first = timeout(HANG, first)
        .await
        .expect("A answers")
        .expect("task");
    assert_eq!(first.status, 409, "{first:?}");
    assert!(first.body.contains("refused"), "{first:?}");

    let (status, token) = row(&db, 1).await;
    assert_eq!(status, "paid by B");
    let said = format!("paid by B under token {token}");
    assert_eq!(second.body, said, "the row has B's token");
    assert!(Some(u64::try_from(token).expect("positive")) > freed.fencing_token);
}

/// A holder whose lease runs out unrenewed (as a paused process's does) writes after the
/// next holder: refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_whose_lease_ran_out_is_refused_after_the_next_holder_wrote() {
    crate::needs!(Redis, Postgres);
    let (_postgres, db) = database(&[2]).await;
    let redis = RedisServer::start();
    let (first, second) = (redis.backend().await, redis.backend().await);
    let paused = first.lock("order:2").lease(Duration::from_millis(300));
    let paused = paused.without_watchdog().try_once().await.expect("free");
    timeout(HANG, paused.held().lost())
        .await
        .expect("the unrenewed lease runs out");
    let next = second
        .lock("order:2")
        .wait(HANG)
        .await
        .expect("the key is free again");
    let write = set_status(&db, 2, "second", next.fencing_token()).await;
    assert_eq!(write.expect("write"), Written::Yes);
    let late = set_status(&db, 2, "late", paused.fencing_token()).await;
    let newer = i64::try_from(next.fencing_token()).expect("fits a BIGINT");
    assert_eq!(late.expect("write"), Written::Stale { newer });
    assert_eq!(row(&db, 2).await, ("second".to_owned(), newer));
    next.release().await.expect("release");
}

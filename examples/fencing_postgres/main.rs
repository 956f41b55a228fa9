//! Fencing tokens end to end: a holder that lost its lock writes late, and PostgreSQL
//! refuses the write because a newer token wrote first.
//!
//! ```text
//! cargo run --example fencing_postgres
//! ```
//!
//! Two instances, A and B, serve `POST /orders/{id}/pay` under `LockLayer`, and write the
//! order's row with a guarded `UPDATE ... WHERE id = $2 AND token < $1` (see `orders.rs`).
//! A takes the order's lock and waits for a slow payment provider. An operator sees the key
//! held (`inspect`) and frees it (`force_release`). B pays under a newer fencing token.
//! Then A's provider answers and A writes: refused, 409. The row keeps B's payment.
//! Exits non-zero if A's late write went through.
//!
//! Where things live:
//!
//! - `REDIS_URL`, `DATABASE_URL` when set: the demo's locks live under a namespace of their
//!   own, and it writes one row of `fencing_demo_orders` (created if missing), deleted at
//!   the end.
//! - otherwise throwaway servers, started here on free loopback ports in temp dirs and
//!   stopped at the end: `redis-server`, and PostgreSQL's `initdb` and `postgres` (as the
//!   `postgres` user when run as root; Debian's `postgresql` package has them).

mod orders;
#[path = "../flash_sale/throwaway.rs"]
mod throwaway;
// The tests' throwaway PostgreSQL; the example does not use all of it.
#[allow(dead_code)]
#[path = "../../tests/support/postgres.rs"]
mod postgres;
// Nor all of what the throwaway servers share.
#[allow(dead_code)]
#[path = "../../tests/support/process.rs"]
mod process;

use std::process::ExitCode;
use std::sync::Arc;

use axum::Router;
use axum::body::Body;
use axum::extract::Request;
use sqlx::postgres::PgPoolOptions;
use tokio::sync::Notify;
use tower::ServiceExt;
use tower_lock::RedisBackend;

use crate::orders::{SCHEMA, Shop};
use crate::postgres::PostgresServer;
use crate::throwaway::ThrowawayRedis;

type Error = Box<dyn std::error::Error + Send + Sync>;

#[tokio::main]
async fn main() -> ExitCode {
    match demo().await {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => {
            eprintln!("FAIL: the late write was not refused");
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn demo() -> Result<bool, Error> {
    // Kept until the end: dropping them stops the throwaway servers.
    let (_redis, redis_url) = match std::env::var("REDIS_URL") {
        Ok(url) => (None, url),
        Err(_) => {
            let redis = ThrowawayRedis::start()
                .await?
                .ok_or("redis-server is not on PATH: install it or set REDIS_URL")?;
            println!("throwaway Redis {} at {}", redis.version(), redis.url());
            let url = redis.url().to_owned();
            (Some(redis), url)
        }
    };
    let (_postgres, database_url) = match std::env::var("DATABASE_URL") {
        Ok(url) => (None, url),
        Err(_) => {
            let postgres = tokio::task::spawn_blocking(PostgresServer::try_start).await??;
            println!("throwaway PostgreSQL at {}", postgres.url());
            let url = postgres.url();
            (Some(postgres), url)
        }
    };
    let db = PgPoolOptions::new()
        .max_connections(4)
        .connect(&database_url)
        .await?;
    sqlx::query(SCHEMA).execute(&db).await?;
    let id = fastrand::i64(1..i64::MAX);
    sqlx::query("INSERT INTO fencing_demo_orders (id, status) VALUES ($1, 'new')")
        .bind(id)
        .execute(&db)
        .await?;
    let outcome = story(&redis_url, &db, id).await;
    sqlx::query("DELETE FROM fencing_demo_orders WHERE id = $1")
        .bind(id)
        .execute(&db)
        .await?;
    outcome
}

async fn story(redis_url: &str, db: &sqlx::PgPool, id: i64) -> Result<bool, Error> {
    let namespace = format!("fencing-demo-{}", std::process::id());
    let backend = || {
        RedisBackend::builder(redis_url)
            .namespace(&namespace)
            .build()
    };
    let (a, b, operator) = (backend().await?, backend().await?, backend().await?);
    let provider = Arc::new(Notify::new());
    let shop = |name, slow_provider| Shop {
        db: db.clone(),
        name,
        slow_provider,
    };
    let a = orders::router(a, shop("A", Some(provider.clone())));
    let b = orders::router(b, shop("B", None));
    let path = format!("/orders/{id}/pay");

    let first = tokio::spawn(pay(a, path.clone()));
    let key = format!("order:{id}");
    let held = loop {
        let info = operator.inspect(key.as_str()).await?;
        if !info.is_free() {
            break info;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    };
    println!("A holds {key} and waits for its payment provider");
    println!(
        "operator: inspect -> {:?}, {} holder, lease {:?} left, token {:?}",
        held.mode, held.holders, held.lease_remaining, held.fencing_token
    );
    let freed = operator.force_release(key.as_str()).await?;
    println!("operator: force_release -> freed {:?}", freed.mode);
    let (status_b, said_b) = pay(b, path).await?;
    println!("B: {status_b} {said_b}");
    provider.notify_one();
    let (status_a, said_a) = first.await??;
    println!("A: {status_a} {said_a}");
    let (status, token): (String, i64) =
        sqlx::query_as("SELECT status, token FROM fencing_demo_orders WHERE id = $1")
            .bind(id)
            .fetch_one(db)
            .await?;
    println!("row: status = {status:?}, token = {token}");
    Ok(status_a == 409 && status_b == 200 && status == "paid by B")
}

/// Posts to `path` on `app` and reads the answer.
async fn pay(app: Router, path: String) -> Result<(u16, String), Error> {
    let response = app
        .oneshot(Request::post(path).body(Body::empty())?)
        .await?;
    let status = response.status().as_u16();
    let body = axum::body::to_bytes(response.into_body(), 64 * 1024).await?;
    Ok((status, String::from_utf8_lossy(&body).into_owned()))
}

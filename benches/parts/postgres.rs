//! The PostgreSQL store: uncontended acquire + release next to the `SELECT 1` round trip,
//! and the hot key next to the in-process mutex, measured in the same run.

use std::time::Duration;

use tower_lock::PostgresBackend;

use super::Contender;
use super::sql::{self, Uncontended};
use super::support::RedisServer;
use super::support::postgres::PostgresServer;

pub async fn postgres(redis: &RedisServer, secs: Duration) -> String {
    let server = PostgresServer::start();
    let backend = || async {
        PostgresBackend::builder(server.url())
            .migrate()
            .build()
            .await
            .expect("backend")
    };
    let version: String = sqlx::query_scalar("SHOW server_version")
        .fetch_one(&mut server.conn().await)
        .await
        .expect("version");
    let mut out = format!("## PostgreSQL {version} on loopback\n\n");
    out += &sql::uncontended_table("PostgreSQL", uncontended(&server, &backend().await).await);
    let instance = || async { Contender::Postgres(backend().await) };
    out += &sql::hot_key(redis, secs, "tower-lock on PostgreSQL", instance).await;
    out
}

/// `try_once` + `release` on a free key, interleaved with `SELECT 1` on a connection of
/// a pool set up as the backend's (no ping before a checkout).
async fn uncontended(server: &PostgresServer, backend: &PostgresBackend) -> Uncontended {
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .test_before_acquire(false)
        .connect(&server.url())
        .await
        .expect("pool");
    sqlx::raw_sql(
        "CREATE TABLE IF NOT EXISTS bench_floor (id int PRIMARY KEY, n bigint); \
         INSERT INTO bench_floor VALUES (1, 0) ON CONFLICT DO NOTHING",
    )
    .execute(&pool)
    .await
    .expect("floor table");
    let (select, update) = sql::floor!(pool, i32);
    sql::measure(backend, select, update).await
}

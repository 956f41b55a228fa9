//! The MySQL store on MariaDB: uncontended acquire + release next to the `SELECT 1` round
//! trip, and the hot key next to the in-process mutex, measured in the same run.

use std::time::Duration;

use tower_lock::MySqlBackend;

use super::Contender;
use super::sql::{self, Uncontended};
use super::support::RedisServer;
use super::support::mariadb::MariaDbServer;

pub async fn mysql(redis: &RedisServer, secs: Duration) -> String {
    let server = MariaDbServer::start();
    let backend = || async {
        MySqlBackend::builder(server.url())
            .migrate()
            .build()
            .await
            .expect("backend")
    };
    let version: String = sqlx::query_scalar("SELECT VERSION()")
        .fetch_one(&mut server.conn().await)
        .await
        .expect("version");
    let mut out =
        format!("## MariaDB {version} on loopback (innodb_flush_log_at_trx_commit = 2)\n\n");
    out += &sql::uncontended_table("MariaDB", uncontended(&server, &backend().await).await);
    let instance = || async { Contender::MySql(backend().await) };
    out += &sql::hot_key(redis, secs, "tower-lock on MariaDB", instance).await;
    out
}

/// `try_once` + `release` on a free key, interleaved with `SELECT 1` and two one-row
/// `UPDATE`s on a connection of a pool set up as the backend's (no ping before a checkout).
async fn uncontended(server: &MariaDbServer, backend: &MySqlBackend) -> Uncontended {
    let pool = sqlx::mysql::MySqlPoolOptions::new()
        .max_connections(1)
        .test_before_acquire(false)
        .connect(&server.url())
        .await
        .expect("pool");
    sqlx::raw_sql(
        "CREATE TABLE IF NOT EXISTS bench_floor (id INT PRIMARY KEY, n BIGINT); \
         INSERT IGNORE INTO bench_floor VALUES (1, 0)",
    )
    .execute(&pool)
    .await
    .expect("floor table");
    let (select, update) = sql::floor!(pool, i64);
    sql::measure(backend, select, update).await
}

//! The PostgreSQL store: uncontended acquire + release next to the `SELECT 1` round trip,
//! and the hot key next to the in-process mutex, measured in the same run.

use std::fmt::Write as _;
use std::time::{Duration, Instant};

use tower_lock::PostgresBackend;

use super::support::RedisServer;
use super::support::postgres::PostgresServer;
use super::{Contender, HotBench, HotRun, INSTANCES, Percentiles, ROUNDS, hot_table, us};

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
    out += &uncontended(&server, &backend().await).await;
    for section in [Duration::ZERO, Duration::from_millis(1)] {
        let bench = HotBench {
            server: redis,
            section,
            secs: secs / ROUNDS,
        };
        let mut towers = Vec::new();
        for _ in 0..INSTANCES {
            towers.push(Contender::Postgres(backend().await));
        }
        let mutex = std::sync::Arc::new(tokio::sync::Mutex::new(()));
        let mut runs = [
            HotRun::new(
                "tokio::sync::Mutex (in-process ideal)",
                vec![Contender::Mutex(mutex); INSTANCES],
            ),
            HotRun::new("tower-lock on PostgreSQL", towers),
        ];
        for _ in 0..ROUNDS {
            for run in &mut runs {
                bench.round(run).await;
            }
        }
        out += &hot_table(section, &runs);
    }
    out
}

/// `try_once` + `release` on a free key, interleaved with `SELECT 1` on a connection of
/// a pool set up as the backend's (no ping before a checkout).
async fn uncontended(server: &PostgresServer, backend: &PostgresBackend) -> String {
    const N: usize = 2000;
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
    let (mut selects, mut updates) = (Vec::with_capacity(N), Vec::with_capacity(N));
    let mut locks = Vec::with_capacity(N);
    for i in 0..N + 200 {
        let t = Instant::now();
        let _: i32 = sqlx::query_scalar("SELECT 1")
            .fetch_one(&pool)
            .await
            .expect("SELECT 1");
        let select = t.elapsed();
        let t = Instant::now();
        for _ in 0..2 {
            sqlx::query("UPDATE bench_floor SET n = n + 1 WHERE id = 1")
                .execute(&pool)
                .await
                .expect("UPDATE");
        }
        let update = t.elapsed();
        let t = Instant::now();
        let guard = backend.lock("bench:solo").try_once().await.expect("free");
        guard.release().await.expect("release");
        let lock = t.elapsed();
        if i >= 200 {
            selects.push(select);
            updates.push(update);
            locks.push(lock);
        }
    }
    let (select, update) = (Percentiles::of(selects), Percentiles::of(updates));
    let lock = Percentiles::of(locks);
    let mut out = String::from("### PostgreSQL: uncontended acquire + release\n\n");
    out += "| | p50 | p99 |\n|---|---|---|\n";
    for (name, latency) in [
        ("`SELECT 1` round trip", &select),
        (
            "two one-row `UPDATE`s (the floor of two write transactions)",
            &update,
        ),
        ("tower-lock `try_once` + `release`", &lock),
    ] {
        let _ = writeln!(
            out,
            "| {name} | {} | {} |",
            us(latency.p50),
            us(latency.p99)
        );
    }
    let _ = writeln!(
        out,
        "\nRound trips per acquire + release (p50 / `SELECT 1` p50): **{:.2}**; the two \
         `UPDATE`s: {:.2}\n",
        lock.p50.as_secs_f64() / select.p50.as_secs_f64(),
        update.p50.as_secs_f64() / select.p50.as_secs_f64()
    );
    out
}

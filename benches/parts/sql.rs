//! What the SQL stores' tables share: the hot key next to the in-process mutex, and the
//! uncontended table next to the server's `SELECT 1` round trip.

use std::fmt::Write as _;
use std::future::Future;
use std::time::{Duration, Instant};

use tower_lock::LockBackend;

use super::support::RedisServer;
use super::{
    Contender, HotBench, HotRun, INSTANCES, Percentiles, ROUNDS, hot_table, latency_table,
};

/// The hot-key tables (0 and 1 ms sections) for `INSTANCES` instances that `instance`
/// builds, named `name`, next to the mutex in the same run.
pub async fn hot_key<F, Fut>(
    redis: &RedisServer,
    secs: Duration,
    name: &'static str,
    instance: F,
) -> String
where
    F: Fn() -> Fut,
    Fut: Future<Output = Contender>,
{
    let mut out = String::new();
    for section in [Duration::ZERO, Duration::from_millis(1)] {
        let bench = HotBench {
            server: redis,
            section,
            secs: secs / ROUNDS,
        };
        let mut towers = Vec::new();
        for _ in 0..INSTANCES {
            towers.push(instance().await);
        }
        let mutex = std::sync::Arc::new(tokio::sync::Mutex::new(()));
        let mut runs = [
            HotRun::new(
                "tokio::sync::Mutex (in-process ideal)",
                vec![Contender::Mutex(mutex); INSTANCES],
            ),
            HotRun::new(name, towers),
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

/// Latencies of one uncontended iteration's parts, in the order measured.
pub struct Uncontended {
    pub selects: Vec<Duration>,
    pub updates: Vec<Duration>,
    pub locks: Vec<Duration>,
}

/// The floor's calls on the pool `$pool`: one `SELECT 1` (decoded as `$int`), and two
/// one-row `UPDATE`s of `bench_floor`; for [`measure`].
macro_rules! floor {
    ($pool:ident, $int:ty) => {
        (
            || async {
                let _: $int = sqlx::query_scalar("SELECT 1")
                    .fetch_one(&$pool)
                    .await
                    .expect("SELECT 1");
            },
            || async {
                for _ in 0..2 {
                    sqlx::query("UPDATE bench_floor SET n = n + 1 WHERE id = 1")
                        .execute(&$pool)
                        .await
                        .expect("UPDATE");
                }
            },
        )
    };
}
pub(crate) use floor;

/// `try_once` + `release` on a free key, interleaved with `select` (one `SELECT 1`) and
/// `update` (two one-row `UPDATE`s), 2000 times after 200 to warm up.
pub async fn measure<S, SF, U, UF>(backend: &impl LockBackend, select: S, update: U) -> Uncontended
where
    S: Fn() -> SF,
    SF: Future<Output = ()>,
    U: Fn() -> UF,
    UF: Future<Output = ()>,
{
    const N: usize = 2000;
    let mut measured = Uncontended {
        selects: Vec::with_capacity(N),
        updates: Vec::with_capacity(N),
        locks: Vec::with_capacity(N),
    };
    for i in 0..N + 200 {
        let t = Instant::now();
        select().await;
        let selected = t.elapsed();
        let t = Instant::now();
        update().await;
        let updated = t.elapsed();
        let t = Instant::now();
        let guard = backend.lock("bench:solo").try_once().await.expect("free");
        guard.release().await.expect("release");
        let lock = t.elapsed();
        if i >= 200 {
            measured.selects.push(selected);
            measured.updates.push(updated);
            measured.locks.push(lock);
        }
    }
    measured
}

/// The uncontended table of `store`: `SELECT 1`, two one-row `UPDATE`s, and
/// `try_once` + `release`, with the round trips an acquire + release costs.
pub fn uncontended_table(store: &str, measured: Uncontended) -> String {
    let select = Percentiles::of(measured.selects);
    let update = Percentiles::of(measured.updates);
    let lock = Percentiles::of(measured.locks);
    let mut out = format!("### {store}: uncontended acquire + release\n\n");
    out += &latency_table(&[
        ("`SELECT 1` round trip", &select),
        (
            "two one-row `UPDATE`s (the floor of two write transactions)",
            &update,
        ),
        ("tower-lock `try_once` + `release`", &lock),
    ]);
    let _ = writeln!(
        out,
        "\nRound trips per acquire + release (p50 / `SELECT 1` p50): **{:.2}**; the two \
         `UPDATE`s: {:.2}\n",
        lock.p50.as_secs_f64() / select.p50.as_secs_f64(),
        update.p50.as_secs_f64() / select.p50.as_secs_f64()
    );
    out
}

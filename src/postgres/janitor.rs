//! The janitor's sweep call on PostgreSQL (see `core::janitor`).

use std::time::Duration;

use sqlx::postgres::PgPool;
use tokio_util::sync::CancellationToken;

use crate::core::janitor;
use crate::core::runtime::{Daemon, Spawner};

/// Starts the janitor with the `sweep` statement (`SELECT {table}_sweep($1, $2)`).
pub(crate) fn spawn(
    pool: PgPool,
    sweep: String,
    fence_ttl: Duration,
    shutdown: CancellationToken,
    spawner: &Spawner,
) -> Daemon {
    let call: janitor::Sweep = Box::new(move |keep_ms, limit| {
        let (pool, sweep) = (pool.clone(), sweep.clone());
        Box::pin(async move {
            sqlx::query_scalar::<_, i32>(&sweep)
                .bind(keep_ms)
                .bind(limit)
                .fetch_one(&pool)
                .await
                .map(i64::from)
                .map_err(|e| e.to_string())
        })
    });
    janitor::spawn(call, fence_ttl, shutdown, spawner)
}

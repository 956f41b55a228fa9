//! The janitor's sweep call on MySQL (see `core::janitor`): the procedure also deletes the
//! waiter rows of wake connections that are gone.

use std::time::Duration;

use sqlx::mysql::MySqlPool;
use tokio_util::sync::CancellationToken;

use crate::core::janitor;
use crate::core::runtime::{Daemon, Spawner};

/// Starts the janitor with the `sweep` statement (`CALL {table}_sweep(?, ?)`).
pub(crate) fn spawn(
    pool: MySqlPool,
    sweep: String,
    fence_ttl: Duration,
    shutdown: CancellationToken,
    spawner: &Spawner,
) -> Daemon {
    let call: janitor::Sweep = Box::new(move |keep_ms, limit| {
        let (pool, sweep) = (pool.clone(), sweep.clone());
        Box::pin(async move {
            let gone = sqlx::query_scalar::<_, i64>(&sweep)
                .bind(keep_ms)
                .bind(limit)
                .fetch_all(&pool)
                .await
                .map_err(|e| e.to_string())?;
            Ok(gone.first().copied().unwrap_or(0))
        })
    });
    janitor::spawn(call, fence_ttl, shutdown, spawner)
}

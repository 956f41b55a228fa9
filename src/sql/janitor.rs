//! The janitor of a SQL store (see `core::janitor`), calling the store's `sweep` routine,
//! which also deletes expired idempotency records; MySQL's also deletes the waiter rows of
//! wake connections that are gone.

use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::Calls;
use crate::core::runtime::janitor;
use crate::core::runtime::{Daemon, Spawner};

/// Starts the janitor with the `sweep` statement (see [`Calls::sweep`]).
pub(crate) fn spawn<D: Calls>(
    pool: sqlx::Pool<D>,
    sweep: String,
    fence_ttl: Duration,
    shutdown: CancellationToken,
    spawner: &Spawner,
) -> Daemon {
    let call: janitor::Sweep = Box::new(move |keep_ms, limit| {
        let sweep = D::sweep(pool.clone(), sweep.clone(), keep_ms, limit);
        Box::pin(async move { sweep.await.map_err(|e| e.to_string()) })
    });
    janitor::spawn(call, fence_ttl, shutdown, spawner)
}

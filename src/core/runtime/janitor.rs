//! The janitor of a store: deletes what keys that came and went left behind, so that it
//! stays bounded: in SQL the rows of names that nobody has used for the fence retention
//! and expired idempotency records; in ZooKeeper expired idempotency records.

use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::core::runtime::{Daemon, Spawner};
use crate::lock::BoxFuture;

/// Rows deleted by one statement: a sweep of many stale names is a series of short
/// statements, not one long one.
const SWEEP_BATCH: i32 = 1000;

/// One sweep call: `(keep_ms, limit)` to how many names went, or why it failed.
pub(crate) type Sweep =
    Box<dyn Fn(i64, i32) -> BoxFuture<'static, Result<i64, String>> + Send + Sync>;

/// Starts the janitor: every `fence_ttl / 4` (between 1 s and 5 min) it deletes the names
/// free and unused for `fence_ttl`, so a released name is gone within 1.25 fence TTLs.
pub(crate) fn spawn(
    sweep: Sweep,
    fence_ttl: Duration,
    shutdown: CancellationToken,
    spawner: &Spawner,
) -> Daemon {
    let interval = (fence_ttl / 4).clamp(Duration::from_secs(1), Duration::from_secs(300));
    let keep_ms = i64::try_from(fence_ttl.as_millis()).unwrap_or(i64::MAX);
    let sweep = std::sync::Arc::new(sweep);
    let start = move |shutdown: CancellationToken| {
        let sweep = sweep.clone();
        async move {
            let mut ticks = tokio::time::interval(interval);
            ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = ticks.tick() => {}
                }
                loop {
                    match sweep(keep_ms, SWEEP_BATCH).await {
                        Ok(n) if n == i64::from(SWEEP_BATCH) => continue,
                        Ok(n) => tracing::trace!(deleted = n, "lock store swept"),
                        Err(error) => tracing::debug!(%error, "lock store sweep failed"),
                    }
                    break;
                }
            }
        }
    };
    Daemon::spawn(start, spawner, shutdown)
}

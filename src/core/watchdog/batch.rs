//! One renewal call: a batch of held locks renewed (or checked) by one store call, and
//! what its reply means for each of them.

use std::time::Duration;

use tokio::time::{Instant, timeout};

use super::{HoldKey, OnLost, Shared, Store, run_hooks};

/// A hold due for renewal (or a check), as collected for one call.
#[derive(Clone)]
pub(crate) struct Due {
    /// The lock's name in the store and the holder's identity.
    pub(crate) key: HoldKey,
    pub(super) generation: u64,
    pub(crate) lease: Duration,
    /// False: only check that the lock is still held (a hold without renewal).
    pub(crate) renew: bool,
    /// The state's recheck count when the hold was collected: a recheck raised while the
    /// call was in flight (the store may have lost data since) asks for another call.
    pub(super) rechecks: u64,
}

impl Due {
    /// A renewal outside the watchdog's rounds, of `key` for `lease`: the claim of a
    /// grant, made before its holder runs (see `grant.rs`).
    pub(crate) fn claim(key: HoldKey, lease: Duration) -> Self {
        Due {
            key,
            generation: 0,
            lease,
            renew: true,
            rechecks: 0,
        }
    }
}

/// Sends one renewal call and applies its reply. The holds of `batch` are marked in
/// flight (see `collect_due`) until this returns, which it does within `command_timeout`.
pub(super) async fn renew_batch<S: Store>(
    shared: &Shared,
    store: &S,
    command_timeout: Duration,
    batch: Vec<Due>,
) {
    let sent_at = Instant::now();
    let result = timeout(command_timeout, store.renew(&batch)).await;
    let failed = !matches!(&result, Ok(Ok(renewed)) if renewed.len() == batch.len());
    let mut state = shared.state();
    let rechecks = state.rechecks;
    let mut hooks: Vec<OnLost> = Vec::new();
    match result {
        Ok(Ok(renewed)) if renewed.len() == batch.len() => {
            for (due, still_held) in batch.iter().zip(renewed) {
                let Some(entry) = state
                    .holds
                    .get_mut(&due.key)
                    .filter(|e| e.generation == due.generation)
                else {
                    continue; // released (or lost and taken anew) while the renewal was in flight
                };
                entry.in_flight = false;
                // Rechecked since the call was sent: `next` stays due now, `recheck` set.
                let settled = due.rechecks == rechecks;
                if still_held && due.renew {
                    entry.confirmed = sent_at;
                    if settled {
                        entry.recheck = false;
                        entry.next = sent_at + entry.lease / 3;
                    }
                } else if still_held {
                    // Checked, not extended: the lease still ends where it did.
                    if settled {
                        entry.recheck = false;
                        entry.next = entry.end();
                    }
                } else {
                    tracing::warn!(key = %due.key.0, "lock no longer held at renewal");
                    hooks.extend(entry.lose());
                    state.holds.remove(&due.key);
                }
            }
        }
        outcome => {
            match outcome {
                Ok(Ok(_)) => tracing::warn!("lock renewal returned a malformed reply"),
                // Recorded as an error, so subscribers print its sources (the cause).
                Ok(Err(e)) => tracing::warn!(
                    error = &e as &(dyn std::error::Error + 'static),
                    "lock renewal failed; retrying"
                ),
                Err(_) => tracing::warn!("lock renewal timed out; retrying"),
            }
            // Keep the locks and try again soon; `collect_due` declares them lost only once
            // their lease has certainly run out.
            for due in &batch {
                if let Some(entry) = state
                    .holds
                    .get_mut(&due.key)
                    .filter(|e| e.generation == due.generation)
                {
                    entry.in_flight = false;
                    let retry =
                        (entry.lease / 10).clamp(Duration::from_millis(20), Duration::from_secs(1));
                    entry.next = Instant::now() + retry;
                }
            }
        }
    }
    drop(state);
    if failed {
        shared.metrics.renewal_failed();
    }
    run_hooks(hooks);
}

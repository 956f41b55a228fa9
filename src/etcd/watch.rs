//! One watch per backend on the whole namespace, for deletions only: a key deleted
//! (released, withdrawn, or gone with its lease) wakes the waiters of this process that
//! wait behind it (see `behind.rs`).
//!
//! The watch covers every lock of the namespace from the moment etcd confirms it, so a
//! waiter's channel is confirmed as soon as it registers on a live watch. A watch that
//! breaks (etcd unreachable, a member that lost its leader, a compaction) wakes every
//! waiter, and is opened again with capped exponential backoff; its confirmation wakes
//! them once more. The gRPC connection is pinged by HTTP/2 keep-alives (see the
//! builder), so a half-open connection fails the stream too.

use std::sync::Arc;
use std::time::Duration;

use etcd_client::{EventType, WatchClient, WatchFilterType, WatchOptions};
use tokio::time::timeout;
use tokio_util::sync::CancellationToken;

use super::behind::Behind;
use crate::core::runtime::{Daemon, Spawner};
use crate::core::wakeups::{Disconnected, Waiter, Wakeups};
use crate::core::watchdog::recheck::Recheck;

/// Handle to the backend's watch task.
pub(crate) struct Listener {
    wakeups: Wakeups,
    behind: Arc<Behind>,
    task: Daemon,
}

/// What the watch task needs.
#[derive(Clone)]
pub(crate) struct WatchConfig {
    pub(crate) client: WatchClient,
    /// The namespace's prefix (see `keys::namespace_prefix`).
    pub(crate) prefix: String,
    pub(crate) connect_timeout: Duration,
    pub(crate) max_backoff: Duration,
}

impl Listener {
    /// Starts the watch task; it stops when `shutdown` is cancelled. Every (re)opened
    /// watch raises `recheck`: deletions may have been missed meanwhile.
    pub(crate) fn spawn(
        wakeups: Wakeups,
        config: WatchConfig,
        recheck: Recheck,
        shutdown: CancellationToken,
        spawner: &Spawner,
    ) -> Self {
        let behind = Arc::new(Behind::default());
        let (serving, waits) = (wakeups.clone(), behind.clone());
        let start = move |shutdown| {
            let watched = (serving.clone(), waits.clone());
            watch_until_shutdown(watched, config.clone(), recheck.clone(), shutdown)
        };
        let task = Daemon::spawn(start, spawner, shutdown);
        Listener {
            wakeups,
            behind,
            task,
        }
    }

    /// Registers a waiter on an acquisition's `channel` (see [`Wakeups::register`]).
    pub(crate) fn register(&self, channel: &str) -> Waiter {
        self.task.ensure_running();
        self.wakeups.register(channel)
    }

    /// What the waiters wait behind.
    pub(crate) fn behind(&self) -> &Arc<Behind> {
        &self.behind
    }

    /// The waiters and the watch's state.
    pub(crate) fn wakeups(&self) -> &Wakeups {
        &self.wakeups
    }
}

async fn watch_until_shutdown(
    (wakeups, behind): (Wakeups, Arc<Behind>),
    config: WatchConfig,
    recheck: Recheck,
    shutdown: CancellationToken,
) {
    let _disconnected = Disconnected(&wakeups);
    let initial_backoff = Duration::from_millis(20);
    let mut backoff = initial_backoff;
    while !shutdown.is_cancelled() {
        let ended = tokio::select! {
            () = shutdown.cancelled() => return,
            ended = serve((&wakeups, &behind), &config, &recheck, &mut backoff) => ended,
        };
        wakeups.disconnected();
        if backoff == initial_backoff {
            tracing::warn!(reason = %ended, "etcd watch lost");
        } else {
            tracing::debug!(reason = %ended, "etcd watch could not be opened");
        }
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = tokio::time::sleep(backoff) => {}
        }
        backoff = (backoff * 2).min(config.max_backoff);
    }
}

/// Opens the watch and serves it until it fails; returns why. Resets `backoff` once the
/// watch is confirmed.
async fn serve(
    (wakeups, behind): (&Wakeups, &Behind),
    config: &WatchConfig,
    recheck: &Recheck,
    backoff: &mut Duration,
) -> String {
    let options = WatchOptions::new()
        .with_prefix()
        .with_filters([WatchFilterType::NoPut]);
    let opened = timeout(
        config.connect_timeout,
        config
            .client
            .clone()
            .watch(config.prefix.clone(), Some(options)),
    )
    .await;
    let mut stream = match opened {
        Ok(Ok(stream)) => stream,
        Ok(Err(e)) => return format!("watch failed: {e}"),
        Err(_) => return "watch timed out".to_owned(),
    };
    // etcd confirms the watch before any event.
    match timeout(config.connect_timeout, stream.message()).await {
        Ok(Ok(Some(reply))) if reply.created() && !reply.canceled() => {
            behind.opened(reply.header().map_or(i64::MAX, |h| h.revision()));
        }
        Ok(Ok(Some(reply))) => return format!("watch refused: {}", reply.cancel_reason()),
        Ok(Ok(None)) => return "watch closed".to_owned(),
        Ok(Err(e)) => return format!("watch failed: {e}"),
        Err(_) => return "watch not confirmed in time".to_owned(),
    }
    *backoff = Duration::from_millis(20);
    wakeups.connected();
    recheck.raise("the etcd watch was (re)opened");
    tracing::debug!("etcd watch open");
    loop {
        // Every key of the namespace is watched: new waiters are confirmed at once.
        {
            let mut registry = wakeups.registry();
            let (new, _) = registry.changes();
            registry.confirmed(new);
        }
        wakeups.report_subscriptions();
        tokio::select! {
            () = wakeups.changed() => {}
            message = stream.message() => match message {
                Ok(Some(reply)) if reply.canceled() => {
                    return format!("watch cancelled: {}", reply.cancel_reason());
                }
                Ok(Some(reply)) => {
                    let registry = wakeups.registry();
                    for event in reply.events() {
                        if event.event_type() != EventType::Delete {
                            continue;
                        }
                        if let Some(kv) = event.kv() {
                            behind.deleted(&registry, kv.key(), kv.mod_revision());
                        }
                    }
                }
                Ok(None) => return "watch closed".to_owned(),
                Err(e) => return format!("watch failed: {e}"),
            },
        }
    }
}

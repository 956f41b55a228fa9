//! One watch per backend on the whole namespace, for deletions only: a key deleted
//! (released, withdrawn, or gone with its lease) wakes the waiters of this process that
//! wait behind it (see `behind.rs`).
//!
//! The watch covers every lock of the namespace from the moment etcd confirms it, so a
//! waiter's channel is confirmed as soon as it registers on a live watch. A watch that
//! breaks (etcd unreachable, a member that lost its leader, a compaction) wakes every
//! waiter, and is opened again with capped exponential backoff; its confirmation wakes
//! them once more. The gRPC connection is pinged by HTTP/2 keep-alives (see the
//! builder), so a half-open connection fails the stream too. And the watch keeps to the
//! member the backend's calls go to: once calls move on from its member (it failed one,
//! or did not answer in time: it may be paused, or cut off from its cluster, whose watch
//! would then stay silent), the watch is opened again on theirs.

use std::sync::Arc;
use std::time::Duration;

use etcd_client::{EventType, WatchFilterType, WatchOptions, WatchStream};
use tokio::time::timeout;
use tokio_util::sync::CancellationToken;

use super::behind::Behind;
use super::members::Members;
use crate::core::kit::listener::{self as kit, Listen, Lost};
use crate::core::runtime::Spawner;
use crate::core::wakeups::{Waiter, Wakeups};
use crate::core::watchdog::recheck::Recheck;

/// Handle to the backend's watch task: the store kit's listener, and what the waiters
/// wait behind.
pub(crate) struct Listener {
    listener: kit::Listener,
    behind: Arc<Behind>,
}

/// What the watch task needs.
#[derive(Clone)]
pub(crate) struct WatchConfig {
    pub(crate) members: Arc<Members>,
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
        let max_backoff = config.max_backoff;
        let make = move || Watching {
            wakeups: serving.clone(),
            behind: waits.clone(),
            config: config.clone(),
            recheck: recheck.clone(),
        };
        let listener = kit::Listener::spawn(wakeups, make, max_backoff, (shutdown, spawner));
        Listener { listener, behind }
    }

    /// Registers a waiter on an acquisition's `channel` (see [`Wakeups::register`]).
    pub(crate) fn register(&self, channel: &str) -> Waiter {
        self.listener.register(channel)
    }

    /// What the waiters wait behind.
    pub(crate) fn behind(&self) -> &Arc<Behind> {
        &self.behind
    }

    /// The waiters and the watch's state.
    pub(crate) fn wakeups(&self) -> &Wakeups {
        self.listener.wakeups()
    }
}

/// The watch, as the store kit's loop drives it.
struct Watching {
    wakeups: Wakeups,
    behind: Arc<Behind>,
    config: WatchConfig,
    recheck: Recheck,
}

impl Listen for Watching {
    const NAME: &'static str = "etcd watch";
    /// The stream, the member it is open on, and where calls go.
    type Connection = (WatchStream, usize, tokio::sync::watch::Receiver<usize>);

    /// Opens the watch, and waits for etcd to confirm it (before any event).
    async fn connect(&mut self) -> Result<Self::Connection, String> {
        let options = WatchOptions::new()
            .with_prefix()
            .with_filters([WatchFilterType::NoPut]);
        let mut moves = self.config.members.moves();
        let opened = self
            .config
            .members
            .watch(self.config.prefix.clone(), options);
        let (on, mut stream) = match timeout(self.config.connect_timeout, opened).await {
            Ok(Ok(opened)) => opened,
            Ok(Err(e)) => return Err(format!("watch failed: {e}")),
            Err(_) => return Err("watch timed out".to_owned()),
        };
        match timeout(self.config.connect_timeout, stream.message()).await {
            Ok(Ok(Some(reply))) if reply.created() && !reply.canceled() => {
                let revision = reply.header().map_or(i64::MAX, |h| h.revision());
                self.behind.opened(revision);
            }
            Ok(Ok(Some(reply))) => return Err(format!("watch refused: {}", reply.cancel_reason())),
            Ok(Ok(None)) => return Err("watch closed".to_owned()),
            Ok(Err(e)) => return Err(format!("watch failed: {e}")),
            Err(_) => return Err("watch not confirmed in time".to_owned()),
        }
        self.wakeups.connected();
        self.recheck.raise("the etcd watch was (re)opened");
        moves.mark_unchanged();
        Ok((stream, on, moves))
    }

    async fn serve(
        &mut self,
        (mut stream, on, mut moves): Self::Connection,
        proven: &mut bool,
    ) -> Lost {
        // Confirmed by etcd as it opened.
        *proven = true;
        let (wakeups, behind) = (&self.wakeups, &self.behind);
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
                Ok(()) = moves.changed() => {
                    if *moves.borrow_and_update() != on {
                        return "calls moved on from the watch's member".into();
                    }
                }
                message = stream.message() => match message {
                    Ok(Some(reply)) if reply.canceled() => {
                        return format!("watch cancelled: {}", reply.cancel_reason()).into();
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
                    Ok(None) => return "watch closed".into(),
                    Err(e) => return format!("watch failed: {e}").into(),
                },
            }
        }
    }
}

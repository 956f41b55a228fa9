//! The subscriber's registry: which release channels have waiters, and which of them the
//! current connection has confirmed. Shared by the single-server and the sharded
//! subscriber (`pubsub.rs`, `shard_pubsub.rs`).

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use tokio::sync::Notify;

#[derive(Default)]
pub(super) struct Registry {
    /// Channels with waiters, each waiter's wakeup keyed by its id.
    pub(super) channels: HashMap<String, HashMap<u64, Arc<Notify>>>,
    /// Channels the current connection has confirmed. A waiter that registers on one of
    /// these can try again at once: any later release reaches it.
    pub(super) active: HashSet<String>,
    /// Whether a subscriber connection is up (for introspection and tests).
    pub(super) connected: bool,
    /// The subscriptions last counted in the metrics.
    pub(super) reported: usize,
}

impl Registry {
    pub(super) fn wake_channel(&self, channel: &str) {
        if let Some(waiters) = self.channels.get(channel) {
            waiters.values().for_each(|n| n.notify_one());
        }
    }

    pub(super) fn wake_all(&self) {
        self.channels
            .values()
            .flat_map(HashMap::values)
            .for_each(|n| n.notify_one());
    }

    /// The channels to subscribe (waiters, not active) and to unsubscribe (active, no
    /// waiters). The latter are forgotten before the command is sent, so a waiter arriving
    /// meanwhile sees its channel as inactive and asks for it again (the unsubscribe goes
    /// first).
    pub(super) fn changes(&mut self) -> (Vec<String>, Vec<String>) {
        let unsubscribe: Vec<String> = self
            .active
            .iter()
            .filter(|c| !self.channels.contains_key(*c))
            .cloned()
            .collect();
        for c in &unsubscribe {
            self.active.remove(c);
        }
        let subscribe = self
            .channels
            .keys()
            .filter(|c| !self.active.contains(*c))
            .cloned()
            .collect();
        (subscribe, unsubscribe)
    }

    /// Records confirmed subscriptions. Their waiters try again: a release may have been
    /// published between their last attempt and the subscription.
    pub(super) fn confirmed(&mut self, channels: impl IntoIterator<Item = String>) {
        for channel in channels {
            self.wake_channel(&channel);
            self.active.insert(channel);
        }
    }
}

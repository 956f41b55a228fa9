//! The subscriber of a Redis Cluster backend: sharded pub/sub.
//!
//! Releases are published with `SPUBLISH` on the shard that owns the lock's hash slot, so
//! the backend subscribes each channel with `SSUBSCRIBE` on that shard, through one RESP3
//! cluster connection (redis-rs keeps one socket per node and routes each `SSUBSCRIBE` by
//! the channel's slot): only shards that own a channel with waiters carry subscriptions,
//! and a release is not broadcast to every node (Redisson #3349).
//!
//! The registry and the waiters are the core's (`core/wakeups.rs`); only serving differs. Sharded
//! subscriptions move: a failover or a reshard ends them on the old node (the connection
//! drops, or the server sends `sunsubscribe`). Messages may have been missed then, so every
//! waiter tries again, and the channels are subscribed anew on their current owners; a
//! confirmed subscription wakes its waiters once more. The connection is pinged every
//! `ping_interval`, so that a half-open node is noticed (redis-rs #404) and the connection
//! rebuilt.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use futures_util::future::join_all;
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{MultipleNodeRoutingInfo, ResponsePolicy, RoutingInfo};
use redis::{PushInfo, PushKind, Value};
use tokio::sync::mpsc::{UnboundedReceiver, unbounded_channel};
use tokio::time::{Instant, sleep_until, timeout};

use super::Shared;
use super::SubscriberConfig;
use crate::core::kit::backoff::Backoff;
use crate::core::kit::listener::{Listen, Lost, within};
use crate::redis::connection::cluster::{self, ClusterNodes};
use crate::redis::connection::pool::FailureEpoch;
use crate::redis::run_id::ServerIdentity;

/// The cluster subscriber connection, as the store kit's loop drives it.
pub(super) struct ShardListen {
    shared: Arc<Shared>,
    nodes: Arc<ClusterNodes>,
    config: SubscriberConfig,
    failure_epoch: FailureEpoch,
    server: ServerIdentity,
    /// Whether the refusal of the current run of NOPERMs was logged.
    refusal_logged: bool,
}

impl ShardListen {
    pub(super) fn new(
        shared: Arc<Shared>,
        nodes: Arc<ClusterNodes>,
        config: SubscriberConfig,
        (failure_epoch, server): (FailureEpoch, ServerIdentity),
    ) -> Self {
        ShardListen {
            shared,
            nodes,
            config,
            failure_epoch,
            server,
            refusal_logged: false,
        }
    }
}

impl Listen for ShardListen {
    const NAME: &'static str = "lock subscriber of the cluster";
    type Connection = (ClusterConnection, UnboundedReceiver<PushInfo>);

    async fn connect(&mut self) -> Result<Self::Connection, String> {
        let (pushes, received) = unbounded_channel();
        let connecting = self.nodes.connect_subscriber(pushes);
        let conn = within(self.config.connect_timeout, connecting).await?;
        self.shared.wakeups.connected();
        // A node may have restarted or failed over while the subscriber was away.
        self.server
            .recheck("the subscriber connection was (re)opened");
        Ok((conn, received))
    }

    async fn serve(&mut self, (conn, pushes): Self::Connection, proven: &mut bool) -> Lost {
        // The cluster answered: a shard that is down is retried on its own (`Deferred`).
        *proven = true;
        let signs = (&self.failure_epoch, &self.server);
        let served = serve(
            &self.shared,
            (conn, pushes),
            &self.config,
            signs,
            &mut self.refusal_logged,
        );
        let Err(reason) = served.await;
        self.failure_epoch.raise();
        Lost::Failed(reason)
    }
}

/// Channels whose shard refused or did not answer `SSUBSCRIBE` (its primary is down and
/// not yet replaced): left alone until `until`, so that a shard that is down does not hold
/// up every later reconcile, then asked for again with a doubled backoff. A refusal for
/// lack of rights (NOPERM: the ACL user's channel rights were revoked after build) waits
/// the longest backoff at once: rights do not come back within milliseconds, and a
/// refused subscriber must not hammer the shard (the issue saw 219 reconnects in 5 s).
struct Deferred {
    channels: HashSet<String>,
    until: Option<Instant>,
    backoff: Backoff,
}

/// Serves one cluster connection until it must be replaced: why. `refusal_logged` says
/// whether the refusal of the current run of NOPERMs was logged.
async fn serve(
    shared: &Shared,
    (mut conn, mut pushes): (ClusterConnection, UnboundedReceiver<PushInfo>),
    config: &SubscriberConfig,
    (failure_epoch, server): (&FailureEpoch, &ServerIdentity),
    refusal_logged: &mut bool,
) -> Result<std::convert::Infallible, String> {
    let mut ping = tokio::time::interval(config.ping_interval);
    ping.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    ping.tick().await;
    let mut deferred = Deferred {
        channels: HashSet::new(),
        until: None,
        backoff: Backoff::up_to(config.max_backoff),
    };
    shared.admin.resubscribe();
    loop {
        if deferred.until.is_some_and(|until| until <= Instant::now()) {
            deferred.channels.clear();
            deferred.until = None;
        }
        let failed = reconcile(shared, &conn, config.command_timeout, &deferred.channels).await;
        // Retried no sooner than the next ping when its shard does not answer.
        let retry = config.ping_interval;
        shared
            .admin
            .ssubscribe(&conn, config.command_timeout, retry)
            .await;
        match &failed.refusal {
            Some(error) if !*refusal_logged => {
                *refusal_logged = true;
                tracing::warn!(
                    %error,
                    "the cluster refused SSUBSCRIBE for lack of rights (were the ACL user's \
                     channel rights revoked?); waiters fall back to their lock's lease and \
                     the subscription is retried every max_backoff"
                );
            }
            Some(error) => tracing::debug!(%error, "lock subscriber still refused"),
            None if failed.confirmed => *refusal_logged = false,
            None => {}
        }
        if failed.channels.is_empty() && deferred.channels.is_empty() {
            deferred.backoff.reset();
        } else if !failed.channels.is_empty() {
            if failed.refusal.is_some() {
                deferred.backoff.exhaust();
            }
            deferred.channels.extend(failed.channels);
            deferred.until = Some(Instant::now() + deferred.backoff.next());
        }
        tokio::select! {
            _ = shared.wakeups.changed() => {}
            push = pushes.recv() => {
                on_push(shared, push.ok_or("connection closed")?, failure_epoch, server);
            }
            _ = ping.tick() => {
                // A half-open TCP connection never errors by itself; an unanswered ping
                // is the only way to notice it. PING goes to every primary.
                let routing = RoutingInfo::MultiNode((
                    MultipleNodeRoutingInfo::AllMasters,
                    Some(ResponsePolicy::AllSucceeded),
                ));
                timeout(config.command_timeout, conn.route_command(redis::cmd("PING"), routing))
                    .await
                    .map_err(|_| "ping timed out".to_owned())?
                    .map_err(|e| format!("ping failed: {e}"))?;
            }
            _ = sleep_until(deferred.until.unwrap_or_else(Instant::now)), if deferred.until.is_some() => {}
        }
    }
}

/// Acts on what the cluster pushed: a release wakes its channel's waiters; a lost node or a
/// subscription the server ended (its slot moved) makes every waiter try again and every
/// channel be subscribed anew on the shard that owns it now.
fn on_push(shared: &Shared, push: PushInfo, failure_epoch: &FailureEpoch, server: &ServerIdentity) {
    let channel = || match push.data.first() {
        Some(Value::BulkString(name)) => std::str::from_utf8(name).ok(),
        _ => None,
    };
    match push.kind {
        PushKind::SMessage | PushKind::Message => {
            if let Some(channel) = channel() {
                let payload = match push.data.get(1) {
                    Some(Value::BulkString(payload)) => payload.as_slice(),
                    _ => &[],
                };
                shared.received(channel, payload);
            }
        }
        // redis-rs subscribed a channel again after a reconnect or a slot map change: a
        // release may have gone out while it was not.
        PushKind::SSubscribe => {
            if let Some(channel) = channel() {
                shared.wakeups.registry().wake_channel(channel);
            }
        }
        PushKind::SUnsubscribe => {
            let Some(channel) = channel() else { return };
            if shared.admin.is(channel) {
                shared.admin.resubscribe();
                shared.wakeups.mark_changed();
                return;
            }
            let mut registry = shared.wakeups.registry();
            // Not one this backend gave up (it has waiters): the server ended it.
            if registry.has_waiters(channel) && registry.active.remove(channel) {
                tracing::debug!(%channel, "shard ended a lock channel subscription");
                registry.wake_channel(channel);
                drop(registry);
                shared.wakeups.mark_changed();
            }
        }
        PushKind::Disconnection => {
            tracing::warn!("lock subscriber lost a cluster node; waiters try again");
            // The node may have failed over and lost data: connections and held locks on
            // it are checked again.
            failure_epoch.raise();
            server.recheck("a cluster node connection was lost");
            shared.admin.resubscribe();
            let mut registry = shared.wakeups.registry();
            registry.active.clear();
            registry.wake_all();
            drop(registry);
            shared.wakeups.mark_changed();
        }
        _ => {}
    }
}

/// What a reconcile could not do.
#[derive(Default)]
struct Failed {
    /// The channels that could not be subscribed.
    channels: Vec<String>,
    /// A refusal for lack of rights among the failures (NOPERM), as the server put it.
    refusal: Option<String>,
    /// Whether some subscription was confirmed.
    confirmed: bool,
}

/// Brings the subscriptions in line with the registry, one `SSUBSCRIBE` / `SUNSUBSCRIBE`
/// per hash slot (a sharded command's channels must share one), the slots in flight
/// together, leaving out `deferred` channels.
async fn reconcile(
    shared: &Shared,
    conn: &ClusterConnection,
    command_timeout: Duration,
    deferred: &HashSet<String>,
) -> Failed {
    let (mut subscribe, unsubscribe) = shared.wakeups.registry().changes();
    subscribe.retain(|c| !deferred.contains(c));
    let unsubscribing = cluster::by_slot(unsubscribe, |c| c)
        .into_iter()
        .map(|channels| {
            let mut conn = conn.clone();
            async move {
                // A failure leaves a subscription without waiters on a shard that is probably
                // gone; its messages are ignored.
                let _ = timeout(command_timeout, conn.sunsubscribe(&channels)).await;
            }
        });
    join_all(unsubscribing).await;
    let subscribing = cluster::by_slot(subscribe, |c| c)
        .into_iter()
        .map(|channels| {
            let mut conn = conn.clone();
            async move {
                let outcome = match timeout(command_timeout, conn.ssubscribe(&channels)).await {
                    Ok(Ok(())) => Ok(()),
                    Ok(Err(e)) => Err((e.to_string(), e.code() == Some("NOPERM"))),
                    Err(_) => Err(("timed out".to_owned(), false)),
                };
                (channels, outcome)
            }
        });
    let mut failed = Failed::default();
    for (channels, outcome) in join_all(subscribing).await {
        match outcome {
            Ok(()) => {
                failed.confirmed = true;
                shared.wakeups.registry().confirmed(channels);
            }
            Err((error, refused)) => {
                if refused {
                    failed.refusal = Some(error);
                } else {
                    tracing::debug!(%error, "lock subscriber cannot subscribe on a shard yet");
                }
                failed.channels.extend(channels);
            }
        }
    }
    shared.wakeups.report_subscriptions();
    failed
}

//! One subscriber connection per backend, multiplexing the release channels of every key
//! that has waiters in this process.
//!
//! The registry (channel -> waiters) is the source of truth; a background task reconciles
//! the connection's subscriptions with it. A channel is subscribed while it has waiters and
//! unsubscribed when the last one leaves. Every waiter owns a [`Notify`], whose stored
//! permit means "try the lock again": a release message, a confirmed subscription or a
//! reconnect all hand out permits, and a permit that arrives before the waiter parks is
//! kept rather than lost.

use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use redis::aio::{PubSubSink, PubSubStream};
use tokio::time::timeout;
use tokio_util::sync::CancellationToken;

use super::admin::AdminChannel;
use super::connection::pool::FailureEpoch;
use super::connection::topology::{Topology, TopologyChanges};
use super::run_id::ServerIdentity;
use crate::core::kit::listener::{Listen, Listener, Lost, supervise, within};
use crate::core::runtime::Spawner;
use crate::core::wakeups::{Grant, Waiter, Wakeups};
use crate::lock::LockOwner;

mod shard;

/// Timing of the subscriber connection.
#[derive(Debug, Clone)]
pub(crate) struct SubscriberConfig {
    pub(crate) connect_timeout: Duration,
    pub(crate) command_timeout: Duration,
    pub(crate) ping_interval: Duration,
    pub(crate) max_backoff: Duration,
    /// The namespace's admin channel (see `admin.rs`).
    pub(crate) admin_channel: String,
}

/// What the subscriber task serves: the waiters, and the namespace's admin channel.
pub(super) struct Shared {
    pub(super) wakeups: Wakeups,
    pub(super) admin: AdminChannel,
}

impl Shared {
    /// A message on `channel`: a release wakes the channel's waiters, a grant goes to
    /// its holder's waiter (see release.lua); an announced force-release re-checks every
    /// held lock.
    pub(super) fn received(&self, channel: &str, payload: &[u8]) {
        if self.admin.is(channel) {
            self.admin.announced();
            return;
        }
        let registry = self.wakeups.registry();
        match parse_grant(payload) {
            Some((holder, grant)) => {
                registry.granted(channel, holder, grant);
            }
            None => registry.wake_channel(channel),
        }
    }
}

/// A grant's message: "granted <holder> <token> <reserved> <server ms> <lease ms>"; `None`
/// for a release's ("released") or anything else, which wakes every waiter.
fn parse_grant(payload: &[u8]) -> Option<(&str, Grant)> {
    let mut fields = std::str::from_utf8(payload).ok()?.split(' ');
    if fields.next()? != "granted" {
        return None;
    }
    let holder = fields.next()?;
    let mut number = || fields.next()?.parse::<u64>().ok();
    let grant = Grant {
        token: number()?,
        reserved: number()?,
        at: number()?,
        lease: Duration::from_millis(number()?),
    };
    Some((holder, grant))
}

/// Handle to the backend's subscriber task: the store kit's listener, shared by the
/// backend's parts.
#[derive(Clone)]
pub(crate) struct Subscriber(Arc<Listener>);

impl Subscriber {
    /// Starts the subscriber task; it stops when `shutdown` is cancelled.
    /// Losing the subscriber connection raises `failure_epoch`: the command connections to the
    /// same server are probably gone too. Opening one raises the re-check of held locks: the
    /// server may have restarted empty meanwhile.
    pub(crate) fn spawn(
        (topology, wakeups): (Topology, Wakeups),
        config: SubscriberConfig,
        failure_epoch: FailureEpoch,
        server: ServerIdentity,
        shutdown: CancellationToken,
        spawner: &Spawner,
    ) -> Self {
        let shared = Arc::new(Shared {
            admin: AdminChannel::new(config.admin_channel.clone(), server.clone()),
            wakeups: wakeups.clone(),
        });
        let start = move |shutdown| {
            let (topology, config) = (topology.clone(), config.clone());
            let signs = (failure_epoch.clone(), server.clone());
            serve_until_shutdown(shared.clone(), topology, config, signs, shutdown)
        };
        Subscriber(Arc::new(Listener::run(wakeups, start, (shutdown, spawner))))
    }

    /// Registers a waiter on `channel` that takes the grants made to `holder` (see
    /// [`Wakeups::register_as`]; `None`: no grants).
    pub(crate) fn register(&self, channel: &str, holder: Option<LockOwner>) -> Waiter {
        self.0.register_as(channel, holder)
    }

    /// The waiters and the connection's state.
    pub(crate) fn wakeups(&self) -> &Wakeups {
        self.0.wakeups()
    }
}

/// Runs the subscriber, and the topology's announcements of a failover next to it, until
/// shut down.
async fn serve_until_shutdown(
    shared: Arc<Shared>,
    topology: Topology,
    config: SubscriberConfig,
    (failure_epoch, server): (FailureEpoch, ServerIdentity),
    shutdown: CancellationToken,
) {
    let (wakeups, max_backoff) = (shared.wakeups.clone(), config.max_backoff);
    if let Topology::Cluster(nodes) = &topology {
        let listen =
            shard::ShardListen::new(shared, nodes.clone(), config, (failure_epoch, server));
        return supervise(listen, wakeups, max_backoff, shutdown).await;
    }
    let announce = topology.announce_changes(
        failure_epoch.clone(),
        config.connect_timeout,
        config.max_backoff,
        shutdown.clone(),
    );
    let listen = Subscribing {
        changes: topology.changes(),
        topology: topology.clone(),
        shared,
        config,
        failure_epoch,
        server,
    };
    tokio::join!(supervise(listen, wakeups, max_backoff, shutdown), announce);
}

/// The subscriber connection to one server, as the store kit's loop drives it. An
/// announced failover ends the backoff, or the connection to the old primary, at once.
struct Subscribing {
    topology: Topology,
    changes: TopologyChanges,
    shared: Arc<Shared>,
    config: SubscriberConfig,
    failure_epoch: FailureEpoch,
    server: ServerIdentity,
}

/// What the log says once when a SUBSCRIBE is refused for lack of rights.
const REFUSED: &str = "the lock subscriber may not SUBSCRIBE to a release channel: the ACL \
                       user lacks channel rights on the namespace; waiters are woken only \
                       by lease expiry and retries until the rights are restored";

impl Listen for Subscribing {
    const NAME: &'static str = "lock subscriber";
    type Connection = (PubSubSink, PubSubStream);

    async fn connect(&mut self) -> Result<Self::Connection, String> {
        let topology = &self.topology;
        let connecting = async { topology.subscriber_client().await?.get_async_pubsub().await };
        let pubsub = within(self.config.connect_timeout, connecting).await?;
        self.shared.wakeups.connected();
        // The first sign of a restart (the old connection ended with the server) or of a
        // fault that may have hidden one: held locks may be gone.
        self.server
            .recheck("the subscriber connection was (re)opened");
        Ok(pubsub.split())
    }

    async fn serve(&mut self, (mut sink, mut stream): Self::Connection, proven: &mut bool) -> Lost {
        let connection = (&mut sink, &mut stream);
        let Err(ended) = serve(
            &self.shared,
            connection,
            &self.config,
            &mut self.changes,
            proven,
        )
        .await;
        // A failed connection may mean the server restarted; a refusal does not.
        if let Lost::Failed(_) = ended {
            self.failure_epoch.raise();
        }
        ended
    }

    async fn hurry(&mut self) {
        self.changes.next().await;
    }
}

/// Serves one connection until it must be replaced: why. Sets `proven` once the server
/// confirmed a subscription or answered a ping.
async fn serve(
    shared: &Shared,
    (sink, stream): (&mut PubSubSink, &mut PubSubStream),
    config: &SubscriberConfig,
    changes: &mut TopologyChanges,
    proven: &mut bool,
) -> Result<std::convert::Infallible, Lost> {
    let mut ping = tokio::time::interval(config.ping_interval);
    ping.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // The first tick completes at once; the connection was just proven by the handshake.
    ping.tick().await;
    shared.admin.subscribe(sink, config.command_timeout).await?;
    loop {
        reconcile(shared, sink, config.command_timeout, proven).await?;
        tokio::select! {
            _ = shared.wakeups.changed() => {}
            _ = changes.next() => return Err("another server took over".into()),
            message = stream.next() => {
                let message = message.ok_or("connection closed")?;
                shared.received(message.get_channel_name(), message.get_payload_bytes());
            }
            _ = ping.tick() => {
                // A half-open TCP connection never errors by itself; an unanswered ping
                // is the only way to notice it.
                timeout(config.command_timeout, sink.ping::<redis::Value>())
                    .await
                    .map_err(|_| "ping timed out".to_owned())?
                    .map_err(|e| format!("ping failed: {e}"))?;
                *proven = true;
            }
        }
    }
}

/// Brings the connection's subscriptions in line with the registry.
async fn reconcile(
    shared: &Shared,
    sink: &mut PubSubSink,
    command_timeout: Duration,
    proven: &mut bool,
) -> Result<(), Lost> {
    loop {
        let (subscribe, unsubscribe) = shared.wakeups.registry().changes();
        if subscribe.is_empty() && unsubscribe.is_empty() {
            shared.wakeups.report_subscriptions();
            return Ok(());
        }
        if !unsubscribe.is_empty() {
            timeout(command_timeout, sink.unsubscribe(&unsubscribe))
                .await
                .map_err(|_| "unsubscribe timed out".to_owned())?
                .map_err(|e| format!("unsubscribe failed: {e}"))?;
        }
        if !subscribe.is_empty() {
            timeout(command_timeout, sink.subscribe(&subscribe))
                .await
                .map_err(|_| "subscribe timed out".to_owned())?
                .map_err(|e| match e.code() {
                    // The ACL user's channel rights were revoked after build: retried on a
                    // new connection, under the backoff.
                    Some("NOPERM") => Lost::Refused {
                        error: e.to_string(),
                        message: REFUSED,
                    },
                    _ => Lost::Failed(format!("subscribe failed: {e}")),
                })?;
            *proven = true;
            shared.wakeups.registry().confirmed(subscribe);
        }
    }
}

//! One listening connection per backend: `LISTEN` on the channel of every key with
//! waiters in this process, multiplexed on it as the Redis subscriber does.
//!
//! A release does `pg_notify` inside its statement, and PostgreSQL delivers the
//! notification when that statement commits. A listener that reconnects has missed what
//! was sent meanwhile, so every drop of the connection wakes every waiter, and the
//! channels are listened to anew on the next connection (whose confirmation wakes them
//! once more). The connection is pinged every `ping_interval`: a half-open TCP
//! connection never fails by itself.

use std::time::Duration;

use sqlx::postgres::{PgListener, PgPool};
use tokio::time::timeout;
use tokio_util::sync::CancellationToken;

use crate::core::kit::listener::{Listen, Listener, Lost, within};
use crate::core::runtime::Spawner;
use crate::core::wakeups::Wakeups;
use crate::core::watchdog::recheck::Recheck;
use crate::sql::Staleness;

/// Timing of the listening connection.
#[derive(Debug, Clone)]
pub(crate) struct ListenConfig {
    /// The namespace's admin channel, listened to on every connection: a force-release
    /// announced there re-checks every held lock.
    pub(crate) admin_channel: String,
    pub(crate) connect_timeout: Duration,
    pub(crate) command_timeout: Duration,
    pub(crate) ping_interval: Duration,
    pub(crate) max_backoff: Duration,
    /// Raised when the connection is lost or opened again: the server may have dropped
    /// the command pool's idle connections too.
    pub(crate) stale: Staleness,
}

/// Starts the listener on a connection of `pool` (a pool of its own: the connection is
/// held for as long as the backend lives); it stops when `shutdown` is cancelled. Every
/// (re)connect raises `recheck`: a failover may have lost recent writes.
pub(crate) fn spawn(
    (pool, wakeups): (PgPool, Wakeups),
    config: ListenConfig,
    recheck: Recheck,
    shutdown: CancellationToken,
    spawner: &Spawner,
) -> Listener {
    let serving = wakeups.clone();
    let max_backoff = config.max_backoff;
    let make = move || Listening {
        wakeups: serving.clone(),
        pool: pool.clone(),
        config: config.clone(),
        recheck: recheck.clone(),
    };
    Listener::spawn(wakeups, make, max_backoff, (shutdown, spawner))
}

/// The listening connection, as the store kit's loop drives it.
struct Listening {
    wakeups: Wakeups,
    pool: PgPool,
    config: ListenConfig,
    recheck: Recheck,
}

impl Listen for Listening {
    const NAME: &'static str = "lock listener";
    type Connection = PgListener;

    async fn connect(&mut self) -> Result<PgListener, String> {
        let connecting = PgListener::connect_with(&self.pool);
        let listener = within(self.config.connect_timeout, connecting).await?;
        self.wakeups.connected();
        self.config.stale.opened();
        self.recheck
            .raise("the listening connection was (re)opened");
        Ok(listener)
    }

    async fn serve(&mut self, mut listener: PgListener, proven: &mut bool) -> Lost {
        let served = serve(
            (&self.wakeups, &self.recheck),
            &mut listener,
            &self.config,
            proven,
        );
        let Err(reason) = served.await;
        self.config.stale.raise();
        Lost::Failed(reason)
    }
}

/// Serves one connection until it must be replaced: why. Sets `proven` once a `LISTEN`
/// or a ping went through.
async fn serve(
    (wakeups, recheck): (&Wakeups, &Recheck),
    listener: &mut PgListener,
    config: &ListenConfig,
    proven: &mut bool,
) -> Result<std::convert::Infallible, String> {
    // sqlx reconnects a listener by itself inside `try_recv`; this task replaces it instead,
    // to wake every waiter (and count the reconnect) each time.
    listener.eager_reconnect(false);
    let mut ping = tokio::time::interval(config.ping_interval);
    ping.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    ping.tick().await;
    timeout(
        config.command_timeout,
        listener.listen(&config.admin_channel),
    )
    .await
    .map_err(|_| "LISTEN timed out".to_owned())?
    .map_err(|e| format!("LISTEN failed: {e}"))?;
    loop {
        reconcile(wakeups, listener, config.command_timeout, proven).await?;
        tokio::select! {
            _ = wakeups.changed() => {}
            // Cancel-safe: sqlx keeps a partly read message in the connection's buffer.
            received = listener.try_recv() => match received {
                Ok(Some(notification)) if notification.channel() == config.admin_channel => {
                    recheck.raise("a lock of the namespace was force-released");
                }
                Ok(Some(notification)) => {
                    wakeups.registry().wake_channel(notification.channel());
                }
                Ok(None) => return Err("connection closed".to_owned()),
                Err(e) => return Err(format!("receive failed: {e}")),
            },
            _ = ping.tick() => {
                timeout(config.command_timeout, sqlx::query("SELECT 1").execute(&mut *listener))
                    .await
                    .map_err(|_| "ping timed out".to_owned())?
                    .map_err(|e| format!("ping failed: {e}"))?;
                *proven = true;
            }
        }
    }
}

/// Brings the connection's `LISTEN`s in line with the registry.
async fn reconcile(
    wakeups: &Wakeups,
    listener: &mut PgListener,
    command_timeout: Duration,
    proven: &mut bool,
) -> Result<(), String> {
    loop {
        let (listen, unlisten) = wakeups.registry().changes();
        if listen.is_empty() && unlisten.is_empty() {
            wakeups.report_subscriptions();
            return Ok(());
        }
        for channel in &unlisten {
            timeout(command_timeout, listener.unlisten(channel))
                .await
                .map_err(|_| "UNLISTEN timed out".to_owned())?
                .map_err(|e| format!("UNLISTEN failed: {e}"))?;
        }
        if !listen.is_empty() {
            let channels = listen.iter().map(String::as_str);
            timeout(command_timeout, listener.listen_all(channels))
                .await
                .map_err(|_| "LISTEN timed out".to_owned())?
                .map_err(|e| format!("LISTEN failed: {e}"))?;
            *proven = true;
            wakeups.registry().confirmed(listen);
        }
    }
}

//! The listening connection every store keeps beside its calls (Redis pub/sub,
//! PostgreSQL's `LISTEN`, the parked MySQL connection, etcd's watch, ZooKeeper's session),
//! supervised by one loop: connect, serve until the connection fails, wake every waiter
//! (releases may have been missed meanwhile), wait with capped exponential backoff, and
//! connect again, until the backend is dropped.
//!
//! A store says how to connect and how to serve one connection ([`Listen`]); the loop
//! owns the backoff and the log. An operator reads one WARN line when the connection
//! goes down or cannot be opened, naming the cause, then nothing more while it stays down
//! (each further failure at DEBUG), and one INFO line when it is back.

use std::future::Future;
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::backoff::Backoff;
use crate::core::runtime::{Daemon, Spawner};
use crate::core::wakeups::{Disconnected, Waiter, Wakeups};
use crate::lock::LockOwner;

/// `connecting` within `bound`: the connection, or why not, as [`Listen::connect`]
/// says it.
pub(crate) async fn within<T, E: std::fmt::Display>(
    bound: Duration,
    connecting: impl Future<Output = Result<T, E>>,
) -> Result<T, String> {
    match tokio::time::timeout(bound, connecting).await {
        Ok(connected) => connected.map_err(|e| e.to_string()),
        Err(_) => Err("connect timed out".to_owned()),
    }
}

/// Why a connection was given up.
#[derive(Debug)]
pub(crate) enum Lost {
    /// It failed, or proved dead: connect again.
    Failed(String),
    /// The server refused what the connection is for (an ACL user without channel
    /// rights): `message` is logged once at ERROR, then the refusal at DEBUG while it
    /// lasts.
    Refused {
        error: String,
        message: &'static str,
    },
}

impl From<String> for Lost {
    fn from(reason: String) -> Self {
        Lost::Failed(reason)
    }
}

impl From<&str> for Lost {
    fn from(reason: &str) -> Self {
        Lost::Failed(reason.to_owned())
    }
}

/// One store's listening connection, as the supervising loop drives it.
pub(crate) trait Listen: Send + 'static {
    /// What the log calls it ("lock listener", "etcd watch").
    const NAME: &'static str;
    /// One open connection.
    type Connection: Send;

    /// Opens a connection, within the store's connect timeout: why not, if it fails.
    fn connect(&mut self) -> impl Future<Output = Result<Self::Connection, String>> + Send;

    /// Serves `connection` until it fails: why. Sets `proven` once the server answered on
    /// it (a subscription confirmed, a ping answered): only then does the backoff start
    /// over, so a connection accepted and dropped at once is not opened in a tight loop.
    /// It is dropped when the backend shuts down.
    fn serve(
        &mut self,
        connection: Self::Connection,
        proven: &mut bool,
    ) -> impl Future<Output = Lost> + Send;

    /// Resolves when the wait before the next connect should end at once (a failover
    /// announced). Never, by default.
    fn hurry(&mut self) -> impl Future<Output = ()> + Send {
        std::future::pending()
    }
}

/// A store's listening connection, as its backend holds it: the waiters it wakes, and the
/// task that keeps it open.
pub(crate) struct Listener {
    wakeups: Wakeups,
    task: Daemon,
}

impl Listener {
    /// Starts `start(shutdown)` as the task that keeps the connection, for a store whose
    /// task runs more than [`supervise`] (Redis: the announcements of a failover beside
    /// it).
    pub(crate) fn run<F, Fut>(
        wakeups: Wakeups,
        start: F,
        (shutdown, spawner): (CancellationToken, &Spawner),
    ) -> Self
    where
        F: Fn(CancellationToken) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let task = Daemon::spawn(start, spawner, shutdown);
        Listener { wakeups, task }
    }

    /// Registers a waiter on `channel` that takes the grants a release makes to `holder`,
    /// if any (see [`Wakeups::register_as`]).
    pub(crate) fn register_as(&self, channel: &str, holder: Option<LockOwner>) -> Waiter {
        self.ensure_running();
        match holder {
            Some(holder) => self.wakeups.register_as(channel, holder),
            None => self.wakeups.register(channel),
        }
    }

    /// Starts the task again if the runtime it ran on has shut down (a waiter or a hold
    /// on another runtime).
    pub(crate) fn ensure_running(&self) {
        self.task.ensure_running();
    }

    /// The waiters and the connection's state.
    pub(crate) fn wakeups(&self) -> &Wakeups {
        &self.wakeups
    }
}

/// What only the stores whose task is the supervised loop alone use (Redis runs more in its
/// task, and registers its waiters as holders that may take grants).
#[cfg_attr(
    not(any(
        feature = "postgres",
        feature = "mysql",
        feature = "etcd",
        feature = "zookeeper"
    )),
    expect(dead_code, reason = "a build with Redis alone")
)]
impl Listener {
    /// Starts the task that keeps `make()`'s connection open, backing off up to
    /// `max_backoff`; it stops when `shutdown` is cancelled. `make` is called again if the
    /// task has to be started anew on another runtime.
    pub(crate) fn spawn<L: Listen>(
        wakeups: Wakeups,
        make: impl Fn() -> L + Send + Sync + 'static,
        max_backoff: Duration,
        (shutdown, spawner): (CancellationToken, &Spawner),
    ) -> Self {
        let serving = wakeups.clone();
        let start = move |shutdown| supervise(make(), serving.clone(), max_backoff, shutdown);
        Listener::run(wakeups, start, (shutdown, spawner))
    }

    /// Registers a waiter on `channel` (see [`Wakeups::register`]).
    pub(crate) fn register(&self, channel: &str) -> Waiter {
        self.ensure_running();
        self.wakeups.register(channel)
    }
}

/// Connects, serves, and reconnects with capped exponential backoff until `shutdown`.
pub(crate) async fn supervise<L: Listen>(
    mut listen: L,
    wakeups: Wakeups,
    max_backoff: Duration,
    shutdown: CancellationToken,
) {
    // However the task ends, even dropped with its runtime, no connection is claimed and
    // every waiter tries again.
    let _disconnected = Disconnected(&wakeups);
    let mut backoff = Backoff::up_to(max_backoff);
    let mut log = Outages::default();
    while !shutdown.is_cancelled() {
        let connected = tokio::select! {
            () = shutdown.cancelled() => return,
            connected = listen.connect() => connected,
        };
        match connected {
            Ok(connection) => {
                log.connected(L::NAME);
                let mut proven = false;
                let lost = tokio::select! {
                    () = shutdown.cancelled() => return,
                    lost = listen.serve(connection, &mut proven) => lost,
                };
                wakeups.disconnected();
                if proven {
                    backoff.reset();
                }
                log.lost(L::NAME, lost);
            }
            Err(reason) => log.cannot_connect(L::NAME, &reason),
        }
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = tokio::time::sleep(backoff.next()) => {}
            () = listen.hurry() => {}
        }
    }
}

/// What the log said of the connection so far: one line per outage, not per try.
#[derive(Default)]
struct Outages {
    /// Since when the connection is down, after it was up once (or could not be opened).
    down_since: Option<Instant>,
    /// A refusal was logged at ERROR, and has not been lifted since.
    refusal_logged: bool,
}

impl Outages {
    fn connected(&mut self, name: &'static str) {
        // A connection refused again at once is no recovery.
        if self.refusal_logged {
            return;
        }
        match self.down_since.take() {
            Some(since) => tracing::info!(
                down_for = ?since.elapsed(),
                "{name} connected again"
            ),
            None => tracing::debug!("{name} connected"),
        }
    }

    fn lost(&mut self, name: &'static str, lost: Lost) {
        match lost {
            Lost::Failed(reason) => {
                self.refusal_logged = false;
                if self.down_since.is_none() {
                    self.down_since = Some(Instant::now());
                    tracing::warn!(%reason, "{name} connection lost; reconnecting");
                } else {
                    tracing::debug!(%reason, "{name} connection lost again");
                }
            }
            Lost::Refused { error, message } if !self.refusal_logged => {
                self.refusal_logged = true;
                self.down_since.get_or_insert_with(Instant::now);
                tracing::error!(%error, "{message}");
            }
            Lost::Refused { error, .. } => tracing::debug!(%error, "{name} still refused"),
        }
    }

    fn cannot_connect(&mut self, name: &'static str, reason: &str) {
        if self.down_since.is_none() {
            self.down_since = Some(Instant::now());
            tracing::warn!(%reason, "{name} cannot connect; retrying with backoff");
        } else {
            tracing::debug!(%reason, "{name} still cannot connect");
        }
    }
}

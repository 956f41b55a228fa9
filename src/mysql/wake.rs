//! One wake connection per backend: MySQL has no `LISTEN`, so waiting is a parked
//! statement that a release cuts short.
//!
//! The connection registers `(channel, CONNECTION_ID())` in the waiters table for every key
//! with waiters in this process (through the command pool, so that registering does not
//! disturb the park), then parks in one statement:
//! `SELECT IF(EXISTS(<a row of this connection marked woken>), 0, GET_LOCK(gate, n))`, on a
//! named lock that a second connection of the backend (the gate) holds for as long as it
//! lives. A release that
//! frees a key with waiters marks their rows woken once it has committed, then sends
//! `KILL QUERY` to their connections (`tower_lock_wake` in schema.sql): a park that was
//! running is interrupted, and one that starts later finds its rows woken, so no wake-up
//! falls between the check and the sleep. The woken connection reads and clears its woken
//! rows, wakes those keys' waiters through the core, and parks again. Waiting costs no
//! statement at all; the park's end every `n` seconds is the connection's ping.
//!
//! A connection that drops has missed what happened meanwhile: every waiter is woken, the
//! rows of the old connection are deleted and the channels registered anew under the new
//! one (whose confirmation wakes them once more).

use std::time::Duration;

use sqlx::mysql::{MySqlConnectOptions, MySqlConnection, MySqlPool};
use sqlx::{ConnectOptions, Connection, Executor};
use tokio::time::{Instant, timeout};
use tokio_util::sync::CancellationToken;

use super::error::{INTERRUPTED, number};
use crate::core::kit::listener::{Listen, Listener, Lost, within};
use crate::core::runtime::Spawner;
use crate::core::wakeups::Wakeups;
use crate::core::watchdog::recheck::Recheck;
use crate::sql::Staleness;

/// Settings of the wake connection.
#[derive(Debug, Clone)]
pub(crate) struct WakeConfig {
    /// The waiters table.
    pub(crate) waiters: String,
    /// The namespace's admin channel, registered on every connection: a force-release
    /// woken there re-checks every held lock.
    pub(crate) admin_channel: String,
    pub(crate) connect_timeout: Duration,
    pub(crate) command_timeout: Duration,
    /// How long one park lasts at most: the connection's ping interval.
    pub(crate) park: Duration,
    pub(crate) max_backoff: Duration,
    /// Raised when the connection is lost or opened again: the server may have dropped
    /// the command pool's idle connections too.
    pub(crate) stale: Staleness,
}

/// What the task works with: the command pool (registrations) and the options its own
/// connection is opened with.
pub(crate) struct Links {
    pub(crate) pool: MySqlPool,
    pub(crate) options: MySqlConnectOptions,
    pub(crate) wakeups: Wakeups,
}

/// Starts the wake connection's task; it stops when `shutdown` is cancelled. Every
/// (re)connect raises `recheck`: a server that restarted may have lost recent writes.
pub(crate) fn spawn(
    links: Links,
    config: WakeConfig,
    recheck: Recheck,
    shutdown: CancellationToken,
    spawner: &Spawner,
) -> Listener {
    let (wakeups, max_backoff) = (links.wakeups.clone(), config.max_backoff);
    // A park lasts its whole interval when no release wakes it: by design, not a slow
    // statement for sqlx to warn of.
    let options = links
        .options
        .clone()
        .log_slow_statements(log::LevelFilter::Off, Duration::MAX);
    let make = move || Waking {
        wakeups: links.wakeups.clone(),
        pool: links.pool.clone(),
        options: options.clone(),
        config: config.clone(),
        recheck: recheck.clone(),
        last_id: None,
    };
    Listener::spawn(wakeups, make, max_backoff, (shutdown, spawner))
}

/// The wake connection, as the store kit's loop drives it.
struct Waking {
    wakeups: Wakeups,
    pool: MySqlPool,
    options: MySqlConnectOptions,
    config: WakeConfig,
    recheck: Recheck,
    /// The id of the last connection, whose rows the next one deletes.
    last_id: Option<u64>,
}

/// Why a connection is given up.
type Failed = String;

/// The park's statement, and how its end is read.
struct Park {
    /// `SELECT IF(<a row of the connection woken>, 0, GET_LOCK(gate, park))`.
    statement: String,
    /// The connection's woken channels.
    woken: String,
    /// The gate's named lock.
    gate: String,
    /// How long one park may take before the connection is thought dead.
    bound: Duration,
}

impl Listen for Waking {
    const NAME: &'static str = "lock waker";
    /// The parked connection, and the gate: a second connection holding the named lock
    /// the first parks on.
    type Connection = (MySqlConnection, MySqlConnection);

    async fn connect(&mut self) -> Result<Self::Connection, String> {
        let bound = self.config.connect_timeout;
        let open = || within(bound, MySqlConnection::connect_with(&self.options));
        let opened = (open().await?, open().await?);
        self.config.stale.opened();
        Ok(opened)
    }

    async fn serve(&mut self, (mut conn, mut gate): Self::Connection, proven: &mut bool) -> Lost {
        let Err(reason) = self.serve_parked((&mut conn, &mut gate), proven).await;
        self.config.stale.raise();
        Lost::Failed(reason)
    }
}

impl Waking {
    /// Serves one connection until it must be replaced: why. Sets `proven` once the
    /// connection registered and parked.
    async fn serve_parked(
        &mut self,
        (conn, gate): (&mut MySqlConnection, &mut MySqlConnection),
        proven: &mut bool,
    ) -> Result<std::convert::Infallible, Failed> {
        let (id, park) = self.open((conn, gate)).await?;
        self.wakeups.connected();
        tracing::debug!(id, "lock wake connection up");
        self.recheck.raise("the wake connection was (re)opened");
        loop {
            self.reconcile(id).await?;
            let ended = self.park(conn, id, &park).await?;
            match ended {
                // The gate is gone (its connection dropped): the park would not wait.
                Ok(Some(1)) => return Err("the gate's connection was lost".to_owned()),
                Ok(_) => {}
                Err(e) if number(&e) == Some(INTERRUPTED) => {}
                Err(e) => return Err(format!("park failed: {e}")),
            }
            *proven = true;
            let Some(channels) = self.take_woken(conn, id, &park.woken).await? else {
                continue;
            };
            for channel in &channels {
                if *channel == self.config.admin_channel {
                    self.recheck
                        .raise("a lock of the namespace was force-released");
                } else {
                    self.wakeups.registry().wake_channel(channel);
                }
            }
        }
    }

    /// Registers connection `conn` (deleting the rows of the last one) and takes the gate
    /// on `gate`: its id, and its park.
    async fn open(
        &mut self,
        (conn, gate): (&mut MySqlConnection, &mut MySqlConnection),
    ) -> Result<(u64, Park), Failed> {
        let waiters = &self.config.waiters;
        let id = self
            .bounded(
                "connection id",
                sqlx::query_scalar::<_, u64>("SELECT CONNECTION_ID()").fetch_one(&mut *conn),
            )
            .await?;
        if let Some(old) = self.last_id.replace(id) {
            let forget = format!("DELETE FROM {waiters} WHERE conn = ?");
            self.bounded("forget", sqlx::query(&forget).bind(old).execute(&mut *conn))
                .await?;
        }
        let admin = format!("INSERT IGNORE INTO {waiters} (channel, conn) VALUES (?, ?)");
        self.bounded(
            "register",
            sqlx::query(&admin)
                .bind(&self.config.admin_channel)
                .bind(id)
                .execute(&mut *conn),
        )
        .await?;
        let gate_name = format!("tower-lock gate {id}");
        let held = self
            .bounded(
                "gate",
                sqlx::query_scalar::<_, Option<i64>>("SELECT GET_LOCK(?, 0)")
                    .bind(&gate_name)
                    .fetch_one(&mut *gate),
            )
            .await?;
        if held != Some(1) {
            return Err("the gate's named lock is taken".to_owned());
        }
        // GET_LOCK on the gate's lock, not SLEEP: MariaDB interrupts a SLEEP through one
        // mutex that every SLEEP shares, and gives up after a few tries when it is busy (the
        // SLEEP then runs to its end), while a lock wait has a mutex of its own.
        let park = Park {
            statement: format!(
                "SELECT IF(EXISTS(SELECT 1 FROM {waiters} WHERE conn = ? AND woken = 1), 0, \
                 GET_LOCK(?, ?))"
            ),
            woken: format!("SELECT channel FROM {waiters} WHERE conn = ? AND woken = 1"),
            gate: gate_name,
            bound: self.config.park + self.config.command_timeout,
        };
        Ok((id, park))
    }

    /// One park of connection `id`, registering new waiters through the pool meanwhile:
    /// how it ended.
    async fn park(
        &self,
        conn: &mut MySqlConnection,
        id: u64,
        park: &Park,
    ) -> Result<Result<Option<i64>, sqlx::Error>, Failed> {
        let parked = sqlx::query_scalar::<_, Option<i64>>(&park.statement)
            .bind(id)
            .bind(&park.gate)
            .bind(self.config.park.as_secs_f64())
            .fetch_one(&mut *conn);
        tokio::pin!(parked);
        let deadline = Instant::now() + park.bound;
        loop {
            tokio::select! {
                // Registered through the pool while the park goes on.
                _ = self.wakeups.changed() => self.reconcile(id).await?,
                ended = &mut parked => return Ok(ended),
                _ = tokio::time::sleep_until(deadline) => {
                    return Err("the park outlived its bound".to_owned());
                }
            }
        }
    }

    /// Reads and clears the woken channels of connection `id` (`woken` reads them):
    /// `None` when a `KILL QUERY` cut the reading short (look again).
    async fn take_woken(
        &self,
        conn: &mut MySqlConnection,
        id: u64,
        woken: &str,
    ) -> Result<Option<Vec<String>>, Failed> {
        let waiters = &self.config.waiters;
        // VARBINARY: bytes, which are the channel's ASCII name.
        let channels = sqlx::query_scalar::<_, Vec<u8>>(woken)
            .bind(id)
            .fetch_all(&mut *conn);
        let channels = match timeout(self.config.command_timeout, channels).await {
            Ok(Ok(channels)) => channels
                .into_iter()
                .map(|c| String::from_utf8_lossy(&c).into_owned())
                .collect::<Vec<_>>(),
            // A KILL QUERY that came meanwhile: look again.
            Ok(Err(e)) if number(&e) == Some(INTERRUPTED) => return Ok(None),
            Ok(Err(e)) => return Err(format!("reading wake-ups failed: {e}")),
            Err(_) => return Err("reading wake-ups timed out".to_owned()),
        };
        if channels.is_empty() {
            return Ok(None);
        }
        // Cleared before the waiters try again: a release after this marks them anew.
        let clear = format!(
            "UPDATE {waiters} SET woken = 0 WHERE conn = ? AND channel IN ({})",
            placeholders(channels.len())
        );
        let cleared = channels
            .iter()
            .fold(sqlx::query(&clear).bind(id), |q, c| q.bind(c))
            .execute(&mut *conn);
        match timeout(self.config.command_timeout, cleared).await {
            Ok(Ok(_)) => Ok(Some(channels)),
            Ok(Err(e)) if number(&e) == Some(INTERRUPTED) => Ok(None),
            Ok(Err(e)) => Err(format!("clearing wake-ups failed: {e}")),
            Err(_) => Err("clearing wake-ups timed out".to_owned()),
        }
    }

    /// Brings the waiters table's rows of connection `id` in line with the registry.
    async fn reconcile(&self, id: u64) -> Result<(), Failed> {
        let waiters = &self.config.waiters;
        loop {
            let (register, forget) = self.wakeups.registry().changes();
            if register.is_empty() && forget.is_empty() {
                self.wakeups.report_subscriptions();
                return Ok(());
            }
            if !forget.is_empty() {
                let delete = format!(
                    "DELETE FROM {waiters} WHERE conn = ? AND channel IN ({})",
                    placeholders(forget.len())
                );
                let query = forget
                    .iter()
                    .fold(sqlx::query(&delete).bind(id), |q, c| q.bind(c));
                self.bounded("forget", self.pool.execute(query)).await?;
            }
            if !register.is_empty() {
                let insert = format!(
                    "INSERT IGNORE INTO {waiters} (channel, conn) VALUES {}",
                    vec!["(?, ?)"; register.len()].join(", ")
                );
                let query = register
                    .iter()
                    .fold(sqlx::query(&insert), |q, c| q.bind(c).bind(id));
                self.bounded("register", self.pool.execute(query)).await?;
                self.wakeups.registry().confirmed(register);
            }
        }
    }

    /// `call` within the command timeout.
    async fn bounded<T>(
        &self,
        what: &str,
        call: impl Future<Output = Result<T, sqlx::Error>>,
    ) -> Result<T, Failed> {
        match timeout(self.config.command_timeout, call).await {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(e)) => Err(format!("{what} failed: {e}")),
            Err(_) => Err(format!("{what} timed out")),
        }
    }
}

/// `?, ?, ...`: `n` placeholders.
fn placeholders(n: usize) -> String {
    vec!["?"; n].join(", ")
}

/// Whether this connection's user may interrupt another of its connections, as every
/// release must to wake a waiter: `KILL QUERY` on a second, idle connection. `Err` with the
/// server's refusal when not; a failure to connect is passed on as it is.
pub(crate) async fn may_kill(
    pool: &MySqlPool,
    options: &MySqlConnectOptions,
) -> Result<Result<(), sqlx::Error>, sqlx::Error> {
    let mut other = MySqlConnection::connect_with(options).await?;
    let id = sqlx::query_scalar::<_, u64>("SELECT CONNECTION_ID()")
        .fetch_one(&mut other)
        .await?;
    let killed = sqlx::query(&format!("KILL QUERY {id}")).execute(pool).await;
    drop(other.close().await);
    Ok(killed.map(drop))
}

//! The command connections: a bb8 pool of multiplexed connections.
//!
//! bb8-redis's own manager builds connections with redis' default timeouts and never
//! reports a multiplexed connection as broken (redis-rs does not reconnect one), so a
//! connection killed under the pool would be handed out forever. This manager applies the
//! backend's timeouts and retires a connection once a command on it fails at the
//! transport level.
//!
//! One dead connection usually means they all are (Redis restarted): a transport failure
//! anywhere, or the loss of the subscriber connection, raises a shared [`Suspicion`], and
//! every pooled connection older than it answers a PING at its next checkout before it
//! carries a command. Without that, each stale connection would fail one request after
//! Redis came back.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use bb8_redis::bb8;
use redis::aio::MultiplexedConnection;
use redis::{AsyncConnectionConfig, FromRedisValue, RedisError, ScriptInvocation};

/// A pooled connection and whether a transport failure has been seen on it.
#[derive(Clone)]
pub(crate) struct Conn {
    conn: MultiplexedConnection,
    broken: Arc<AtomicBool>,
    suspicion: Suspicion,
    /// The suspicion level at which this connection was last known to work.
    proven: u64,
}

/// A counter raised whenever some connection to Redis was found dead; connections proven
/// healthy at a lower level are checked before use.
#[derive(Clone, Default)]
pub(crate) struct Suspicion(Arc<AtomicU64>);

impl Suspicion {
    pub(crate) fn raise(&self) {
        self.0.fetch_add(1, Ordering::Relaxed);
    }

    fn level(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

pub(crate) struct Manager {
    client: redis::Client,
    config: AsyncConnectionConfig,
    suspicion: Suspicion,
}

impl bb8::ManageConnection for Manager {
    type Connection = Conn;
    type Error = RedisError;

    async fn connect(&self) -> Result<Conn, RedisError> {
        let conn = self
            .client
            .get_multiplexed_async_connection_with_config(&self.config)
            .await?;
        Ok(Conn {
            conn,
            broken: Arc::new(AtomicBool::new(false)),
            proven: self.suspicion.level(),
            suspicion: self.suspicion.clone(),
        })
    }

    async fn is_valid(&self, conn: &mut Conn) -> Result<(), RedisError> {
        redis::cmd("PING").query_async::<()>(&mut conn.conn).await
    }

    fn has_broken(&self, conn: &mut Conn) -> bool {
        conn.broken.load(Ordering::Relaxed)
    }
}

/// Why a command did not complete.
#[derive(Debug)]
pub(crate) enum CommandError {
    /// No connection could be had; nothing was sent.
    Connect(bb8::RunError<RedisError>),
    /// Redis answered with an error, or the transport failed after sending.
    Redis(RedisError),
    /// The runtime is shutting down and the command's task was dropped.
    Shutdown,
}

impl CommandError {
    /// True when Redis refused the command because a key holds another type of value:
    /// something other than this crate wrote it, and retrying cannot help.
    pub(crate) fn is_wrong_type(&self) -> bool {
        matches!(self, CommandError::Redis(e) if e.code() == Some("WRONGTYPE"))
    }

    /// True when the command may have run even though no reply arrived.
    pub(crate) fn is_ambiguous(&self) -> bool {
        match self {
            CommandError::Connect(_) => false,
            CommandError::Redis(e) => is_transport(e),
            CommandError::Shutdown => true,
        }
    }
}

impl fmt::Display for CommandError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CommandError::Connect(bb8::RunError::TimedOut) => {
                f.write_str("timed out waiting for a Redis connection")
            }
            CommandError::Connect(bb8::RunError::User(e)) => {
                write!(f, "cannot connect to Redis: {e}")
            }
            CommandError::Redis(e) => write!(f, "Redis command failed: {e}"),
            CommandError::Shutdown => f.write_str("the runtime is shutting down"),
        }
    }
}

impl std::error::Error for CommandError {}

fn is_transport(e: &RedisError) -> bool {
    e.is_io_error() || e.is_timeout() || e.is_connection_dropped() || e.is_unrecoverable_error()
}

/// The backend's command pool.
#[derive(Clone)]
pub(crate) struct Pool {
    pool: bb8::Pool<Manager>,
    suspicion: Suspicion,
}

impl Pool {
    pub(crate) fn new(
        client: redis::Client,
        size: u32,
        connect_timeout: Duration,
        response_timeout: Duration,
    ) -> Self {
        let suspicion = Suspicion::default();
        let config = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(connect_timeout))
            .set_response_timeout(Some(response_timeout));
        let pool = bb8::Pool::builder()
            .max_size(size)
            // A ping on every checkout would double the round trips of an acquisition;
            // broken connections are found by `has_broken` instead.
            .test_on_check_out(false)
            // Fail at once when Redis is down instead of retrying until the pool timeout:
            // the caller turns the error into a 503 while it still matters.
            .retry_connection(false)
            .connection_timeout(connect_timeout)
            .build_unchecked(Manager {
                client,
                config,
                suspicion: suspicion.clone(),
            });
        Pool { pool, suspicion }
    }

    /// The counter that makes pooled connections prove themselves before their next use.
    pub(crate) fn suspicion(&self) -> Suspicion {
        self.suspicion.clone()
    }

    /// Checks out a healthy connection and clones its multiplexed handle, so the pool
    /// slot is returned at once and many commands share each connection.
    pub(crate) async fn connection(&self) -> Result<Conn, CommandError> {
        // Dropping a broken connection makes bb8 discard it, so each retry either gets a
        // healthy one or a fresh connection; give up after every slot was tried.
        let mut tries = self.pool.state().connections + 1;
        loop {
            let mut pooled = self.pool.get().await.map_err(CommandError::Connect)?;
            tries = tries.saturating_sub(1);
            if pooled.is_usable().await || tries == 0 {
                return Ok(pooled.clone());
            }
        }
    }

    /// Runs a script through EVALSHA, loading it on NOSCRIPT.
    pub(crate) async fn invoke<T: FromRedisValue>(
        &self,
        invocation: &ScriptInvocation<'_>,
    ) -> Result<T, CommandError> {
        self.connection().await?.invoke(invocation).await
    }

    /// Loads a script so that the first EVALSHA does not pay a NOSCRIPT round trip.
    pub(crate) async fn load(&self, script: &redis::Script) -> Result<String, CommandError> {
        let mut conn = self.connection().await?;
        let result = script.load_async(&mut conn.conn).await;
        conn.observe(result)
    }

    /// Runs one command.
    pub(crate) async fn query<T: FromRedisValue>(
        &self,
        cmd: &redis::Cmd,
    ) -> Result<T, CommandError> {
        let mut conn = self.connection().await?;
        let result = cmd.query_async(&mut conn.conn).await;
        conn.observe(result)
    }
}

impl Conn {
    /// False when the connection failed before, or cannot answer a PING after another
    /// connection was found dead.
    async fn is_usable(&mut self) -> bool {
        if self.broken.load(Ordering::Relaxed) {
            return false;
        }
        let level = self.suspicion.level();
        if self.proven >= level {
            return true;
        }
        let ping = redis::cmd("PING").query_async::<()>(&mut self.conn).await;
        if ping.is_err() {
            self.broken.store(true, Ordering::Relaxed);
            return false;
        }
        self.proven = level;
        true
    }

    /// Runs a script through EVALSHA, loading it on NOSCRIPT. Commands sent on one
    /// connection run in the order they were sent.
    pub(crate) async fn invoke<T: FromRedisValue>(
        &mut self,
        invocation: &ScriptInvocation<'_>,
    ) -> Result<T, CommandError> {
        let result = invocation.invoke_async(&mut self.conn).await;
        self.observe(result)
    }

    fn observe<T>(&self, result: Result<T, RedisError>) -> Result<T, CommandError> {
        result.map_err(|e| {
            if is_transport(&e) {
                self.broken.store(true, Ordering::Relaxed);
                self.suspicion.raise();
            }
            CommandError::Redis(e)
        })
    }
}

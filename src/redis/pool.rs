//! The command connections: a bb8 pool of multiplexed connections.
//!
//! bb8-redis's own manager builds connections with redis' default timeouts and never
//! reports a multiplexed connection as broken (redis-rs does not reconnect one), so a
//! connection killed under the pool would be handed out forever. This manager applies the
//! backend's timeouts and retires a connection once a command on it fails at the
//! transport level.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use bb8_redis::bb8;
use redis::aio::MultiplexedConnection;
use redis::{AsyncConnectionConfig, FromRedisValue, RedisError, ScriptInvocation};

/// A pooled connection and whether a transport failure has been seen on it.
#[derive(Clone)]
pub(crate) struct Conn {
    conn: MultiplexedConnection,
    broken: Arc<AtomicBool>,
}

pub(crate) struct Manager {
    client: redis::Client,
    config: AsyncConnectionConfig,
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
}

impl Pool {
    pub(crate) fn new(
        client: redis::Client,
        size: u32,
        connect_timeout: Duration,
        response_timeout: Duration,
    ) -> Self {
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
            .build_unchecked(Manager { client, config });
        Pool { pool }
    }

    /// Checks out a healthy connection and clones its multiplexed handle, so the pool
    /// slot is returned at once and many commands share each connection.
    pub(crate) async fn connection(&self) -> Result<Conn, CommandError> {
        // Dropping a broken connection makes bb8 discard it, so each retry either gets a
        // healthy one or a fresh connection; give up after every slot was tried.
        let slots = self.pool.state().connections;
        let mut attempt = 0;
        loop {
            let pooled = self.pool.get().await.map_err(CommandError::Connect)?;
            if !pooled.broken.load(Ordering::Relaxed) || attempt >= slots {
                return Ok(Conn {
                    conn: pooled.conn.clone(),
                    broken: pooled.broken.clone(),
                });
            }
            attempt += 1;
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
            }
            CommandError::Redis(e)
        })
    }
}

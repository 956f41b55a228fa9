//! The command connections: a bb8 pool of multiplexed connections.
//!
//! bb8-redis's own manager builds connections with redis' default timeouts and never
//! reports a multiplexed connection as broken (redis-rs does not reconnect one), so a
//! connection killed under the pool would be handed out forever. This manager applies the
//! backend's timeouts and retires a connection once a command on it fails at the
//! transport level.
//!
//! One dead connection usually means they all are (Redis restarted): a transport failure
//! anywhere, or the loss of the subscriber connection, raises a shared [`FailureEpoch`], and
//! every pooled connection older than it answers a PING at its next checkout before it
//! carries a command. Without that, each stale connection would fail one request after
//! Redis came back.
//!
//! bb8 opens connections in its own tasks and only ever tells a waiting `get` that it timed
//! out: a refused connection, an unknown host or a wrong password all read "timed out"
//! after the connect timeout. The pool's error sink therefore publishes every failed
//! connection attempt, and a caller waiting for a connection fails at once with it.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use bb8_redis::bb8;
use redis::{AsyncConnectionConfig, FromRedisValue, RedisError, ScriptInvocation, Value};
use tokio::sync::watch;

pub(crate) use super::command_error::{
    CommandError, ConnectError, RedisCause, is_read_only, is_transport,
};
use super::topology::{AnyConn, Topology};
use crate::core::runtime::RuntimeAlive;
use crate::redis::run_id::ServerIdentity;

/// A pooled connection and whether a transport failure has been seen on it.
#[derive(Clone)]
pub(crate) struct Conn {
    conn: AnyConn,
    broken: Arc<AtomicBool>,
    failure_epoch: FailureEpoch,
    /// The failure epoch at which this connection was last known to work.
    proven: u64,
    /// The topology's generation when the connection was opened (see
    /// [`Topology::generation`]): once another server took over, it is retired.
    generation: u64,
    /// The runtime that runs the connection's I/O task: when it shuts down (a backend
    /// shared by tests with a runtime each), the connection is dead.
    driver: Arc<RuntimeAlive>,
}

/// A counter raised whenever some connection to Redis was found dead; connections proven
/// healthy at a lower level are checked before use.
#[derive(Clone, Default)]
pub(crate) struct FailureEpoch(Arc<AtomicU64>);

impl FailureEpoch {
    pub(crate) fn raise(&self) {
        self.0.fetch_add(1, Ordering::Relaxed);
    }

    fn level(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

pub(crate) struct Manager {
    topology: Topology,
    config: AsyncConnectionConfig,
    failure_epoch: FailureEpoch,
    /// The failure epoch when the last connection was opened: a connection opened at a
    /// higher one replaces a connection that failed, and Redis may have lost data meanwhile.
    opened_at: AtomicU64,
    server: ServerIdentity,
}

impl Manager {
    /// Raises the recheck if this connection replaces one that failed, or reaches another
    /// server process than the last one.
    async fn check_server(&self, conn: &mut AnyConn) -> Result<(), RedisError> {
        let level = self.failure_epoch.level();
        if level > self.opened_at.swap(level, Ordering::Relaxed) {
            self.server
                .recheck("a command connection was opened after a connection failed");
        }
        // A cluster answers `INFO` from one of its primaries, another on each call: its
        // run_id says nothing (a lost node is reported by the sharded subscriber instead).
        if conn.heals_itself() {
            return Ok(());
        }
        self.server.read_run_id(conn).await
    }
}

impl bb8::ManageConnection for Manager {
    type Connection = Conn;
    type Error = RedisError;

    async fn connect(&self) -> Result<Conn, RedisError> {
        // Read first: a takeover announced while connecting retires the connection.
        let generation = self.topology.generation();
        let mut conn = self.topology.connect(&self.config).await?;
        self.check_server(&mut conn).await?;
        Ok(Conn {
            conn,
            broken: Arc::new(AtomicBool::new(false)),
            proven: self.failure_epoch.level(),
            generation,
            failure_epoch: self.failure_epoch.clone(),
            // redis-rs spawned the I/O task on the runtime this runs on.
            driver: Arc::new(RuntimeAlive::here()),
        })
    }

    async fn is_valid(&self, conn: &mut Conn) -> Result<(), RedisError> {
        redis::cmd("PING").query_async::<()>(&mut conn.conn).await
    }

    fn has_broken(&self, conn: &mut Conn) -> bool {
        conn.broken.load(Ordering::Relaxed)
    }
}

/// Every failed connection attempt of the pool, newest last, for the callers waiting on one.
#[derive(Debug, Clone)]
struct ConnectFailures(Arc<watch::Sender<Option<Arc<RedisError>>>>);

impl bb8::ErrorSink<RedisError> for ConnectFailures {
    fn sink(&self, error: RedisError) {
        tracing::debug!(%error, "lock backend cannot open a Redis connection");
        self.0.send_replace(Some(Arc::new(error)));
    }

    fn boxed_clone(&self) -> Box<dyn bb8::ErrorSink<RedisError>> {
        Box::new(self.clone())
    }
}

/// The backend's command pool.
#[derive(Clone)]
pub(crate) struct Pool {
    pool: bb8::Pool<Manager>,
    topology: Topology,
    failure_epoch: FailureEpoch,
    failures: ConnectFailures,
}

impl Pool {
    pub(crate) fn new(
        topology: Topology,
        size: u32,
        connect_timeout: Duration,
        response_timeout: Duration,
        server: ServerIdentity,
    ) -> Self {
        let failure_epoch = FailureEpoch::default();
        let failures = ConnectFailures(Arc::new(watch::Sender::new(None)));
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
            .error_sink(Box::new(failures.clone()))
            .connection_timeout(connect_timeout)
            .build_unchecked(Manager {
                topology: topology.clone(),
                config,
                failure_epoch: failure_epoch.clone(),
                opened_at: AtomicU64::new(0),
                server,
            });
        Pool {
            pool,
            topology,
            failure_epoch,
            failures,
        }
    }

    /// Where the pool's connections go.
    pub(crate) fn topology(&self) -> &Topology {
        &self.topology
    }

    /// The counter that makes pooled connections prove themselves before their next use.
    pub(crate) fn failure_epoch(&self) -> FailureEpoch {
        self.failure_epoch.clone()
    }

    /// Checks out a healthy connection and clones its multiplexed handle, so the pool
    /// slot is returned at once and many commands share each connection.
    pub(crate) async fn connection(&self) -> Result<Conn, CommandError> {
        // Dropping a broken connection makes bb8 discard it, so each retry either gets a
        // healthy one or a fresh connection; give up after every slot was tried.
        let mut tries = self.pool.state().connections + 1;
        loop {
            let mut pooled = self.checkout().await.map_err(CommandError::Connect)?;
            tries = tries.saturating_sub(1);
            if pooled.is_usable(self.topology.generation()).await || tries == 0 {
                return Ok(pooled.clone());
            }
        }
    }

    /// Waits for a pooled connection, failing with the cause as soon as an attempt to open
    /// one fails while the pool has no connection left (a connection refused or a wrong
    /// password will not heal by waiting). While the pool still has connections, one of
    /// them may come back to this caller: a failed attempt to open another (bb8
    /// replenishing it, a transient "max number of clients") does not fail every request
    /// waiting for one; the pool's connection timeout bounds the wait.
    async fn checkout(&self) -> Result<bb8::PooledConnection<'_, Manager>, ConnectError> {
        // Subscribed before asking, so the failure of the attempt this call starts is seen.
        let mut failures = self.failures.0.subscribe();
        let get = self.pool.get();
        tokio::pin!(get);
        loop {
            tokio::select! {
                biased;
                pooled = &mut get => {
                    return pooled.map_err(|e| match e {
                        bb8::RunError::User(e) => ConnectError::Failed(Arc::new(e)),
                        bb8::RunError::TimedOut => {
                            ConnectError::TimedOut(failures.borrow().clone())
                        }
                    });
                }
                Ok(()) = failures.changed() => {
                    if self.pool.state().connections > 0 {
                        continue;
                    }
                    let last = failures.borrow().clone();
                    return Err(last.map_or(ConnectError::TimedOut(None), ConnectError::Failed));
                }
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

impl Pool {
    /// Runs one command on every server that takes writes (each primary of a cluster, the
    /// one server otherwise), for settings that must hold on all of them. Each reply comes
    /// with its primary's address on a cluster.
    pub(crate) async fn query_each_primary<T: FromRedisValue>(
        &self,
        cmd: &redis::Cmd,
    ) -> Result<Vec<(Option<String>, T)>, CommandError> {
        let mut conn = self.connection().await?;
        let replies = match &mut conn.conn {
            AnyConn::Cluster(cluster) => {
                super::cluster::query_each_primary(&mut cluster.conn, cmd).await
            }
            server => cmd
                .query_async::<Value>(server)
                .await
                .map(|v| vec![(None, v)]),
        };
        let replies = conn.observe(replies)?;
        replies
            .into_iter()
            .map(|(node, v)| match T::from_redis_value(v) {
                Ok(reply) => Ok((node, reply)),
                Err(e) => Err(CommandError::Redis(e.into())),
            })
            .collect()
    }
}

impl Pool {
    /// The addresses of a cluster's primaries (`host:port`, sorted); `None` for the one
    /// server of the other topologies.
    pub(crate) async fn primaries(&self) -> Result<Option<Vec<String>>, CommandError> {
        if !self.topology.is_cluster() {
            return Ok(None);
        }
        let pings = self
            .query_each_primary::<Value>(&redis::cmd("PING"))
            .await?;
        let mut nodes: Vec<String> = pings.into_iter().filter_map(|(node, _)| node).collect();
        nodes.sort_unstable();
        Ok(Some(nodes))
    }

    /// Runs one command on the primary at `node` (one of [`primaries`](Self::primaries)),
    /// or on the one server when `node` is `None`.
    pub(crate) async fn query_on<T: FromRedisValue>(
        &self,
        node: Option<&str>,
        cmd: &redis::Cmd,
    ) -> Result<T, CommandError> {
        let mut conn = self.connection().await?;
        let result = match (&mut conn.conn, node) {
            (AnyConn::Cluster(cluster), Some(node)) => {
                super::cluster::query_node(&mut cluster.conn, node, cmd)
                    .await
                    .and_then(|v| T::from_redis_value(v).map_err(RedisError::from))
            }
            (server, _) => cmd.query_async(server).await,
        };
        conn.observe(result)
    }
}

impl Conn {
    /// False when the connection failed before, was opened before another server took
    /// over, or cannot answer a PING after another connection was found dead.
    async fn is_usable(&mut self, generation: u64) -> bool {
        // A server that was master until a failover may still answer, and even take
        // writes until the sentinels demote it: a PING proves nothing.
        if !self.driver.is_alive() || self.generation != generation {
            self.broken.store(true, Ordering::Relaxed);
        }
        if self.broken.load(Ordering::Relaxed) {
            return false;
        }
        // A cluster connection repairs itself; a PING (sent to every primary) would fail
        // it while one shard fails over and the healthy shards still serve.
        if self.conn.heals_itself() {
            return true;
        }
        let level = self.failure_epoch.level();
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

    /// Sends `cmd`, a command that names no key (`WAIT`), to the server that holds `key`:
    /// on a cluster the primary of its slot, over the node connection that `key`'s
    /// scripts went out on (redis-rs would send it to every primary).
    pub(crate) async fn query_at<T: FromRedisValue>(
        &mut self,
        key: &str,
        cmd: &redis::Cmd,
    ) -> Result<T, CommandError> {
        let result = match &mut self.conn {
            AnyConn::Cluster(cluster) => super::cluster::query_at(&mut cluster.conn, key, cmd)
                .await
                .and_then(|v| T::from_redis_value(v).map_err(RedisError::from)),
            server => cmd.query_async(server).await,
        };
        self.observe(result)
    }

    fn observe<T>(&self, result: Result<T, RedisError>) -> Result<T, CommandError> {
        result.map_err(|e| {
            // A master demoted to replica (a failover) refuses writes with READONLY but
            // stays up: the connection is as useless as a dead one, and so are its
            // siblings, and a fresh one goes to whichever server is master now. A cluster
            // connection follows its cluster by itself.
            if (is_transport(&e) && !self.conn.heals_itself()) || is_read_only(&e) {
                self.broken.store(true, Ordering::Relaxed);
                self.failure_epoch.raise();
            }
            CommandError::Redis(e)
        })
    }
}

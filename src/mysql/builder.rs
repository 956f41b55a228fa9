//! [`MySqlBackendBuilder`]: the settings, and `build`: connect, check the server and the
//! schema (or create it), start the wake connection and the janitor.

use std::str::FromStr;
use std::time::Duration;

use sqlx::mysql::{MySqlConnectOptions, MySqlPool, MySqlPoolOptions};
use sqlx::{Executor, MySql};

use super::checks::{call_failure, probe, refuse_read_only};
use super::wake::{Links, WakeConfig, WakeConnection};
use super::{MySqlBackend, schema};
use crate::core::Core;
use crate::core::wakeups::Wakeups;
use crate::error::BuildError;
use crate::sql::{self, Calls, Config, SqlStore, admin_channel};

/// Configures a [`MySqlBackend`]; created by [`MySqlBackend::builder`] or
/// [`MySqlBackend::from_pool`].
#[derive(Debug, Clone)]
#[must_use = "a builder does nothing until `build` is awaited"]
pub struct MySqlBackendBuilder {
    target: Target,
    config: Config,
}

#[derive(Debug, Clone)]
enum Target {
    Url(String),
    Pool(MySqlPool),
}

impl MySqlBackendBuilder {
    pub(super) fn new(url: String) -> Self {
        Self::with_target(Target::Url(url))
    }

    pub(super) fn from_pool(pool: MySqlPool) -> Self {
        Self::with_target(Target::Pool(pool))
    }

    fn with_target(target: Target) -> Self {
        MySqlBackendBuilder {
            target,
            config: Config::new(
                schema::DEFAULT_TABLE,
                Duration::from_secs(60 * 60),
                Duration::from_secs(2),
            ),
        }
    }

    /// Creates the lock tables and their procedures at build if the database does not
    /// have this version of them (idempotent, and serialized across instances that build
    /// at once). Without it, `build` refuses a database that lacks them and names the SQL
    /// file to run (`src/mysql/schema.sql` in this crate, or
    /// [`MySqlBackend::schema_sql`]): for deployments where the application's database
    /// user may not create tables or routines.
    pub fn migrate(mut self) -> Self {
        self.config.migrate = true;
        self
    }

    /// The lock table's name (default `tower_lock`): its procedures and other tables are
    /// named after it (`tower_lock_acquire`, `tower_lock_holders`, `tower_lock_waiters`,
    /// ...). A lower-case identifier of at most 48 bytes, in the URL's database.
    pub fn table(mut self, table: impl Into<String>) -> Self {
        self.config.table = table.into();
        self
    }

    /// Connections of the command pool (default 8; ignored by [`from_pool`]). Each call
    /// takes one for a single `CALL`: a held lock never keeps one. A call that finds the
    /// pool exhausted for the connect timeout fails: 503 from the layer. The wake
    /// connection is one more, of its own.
    ///
    /// [`from_pool`]: super::MySqlBackend::from_pool
    pub fn pool_size(mut self, size: u32) -> Self {
        self.config.pool_size = size.max(1);
        self
    }

    /// The prefix of every lock name in the table (default `tower-lock`): backends whose
    /// locks must not contend with each other use different namespaces. Must not contain
    /// `{`, `}` or control characters.
    pub fn namespace(mut self, namespace: impl Into<String>) -> Self {
        self.config.namespace = namespace.into();
        self
    }

    /// The longest key accepted, in bytes (default 1024); longer keys are refused with
    /// 400, never truncated. A key whose escaped row name does not fit the table's
    /// 2800-byte name column is refused too.
    pub fn max_key_len(mut self, len: usize) -> Self {
        self.config.max_key_len = len;
        self
    }

    /// How long to wait for a connection, new or from the pool (default 1 s).
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.config.connect_timeout = timeout;
        self
    }

    /// How long one call may take (default 1 s). The command pool's sessions wait for a
    /// row lock at most this long, rounded up to whole seconds
    /// (`innodb_lock_wait_timeout`); a call that timed out so is sent again.
    pub fn command_timeout(mut self, timeout: Duration) -> Self {
        self.config.command_timeout = timeout;
        self
    }

    /// How long a name's row, with its fencing counter, is kept once nobody holds or waits
    /// for it (default 1 hour); the janitor deletes it within a quarter of that more.
    /// Tokens never fall below the server clock in microseconds, so after that the clock
    /// alone keeps them increasing, provided it never steps back by more than this.
    pub fn fence_ttl(mut self, ttl: Duration) -> Self {
        self.config.fence_ttl = ttl;
        self
    }

    /// How long the wake connection's park lasts at most (default 2 s, at least 1 s): its
    /// one statement per interval is its ping, so a half-open connection is noticed within this plus
    /// the command timeout, and its waiters are woken.
    pub fn wake_ping_interval(mut self, interval: Duration) -> Self {
        self.config.ping_interval = interval;
        self
    }

    /// Bounds consecutive handoffs within this process under one hold in the table
    /// (default [`DEFAULT_MAX_LOCAL_HANDOFFS`]); 0 turns handoff in memory off. See
    /// [`RedisBackendBuilder::max_local_handoffs`](crate::RedisBackendBuilder::max_local_handoffs).
    ///
    /// [`DEFAULT_MAX_LOCAL_HANDOFFS`]: crate::DEFAULT_MAX_LOCAL_HANDOFFS
    pub fn max_local_handoffs(mut self, max: u32) -> Self {
        self.config.max_local_handoffs = max;
        self
    }

    /// Bounds the time this process's tasks take turns under one hold in the table
    /// (default [`DEFAULT_MAX_LOCAL_HANDOFF_TIME`]).
    ///
    /// [`DEFAULT_MAX_LOCAL_HANDOFF_TIME`]: crate::DEFAULT_MAX_LOCAL_HANDOFF_TIME
    pub fn max_local_handoff_time(mut self, time: Duration) -> Self {
        self.config.max_local_handoff_time = time;
        self
    }

    /// Connects, checks the server and the schema (or creates it with
    /// [`migrate`](Self::migrate)), and starts the backend's tasks. Must be called inside
    /// a Tokio runtime.
    ///
    /// Refused with the cause: an unreachable server, wrong credentials, a read-only
    /// server (`read_only`: a replica), a database without the lock tables and procedures
    /// (naming the SQL file) or with another version of them, a user not allowed to use
    /// them (a probe acquisition and release, which leave nothing behind, must pass), or
    /// not allowed to interrupt its own connections with `KILL QUERY` (how a release wakes
    /// waiters).
    pub async fn build(self) -> Result<MySqlBackend, BuildError> {
        self.validate()?;
        let (pool, options) = self.pool().await?;
        refuse_read_only(&pool, &options).await?;
        if self.config.migrate {
            schema::migrate(&pool, &self.config.table)
                .await
                .map_err(|e| call_failure(e, &options, &self.config.table))?;
        } else {
            schema::check(&pool, &self.config.table)
                .await
                .map_err(|e| e.unwrap_or_else(|e| call_failure(e, &options, &self.config.table)))?;
        }
        let (parts, metrics) = self.config.parts();
        let wake = WakeConnection::spawn(
            Links {
                pool: pool.clone(),
                options: options.clone(),
                wakeups: Wakeups::new(metrics),
            },
            WakeConfig {
                waiters: format!("{}_waiters", self.config.table),
                admin_channel: admin_channel(&self.config.namespace),
                connect_timeout: self.config.connect_timeout,
                command_timeout: self.config.command_timeout,
                park: self.config.ping_interval,
                max_backoff: self.config.max_backoff,
            },
            parts.recheck.clone(),
            parts.shutdown.clone(),
            &parts.runtime,
        );
        let sql = MySql::statements(&self.config.table);
        let janitor = sql::janitor::spawn(
            pool.clone(),
            sql.sweep.clone(),
            self.config.fence_ttl,
            parts.shutdown.clone(),
            &parts.runtime,
        );
        let store = SqlStore {
            pool,
            sql,
            wake,
            janitor,
            instance: parts.owners.instance().to_owned(),
            admin_channel: admin_channel(&self.config.namespace),
            namespace: self.config.namespace,
            table: self.config.table,
            max_key_len: self.config.max_key_len,
        };
        probe(&store, &options).await?;
        Ok(MySqlBackend {
            inner: Core::new(store, parts),
        })
    }

    fn validate(&self) -> Result<(), BuildError> {
        self.config.validate(schema::sql)?;
        // MySQL's GET_LOCK takes whole seconds.
        if self.config.ping_interval < Duration::from_secs(1) {
            return Err(BuildError::Setting {
                name: "wake_ping_interval",
                reason: "it must be at least one second",
            });
        }
        Ok(())
    }

    /// The command pool, connected (the first connection proves the server and the
    /// credentials), and the options the wake connection connects with.
    async fn pool(&self) -> Result<(MySqlPool, MySqlConnectOptions), BuildError> {
        let (pool, options) = match &self.target {
            Target::Url(url) => {
                let options = MySqlConnectOptions::from_str(url).map_err(|e| BuildError::Url {
                    source: Box::new(e),
                })?;
                // A row lock is waited for no longer than a call may take (whole seconds).
                let lock_wait = self
                    .config
                    .command_timeout
                    .as_millis()
                    .div_ceil(1000)
                    .max(1);
                let set = format!("SET SESSION innodb_lock_wait_timeout = {lock_wait}");
                let pool = MySqlPoolOptions::new()
                    .max_connections(self.config.pool_size)
                    .acquire_timeout(self.config.connect_timeout)
                    // A statement on a dead connection fails and is retried; a ping before
                    // every call would double the round trips.
                    .test_before_acquire(false)
                    .after_connect(move |conn, _| {
                        let set = set.clone();
                        Box::pin(async move { conn.execute(set.as_str()).await.map(drop) })
                    })
                    .connect_lazy_with(options.clone());
                (pool, options)
            }
            Target::Pool(pool) => (pool.clone(), (*pool.connect_options()).clone()),
        };
        self.config.prove::<MySql>(&options).await?;
        Ok((pool, options))
    }
}

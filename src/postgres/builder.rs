//! [`PostgresBackendBuilder`]: the settings, and `build`: connect, check the server and the
//! schema (or create it), start the listener and the janitor.

use std::str::FromStr;
use std::time::Duration;

use sqlx::Postgres;
use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};

use super::checks::{connect_failure, probe, refuse_read_only};
use super::listen::{ListenConfig, Listener};
use super::{PostgresBackend, schema};
use crate::core::Core;
use crate::core::wakeups::Wakeups;
use crate::error::BuildError;
use crate::sql::{self, Calls, Config, SqlStore, admin_channel};

/// The `application_name` of the command connections, unless the URL sets one.
const APPLICATION_NAME: &str = "tower-lock";
/// The `application_name` of the listening connection, to tell it apart in
/// `pg_stat_activity`.
const LISTENER_NAME: &str = "tower-lock listener";

/// Configures a [`PostgresBackend`]; created by [`PostgresBackend::builder`] or
/// [`PostgresBackend::from_pool`].
#[derive(Debug, Clone)]
#[must_use = "a builder does nothing until `build` is awaited"]
pub struct PostgresBackendBuilder {
    target: Target,
    config: Config,
}

#[derive(Debug, Clone)]
enum Target {
    Url(String),
    Pool(PgPool),
}

impl PostgresBackendBuilder {
    pub(super) fn new(url: String) -> Self {
        Self::with_target(Target::Url(url))
    }

    pub(super) fn from_pool(pool: PgPool) -> Self {
        Self::with_target(Target::Pool(pool))
    }

    fn with_target(target: Target) -> Self {
        PostgresBackendBuilder {
            target,
            config: Config::new(
                schema::DEFAULT_TABLE,
                Duration::from_secs(10 * 60),
                Duration::from_secs(1),
            ),
        }
    }

    /// Creates the lock table and its functions at build if they are missing, and upgrades
    /// them if they are older (idempotent, and safe when several instances build at once).
    /// Without it, `build` refuses a database that lacks them and names the SQL file to
    /// run (`src/postgres/schema.sql` in this crate, or
    /// [`PostgresBackend::schema_sql`]): for deployments where the application's database
    /// user may not create tables.
    pub fn migrate(mut self) -> Self {
        self.config.migrate = true;
        self
    }

    /// The lock table's name (default `tower_lock`): its functions and second table are
    /// named after it (`tower_lock_acquire`, `tower_lock_holders`, ...). A lower-case
    /// identifier of at most 48 bytes; put it in a schema with the connection's
    /// `search_path`.
    pub fn table(mut self, table: impl Into<String>) -> Self {
        self.config.table = table.into();
        self
    }

    /// Connections of the command pool (default 8; ignored by [`from_pool`]). Each call
    /// takes one for a single statement: a held lock never keeps one. The listening
    /// connection is one more, of its own.
    ///
    /// [`from_pool`]: super::PostgresBackend::from_pool
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
    /// 400, never truncated.
    pub fn max_key_len(mut self, len: usize) -> Self {
        self.config.max_key_len = len;
        self
    }

    /// How long to wait for a connection, new or from the pool (default 1 s). A pool that
    /// stays exhausted this long fails the call: 503 from the layer.
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.config.connect_timeout = timeout;
        self
    }

    /// How long one call may take (default 1 s). The server cancels a statement that runs
    /// past twice this long (`statement_timeout`), so none outlives its caller by much.
    pub fn command_timeout(mut self, timeout: Duration) -> Self {
        self.config.command_timeout = timeout;
        self
    }

    /// How long a name's row, with its fencing counter, is kept once nobody holds or waits
    /// for it (default 10 minutes); the janitor deletes it within a quarter of that more.
    /// Tokens never fall below the server clock in microseconds, so after that the clock
    /// alone keeps them increasing, provided it never steps back by more than this.
    pub fn fence_ttl(mut self, ttl: Duration) -> Self {
        self.config.fence_ttl = ttl;
        self
    }

    /// How often the listening connection is pinged (default 1 s): a half-open connection
    /// is noticed within this plus the command timeout, and its waiters are woken.
    pub fn listener_ping_interval(mut self, interval: Duration) -> Self {
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
    /// server (a replica, or `default_transaction_read_only`), a database without the lock
    /// table and functions (naming the SQL file) or with another version of them, a user
    /// not allowed to use them (a probe acquisition and release, which leave nothing
    /// behind, must pass).
    pub async fn build(self) -> Result<PostgresBackend, BuildError> {
        self.config.validate(schema::sql)?;
        let (pool, options) = self.pool().await?;
        refuse_read_only(&pool, &options).await?;
        if self.config.migrate {
            schema::migrate(&pool, &self.config.table)
                .await
                .map_err(|e| connect_failure(e, &options))?;
        } else {
            schema::check(&pool, &self.config.table)
                .await
                .map_err(|e| e.unwrap_or_else(|e| connect_failure(e, &options)))?;
        }
        let (parts, metrics) = self.config.parts();
        let listen_pool = PgPoolOptions::new()
            .max_connections(1)
            .acquire_timeout(self.config.connect_timeout)
            .connect_lazy_with(options.clone().application_name(LISTENER_NAME));
        let listener = Listener::spawn(
            (listen_pool, Wakeups::new(metrics)),
            ListenConfig {
                admin_channel: admin_channel(&self.config.namespace),
                connect_timeout: self.config.connect_timeout,
                command_timeout: self.config.command_timeout,
                ping_interval: self.config.ping_interval,
                max_backoff: self.config.max_backoff,
            },
            parts.recheck.clone(),
            parts.shutdown.clone(),
            &parts.runtime,
        );
        let sql = Postgres::statements(&self.config.table);
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
            wake: listener,
            janitor,
            instance: parts.owners.instance().to_owned(),
            admin_channel: admin_channel(&self.config.namespace),
            namespace: self.config.namespace,
            table: self.config.table,
            max_key_len: self.config.max_key_len,
        };
        probe(&store, &options).await?;
        Ok(PostgresBackend {
            inner: Core::new(store, parts),
        })
    }

    /// The command pool, connected (the first connection proves the server and the
    /// credentials), and the options the listener connects with.
    async fn pool(&self) -> Result<(PgPool, PgConnectOptions), BuildError> {
        let statement_timeout = self
            .config
            .command_timeout
            .saturating_mul(2)
            .as_millis()
            .to_string();
        let (pool, options) = match &self.target {
            Target::Url(url) => {
                let mut options = PgConnectOptions::from_str(url)
                    .map_err(|e| BuildError::Url {
                        source: Box::new(e),
                    })?
                    .options([("statement_timeout", statement_timeout.as_str())]);
                // Named in pg_stat_activity, unless the URL names them.
                if options.get_application_name().is_none() {
                    options = options.application_name(APPLICATION_NAME);
                }
                let pool = PgPoolOptions::new()
                    .max_connections(self.config.pool_size)
                    .acquire_timeout(self.config.connect_timeout)
                    // A statement on a dead connection fails and is retried; a ping before
                    // every call would double the round trips.
                    .test_before_acquire(false)
                    .connect_lazy_with(options.clone());
                (pool, options)
            }
            Target::Pool(pool) => (pool.clone(), (*pool.connect_options()).clone()),
        };
        self.config.prove::<Postgres>(&options).await?;
        Ok((pool, options))
    }
}

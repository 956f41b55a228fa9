//! [`MySqlBackendBuilder`]: the settings, and what `build` does on MySQL/MariaDB (the
//! command pool, the checks of the server and the schema, the wake connection); the rest
//! of `build` is both SQL stores' (`sql::build`).

use std::future::Future;
use std::str::FromStr;
use std::time::Duration;

use sqlx::mysql::{MySqlConnectOptions, MySqlPool};
use sqlx::{Executor, MySql};

use super::checks::{call_failure, probe, refuse_read_only};
use super::store::MySqlStore;
use super::wake::{self, Links, WakeConfig};
use super::{MySqlBackend, schema};
use crate::core::Parts;
use crate::core::kit::listener::Listener;
use crate::core::kit::settings::{StoreSettings, refuse_under_a_second};
use crate::core::wakeups::Wakeups;
use crate::error::BuildError;
use crate::sql::{self, Config, Server, Staleness, Target, admin_channel};

/// Configures a [`MySqlBackend`]; created by [`MySqlBackend::builder`] or
/// [`MySqlBackend::from_pool`].
///
/// A key whose escaped row name (namespace and key) does not fit the table's 2800-byte name
/// column is refused with 400, as a key longer than [`max_key_len`](Self::max_key_len) is.
#[derive(Debug, Clone)]
#[must_use = "a builder does nothing until `build` is awaited"]
pub struct MySqlBackendBuilder {
    pub(super) target: Target<MySql>,
    pub(super) settings: StoreSettings,
    pub(super) config: Config,
}

impl MySqlBackendBuilder {
    pub(super) fn new(target: Target<MySql>) -> Self {
        MySqlBackendBuilder {
            target,
            settings: sql::settings(),
            config: Config::new(
                schema::DEFAULT_TABLE,
                Duration::from_secs(60 * 60),
                Duration::from_secs(2),
            ),
        }
    }

    /// How long the wake connection's park lasts at most (default 2 s, at least 1 s): its
    /// one statement per interval is its ping, so a half-open connection is noticed within
    /// this plus the command timeout, and its waiters are woken.
    pub fn wake_ping_interval(mut self, interval: Duration) -> Self {
        self.config.ping_interval = interval;
        self
    }

    /// Connects, checks the server and the schema (or creates it with
    /// [`migrate`](Self::migrate)), and starts the backend's tasks. Must be called inside
    /// a Tokio runtime.
    ///
    /// Refused with the cause: a URL of another scheme than `mysql://` or `mariadb://`, a
    /// setting out of range, an unreachable server, wrong credentials, a read-only server
    /// (`read_only`: a replica), a database without the
    /// lock tables and procedures (naming the SQL file) or with another version of them, a
    /// user not allowed to use them (a probe acquisition and release, which leave nothing
    /// behind, must pass), or not allowed to interrupt its own connections with `KILL
    /// QUERY` (how a release wakes waiters).
    pub async fn build(self) -> Result<MySqlBackend, BuildError> {
        let inner = sql::build(self.target, self.settings, self.config).await?;
        Ok(MySqlBackend { inner })
    }
}

impl Server for MySql {
    fn schema_sql(table: &str) -> Result<String, BuildError> {
        schema::sql(table)
    }

    fn validate(config: &Config) -> Result<(), BuildError> {
        // MySQL's GET_LOCK takes whole seconds.
        refuse_under_a_second("wake_ping_interval", config.ping_interval)
    }

    fn pool(
        url: &str,
        settings: &StoreSettings,
        stale: &Staleness,
    ) -> Result<(MySqlPool, MySqlConnectOptions), BuildError> {
        let options = MySqlConnectOptions::from_str(url).map_err(|e| BuildError::Url {
            source: Box::new(e),
        })?;
        // A row lock is waited for no longer than a call may take (whole seconds).
        let lock_wait = settings.command_timeout.as_millis().div_ceil(1000).max(1);
        let set = format!("SET SESSION innodb_lock_wait_timeout = {lock_wait}");
        let pool = sql::pool_options::<sqlx::MySql>(settings, stale)
            .after_connect(move |conn, _| {
                let set = set.clone();
                Box::pin(async move { conn.execute(set.as_str()).await.map(drop) })
            })
            .connect_lazy_with(options.clone());
        Ok((pool, options))
    }

    fn refuse_read_only(
        pool: &MySqlPool,
        options: &MySqlConnectOptions,
    ) -> impl Future<Output = Result<(), BuildError>> {
        refuse_read_only(pool, options)
    }

    fn migrate(pool: &MySqlPool, table: &str) -> impl Future<Output = Result<(), sqlx::Error>> {
        schema::migrate(pool, table)
    }

    fn check(
        pool: &MySqlPool,
        table: &str,
    ) -> impl Future<Output = Result<(), Result<BuildError, sqlx::Error>>> {
        schema::check(pool, table)
    }

    fn call_failure(e: sqlx::Error, options: &MySqlConnectOptions, table: &str) -> BuildError {
        call_failure(e, options, table)
    }

    fn wake(
        (pool, options, stale): (&MySqlPool, &MySqlConnectOptions, &Staleness),
        (settings, config): (&StoreSettings, &Config),
        parts: &Parts,
    ) -> Listener {
        wake::spawn(
            Links {
                pool: pool.clone(),
                options: options.clone(),
                wakeups: Wakeups::new(parts.metrics.clone()),
            },
            WakeConfig {
                waiters: format!("{}_waiters", config.table),
                admin_channel: admin_channel(&settings.namespace),
                connect_timeout: settings.connect_timeout,
                command_timeout: settings.command_timeout,
                park: config.ping_interval,
                max_backoff: settings.max_backoff,
                stale: stale.clone(),
            },
            parts.recheck.clone(),
            parts.shutdown.clone(),
            &parts.runtime,
        )
    }

    fn probe(
        store: &MySqlStore,
        options: &MySqlConnectOptions,
    ) -> impl Future<Output = Result<(), BuildError>> {
        probe(store, options)
    }
}

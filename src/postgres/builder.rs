//! [`PostgresBackendBuilder`]: the settings, and what `build` does on PostgreSQL (the
//! command pool, the checks of the server and the schema, the listener); the rest of
//! `build` is both SQL stores' (`sql::build`).

use std::future::Future;
use std::str::FromStr;
use std::time::Duration;

use sqlx::Postgres;
use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};

use super::checks::{connect_failure, probe, refuse_read_only};
use super::listen::{self, ListenConfig};
use super::store::PgStore;
use super::{PostgresBackend, schema};
use crate::core::Parts;
use crate::core::kit::listener::Listener;
use crate::core::kit::settings::StoreSettings;
use crate::core::wakeups::Wakeups;
use crate::error::BuildError;
use crate::sql::{self, Config, Server, Staleness, Target, admin_channel};

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
    pub(super) target: Target<Postgres>,
    pub(super) settings: StoreSettings,
    pub(super) config: Config,
}

impl PostgresBackendBuilder {
    pub(super) fn new(target: Target<Postgres>) -> Self {
        PostgresBackendBuilder {
            target,
            settings: sql::settings(),
            config: Config::new(
                schema::DEFAULT_TABLE,
                Duration::from_secs(10 * 60),
                Duration::from_secs(1),
            ),
        }
    }

    /// How often the listening connection is pinged (default 1 s): a half-open connection
    /// is noticed within this plus the command timeout, and its waiters are woken.
    pub fn listener_ping_interval(mut self, interval: Duration) -> Self {
        self.config.ping_interval = interval;
        self
    }

    /// Connects, checks the server and the schema (or creates it with
    /// [`migrate`](Self::migrate)), and starts the backend's tasks. Must be called inside
    /// a Tokio runtime.
    ///
    /// Refused with the cause: a URL of another scheme than `postgres://` or
    /// `postgresql://`, a setting out of range, an unreachable server, wrong
    /// credentials, a read-only server (a replica, or `default_transaction_read_only`), a
    /// database without the lock table and functions (naming the SQL file) or with another
    /// version of them, a user not allowed to use them (a probe acquisition and release,
    /// which leave nothing behind, must pass).
    pub async fn build(self) -> Result<PostgresBackend, BuildError> {
        let inner = sql::build(self.target, self.settings, self.config).await?;
        Ok(PostgresBackend { inner })
    }
}

impl Server for Postgres {
    fn schema_sql(table: &str) -> Result<String, BuildError> {
        schema::sql(table)
    }

    fn validate(_: &Config) -> Result<(), BuildError> {
        Ok(())
    }

    fn pool(
        url: &str,
        settings: &StoreSettings,
        stale: &Staleness,
    ) -> Result<(PgPool, PgConnectOptions), BuildError> {
        let statement_timeout = settings
            .command_timeout
            .saturating_mul(2)
            .as_millis()
            .to_string();
        let mut options = PgConnectOptions::from_str(url)
            .map_err(|e| BuildError::Url {
                source: Box::new(e),
            })?
            .options([("statement_timeout", statement_timeout.as_str())]);
        // Named in pg_stat_activity, unless the URL names them.
        if options.get_application_name().is_none() {
            options = options.application_name(APPLICATION_NAME);
        }
        let pool = sql::pool_options(settings, stale).connect_lazy_with(options.clone());
        Ok((pool, options))
    }

    fn refuse_read_only(
        pool: &PgPool,
        options: &PgConnectOptions,
    ) -> impl Future<Output = Result<(), BuildError>> {
        refuse_read_only(pool, options)
    }

    fn migrate(pool: &PgPool, table: &str) -> impl Future<Output = Result<(), sqlx::Error>> {
        schema::migrate(pool, table)
    }

    fn check(
        pool: &PgPool,
        table: &str,
    ) -> impl Future<Output = Result<(), Result<BuildError, sqlx::Error>>> {
        schema::check(pool, table)
    }

    fn call_failure(e: sqlx::Error, options: &PgConnectOptions, _: &str) -> BuildError {
        connect_failure(e, options)
    }

    fn wake(
        (_, options, stale): (&PgPool, &PgConnectOptions, &Staleness),
        (settings, config): (&StoreSettings, &Config),
        parts: &Parts,
    ) -> Listener {
        let listen_pool = PgPoolOptions::new()
            .max_connections(1)
            .acquire_timeout(settings.connect_timeout)
            .connect_lazy_with(options.clone().application_name(LISTENER_NAME));
        listen::spawn(
            (listen_pool, Wakeups::new(parts.metrics.clone())),
            ListenConfig {
                admin_channel: admin_channel(&settings.namespace),
                connect_timeout: settings.connect_timeout,
                command_timeout: settings.command_timeout,
                ping_interval: config.ping_interval,
                max_backoff: settings.max_backoff,
                stale: stale.clone(),
            },
            parts.recheck.clone(),
            parts.shutdown.clone(),
            &parts.runtime,
        )
    }

    fn probe(
        store: &PgStore,
        options: &PgConnectOptions,
    ) -> impl Future<Output = Result<(), BuildError>> {
        probe(store, options)
    }
}

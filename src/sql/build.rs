//! What both SQL builders do alike: their settings, the checks of them, the core's parts,
//! and how `build` reports a connection or call that failed.

use std::io;
use std::time::Duration;

use sqlx::Connection;
use tokio::time::timeout;

use super::Dialect;
use crate::core::telemetry::{self, Namespace};
use crate::core::{
    DEFAULT_MAX_KEY_LEN, DEFAULT_MAX_LOCAL_HANDOFF_TIME, DEFAULT_MAX_LOCAL_HANDOFFS, Parts,
    Settings,
};
use crate::error::{BuildError, ConnectFailure};
use crate::key::validate_namespace;

/// The build error for a failed connection or call, naming the server and the kind of
/// failure: refused, unknown host, timed out, closed, TLS, wrong credentials.
pub(crate) fn connect_failure<D: Dialect>(
    e: sqlx::Error,
    options: &<D::Connection as sqlx::Connection>::Options,
) -> BuildError {
    let addr = D::addr(options);
    let failure = match &e {
        sqlx::Error::Database(_) if D::auth_refusal(&e) => {
            return BuildError::Auth {
                user: D::user(options).to_owned(),
                addr,
                source: Box::new(e),
            };
        }
        sqlx::Error::Tls(_) => {
            return BuildError::Tls {
                reason: "could not set up TLS",
                addr: Some(addr),
                certificate: None,
                source: Some(Box::new(e)),
            };
        }
        sqlx::Error::PoolTimedOut => ConnectFailure::TimedOut,
        sqlx::Error::Io(io) => match io.kind() {
            io::ErrorKind::ConnectionRefused => ConnectFailure::Refused,
            io::ErrorKind::TimedOut => ConnectFailure::TimedOut,
            io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::UnexpectedEof
            | io::ErrorKind::BrokenPipe => ConnectFailure::Closed,
            // getaddrinfo's failures come as uncategorized I/O errors.
            _ if io.to_string().contains("lookup") => ConnectFailure::UnknownHost,
            _ => ConnectFailure::Other,
        },
        _ => ConnectFailure::Other,
    };
    BuildError::Connect {
        addr,
        failure,
        source: Box::new(e),
    }
}

/// The settings both SQL builders take, as they are set; each builder documents them in
/// its own words.
#[derive(Debug, Clone)]
pub(crate) struct Config {
    pub(crate) table: String,
    pub(crate) migrate: bool,
    pub(crate) pool_size: u32,
    pub(crate) namespace: String,
    pub(crate) max_key_len: usize,
    pub(crate) connect_timeout: Duration,
    pub(crate) command_timeout: Duration,
    pub(crate) fence_ttl: Duration,
    /// How often the connection that waiters are woken through shows it is alive.
    pub(crate) ping_interval: Duration,
    pub(crate) max_backoff: Duration,
    pub(crate) max_local_handoffs: u32,
    pub(crate) max_local_handoff_time: Duration,
}

impl Config {
    /// The defaults, but for the store's own: `fence_ttl` and `ping_interval`.
    pub(crate) fn new(table: &str, fence_ttl: Duration, ping_interval: Duration) -> Self {
        Config {
            table: table.to_owned(),
            migrate: false,
            pool_size: 8,
            namespace: "tower-lock".to_owned(),
            max_key_len: DEFAULT_MAX_KEY_LEN,
            connect_timeout: Duration::from_secs(1),
            command_timeout: Duration::from_secs(1),
            fence_ttl,
            ping_interval,
            max_backoff: Duration::from_secs(2),
            max_local_handoffs: DEFAULT_MAX_LOCAL_HANDOFFS,
            max_local_handoff_time: DEFAULT_MAX_LOCAL_HANDOFF_TIME,
        }
    }

    /// Refuses the settings no store can run with, naming the first; `schema_sql` is the
    /// store's schema for a table name (which refuses a name it cannot use).
    pub(crate) fn validate(
        &self,
        schema_sql: fn(&str) -> Result<String, BuildError>,
    ) -> Result<(), BuildError> {
        validate_namespace(&self.namespace)?;
        schema_sql(&self.table)?;
        let refuse = |name, reason| Err(BuildError::Setting { name, reason });
        if self.command_timeout.is_zero() {
            return refuse("command_timeout", "it must be above zero");
        }
        if self.connect_timeout.is_zero() {
            return refuse("connect_timeout", "it must be above zero");
        }
        if self.max_key_len == 0 {
            return refuse("max_key_len", "it must be at least one byte");
        }
        if self.fence_ttl < Duration::from_secs(1) {
            return refuse("fence_ttl", "it must be at least one second");
        }
        Ok(())
    }

    /// What the core needs besides the store, and the metrics' namespace for the store's
    /// wake-ups.
    pub(crate) fn parts(&self) -> (Parts, Namespace) {
        let metrics = Namespace::new(&self.namespace);
        telemetry::describe_metrics();
        let parts = Parts::new(
            Settings {
                command_timeout: self.command_timeout,
                max_local_handoffs: self.max_local_handoffs,
                max_local_handoff_time: self.max_local_handoff_time,
                max_key_len: self.max_key_len,
            },
            metrics.clone(),
        );
        (parts, metrics)
    }

    /// Opens one connection of its own, which proves the server and the credentials with
    /// the cause when it cannot (a pool only says that it timed out), and closes it.
    pub(crate) async fn prove<D: Dialect>(
        &self,
        options: &<D::Connection as Connection>::Options,
    ) -> Result<(), BuildError> {
        match timeout(self.connect_timeout, D::Connection::connect_with(options)).await {
            Ok(Ok(conn)) => drop(conn.close().await),
            Ok(Err(e)) => return Err(connect_failure::<D>(e, options)),
            Err(_) => return Err(connect_failure::<D>(sqlx::Error::PoolTimedOut, options)),
        }
        Ok(())
    }
}

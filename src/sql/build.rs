//! What both SQL builders do alike: the settings only SQL stores take, `build` itself
//! (check the settings, connect, check the server and the schema or create it, start the
//! wake-up connection and the janitor, probe the user's rights), and how it reports a
//! connection or call that failed. What differs is each server's [`Server`].

use std::fmt;
use std::future::Future;
use std::io;
use std::sync::Arc;
use std::time::Duration;

use sqlx::Connection;
use tokio::time::{Instant, timeout};

use super::{Calls, Dialect, Refusal, SqlStore, admin_channel, janitor};
use crate::core::kit::settings::{StoreSettings, refuse_under_a_second};
use crate::core::{Core, Parts, Store};
use crate::error::{BuildError, ConnectFailure};

/// The build error for a failed connection or call, naming the server and the kind of
/// failure: refused, unknown host, timed out, closed, TLS, wrong credentials.
pub(crate) fn connect_failure<D: Dialect>(
    e: sqlx::Error,
    options: &<D::Connection as sqlx::Connection>::Options,
) -> BuildError {
    let addr = D::addr(options);
    let failure = match &e {
        sqlx::Error::Database(_) => match D::refusal(&e) {
            Some(Refusal::Credentials) => {
                return BuildError::Auth {
                    user: D::user(options).to_owned(),
                    addr,
                    source: Box::new(e),
                };
            }
            Some(Refusal::DatabaseDenied) => {
                // MySQL says the same of a database that does not exist, to a user without
                // rights on it.
                let right = format!(
                    "use the database `{}` (or it does not exist)",
                    D::database(options)
                );
                return rights::<D>(e, options, right);
            }
            Some(Refusal::UnknownDatabase) => ConnectFailure::UnknownDatabase {
                name: D::database(options).to_owned(),
            },
            Some(Refusal::Denied) | None => ConnectFailure::Other,
        },
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

/// The build error of a right the user lacks.
pub(crate) fn rights<D: Dialect>(
    e: sqlx::Error,
    options: &Options<D>,
    right: String,
) -> BuildError {
    BuildError::Rights {
        user: D::user(options).to_owned(),
        addr: D::addr(options),
        right,
        source: Box::new(e),
    }
}

/// The build error of a failed `migrate()`: a right to create the schema the user lacks,
/// named as such, or what the call's failure says.
fn migrate_failure<D: Server>(e: sqlx::Error, options: &Options<D>, table: &str) -> BuildError {
    match D::refusal(&e) {
        Some(Refusal::Denied | Refusal::DatabaseDenied) => {
            let right = format!(
                "create the lock table `{table}` and its {}s (what `migrate()` does: run the \
                 SQL of `{}::schema_sql` as a user who may, or grant CREATE)",
                D::ROUTINE,
                D::BACKEND,
            );
            rights::<D>(e, options, right)
        }
        _ => D::call_failure(e, options, table),
    }
}

/// Refuses a URL of another scheme than the server's (the driver's parser reads any URL
/// as its own: a MySQL URL would connect to a PostgreSQL server at its address), naming the
/// scheme found, never the URL (it may carry a password).
fn check_scheme<D: Dialect>(url: &str) -> Result<(), BuildError> {
    let scheme = url.split_once("://").map_or("", |(scheme, _)| scheme);
    if D::SCHEMES.iter().any(|s| s.eq_ignore_ascii_case(scheme)) {
        return Ok(());
    }
    let takes = D::SCHEMES
        .iter()
        .map(|s| format!("`{s}://`"))
        .collect::<Vec<_>>()
        .join(" or ");
    let found = match scheme {
        "" => "the URL has no scheme".to_owned(),
        _ => format!("the URL's scheme is `{scheme}`"),
    };
    Err(BuildError::Url {
        source: format!("{found}; a {} URL starts with {takes}", D::SERVER).into(),
    })
}

/// The options a server's connections are opened with.
pub(crate) type Options<D> = <<D as sqlx::Database>::Connection as Connection>::Options;

/// Where a SQL backend's connections come from, as the user gave it.
pub(crate) enum Target<D: sqlx::Database> {
    /// The database's URL: the backend opens a pool of its own.
    Url(String),
    /// The application's pool.
    Pool(sqlx::Pool<D>),
}

impl<D: sqlx::Database> Clone for Target<D> {
    fn clone(&self) -> Self {
        match self {
            Target::Url(url) => Target::Url(url.clone()),
            Target::Pool(pool) => Target::Pool(pool.clone()),
        }
    }
}

impl<D: sqlx::Database> fmt::Debug for Target<D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Target::Url(url) => f.debug_tuple("Url").field(url).finish(),
            Target::Pool(pool) => f.debug_tuple("Pool").field(pool).finish(),
        }
    }
}

/// The pool a SQL backend opens of its own, as `settings` size it. A connection is not
/// pinged before every use (that would double the round trips), only when it has been
/// idle since `stale` was last raised: the server may have dropped it meanwhile (a
/// restart), and the first requests after it would otherwise fail on dead connections.
pub(crate) fn pool_options<D: sqlx::Database>(
    settings: &StoreSettings,
    stale: &Staleness,
) -> sqlx::pool::PoolOptions<D> {
    let stale = stale.clone();
    sqlx::pool::PoolOptions::new()
        .max_connections(settings.pool_size)
        .acquire_timeout(settings.connect_timeout)
        .test_before_acquire(false)
        .before_acquire(move |conn: &mut D::Connection, meta| {
            let suspect = stale.suspects(meta.idle_for);
            Box::pin(async move {
                // A connection that fails its ping is closed, and another one taken.
                Ok(!suspect || conn.ping().await.is_ok())
            })
        })
}

/// When the server may last have dropped the pool's idle connections: the backend's
/// listening connection was lost or opened again (a restart, a network fault).
#[derive(Clone, Debug, Default)]
pub(crate) struct Staleness(Arc<std::sync::Mutex<Stale>>);

#[derive(Debug, Default)]
struct Stale {
    /// The listening connection was opened once: a later opening is a reopening.
    opened: bool,
    /// The last sign, if any.
    since: Option<Instant>,
}

impl Staleness {
    /// The server may have dropped every connection idle until now.
    pub(crate) fn raise(&self) {
        self.state().since = Some(Instant::now());
    }

    /// The listening connection was opened: the first time at build, whose connections
    /// are fresh; any later time after a loss, which may have dropped idle ones too.
    pub(crate) fn opened(&self) {
        let mut state = self.state();
        if std::mem::replace(&mut state.opened, true) {
            state.since = Some(Instant::now());
        }
    }

    /// Whether a connection idle for `idle_for` has been idle since the last sign.
    fn suspects(&self, idle_for: Duration) -> bool {
        let since = self.state().since;
        since.is_some_and(|at| idle_for >= at.elapsed())
    }

    fn state(&self) -> std::sync::MutexGuard<'_, Stale> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The settings a SQL builder starts with, besides its own ([`Config`]): a pool of 8
/// connections, timeouts of 1 s.
pub(crate) fn settings() -> StoreSettings {
    StoreSettings {
        pool_size: 8,
        ..StoreSettings::new(Duration::from_secs(1))
    }
}

/// The settings only the SQL stores take, as they are set; each builder documents them in
/// its own words.
#[derive(Debug, Clone)]
pub(crate) struct Config {
    pub(crate) table: String,
    pub(crate) migrate: bool,
    pub(crate) fence_ttl: Duration,
    /// How often the connection that waiters are woken through shows it is alive.
    pub(crate) ping_interval: Duration,
}

impl Config {
    /// The defaults, but for the store's own: its table, `fence_ttl` and `ping_interval`.
    pub(crate) fn new(table: &str, fence_ttl: Duration, ping_interval: Duration) -> Self {
        Config {
            table: table.to_owned(),
            migrate: false,
            fence_ttl,
            ping_interval,
        }
    }
}

/// What `build` does on one server that the other does not: the schema, the command pool,
/// the checks of the server and of the user's rights, and the connection waiters are woken
/// through. Implemented for sqlx's database types in each store's `builder.rs`.
pub(crate) trait Server: Calls {
    /// The SQL that creates or upgrades the schema of the lock table `table`; refuses a
    /// name the server cannot take.
    fn schema_sql(table: &str) -> Result<String, BuildError>;

    /// Refuses what this server cannot take of the SQL settings, besides what every SQL
    /// store refuses.
    fn validate(config: &Config) -> Result<(), BuildError>;

    /// The command pool for the database at `url`, connecting lazily, and the options its
    /// connections are opened with.
    fn pool(
        url: &str,
        settings: &StoreSettings,
        stale: &Staleness,
    ) -> Result<(sqlx::Pool<Self>, Options<Self>), BuildError>;

    /// Refuses a server that takes no writes: every acquisition would fail.
    fn refuse_read_only(
        pool: &sqlx::Pool<Self>,
        options: &Options<Self>,
    ) -> impl Future<Output = Result<(), BuildError>>;

    /// Creates or upgrades the schema of `table`: idempotent, and safe when several
    /// instances build at once.
    fn migrate(
        pool: &sqlx::Pool<Self>,
        table: &str,
    ) -> impl Future<Output = Result<(), sqlx::Error>>;

    /// Refuses a database without the schema of `table`, or with another version of it;
    /// `Err(Err(e))` when the check itself failed.
    fn check(
        pool: &sqlx::Pool<Self>,
        table: &str,
    ) -> impl Future<Output = Result<(), Result<BuildError, sqlx::Error>>>;

    /// The build error for a failed call to the schema of `table`.
    fn call_failure(e: sqlx::Error, options: &Options<Self>, table: &str) -> BuildError;

    /// Starts the connection the backend's waiters are woken through, given the command
    /// pool and the options of its connections (and what the connection raises when it is
    /// lost or opened again), and the settings.
    fn wake(
        connections: (&sqlx::Pool<Self>, &Options<Self>, &Staleness),
        settings: (&StoreSettings, &Config),
        parts: &Parts,
    ) -> Self::Wake;

    /// Refuses a user without the rights the store's calls need: a probe acquisition and
    /// release, which leave nothing behind, must pass.
    fn probe(
        store: &SqlStore<Self>,
        options: &Options<Self>,
    ) -> impl Future<Output = Result<(), BuildError>>;
}

/// The core of a backend on the server `D` (see each builder's `build` for what is
/// refused): checks the settings, connects (one connection of its own first, which proves
/// the server and the credentials), refuses a read-only server, checks the schema or
/// creates it with `migrate`, starts the wake-up connection and the janitor, and probes the
/// user's rights.
pub(crate) async fn build<D: Server>(
    target: Target<D>,
    settings: StoreSettings,
    config: Config,
) -> Result<Arc<Core<SqlStore<D>>>, BuildError>
where
    SqlStore<D>: Store,
{
    settings.validate()?;
    D::schema_sql(&config.table)?;
    refuse_under_a_second("fence_ttl", config.fence_ttl)?;
    D::validate(&config)?;
    // A pool given by the application is its own: its idle connections are not checked.
    let stale = Staleness::default();
    let (pool, options) = match target {
        Target::Url(url) => {
            check_scheme::<D>(&url)?;
            D::pool(&url, &settings, &stale)?
        }
        Target::Pool(pool) => {
            let options = (*pool.connect_options()).clone();
            (pool, options)
        }
    };
    prove::<D>(&options, settings.connect_timeout).await?;
    D::refuse_read_only(&pool, &options).await?;
    let failure = |e| D::call_failure(e, &options, &config.table);
    if config.migrate {
        D::migrate(&pool, &config.table)
            .await
            .map_err(|e| migrate_failure::<D>(e, &options, &config.table))?;
    } else {
        D::check(&pool, &config.table)
            .await
            .map_err(|e| e.unwrap_or_else(failure))?;
    }
    let parts = settings.parts();
    let wake = D::wake((&pool, &options, &stale), (&settings, &config), &parts);
    let sql = D::statements(&config.table);
    let janitor = janitor::spawn(
        pool.clone(),
        sql.sweep.clone(),
        config.fence_ttl,
        parts.shutdown.clone(),
        &parts.runtime,
    );
    let store = SqlStore {
        pool,
        sql,
        wake,
        janitor,
        instance: parts.owners.instance().to_owned(),
        admin_channel: admin_channel(&settings.namespace),
        namespace: settings.namespace,
        table: config.table,
        max_key_len: settings.max_key_len,
    };
    D::probe(&store, &options).await?;
    Ok(Core::new(store, parts))
}

/// Opens one connection of its own, which proves the server and the credentials with the
/// cause when it cannot (a pool only says that it timed out), and closes it.
async fn prove<D: Dialect>(
    options: &Options<D>,
    connect_timeout: Duration,
) -> Result<(), BuildError> {
    match timeout(connect_timeout, D::Connection::connect_with(options)).await {
        Ok(Ok(conn)) => drop(conn.close().await),
        Ok(Err(e)) => return Err(connect_failure::<D>(e, options)),
        Err(_) => return Err(connect_failure::<D>(sqlx::Error::PoolTimedOut, options)),
    }
    Ok(())
}

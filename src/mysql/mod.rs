//! The MySQL/MariaDB backend: a table of holds driven by the crate's stored procedures,
//! waiters woken through one parked connection per backend.
//!
//! The type and its design are documented on [`MySqlBackend`].

mod builder;
mod checks;
mod error;
mod schema;
mod store;
mod wake;

use std::fmt;
use std::sync::Arc;

pub use self::builder::MySqlBackendBuilder;
use self::store::MySqlStore;
use crate::backend::{Backend, BackendStats, LockBackend, Sealed};
use crate::core::Core;
use crate::error::BuildError;
use crate::idempotency::{IdempotencyBackend, Records, RecordsOf};
use crate::sql::SqlRecords;

/// Distributed locks in MySQL 8 or MariaDB 10.6+ (feature `mysql`). Cheap to clone;
/// clones share connections.
///
/// The same locks as [`RedisBackend`](crate::RedisBackend), for services that run MySQL
/// or MariaDB and nothing else: the layer, [`LockRequest`], [`HeldLock`](crate::HeldLock),
/// read/write locks, semaphores, multi-key locks, fencing tokens and the errors are the
/// same; switching is one line.
///
/// ```no_run
/// use tower_lock::MySqlBackend;
///
/// # async fn run() -> Result<(), tower_lock::BuildError> {
/// let backend = MySqlBackend::builder("mysql://app:secret@db.internal/app")
///     .migrate() // create or upgrade the lock tables at build
///     .build()
///     .await?;
/// let guard = backend.lock("order:42").try_once().await;
/// # drop(guard);
/// # Ok(())
/// # }
/// ```
///
/// A lock is a row of the InnoDB table `tower_lock` (name configurable): its name
/// (`namespace:{key}`, the primary key), the holder and its re-entry count, the lease's
/// end on the server's clock (`UTC_TIMESTAMP(6)`), and the fencing counter; shared
/// holders and semaphore permits are rows of `tower_lock_holders`, each with its own
/// lease. Every operation is one statement or one `CALL` of one of the crate's stored
/// procedures (see `src/mysql/schema.sql`), which runs one short transaction that locks
/// the name's row: no
/// transaction stays open while a lock is held, so a held lock never pins a pooled
/// connection, unlike `GET_LOCK`, which is bound to its session.
///
/// Waiting polls nothing. Each backend keeps one wake connection parked (waiting for a
/// named lock that a second connection of the backend holds) and
/// registered in `tower_lock_waiters` for the keys its tasks wait for; a release that
/// frees such a key marks the rows woken and cuts the parked statements short with
/// `KILL QUERY`. Every instance must therefore connect as the same MySQL user (or one
/// with `CONNECTION ADMIN`/`SUPER`); `build` checks it may interrupt its own connections.
/// When the wake connection drops, the backend reconnects, registers again and wakes
/// every waiter. A watchdog renews held leases in one call per batch, and a janitor
/// deletes the rows of names unused for [`fence_ttl`](MySqlBackendBuilder::fence_ttl), and
/// expired idempotency records (see [`IdempotencyBackend`]).
///
/// Tokens are `BIGINT`s, strictly increasing per name: above the name's counter and never
/// below the server clock in microseconds, so they survive the row's deletion.
///
/// [`LockRequest`]: crate::LockRequest
#[derive(Clone)]
pub struct MySqlBackend {
    inner: Arc<Core<MySqlStore>>,
}

impl MySqlBackend {
    /// Connects with default settings (the schema must be there: see
    /// [`migrate`](MySqlBackendBuilder::migrate)).
    pub async fn connect(url: &str) -> Result<Self, BuildError> {
        Self::builder(url).build().await
    }

    /// Starts configuring a backend for the database at `url`
    /// (`mysql://user:password@host:port/database?ssl-mode=...`).
    pub fn builder(url: impl Into<String>) -> MySqlBackendBuilder {
        MySqlBackendBuilder::new(url.into())
    }

    /// Starts configuring a backend on the application's own pool. Calls take its
    /// connections one `CALL` at a time; the wake connection is opened apart with the
    /// pool's connect options, so it does not take one of the pool's for good.
    pub fn from_pool(pool: sqlx::MySqlPool) -> MySqlBackendBuilder {
        MySqlBackendBuilder::from_pool(pool)
    }

    /// The SQL that creates (or upgrades) the lock table `table`, its other tables and
    /// procedures, as the `mysql`/`mariadb` client runs it: what
    /// [`migrate`](MySqlBackendBuilder::migrate) runs, to run by hand or put in a migration
    /// tool instead. For the default table it is `src/mysql/schema.sql`.
    pub fn schema_sql(table: &str) -> Result<String, BuildError> {
        schema::sql(table)
    }

    crate::core::lock_backend_methods! {
        /// A snapshot of `key`'s lock: how it is held, for how long, and the fencing token
        /// reached (see [`LockBackend::inspect`]). One call; changes nothing.
        fn inspect;
        /// Frees `key`'s lock whatever holds it, fenced; the holder sees `lost()` within a
        /// round trip or two through the namespace's admin channel, which every backend's wake
        /// connection is registered on, at the latest at its next renewal (see
        /// [`LockBackend::force_release`]). Returns what was freed.
        fn force_release;
    }

    /// A snapshot of the backend's wake connection and bookkeeping.
    pub fn stats(&self) -> BackendStats {
        self.inner.stats(self.inner.store.wake.wakeups())
    }

    /// The namespace that prefixes every lock name of this backend.
    pub fn namespace(&self) -> &str {
        &self.inner.store.namespace
    }

    /// The lock table's name.
    pub fn table(&self) -> &str {
        &self.inner.store.table
    }
}

impl fmt::Debug for MySqlBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MySqlBackend")
            .field("table", &self.inner.store.table)
            .field("namespace", &self.inner.store.namespace)
            .field("instance", &self.inner.owners.instance())
            .finish_non_exhaustive()
    }
}

impl Sealed for MySqlBackend {
    fn store(&self) -> Arc<dyn Backend> {
        self.inner.clone()
    }
}

impl LockBackend for MySqlBackend {}

impl RecordsOf for MySqlBackend {
    fn records(&self) -> Arc<dyn Records> {
        SqlRecords::new(
            self.inner.store.clone(),
            self.inner.settings.command_timeout,
        )
    }
}

impl IdempotencyBackend for MySqlBackend {}

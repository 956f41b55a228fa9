//! The PostgreSQL backend: a table of holds driven by the crate's SQL functions, waiters
//! woken by `LISTEN`/`NOTIFY`.
//!
//! The type and its design are documented on [`PostgresBackend`].

mod builder;
mod checks;
mod error;
mod listen;
mod schema;
mod store;

use std::fmt;
use std::sync::Arc;

pub use self::builder::PostgresBackendBuilder;
use self::store::PgStore;
use crate::backend::{Backend, BackendStats, LockBackend, Sealed};
use crate::core::Core;
use crate::error::BuildError;
use crate::idempotency::{IdempotencyBackend, Records, RecordsOf};
use crate::sql::SqlRecords;

/// Distributed locks in PostgreSQL (feature `postgres`). Cheap to clone; clones share
/// connections.
///
/// The same locks as [`RedisBackend`](crate::RedisBackend), for services that run
/// PostgreSQL and no Redis: the layer, [`LockRequest`], [`HeldLock`](crate::HeldLock),
/// read/write locks, semaphores, multi-key locks, fencing tokens and the errors are the
/// same; switching is one line.
///
/// ```no_run
/// use tower_lock::PostgresBackend;
///
/// # async fn run() -> Result<(), tower_lock::BuildError> {
/// let backend = PostgresBackend::builder("postgres://app@db.internal/app")
///     .migrate() // create or upgrade the lock table at build
///     .build()
///     .await?;
/// let guard = backend.lock("order:42").try_once().await;
/// # drop(guard);
/// # Ok(())
/// # }
/// ```
///
/// A lock is a row of the table `tower_lock` (name configurable): its name
/// (`namespace:{key}`), the holder and its re-entry count, the lease's end on the
/// server's clock, and the fencing counter; shared holders and semaphore permits are rows
/// of `tower_lock_holders`, each with its own lease. Every operation is one statement
/// calling one of the crate's SQL functions (see `src/postgres/schema.sql`), which locks
/// the name's row for that statement only: no transaction stays open while a lock is
/// held, so a held lock never pins a pooled connection, and poolers in transaction mode
/// (PgBouncer) work, unlike session advisory locks.
///
/// Waiters `LISTEN` on one dedicated connection per backend, every key multiplexed on it;
/// a release sends `NOTIFY` in its statement, delivered when it commits. When that
/// connection drops, the backend reconnects, listens again and wakes every waiter. A
/// watchdog renews held leases in one statement per batch, and a janitor deletes the rows
/// of names unused for [`fence_ttl`](PostgresBackendBuilder::fence_ttl), and expired
/// idempotency records (see [`IdempotencyBackend`]).
///
/// Tokens are `bigint`s, strictly increasing per name: above the name's counter and never
/// below the server clock in microseconds, so they survive the row's deletion.
///
/// [`LockRequest`]: crate::LockRequest
#[derive(Clone)]
pub struct PostgresBackend {
    inner: Arc<Core<PgStore>>,
}

impl PostgresBackend {
    /// Connects with default settings (the schema must be there: see
    /// [`migrate`](PostgresBackendBuilder::migrate)).
    pub async fn connect(url: &str) -> Result<Self, BuildError> {
        Self::builder(url).build().await
    }

    /// Starts configuring a backend for the database at `url`
    /// (`postgres://user:password@host:port/database?sslmode=...`).
    pub fn builder(url: impl Into<String>) -> PostgresBackendBuilder {
        PostgresBackendBuilder::new(url.into())
    }

    /// Starts configuring a backend on the application's own pool. Calls take its
    /// connections one statement at a time; the listening connection is opened apart with
    /// the pool's connect options, so it does not take one of the pool's for good.
    pub fn from_pool(pool: sqlx::PgPool) -> PostgresBackendBuilder {
        PostgresBackendBuilder::from_pool(pool)
    }

    /// The SQL that creates (or upgrades) the lock table `table` and its functions: what
    /// [`migrate`](PostgresBackendBuilder::migrate) runs, to run by hand or put in a
    /// migration tool instead. For the default table it is `src/postgres/schema.sql`.
    pub fn schema_sql(table: &str) -> Result<String, BuildError> {
        schema::sql(table)
    }

    crate::core::lock_backend_methods! {
        /// A snapshot of `key`'s lock: how it is held, for how long, and the fencing token
        /// reached (see [`LockBackend::inspect`]). One statement; changes nothing.
        fn inspect;
        /// Frees `key`'s lock whatever holds it, fenced; the holder sees `lost()` within a
        /// round trip or two through the namespace's admin channel, which every backend
        /// listens to, at the latest at its next renewal (see
        /// [`LockBackend::force_release`]). Returns what was freed.
        fn force_release;
    }

    /// A snapshot of the backend's listening connection and bookkeeping.
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

impl fmt::Debug for PostgresBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PostgresBackend")
            .field("table", &self.inner.store.table)
            .field("namespace", &self.inner.store.namespace)
            .field("instance", &self.inner.owners.instance())
            .finish_non_exhaustive()
    }
}

impl Sealed for PostgresBackend {
    fn store(&self) -> Arc<dyn Backend> {
        self.inner.clone()
    }
}

impl LockBackend for PostgresBackend {}

impl RecordsOf for PostgresBackend {
    fn records(&self) -> Arc<dyn Records> {
        SqlRecords::new(
            self.inner.store.clone(),
            self.inner.settings.command_timeout,
        )
    }
}

impl IdempotencyBackend for PostgresBackend {}

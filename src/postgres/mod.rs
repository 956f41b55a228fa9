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

use std::sync::Arc;

pub use self::builder::PostgresBackendBuilder;
use self::store::PgStore;
use crate::core::Core;

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
/// [`IdempotencyBackend`]: crate::idempotency::IdempotencyBackend
#[derive(Clone)]
pub struct PostgresBackend {
    inner: Arc<Core<PgStore>>,
}

crate::sql::sql_backend! {
    PostgresBackend, PostgresBackendBuilder, sqlx::PgPool,
    url: "postgres://user:password@host:port/database?sslmode=...",
    schema: schema::sql, "src/postgres/schema.sql", "`psql`",
    routines: "functions",
    table_in: "a schema of the connection's `search_path`",
    fence_ttl: "10 minutes",
    call: "statement",
    wake: "listening connection",
    command: "The server cancels a statement that runs past twice this long \
              (`statement_timeout`), so none outlives its caller by much.",
}

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

use std::sync::Arc;

pub use self::builder::MySqlBackendBuilder;
use self::store::MySqlStore;
use crate::core::Core;

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
/// [`IdempotencyBackend`]: crate::idempotency::IdempotencyBackend
#[derive(Clone)]
pub struct MySqlBackend {
    inner: Arc<Core<MySqlStore>>,
}

crate::sql::sql_backend! {
    MySqlBackend, MySqlBackendBuilder, sqlx::MySqlPool,
    url: "mysql://user:password@host:port/database?ssl-mode=...",
    schema: schema::sql, "src/mysql/schema.sql", "the `mysql`/`mariadb` client",
    routines: "procedures",
    table_in: "the URL's database",
    fence_ttl: "1 hour",
    call: "`CALL`",
    wake: "wake connection",
    command: "The command pool's sessions wait for a row lock at most this long, rounded up \
              to whole seconds (`innodb_lock_wait_timeout`); a call that timed out so is sent \
              again.",
}

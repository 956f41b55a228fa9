//! What `build()` checks of the server before the backend relies on it, and the errors
//! that name what is wrong.

use sqlx::MySql;
use sqlx::mysql::{MySqlConnectOptions, MySqlPool};

use super::error::MySqlError;
use super::error::number;
use super::store::{MySqlStore, reply, retried};
use super::wake::may_kill;
use crate::error::BuildError;
use crate::key::namespaced;
use crate::sql::{self, Dialect};

/// Refuses a server that takes no writes from most users: a replica (`read_only`, which
/// replicas set) would fail every acquisition.
pub(super) async fn refuse_read_only(
    pool: &MySqlPool,
    options: &MySqlConnectOptions,
) -> Result<(), BuildError> {
    let read_only = sqlx::query_scalar::<_, i64>("SELECT @@GLOBAL.read_only")
        .fetch_one(pool)
        .await
        .map_err(|e| connect_failure(e, options))?;
    if read_only != 0 {
        return Err(BuildError::ReadOnly {
            reason: "read_only is on (a replica?): give the primary's URL",
        });
    }
    Ok(())
}

/// Takes a lock on a probe name, stores an idempotency record under it and gives it back,
/// so that a user without the rights the procedures need is refused now rather than on
/// every request, then deletes its rows; and
/// checks that the user may interrupt its own connections (`KILL QUERY`), which every
/// release that wakes a waiter does.
pub(super) async fn probe(
    store: &MySqlStore,
    options: &MySqlConnectOptions,
) -> Result<(), BuildError> {
    let probe = format!("tower-lock-build-probe-{}", uuid::Uuid::new_v4().simple());
    let name = namespaced(&store.namespace, &probe);
    let table = &store.table;
    let refused = |e: sqlx::Error| call_failure(e, options, table);
    let acquire = || {
        sqlx::query_scalar(&store.sql.acquire)
            .bind(&name)
            .bind("probe")
            .bind(1000)
            .bind(0)
            .bind(0)
            .bind(false)
            .bind("")
    };
    let release = || {
        sqlx::query_scalar(&store.sql.release)
            .bind(&name)
            .bind("probe")
            .bind("probe#0")
            .bind(1000)
            .bind("tl_probe")
            .bind(None::<i64>)
            .bind(false)
            .bind(None::<&str>)
            .bind(0)
            .bind(false)
            .bind(None::<i64>)
            .bind(0)
            .bind("")
    };
    let failed = |e: MySqlError| match e.into_sqlx() {
        Ok(e) => refused(e),
        Err(unexpected) => connect_failure(sqlx::Error::Protocol(unexpected.to_string()), options),
    };
    let record = || {
        sqlx::query_scalar(&store.sql.record_store)
            .bind(&name)
            .bind(i64::MAX)
            .bind(1)
            .bind(Vec::<u8>::new())
    };
    for call in [&acquire as &dyn Fn() -> _, &record, &release] {
        reply(&store.pool, call).await.map_err(failed)?;
    }
    for rows in [table.clone(), format!("{table}_records")] {
        // The janitor's first sweep runs meanwhile, and may make a deadlock's victim of
        // this.
        let delete = format!("DELETE FROM {rows} WHERE name = ?");
        retried(|| sqlx::query(&delete).bind(&name).execute(&store.pool))
            .await
            .map_err(failed)?;
    }
    let killed = may_kill(&store.pool, options)
        .await
        .map_err(|e| connect_failure(e, options))?;
    killed.map_err(|e| BuildError::Rights {
        user: options.get_username().to_owned(),
        addr: MySql::addr(options),
        right: "interrupt its own connections with KILL QUERY (a release wakes waiters so; \
                every instance must use one user, or have CONNECTION ADMIN)"
            .to_owned(),
        source: Box::new(e),
    })
}

/// The build error for a failed call to the lock tables or procedures: a user without the
/// rights to use them, a server that refuses writes, or a failed connection.
pub(super) fn call_failure(
    e: sqlx::Error,
    options: &MySqlConnectOptions,
    table: &str,
) -> BuildError {
    match number(&e) {
        // Access denied to a routine; MySQL answers a missing routine with this too, to a
        // user who may not execute it.
        Some(1370) => {
            let right = format!(
                "execute the procedures of the lock table `{table}` (or they are not in this \
                 database: see `MySqlBackend::schema_sql` and `migrate()`)"
            );
            sql::rights::<MySql>(e, options, right)
        }
        // Access denied to a table or a column.
        Some(1142 | 1143) => {
            let right = format!("use the lock table `{table}` and its procedures");
            sql::rights::<MySql>(e, options, right)
        }
        // The server runs with read_only (or is in read-only mode).
        Some(1290 | 1836 | 1792) => BuildError::ReadOnly {
            reason: "the server refuses writes (read_only is on: a replica?)",
        },
        _ => connect_failure(e, options),
    }
}

/// The build error for a failed connection or call (see [`sql::connect_failure`]).
pub(super) fn connect_failure(e: sqlx::Error, options: &MySqlConnectOptions) -> BuildError {
    sql::connect_failure::<MySql>(e, options)
}

//! What `build()` checks of the server before the backend relies on it, and the errors
//! that name what is wrong.

use sqlx::Postgres;
use sqlx::postgres::{PgConnectOptions, PgPool};

use super::store::PgStore;
use crate::error::BuildError;
use crate::key::namespaced;
use crate::sql;

/// Refuses a server that takes no writes: every acquisition would fail.
pub(super) async fn refuse_read_only(
    pool: &PgPool,
    options: &PgConnectOptions,
) -> Result<(), BuildError> {
    let (recovery, read_only) = sqlx::query_as::<_, (bool, String)>(
        "SELECT pg_is_in_recovery(), current_setting('transaction_read_only')",
    )
    .fetch_one(pool)
    .await
    .map_err(|e| connect_failure(e, options))?;
    if recovery {
        return Err(BuildError::ReadOnly {
            reason: "the server is a replica (in recovery): give the primary's URL",
        });
    }
    if read_only == "on" {
        return Err(BuildError::ReadOnly {
            reason: "the session is read-only (default_transaction_read_only is on for this \
                     user or database)",
        });
    }
    Ok(())
}

/// Takes a lock on a probe name, stores an idempotency record under it and gives it back,
/// so that a user without the rights the functions need is refused now rather than on
/// every request; deletes its rows after.
pub(super) async fn probe(store: &PgStore, options: &PgConnectOptions) -> Result<(), BuildError> {
    let probe = format!("tower-lock-build-probe-{}", uuid::Uuid::new_v4().simple());
    let name = namespaced(&store.namespace, &probe);
    let table = &store.table;
    let statements = [
        format!("SELECT {table}_acquire($1, 'probe', 1000, 0, 0, false, '')"),
        format!("SELECT {table}_record_store($1, {}, 1, '')", i64::MAX),
        format!(
            "SELECT {table}_release($1, 'probe', 'probe#0', 1000, 'tl_probe', NULL, false, \
             NULL, 0, false, NULL, 0, '')"
        ),
        format!("DELETE FROM {table} WHERE name = $1"),
        format!("DELETE FROM {table}_records WHERE name = $1"),
    ];
    for statement in &statements {
        sqlx::query(statement)
            .bind(&name)
            .execute(&store.pool)
            .await
            .map_err(|e| {
                let denied = match &e {
                    sqlx::Error::Database(db) if db.code().as_deref() == Some("42501") => Some(
                        format!("use the lock table `{table}` and its functions ({db})"),
                    ),
                    _ => None,
                };
                match denied {
                    Some(right) => sql::rights::<Postgres>(e, options, right),
                    None => connect_failure(e, options),
                }
            })?;
    }
    Ok(())
}

/// The build error for a failed connection or call (see [`sql::connect_failure`]).
pub(super) fn connect_failure(e: sqlx::Error, options: &PgConnectOptions) -> BuildError {
    sql::connect_failure::<Postgres>(e, options)
}

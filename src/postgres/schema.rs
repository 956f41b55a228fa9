//! The lock table and its functions: the shipped SQL (`schema.sql`), `migrate()`, and the
//! check at build that the database has them, in this version.

use sqlx::postgres::PgPool;

use crate::error::BuildError;

/// The version `schema.sql` creates (its `tower_lock_schema_version()`).
pub(crate) const SCHEMA_VERSION: i32 = 2;

/// The default table name, as `schema.sql` spells it.
pub(crate) const DEFAULT_TABLE: &str = "tower_lock";

/// Every function name is the table's name and a suffix of at most 15 bytes, and
/// PostgreSQL truncates identifiers past 63.
const MAX_TABLE_LEN: usize = 48;

/// The schema's SQL for the lock table `table` (the shipped file with its default name
/// replaced).
pub(crate) fn sql(table: &str) -> Result<String, BuildError> {
    validate_table(table)?;
    Ok(include_str!("schema.sql").replace(DEFAULT_TABLE, table))
}

/// A table name the SQL can be made for: a plain lower-case identifier, so that it needs no
/// quoting and cannot change the statements it is put into.
fn validate_table(table: &str) -> Result<(), BuildError> {
    let mut chars = table.chars();
    let plain = chars
        .next()
        .is_some_and(|c| c.is_ascii_lowercase() || c == '_')
        && chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
    if !plain || table.len() > MAX_TABLE_LEN {
        return Err(BuildError::Setting {
            name: "table",
            reason: "it must be a lower-case identifier (a-z, 0-9, _; not starting with a \
                     digit) of at most 48 bytes",
        });
    }
    Ok(())
}

/// Creates the table and functions, or upgrades them: idempotent, and serialized across
/// instances that build at once (an advisory lock, in one transaction).
pub(crate) async fn migrate(pool: &PgPool, table: &str) -> Result<(), sqlx::Error> {
    // Validated by the builder before it connects.
    let sql = sql(table).unwrap_or_default();
    let mut tx = pool.begin().await?;
    sqlx::raw_sql(&sql).execute(&mut *tx).await?;
    tx.commit().await
}

/// Refuses a database without the table's functions, or with another version of them;
/// `Err(Err(e))` when the check itself failed.
pub(crate) async fn check(
    pool: &PgPool,
    table: &str,
) -> Result<(), Result<BuildError, sqlx::Error>> {
    let version = sqlx::query_scalar::<_, i32>(&format!("SELECT {table}_schema_version()"))
        .fetch_one(pool)
        .await;
    let found = match version {
        Ok(version) if version == SCHEMA_VERSION => return Ok(()),
        Ok(version) => Some(version),
        // undefined_function: no schema at all.
        Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("42883") => None,
        Err(e) => return Err(Err(e)),
    };
    Err(Ok(BuildError::Schema {
        backend: "PostgresBackend",
        file: "src/postgres/schema.sql",
        table: table.to_owned(),
        routines: "functions",
        found,
        expected: SCHEMA_VERSION,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_plain_table_names_are_accepted() {
        assert!(sql("locks_2").is_ok_and(|s| s.contains("CREATE TABLE IF NOT EXISTS locks_2 (")));
        for bad in ["", "Locks", "2locks", "locks;drop", "a-b", &"a".repeat(49)] {
            assert!(sql(bad).is_err(), "{bad:?}");
        }
    }
}

//! The lock tables and their procedures: the shipped SQL (`schema.sql`), `migrate()`, and
//! the check at build that the database has them, in this version.

use sqlx::mysql::MySqlPool;
use sqlx::{Acquire, Executor};

use crate::error::BuildError;

/// The version `schema.sql` creates (its `tower_lock_schema_version()`).
pub(crate) const SCHEMA_VERSION: i32 = 2;

/// The default table name, as `schema.sql` spells it.
pub(crate) const DEFAULT_TABLE: &str = "tower_lock";

/// Every procedure, table and index name is the table's name and a suffix of at most 16
/// bytes, and MySQL identifiers are at most 64.
const MAX_TABLE_LEN: usize = 48;

/// The server error numbers of a missing procedure and a missing table.
const NO_PROCEDURE: u16 = 1305;
const NO_TABLE: u16 = 1146;

/// The schema's SQL for the lock table `table` (the shipped file with its default name
/// replaced), as the `mariadb`/`mysql` client runs it (with `DELIMITER` lines).
pub(crate) fn sql(table: &str) -> Result<String, BuildError> {
    validate_table(table)?;
    Ok(include_str!("schema.sql").replace(DEFAULT_TABLE, table))
}

/// The statements of `sql`, one by one as the server takes them: the client's `DELIMITER`
/// lines say where a procedure's body ends.
fn statements(sql: &str) -> Vec<String> {
    let mut delimiter = ";".to_owned();
    let (mut statements, mut current) = (Vec::new(), String::new());
    for line in sql.lines() {
        if let Some(new) = line.trim().strip_prefix("DELIMITER ") {
            delimiter = new.trim().to_owned();
            continue;
        }
        if current.is_empty() && (line.trim().is_empty() || line.trim_start().starts_with("--")) {
            continue;
        }
        match line.trim_end().strip_suffix(delimiter.as_str()) {
            Some(end) => {
                current.push_str(end);
                statements.push(std::mem::take(&mut current));
            }
            None => {
                current.push_str(line);
                current.push('\n');
            }
        }
    }
    statements
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

/// Creates the tables and procedures, or upgrades them, when the database does not have
/// this version: serialized across instances that build at once by a named lock
/// (`GET_LOCK`), on one connection.
pub(crate) async fn migrate(pool: &MySqlPool, table: &str) -> Result<(), sqlx::Error> {
    if matches!(version(pool, table).await, Ok(Some(SCHEMA_VERSION))) {
        return Ok(());
    }
    // Validated by the builder before it connects.
    let sql = sql(table).unwrap_or_default();
    let mut pooled = pool.acquire().await?;
    let conn = pooled.acquire().await?;
    let lock = format!("{table} schema");
    sqlx::query("SELECT GET_LOCK(?, 30)")
        .bind(&lock)
        .execute(&mut *conn)
        .await?;
    let mut done = Ok(());
    // Another instance may have migrated while this one waited for the named lock.
    if !matches!(version(&mut *conn, table).await, Ok(Some(SCHEMA_VERSION))) {
        for statement in statements(&sql) {
            if let Err(e) = run_ddl(conn, &statement).await {
                done = Err(e);
                break;
            }
        }
    }
    sqlx::query("SELECT RELEASE_LOCK(?)")
        .bind(&lock)
        .execute(&mut *conn)
        .await?;
    done
}

/// How often one migration statement is tried when InnoDB picks it as a deadlock victim.
const DDL_TRIES: usize = 5;

/// Runs one statement of the shipped SQL, again when InnoDB rolled it back as a deadlock
/// victim or after a lock-wait timeout: DDL takes row locks in the data dictionary and the
/// persistent statistics tables, so a `CREATE TABLE` can lose to the DDL or statistics
/// update of another database on the same server ("try restarting transaction"). Every
/// statement is idempotent (`IF NOT EXISTS`, a `DROP` before each `CREATE PROCEDURE`).
async fn run_ddl(conn: &mut sqlx::MySqlConnection, statement: &str) -> Result<(), sqlx::Error> {
    let mut tries = 1;
    loop {
        // CREATE PROCEDURE is not a statement the server prepares: sent as text.
        match conn.execute(sqlx::raw_sql(statement)).await {
            Ok(_) => return Ok(()),
            Err(e)
                if tries < DDL_TRIES
                    && matches!(
                        super::error::number(&e),
                        Some(super::error::DEADLOCK | super::error::LOCK_WAIT_TIMEOUT)
                    ) =>
            {
                tracing::debug!(error = %e, tries, "a migration statement is tried again");
                tries += 1;
            }
            Err(e) => return Err(e),
        }
    }
}

/// The database's schema version; `None` without the procedures or tables.
async fn version<'c, E>(executor: E, table: &str) -> Result<Option<i32>, sqlx::Error>
where
    E: Executor<'c, Database = sqlx::MySql>,
{
    let call = format!("CALL {table}_schema_version()");
    match sqlx::query_scalar::<_, i64>(&call)
        .fetch_all(executor)
        .await
    {
        Ok(version) => Ok(version
            .first()
            .map(|v| i32::try_from(*v).unwrap_or(i32::MAX))),
        Err(e) if matches!(super::error::number(&e), Some(NO_PROCEDURE | NO_TABLE)) => Ok(None),
        Err(e) => Err(e),
    }
}

/// Refuses a database without the tables and procedures, or with another version of them;
/// `Err(Err(e))` when the check itself failed.
pub(crate) async fn check(
    pool: &MySqlPool,
    table: &str,
) -> Result<(), Result<BuildError, sqlx::Error>> {
    let found = match version(pool, table).await {
        Ok(Some(version)) if version == SCHEMA_VERSION => return Ok(()),
        Ok(found) => found,
        Err(e) => return Err(Err(e)),
    };
    Err(Ok(BuildError::Schema {
        backend: "MySqlBackend",
        file: "src/mysql/schema.sql",
        table: table.to_owned(),
        routines: "procedures",
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

    #[test]
    fn the_file_splits_into_whole_statements() {
        let all = statements(&sql(DEFAULT_TABLE).unwrap());
        let procedures = all
            .iter()
            .filter(|s| s.starts_with("CREATE PROCEDURE"))
            .count();
        assert_eq!(procedures, 16);
        assert!(
            all.iter()
                .all(|s| !s.contains("DELIMITER") && !s.trim().is_empty())
        );
        assert!(
            all.iter()
                .any(|s| s.starts_with("CREATE PROCEDURE tower_lock_release(")
                    && s.trim_end().ends_with("END"))
        );
    }

    #[test]
    fn the_version_is_created_last() {
        // An instance that builds while another migrates skips migrating once the version
        // is current: by then every procedure must be there (one built without the records'
        // procedure was seen to fail its probe).
        let all = statements(&sql(DEFAULT_TABLE).unwrap());
        let last = all.last().expect("statements");
        assert!(
            last.starts_with("CREATE PROCEDURE tower_lock_schema_version()"),
            "{last}"
        );
    }
}

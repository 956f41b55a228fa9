//! What MySQL's errors mean, and the rest of what the shared SQL code needs to know of
//! MySQL (see [`Dialect`]).

use sqlx::MySql;
use sqlx::mysql::{MySqlConnectOptions, MySqlDatabaseError};

use crate::sql::{Dialect, Refusal, SqlError};

/// InnoDB chose this transaction as a deadlock's victim and rolled it back.
pub(crate) const DEADLOCK: u16 = 1213;
/// A row lock was not granted within `innodb_lock_wait_timeout`; the statement was rolled
/// back.
pub(crate) const LOCK_WAIT_TIMEOUT: u16 = 1205;
/// The statement was interrupted (`KILL QUERY`, or `max_statement_time`).
pub(crate) const INTERRUPTED: u16 = 1317;

/// Why a call to the lock procedures failed.
pub(crate) type MySqlError = SqlError<MySql>;

/// The server's error number, when it refused a call.
pub(crate) fn number(e: &sqlx::Error) -> Option<u16> {
    match e {
        sqlx::Error::Database(db) => db
            .try_downcast_ref::<MySqlDatabaseError>()
            .map(|e| e.number()),
        _ => None,
    }
}

impl MySqlError {
    /// InnoDB rolled the call's transaction back (a deadlock, a lock wait timeout): it
    /// changed nothing, and running it again is safe.
    pub(crate) fn rolled_back(&self) -> bool {
        self.sqlx()
            .is_some_and(|e| matches!(number(e), Some(DEADLOCK | LOCK_WAIT_TIMEOUT)))
    }
}

impl Dialect for MySql {
    const SERVER: &'static str = "MySQL";
    const ROUTINE: &'static str = "procedure";
    const BACKEND: &'static str = "MySqlBackend";
    const SCHEMES: &'static [&'static str] = &["mysql", "mariadb"];
    /// `VARBINARY(2800)`: with the holder, the holders' primary key stays within InnoDB's
    /// 3072-byte limit.
    const MAX_NAME_LEN: Option<usize> = Some(2800);

    fn transient_refusal(e: &sqlx::Error) -> bool {
        number(e).is_some_and(|n| {
            // Deadlocks and lock waits, too many connections, the server shutting down, a
            // connection or statement killed, and a read-only server (a replica, until a
            // failover makes a primary of it).
            matches!(
                n,
                DEADLOCK
                    | LOCK_WAIT_TIMEOUT
                    | INTERRUPTED
                    | 1040
                    | 1053
                    | 1927
                    | 1969
                    | 1290
                    | 1792
                    | 1836
            )
        })
    }

    fn refusal(e: &sqlx::Error) -> Option<Refusal> {
        match number(e)? {
            // Access denied for user (a wrong password, no such user).
            1045 => Some(Refusal::Credentials),
            // Unknown database.
            1049 => Some(Refusal::UnknownDatabase),
            // Access denied for user to database.
            1044 => Some(Refusal::DatabaseDenied),
            // A command, or a routine's creation, denied to the user.
            1142 | 1227 | 1370 => Some(Refusal::Denied),
            _ => None,
        }
    }

    fn database(options: &MySqlConnectOptions) -> &str {
        options.get_database().unwrap_or_default()
    }

    fn addr(options: &MySqlConnectOptions) -> String {
        format!("{}:{}", options.get_host(), options.get_port())
    }

    fn user(options: &MySqlConnectOptions) -> &str {
        options.get_username()
    }
}

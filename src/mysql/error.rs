//! Why a MySQL call failed, and what that means for the core.

use std::fmt;

use sqlx::mysql::MySqlDatabaseError;

use crate::core::store::Failure;

/// InnoDB chose this transaction as a deadlock's victim and rolled it back.
pub(crate) const DEADLOCK: u16 = 1213;
/// A row lock was not granted within `innodb_lock_wait_timeout`; the statement was rolled
/// back.
pub(crate) const LOCK_WAIT_TIMEOUT: u16 = 1205;
/// The statement was interrupted (`KILL QUERY`, or `max_statement_time`).
pub(crate) const INTERRUPTED: u16 = 1317;

/// Why a call to the lock procedures failed.
#[derive(Debug)]
pub(crate) enum MySqlError {
    /// sqlx's error: no connection from the pool, the transport, or the server's refusal.
    Sqlx(sqlx::Error),
    /// A procedure answered with something it never returns.
    Unexpected(&'static str),
}

impl From<sqlx::Error> for MySqlError {
    fn from(e: sqlx::Error) -> Self {
        MySqlError::Sqlx(e)
    }
}

impl fmt::Display for MySqlError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            // The cause is the source.
            MySqlError::Sqlx(sqlx::Error::PoolTimedOut) => {
                f.write_str("no MySQL connection came within the connect timeout")
            }
            MySqlError::Sqlx(_) => f.write_str("MySQL call failed"),
            MySqlError::Unexpected(procedure) => {
                write!(f, "unexpected reply from the {procedure} procedure")
            }
        }
    }
}

impl std::error::Error for MySqlError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            MySqlError::Sqlx(sqlx::Error::PoolTimedOut) | MySqlError::Unexpected(_) => None,
            MySqlError::Sqlx(e) => Some(e),
        }
    }
}

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
        match self {
            MySqlError::Sqlx(e) => matches!(number(e), Some(DEADLOCK | LOCK_WAIT_TIMEOUT)),
            MySqlError::Unexpected(_) => false,
        }
    }
}

impl Failure for MySqlError {
    fn may_have_run(&self) -> bool {
        // A call whose connection failed may have committed before the reply was lost; a
        // reply that cannot be read came from a procedure that ran.
        matches!(
            self,
            MySqlError::Sqlx(sqlx::Error::Io(_) | sqlx::Error::Protocol(_))
                | MySqlError::Unexpected(_)
        )
    }

    fn is_transient(&self) -> bool {
        match self {
            MySqlError::Sqlx(sqlx::Error::PoolTimedOut | sqlx::Error::Io(_)) => true,
            MySqlError::Sqlx(e) => number(e).is_some_and(|n| {
                // Deadlocks and lock waits, too many connections, the server shutting
                // down, a connection or statement killed, and a read-only server (a
                // replica, until a failover makes a primary of it).
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
            }),
            MySqlError::Unexpected(_) => false,
        }
    }

    fn is_foreign(&self) -> bool {
        false
    }
}

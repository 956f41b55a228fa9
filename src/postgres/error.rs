//! Why a PostgreSQL call failed, and what that means for the core.

use std::fmt;

use crate::core::store::Failure;

/// Why a call to the lock functions failed.
#[derive(Debug)]
pub(crate) enum PgError {
    /// sqlx's error: no connection from the pool, the transport, or the server's refusal.
    Sqlx(sqlx::Error),
    /// A function answered with something it never returns.
    Unexpected(&'static str),
}

impl From<sqlx::Error> for PgError {
    fn from(e: sqlx::Error) -> Self {
        PgError::Sqlx(e)
    }
}

impl fmt::Display for PgError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            // The cause is the source.
            PgError::Sqlx(sqlx::Error::PoolTimedOut) => {
                f.write_str("no PostgreSQL connection came within the connect timeout")
            }
            PgError::Sqlx(_) => f.write_str("PostgreSQL call failed"),
            PgError::Unexpected(function) => {
                write!(f, "unexpected reply from the {function} function")
            }
        }
    }
}

impl std::error::Error for PgError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            PgError::Sqlx(sqlx::Error::PoolTimedOut) | PgError::Unexpected(_) => None,
            PgError::Sqlx(e) => Some(e),
        }
    }
}

impl PgError {
    /// The server's SQLSTATE, when it refused the call.
    fn code(&self) -> Option<String> {
        match self {
            PgError::Sqlx(sqlx::Error::Database(e)) => e.code().map(|c| c.into_owned()),
            _ => None,
        }
    }
}

impl Failure for PgError {
    fn may_have_run(&self) -> bool {
        // A call whose connection failed may have committed before the reply was lost; a
        // reply that cannot be read came from a function that ran.
        matches!(
            self,
            PgError::Sqlx(sqlx::Error::Io(_) | sqlx::Error::Protocol(_)) | PgError::Unexpected(_)
        )
    }

    fn is_transient(&self) -> bool {
        match self {
            PgError::Sqlx(sqlx::Error::PoolTimedOut | sqlx::Error::Io(_)) => true,
            PgError::Sqlx(sqlx::Error::Database(_)) => self.code().is_some_and(|code| {
                // Connection exceptions, serialization failures and deadlocks, lock waits,
                // too many connections, the server shutting down or starting, and a
                // read-only server (a replica, until a failover makes a primary of it).
                code.starts_with("08")
                    || code.starts_with("40")
                    || matches!(
                        code.as_str(),
                        "55P03" | "53300" | "57P01" | "57P02" | "57P03" | "25006"
                    )
            }),
            _ => false,
        }
    }

    fn is_foreign(&self) -> bool {
        false
    }
}

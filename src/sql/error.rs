//! Why a call to the crate's SQL failed, and what that means for the core.

use std::fmt;
use std::marker::PhantomData;

use super::Dialect;
use crate::core::store::Failure;

/// Why a call to the lock routines of the server `D` failed.
pub(crate) struct SqlError<D> {
    cause: Cause,
    server: PhantomData<fn() -> D>,
}

#[derive(Debug)]
enum Cause {
    /// sqlx's error: no connection from the pool, the transport, or the server's refusal.
    Sqlx(sqlx::Error),
    /// A routine answered with something it never returns; names the routine.
    Unexpected(&'static str),
}

impl<D> SqlError<D> {
    /// The routine `routine` answered with something it never returns.
    pub(crate) fn unexpected(routine: &'static str) -> Self {
        SqlError {
            cause: Cause::Unexpected(routine),
            server: PhantomData,
        }
    }

    /// sqlx's error, or the error itself when a reply could not be read. (MySQL's code
    /// reads the cause back: its build probe, its retries of rolled-back calls.)
    #[cfg(feature = "mysql")]
    pub(crate) fn into_sqlx(self) -> Result<sqlx::Error, Self> {
        match self.cause {
            Cause::Sqlx(e) => Ok(e),
            Cause::Unexpected(_) => Err(self),
        }
    }

    /// sqlx's error, unless a reply could not be read.
    #[cfg(feature = "mysql")]
    pub(crate) fn sqlx(&self) -> Option<&sqlx::Error> {
        match &self.cause {
            Cause::Sqlx(e) => Some(e),
            Cause::Unexpected(_) => None,
        }
    }
}

impl<D> From<sqlx::Error> for SqlError<D> {
    fn from(e: sqlx::Error) -> Self {
        SqlError {
            cause: Cause::Sqlx(e),
            server: PhantomData,
        }
    }
}

impl<D> fmt::Debug for SqlError<D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.cause.fmt(f)
    }
}

impl<D: Dialect> fmt::Display for SqlError<D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.cause {
            // The cause is the source.
            Cause::Sqlx(sqlx::Error::PoolTimedOut) => write!(
                f,
                "no {} connection came within the connect timeout",
                D::SERVER
            ),
            Cause::Sqlx(_) => write!(f, "{} call failed", D::SERVER),
            Cause::Unexpected(routine) => {
                write!(f, "unexpected reply from the {routine} {}", D::ROUTINE)
            }
        }
    }
}

impl<D: Dialect> std::error::Error for SqlError<D> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match &self.cause {
            Cause::Sqlx(sqlx::Error::PoolTimedOut) | Cause::Unexpected(_) => None,
            Cause::Sqlx(e) => Some(e),
        }
    }
}

impl<D: Dialect> Failure for SqlError<D> {
    fn may_have_run(&self) -> bool {
        // A call whose connection failed may have committed before the reply was lost; a
        // reply that cannot be read came from a routine that ran.
        matches!(
            self.cause,
            Cause::Sqlx(sqlx::Error::Io(_) | sqlx::Error::Protocol(_)) | Cause::Unexpected(_)
        )
    }

    fn is_transient(&self) -> bool {
        match &self.cause {
            Cause::Sqlx(sqlx::Error::PoolTimedOut | sqlx::Error::Io(_)) => true,
            Cause::Sqlx(e) => D::transient_refusal(e),
            Cause::Unexpected(_) => false,
        }
    }

    fn is_foreign(&self) -> bool {
        false
    }
}

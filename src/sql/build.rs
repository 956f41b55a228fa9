//! How `build` reports a connection or call that failed.

use std::io;

use super::Dialect;
use crate::error::{BuildError, ConnectFailure};

/// The build error for a failed connection or call, naming the server and the kind of
/// failure: refused, unknown host, timed out, closed, TLS, wrong credentials.
pub(crate) fn connect_failure<D: Dialect>(
    e: sqlx::Error,
    options: &<D::Connection as sqlx::Connection>::Options,
) -> BuildError {
    let addr = D::addr(options);
    let failure = match &e {
        sqlx::Error::Database(_) if D::auth_refusal(&e) => {
            return BuildError::Auth {
                user: D::user(options).to_owned(),
                addr,
                source: Box::new(e),
            };
        }
        sqlx::Error::Tls(_) => {
            return BuildError::Tls {
                reason: "could not set up TLS",
                addr: Some(addr),
                certificate: None,
                source: Some(Box::new(e)),
            };
        }
        sqlx::Error::PoolTimedOut => ConnectFailure::TimedOut,
        sqlx::Error::Io(io) => match io.kind() {
            io::ErrorKind::ConnectionRefused => ConnectFailure::Refused,
            io::ErrorKind::TimedOut => ConnectFailure::TimedOut,
            io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::UnexpectedEof
            | io::ErrorKind::BrokenPipe => ConnectFailure::Closed,
            // getaddrinfo's failures come as uncategorized I/O errors.
            _ if io.to_string().contains("lookup") => ConnectFailure::UnknownHost,
            _ => ConnectFailure::Other,
        },
        _ => ConnectFailure::Other,
    };
    BuildError::Connect {
        addr,
        failure,
        source: Box::new(e),
    }
}

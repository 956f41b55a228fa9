//! What PostgreSQL's errors mean, and the rest of what the shared SQL code needs to know
//! of PostgreSQL (see [`Dialect`]).

use sqlx::Postgres;
use sqlx::postgres::PgConnectOptions;

use crate::sql::{Dialect, Refusal, SqlError};

/// Why a call to the lock functions failed.
pub(crate) type PgError = SqlError<Postgres>;

/// The server's SQLSTATE, when it refused a call.
fn code(e: &sqlx::Error) -> Option<String> {
    match e {
        sqlx::Error::Database(e) => e.code().map(|c| c.into_owned()),
        _ => None,
    }
}

impl Dialect for Postgres {
    const SERVER: &'static str = "PostgreSQL";
    const ROUTINE: &'static str = "function";
    const BACKEND: &'static str = "PostgresBackend";
    const SCHEMES: &'static [&'static str] = &["postgres", "postgresql"];
    /// Names are `text`.
    const MAX_NAME_LEN: Option<usize> = None;

    fn transient_refusal(e: &sqlx::Error) -> bool {
        code(e).is_some_and(|code| {
            // Connection exceptions, serialization failures and deadlocks, lock waits, too
            // many connections, the server shutting down or starting, and a read-only
            // server (a replica, until a failover makes a primary of it).
            code.starts_with("08")
                || code.starts_with("40")
                || matches!(
                    code.as_str(),
                    "55P03" | "53300" | "57P01" | "57P02" | "57P03" | "25006"
                )
        })
    }

    fn refusal(e: &sqlx::Error) -> Option<Refusal> {
        match code(e)?.as_str() {
            // invalid_password, invalid_authorization_specification
            "28P01" | "28000" => Some(Refusal::Credentials),
            // invalid_catalog_name
            "3D000" => Some(Refusal::UnknownDatabase),
            // insufficient_privilege: at connect, no CONNECT on the database
            "42501" => Some(Refusal::Denied),
            _ => None,
        }
    }

    fn database(options: &PgConnectOptions) -> &str {
        // The server's default: the database named as the user.
        options
            .get_database()
            .unwrap_or_else(|| options.get_username())
    }

    fn addr(options: &PgConnectOptions) -> String {
        format!("{}:{}", options.get_host(), options.get_port())
    }

    fn user(options: &PgConnectOptions) -> &str {
        options.get_username()
    }
}

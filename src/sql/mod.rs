//! What the SQL stores (`postgres`, `mysql`) share: the names of a key's row and channel,
//! the calls' errors and what they mean to the core, how a failed connection is reported
//! at build, how durations and tokens are passed to the crate's SQL, and the idempotency
//! records beside the locks.
//!
//! What differs between the servers (their error codes, names in messages, the longest
//! row name) is a [`Dialect`], implemented for sqlx's database types in each store's
//! module; the SQL text and the wake-up machinery stay with each store.

mod backend;
mod build;
mod error;
pub(crate) mod janitor;
mod keys;
mod records;
mod store;

use std::time::Duration;

pub(crate) use self::backend::sql_backend;
pub(crate) use self::build::{
    Config, Server, Staleness, Target, build, connect_failure, pool_options, rights, settings,
};
pub(crate) use self::error::SqlError;
pub(crate) use self::keys::{SqlKey, admin_channel};
pub(crate) use self::records::SqlRecords;
pub(crate) use self::store::{Calls, HELD_PAGE, HeldRow, SqlSent, SqlStore, Statements};
use crate::lock::MAX_DURATION;

/// What the shared SQL code needs to know of one server.
pub(crate) trait Dialect: sqlx::Database {
    /// The server's name in messages (`PostgreSQL`, `MySQL`).
    const SERVER: &'static str;
    /// What the crate's SQL routines are called on this server (`function`, `procedure`).
    const ROUTINE: &'static str;
    /// The backend's type, whose `schema_sql(table)` prints the schema's SQL.
    const BACKEND: &'static str;
    /// The schemes of this server's URLs, the first the one its guides write.
    const SCHEMES: &'static [&'static str];
    /// The longest row name the lock tables take, when the column has a bound.
    const MAX_NAME_LEN: Option<usize>;

    /// The server refused a call for a reason a later try may not meet (a deadlock, a lock
    /// wait, too many connections, a shutdown, a read-only replica). `false` for anything
    /// but a refusal by the server.
    fn transient_refusal(e: &sqlx::Error) -> bool;

    /// What the server refused, when `e` is a refusal a build error names.
    fn refusal(e: &sqlx::Error) -> Option<Refusal>;

    /// The database the options connect to (the server's default where the URL names
    /// none).
    fn database(options: &<Self::Connection as sqlx::Connection>::Options) -> &str;

    /// `host:port` of the server the options connect to, as build errors name it.
    fn addr(options: &<Self::Connection as sqlx::Connection>::Options) -> String;

    /// The user the options connect as.
    fn user(options: &<Self::Connection as sqlx::Connection>::Options) -> &str;
}

/// A server's refusal that a build error names as its cause.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// The credentials: a wrong or missing password, no such enabled user.
    Credentials,
    /// The URL's database does not exist.
    UnknownDatabase,
    /// The user may not use the URL's database (MySQL's own code; PostgreSQL says
    /// `Denied`).
    #[cfg_attr(
        not(feature = "mysql"),
        expect(dead_code, reason = "PostgreSQL has no code of its own for it")
    )]
    DatabaseDenied,
    /// The user lacks a right the statement needs (to create a table or a routine).
    Denied,
}

/// `d` in whole milliseconds, as the SQL routines take leases and waits: at least 1 and
/// at most [`MAX_DURATION`].
pub(crate) fn millis(d: Duration) -> i64 {
    let ms = d.clamp(Duration::from_millis(1), MAX_DURATION).as_millis();
    i64::try_from(ms).unwrap_or(i64::MAX)
}

/// A token as the tables' `BIGINT`: tokens are microseconds of the server clock plus a
/// count, far below `i64::MAX`.
pub(crate) fn token(t: u64) -> i64 {
    i64::try_from(t).unwrap_or(i64::MAX)
}

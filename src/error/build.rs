//! [`BuildError`]: why a backend could not be built.

use std::error::Error as StdError;
use std::fmt;

/// Why a backend could not be built: its configuration is invalid, or the store could not be
/// reached or prepared. Returned by [`RedisBackend::connect`](crate::RedisBackend::connect)
/// and [`RedisBackendBuilder::build`](crate::RedisBackendBuilder::build).
#[derive(Debug)]
#[non_exhaustive]
pub enum BuildError {
    /// A setting that would make every call fail (a zero timeout, a zero key length).
    Setting {
        /// The builder method that was given the value.
        name: &'static str,
        /// What the setting must be instead.
        reason: &'static str,
    },
    /// The namespace is empty or contains `{`, `}` or a control character.
    Namespace {
        /// The rejected namespace.
        namespace: String,
    },
    /// The URL does not parse as a Redis URL; the parser's reason is the
    /// [`source`](StdError::source).
    Url {
        /// Why the URL was rejected.
        source: Box<dyn StdError + Send + Sync>,
    },
    /// No connection could be opened or the server refused it (connection refused, unknown
    /// host, a database index out of range, ...); the cause is the
    /// [`source`](StdError::source).
    Connect {
        /// Why the connection failed.
        source: Box<dyn StdError + Send + Sync>,
    },
    /// No sentinel named a usable master: none could be reached, none knows the master
    /// name, or the master they name is down or unreachable; the cause is the
    /// [`source`](StdError::source).
    Sentinel {
        /// The master name given to [`RedisBackend::sentinel`](crate::RedisBackend::sentinel).
        master_name: String,
        /// Why the lookup failed (the last sentinel's or the named master's error).
        source: Box<dyn StdError + Send + Sync>,
    },
    /// The server was reached but refused to load the lock scripts.
    Scripts {
        /// Why loading failed.
        source: Box<dyn StdError + Send + Sync>,
    },
    /// The server refused the credentials: a wrong password, an unknown or disabled ACL
    /// user (Redis answers all three with `WRONGPASS`), or no password where one is needed.
    Auth {
        /// The ACL user the URL names (`default` when it names none).
        user: String,
        /// The server's refusal.
        source: Box<dyn StdError + Send + Sync>,
    },
    /// TLS could not be set up (a `rediss://` URL without the crate's `tls` feature,
    /// unusable certificates) or the handshake failed (the server's certificate did not
    /// verify, the server wanted a client certificate).
    Tls {
        /// What went wrong, in words.
        reason: &'static str,
        /// The TLS library's error, when there is one.
        source: Option<Box<dyn StdError + Send + Sync>>,
    },
    /// The ACL user may not run something the backend needs (a lock script, `PUBLISH` or
    /// `SUBSCRIBE` on the namespace's channels, ...): every lock operation would fail later.
    Rights {
        /// The ACL user the URL names (`default` when it names none).
        user: String,
        /// What the user may not do, for example ``SUBSCRIBE to channel `shop:{..}` ``.
        right: String,
        /// The server's refusal.
        source: Box<dyn StdError + Send + Sync>,
    },
    /// The server's `maxmemory-policy` may evict keys, held locks among them (every lock
    /// key has a TTL, so `volatile-*` policies evict them too). Only `noeviction` keeps
    /// locks; [`allow_eviction`](crate::RedisBackendBuilder::allow_eviction) accepts
    /// another policy knowingly.
    Eviction {
        /// The server's policy, for example `allkeys-lru`.
        policy: String,
    },
    /// The database lacks the lock table and its functions (`found: None`), or has another
    /// version of them: run the SQL file the message names, or build with `migrate()`
    /// (PostgreSQL).
    Schema {
        /// The lock table's name.
        table: String,
        /// The version the database has, if any.
        found: Option<i32>,
        /// The version this crate needs.
        expected: i32,
    },
    /// The server takes no writes, so every acquisition would fail: a replica, or a
    /// read-only session (PostgreSQL).
    ReadOnly {
        /// Which, in words.
        reason: &'static str,
    },
}

impl fmt::Display for BuildError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BuildError::Namespace { namespace } => write!(
                f,
                "invalid namespace {namespace:?}: it must be non-empty, without braces or \
                 control characters"
            ),
            BuildError::Setting { name, reason } => write!(f, "invalid `{name}`: {reason}"),
            BuildError::Url { .. } => f.write_str("invalid Redis URL"),
            BuildError::Connect { .. } => f.write_str("cannot connect to the lock backend"),
            BuildError::Sentinel { master_name, .. } => {
                write!(f, "the sentinels name no usable master `{master_name}`")
            }
            BuildError::Scripts { .. } => f.write_str("cannot load the lock scripts"),
            BuildError::Auth { user, .. } => {
                write!(
                    f,
                    "Redis refused the credentials of ACL user `{user}` (a wrong or missing \
                     password, or no such enabled user)"
                )
            }
            BuildError::Tls { reason, .. } => f.write_str(reason),
            BuildError::Rights { user, right, .. } => {
                write!(f, "the ACL user `{user}` may not {right}")
            }
            BuildError::Schema {
                table, found: None, ..
            } => write!(
                f,
                "the database has no lock table `{table}` (or not its functions): run the \
                 SQL of `PostgresBackend::schema_sql(\"{table}\")` (the crate's \
                 src/postgres/schema.sql for the default table), or build with `migrate()`"
            ),
            BuildError::Schema {
                table,
                found: Some(found),
                expected,
            } => write!(
                f,
                "the lock table `{table}` is at schema version {found}, this crate needs \
                 {expected}: run the SQL of `PostgresBackend::schema_sql(\"{table}\")`, or \
                 build with `migrate()`"
            ),
            BuildError::ReadOnly { reason } => {
                write!(f, "the server takes no writes: {reason}")
            }
            BuildError::Eviction { policy } => write!(
                f,
                "the Redis server's maxmemory-policy is `{policy}`, which may evict held \
                 locks; only `noeviction` keeps them (or opt in with `allow_eviction`)"
            ),
        }
    }
}

impl StdError for BuildError {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        match self {
            BuildError::Namespace { .. }
            | BuildError::Setting { .. }
            | BuildError::Eviction { .. }
            | BuildError::Schema { .. }
            | BuildError::ReadOnly { .. } => None,
            BuildError::Url { source }
            | BuildError::Connect { source }
            | BuildError::Scripts { source }
            | BuildError::Sentinel { source, .. }
            | BuildError::Auth { source, .. }
            | BuildError::Rights { source, .. } => Some(&**source),
            BuildError::Tls { source, .. } => source.as_deref().map(|e| e as _),
        }
    }
}

//! [`BuildError`]: why a backend could not be built, and [`ConnectFailure`]: why a
//! connection could not be opened.

use std::error::Error as StdError;
use std::fmt;

/// Why a backend could not be built: its configuration is invalid, or the store could not be
/// reached or prepared. Returned by [`RedisBackend::connect`](crate::RedisBackend::connect),
/// [`RedisBackendBuilder::build`](crate::RedisBackendBuilder::build) and the other stores'
/// `connect` and `build` (PostgreSQL's with the feature `postgres`).
///
/// Each variant's own message (its `Display`) names the server's address (`host:port`,
/// never the password) and what went wrong there; the underlying error, when there is one,
/// is the [`source`](StdError::source) and is not repeated in the message, so
/// `format!("{err}")` is a complete sentence and anyhow's `{:#}` adds the raw cause once.
/// `Debug` (what `main() -> Result<(), Box<dyn Error>>` prints of an error returned with
/// `?`, and `unwrap()`) is the message, then `Caused by:` and each cause on a line of its
/// own.
///
/// An `addr` field holds one server's `host:port`, or a comma-separated list where several
/// servers were tried alike (a cluster's seed nodes, the sentinels). Match variants with
/// `..` so that later fields do not break the match.
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
    /// The URL does not parse as the store's URL; the parser's reason is the
    /// [`source`](StdError::source).
    Url {
        /// Why the URL was rejected.
        source: Box<dyn StdError + Send + Sync>,
    },
    /// No connection could be opened, or the server refused it before any lock command
    /// (connection refused, unknown host, no answer in time, a database index out of
    /// range, ...): [`failure`](ConnectFailure) says which.
    Connect {
        /// Where the connection was going.
        addr: String,
        /// What went wrong.
        failure: ConnectFailure,
        /// The underlying error.
        source: Box<dyn StdError + Send + Sync>,
    },
    /// No sentinel named a usable master: none could be reached, none knows the master
    /// name, or the master they name is down or unreachable; the cause is the
    /// [`source`](StdError::source).
    Sentinel {
        /// The master name given to [`RedisBackend::sentinel`](crate::RedisBackend::sentinel).
        master_name: String,
        /// The sentinels that were asked.
        addr: String,
        /// Why the lookup failed (the last sentinel's or the named master's error).
        source: Box<dyn StdError + Send + Sync>,
    },
    /// The server was reached but refused to load the lock scripts.
    Scripts {
        /// The server that refused.
        addr: String,
        /// Why loading failed.
        source: Box<dyn StdError + Send + Sync>,
    },
    /// The server refused the credentials: a wrong password, an unknown or disabled ACL
    /// user (Redis answers all three with `WRONGPASS`), or no password where one is needed.
    Auth {
        /// The user the URL names (a Redis ACL user: `default` when it names none).
        user: String,
        /// The server that refused.
        addr: String,
        /// The server's refusal.
        source: Box<dyn StdError + Send + Sync>,
    },
    /// TLS could not be set up (a `rediss://` URL without the crate's `tls` feature,
    /// unusable certificates), the handshake failed (the server's certificate did not
    /// verify, the server wanted a client certificate), or the server does not speak TLS
    /// (a `rediss://` URL for a plaintext port).
    Tls {
        /// What went wrong, in words. With an `addr`, it says what the server at that
        /// address did ("does not speak TLS ..."); without one, nothing was contacted and it
        /// is a whole sentence about the settings.
        reason: &'static str,
        /// The server of the failed handshake; `None` when the settings were refused before
        /// connecting.
        addr: Option<String>,
        /// Why the server's certificate failed verification, by rustls' name for it:
        /// `UnknownIssuer` (no trusted CA signed it), `BadSignature`, `NotValidForName`
        /// (it does not name the URL's host), `Expired`, `NotValidYet`, `Revoked`, ...;
        /// `None` for other failures.
        certificate: Option<String>,
        /// The TLS library's error, when there is one.
        source: Option<Box<dyn StdError + Send + Sync>>,
    },
    /// The user may not do something the backend needs (on Redis: run a lock script or a
    /// command it calls, `PUBLISH` or `SUBSCRIBE` on the namespace's channels, ...; on
    /// PostgreSQL: use the lock table): every lock operation would fail later.
    Rights {
        /// The user the URL names (a Redis ACL user: `default` when it names none).
        user: String,
        /// What the user may not do, for example ``SUBSCRIBE to channel `shop:{..}` `` or
        /// `run PUBLISH (the release script calls it)`.
        right: String,
        /// The server that refused.
        addr: String,
        /// The server's refusal.
        source: Box<dyn StdError + Send + Sync>,
    },
    /// The server's `maxmemory-policy` may evict keys, held locks among them (every lock
    /// key has a TTL, so `volatile-*` policies evict them too). The server is the one the
    /// backend writes to (a primary), or a replica that a failover may promote into one.
    /// Only `noeviction` keeps locks;
    /// [`allow_eviction`](crate::RedisBackendBuilder::allow_eviction) accepts another
    /// policy knowingly.
    Eviction {
        /// The server's policy, for example `allkeys-lru`.
        policy: String,
        /// The server with that policy: a primary, or a replica of one.
        addr: String,
    },
    /// The database lacks the lock table and its functions (`found: None`), or has another
    /// version of them: run the SQL file the message names, or build with `migrate()`
    /// (PostgreSQL, MySQL).
    Schema {
        /// The backend's type, whose `schema_sql(table)` prints the SQL to run.
        backend: &'static str,
        /// The crate's SQL file for the default table.
        file: &'static str,
        /// The lock table's name.
        table: String,
        /// What the schema's routines are on this server: `functions` (PostgreSQL) or
        /// `procedures` (MySQL).
        routines: &'static str,
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
    /// A URL given to [`RedisBackend::quorum`](crate::RedisBackend::quorum) names no
    /// independent master: a replica, a node of a Redis Cluster, or the same server as
    /// another URL of the quorum (its `run_id`); or there are fewer than three URLs.
    Quorum {
        /// The server refused (empty when the quorum as a whole was).
        addr: String,
        /// Why, in words.
        reason: &'static str,
    },
}

/// What went wrong opening a connection ([`BuildError::Connect`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ConnectFailure {
    /// The connection was refused: nothing listens at the address (the server is down, or
    /// the host or port is wrong).
    Refused,
    /// The host name does not resolve (DNS).
    UnknownHost,
    /// No answer within the connect timeout (or the command timeout, for the first
    /// command): the host is unreachable, or the server is stopped or overloaded.
    TimedOut,
    /// The server closed or reset the connection before answering.
    Closed,
    /// The server closed or reset the connection on the first command of a `redis://`
    /// (plaintext) URL, as a TLS-only port does: it may expect `rediss://`.
    ClosedOnPlaintext,
    /// The server has no database of the URL's index (`/99` on a server with 16): it
    /// refused to `SELECT` it.
    NoDatabase {
        /// The database index the URL names.
        db: i64,
    },
    /// The server closed the connection on the first request of a plaintext endpoint
    /// (etcd's `http://`), as a TLS-only port does: it may expect TLS, at `scheme`.
    ExpectsTls {
        /// The scheme of the server's TLS endpoints (`https://`).
        scheme: &'static str,
    },
    /// The server has no database of the URL's name (PostgreSQL, MySQL).
    UnknownDatabase {
        /// The database the URL names.
        name: String,
    },
    /// Another failure; the [`source`](StdError::source) says what.
    Other,
}

impl BuildError {
    /// TLS settings refused before anything was contacted.
    pub(crate) fn tls_settings(reason: &'static str) -> Self {
        BuildError::Tls {
            reason,
            addr: None,
            certificate: None,
            source: None,
        }
    }

    /// The same error, of the server at `node` (a cluster's primary, where the error came
    /// through a connection to the whole cluster).
    pub(crate) fn at(mut self, node: String) -> Self {
        match &mut self {
            BuildError::Connect { addr, .. }
            | BuildError::Scripts { addr, .. }
            | BuildError::Auth { addr, .. }
            | BuildError::Rights { addr, .. }
            | BuildError::Eviction { addr, .. } => *addr = node,
            BuildError::Tls { addr, .. } => *addr = Some(node),
            BuildError::Setting { .. }
            | BuildError::Namespace { .. }
            | BuildError::Url { .. }
            | BuildError::Sentinel { .. }
            | BuildError::Schema { .. }
            | BuildError::ReadOnly { .. }
            | BuildError::Quorum { .. } => {}
        }
        self
    }
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
            BuildError::Url { .. } => f.write_str("invalid URL"),
            BuildError::Connect { addr, failure, .. } => connect_message(f, addr, failure),
            BuildError::Sentinel {
                master_name, addr, ..
            } => {
                write!(
                    f,
                    "the sentinels at {addr} name no usable master `{master_name}`"
                )
            }
            BuildError::Scripts { addr, .. } => {
                write!(f, "the server at {addr} did not load the lock scripts")
            }
            BuildError::Schema {
                backend,
                file,
                table,
                routines,
                found,
                expected,
            } => schema_message(f, (backend, file, table, routines), *found, *expected),
            BuildError::ReadOnly { reason } => {
                write!(f, "the server takes no writes: {reason}")
            }
            BuildError::Quorum { addr, reason } if addr.is_empty() => {
                write!(f, "invalid quorum: {reason}")
            }
            BuildError::Quorum { addr, reason } => {
                write!(f, "the quorum's master at {addr} is refused: {reason}")
            }
            BuildError::Auth { user, addr, .. } => {
                write!(
                    f,
                    "the server at {addr} refused the credentials of user `{user}` (a wrong \
                     or missing password, or no such enabled user)"
                )
            }
            BuildError::Tls {
                reason,
                addr,
                certificate,
                ..
            } => tls_message(f, reason, addr.as_deref(), certificate.as_deref()),
            BuildError::Rights {
                user, right, addr, ..
            } => {
                write!(
                    f,
                    "the user `{user}` of the server at {addr} may not {right}"
                )
            }
            BuildError::Eviction { policy, addr } => write!(
                f,
                "the maxmemory-policy of the server at {addr} is `{policy}`, which may evict \
                 held locks; only `noeviction` keeps them (or opt in with `allow_eviction`)"
            ),
        }
    }
}

/// The message of [`BuildError::Schema`]: the table missing, or at another version.
fn schema_message(
    f: &mut fmt::Formatter<'_>,
    (backend, file, table, routines): (&str, &str, &str, &str),
    found: Option<i32>,
    expected: i32,
) -> fmt::Result {
    match found {
        None => write!(
            f,
            "the database has no lock table `{table}` (or not its {routines})"
        )?,
        Some(found) => write!(
            f,
            "the lock table `{table}` is at schema version {found}, this crate needs {expected}"
        )?,
    }
    write!(
        f,
        ": run the SQL of `{backend}::schema_sql(\"{table}\")` (the crate's {file} for the \
         default table), or build with `migrate()`"
    )
}

/// The message of [`BuildError::Tls`].
fn tls_message(
    f: &mut fmt::Formatter<'_>,
    reason: &str,
    addr: Option<&str>,
    certificate: Option<&str>,
) -> fmt::Result {
    match addr {
        Some(addr) => write!(f, "the server at {addr} {reason}")?,
        None => f.write_str(reason)?,
    }
    match certificate {
        Some(problem) => write!(f, ": {problem} ({})", certificate_hint(problem)),
        None => Ok(()),
    }
}

fn connect_message(
    f: &mut fmt::Formatter<'_>,
    addr: &str,
    failure: &ConnectFailure,
) -> fmt::Result {
    match failure {
        ConnectFailure::Refused => write!(
            f,
            "the connection to {addr} was refused: nothing listens there (is the server \
             running, on this host and port?)"
        ),
        ConnectFailure::UnknownHost => write!(
            f,
            "the host of {addr} does not resolve (DNS lookup failed: is the host name right?)"
        ),
        ConnectFailure::TimedOut => write!(
            f,
            "the server at {addr} did not answer within the connect or command timeout (is \
             the host reachable, the server running and not overloaded?)"
        ),
        ConnectFailure::Closed => write!(
            f,
            "the server at {addr} closed the connection before answering"
        ),
        ConnectFailure::ClosedOnPlaintext => write!(
            f,
            "the server at {addr} closed the connection on a plaintext command: it may \
             expect TLS (use `rediss://`)"
        ),
        ConnectFailure::NoDatabase { db } => write!(
            f,
            "the server at {addr} has no database {db}: it refused to SELECT the URL's \
             database index (use one below its `databases` setting)"
        ),
        ConnectFailure::ExpectsTls { scheme } => write!(
            f,
            "the server at {addr} closed the connection on a plaintext request: it may \
             expect TLS (use `{scheme}`), or not be the store's client port"
        ),
        ConnectFailure::UnknownDatabase { name } => write!(
            f,
            "the server at {addr} has no database `{name}` (create it, or name one it has in \
             the URL)"
        ),
        ConnectFailure::Other => write!(f, "cannot connect to the server at {addr}"),
    }
}

/// What a certificate problem of [`BuildError::Tls`] means, and what to do about it.
fn certificate_hint(problem: &str) -> &'static str {
    match problem {
        "UnknownIssuer" => {
            "no CA this client trusts signed it: give the server's CA with `tls_root_cert`"
        }
        "BadSignature" => "its signature does not verify against the CA this client trusts",
        "NotValidForName" => {
            "it does not name the URL's host: connect by a name or address it lists"
        }
        "Expired" => "it has expired",
        "NotValidYet" => "it is not valid yet: is a clock wrong?",
        "Revoked" => "its CA revoked it",
        "InvalidPurpose" => "it is not meant for a TLS server",
        _ => "see the cause",
    }
}

impl StdError for BuildError {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        match self {
            BuildError::Namespace { .. }
            | BuildError::Setting { .. }
            | BuildError::Eviction { .. }
            | BuildError::Schema { .. }
            | BuildError::ReadOnly { .. }
            | BuildError::Quorum { .. } => None,
            BuildError::Url { source }
            | BuildError::Connect { source, .. }
            | BuildError::Scripts { source, .. }
            | BuildError::Sentinel { source, .. }
            | BuildError::Auth { source, .. }
            | BuildError::Rights { source, .. } => Some(&**source),
            BuildError::Tls { source, .. } => source.as_deref().map(|e| e as _),
        }
    }
}

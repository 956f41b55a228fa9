//! The error types: [`LockError`] of every lock operation, [`BuildError`] of building a
//! backend.
//!
//! Each error's `Display` says only its own part and leaves its cause to
//! [`source`](StdError::source) (the std convention), so a chain printed level by level,
//! as anyhow's `{:#}` does, names every cause once.

use std::error::Error as StdError;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

/// Why a lock could not be taken, kept, or released.
///
/// The layer turns each variant into an HTTP response (see
/// [`LockLayer::on_rejection`](crate::LockLayer::on_rejection)); code that calls
/// [`LockBackend::lock`](crate::LockBackend::lock) directly gets it as an error.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum LockError {
    /// Another owner holds the lock and the caller did not wait
    /// ([`LockRequest::try_once`](crate::LockRequest::try_once) or a fail-fast layer).
    Contended {
        /// The user-facing key that was contended.
        key: String,
        /// How long the current holder's lease still runs, when the store reported one.
        retry_after: Option<Duration>,
    },
    /// The lock stayed held for the whole wait.
    TimedOut {
        /// The user-facing key that was waited for.
        key: String,
        /// How long the caller waited.
        waited: Duration,
        /// The holder's remaining lease at the last attempt, when the store reported one.
        retry_after: Option<Duration>,
    },
    /// This process already has the configured number of tasks queued for the key,
    /// so the request was shed instead of queued.
    QueueFull {
        /// The user-facing key whose local queue is full.
        key: String,
    },
    /// The key was rejected before anything was sent to the store. Displays as the
    /// [`KeyError`] itself.
    InvalidKey(KeyError),
    /// The lock was held but is no longer: its lease ran out or someone deleted it.
    Lost {
        /// The user-facing key that was lost.
        key: String,
    },
    /// The store holds a value under the lock's name that is not a lock, written by
    /// something other than this crate (on Redis: the key answered `WRONGTYPE`). The key
    /// cannot be locked until that value is removed; retrying does not help.
    NotALock {
        /// The user-facing key whose name in the store is taken.
        key: String,
    },
    /// The store could not be reached or answered with an error. Displays as the
    /// [`BackendError`] itself; the cause is the [`source`](StdError::source).
    Backend(BackendError),
}

impl LockError {
    /// How long a client should wait before retrying, when it can be known.
    ///
    /// The layer uses this for the `Retry-After` header.
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            LockError::Contended { retry_after, .. } => *retry_after,
            // A 503 always says when to come back: the holder's lease, else a second.
            LockError::TimedOut { retry_after, .. } => {
                Some(retry_after.unwrap_or(Duration::from_secs(1)))
            }
            LockError::QueueFull { .. } | LockError::Backend(_) | LockError::Lost { .. } => {
                Some(Duration::from_secs(1))
            }
            LockError::InvalidKey(_) | LockError::NotALock { .. } => None,
        }
    }

    pub(crate) fn backend(
        context: &'static str,
        source: impl StdError + Send + Sync + 'static,
    ) -> Self {
        LockError::Backend(BackendError {
            context,
            source: Arc::new(source),
        })
    }

    /// True when a retry of the same operation could succeed without anything changing
    /// on the caller's side (contention, timeouts, shedding, an unreachable backend).
    pub fn is_transient(&self) -> bool {
        !matches!(self, LockError::InvalidKey(_) | LockError::NotALock { .. })
    }
}

impl fmt::Display for LockError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LockError::Contended { key, .. } => write!(f, "lock `{key}` is held by another owner"),
            LockError::TimedOut { key, waited, .. } => {
                write!(f, "lock `{key}` still held after waiting {waited:?}")
            }
            LockError::QueueFull { key } => {
                write!(f, "too many local waiters for lock `{key}`")
            }
            // Both wrappers are transparent: the inner error is this level, not its source.
            LockError::InvalidKey(e) => e.fmt(f),
            LockError::Lost { key } => write!(f, "lock `{key}` was lost"),
            LockError::NotALock { key } => {
                write!(
                    f,
                    "the store holds a value that is not a lock under `{key}`"
                )
            }
            LockError::Backend(e) => e.fmt(f),
        }
    }
}

impl StdError for LockError {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        match self {
            LockError::InvalidKey(e) => e.source(),
            LockError::Backend(e) => e.source(),
            _ => None,
        }
    }
}

impl From<KeyError> for LockError {
    fn from(e: KeyError) -> Self {
        LockError::InvalidKey(e)
    }
}

/// A failure talking to the lock backend (for Redis: connect, pool, script or timeout
/// errors). Cheap to clone; the original error is kept as the [`source`](StdError::source),
/// and `Display` names only what the backend was doing.
#[derive(Clone)]
pub struct BackendError {
    context: &'static str,
    source: Arc<dyn StdError + Send + Sync>,
}

impl BackendError {
    /// What the backend was doing when it failed ("acquire", "release", ...).
    pub fn context(&self) -> &'static str {
        self.context
    }
}

impl fmt::Debug for BackendError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BackendError")
            .field("context", &self.context)
            .field("source", &self.source)
            .finish()
    }
}

impl fmt::Display for BackendError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "lock backend failed during {}", self.context)
    }
}

impl StdError for BackendError {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        Some(&*self.source)
    }
}

/// Why a lock key was rejected. Always answered with 400 by the layer.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum KeyError {
    /// The key is the empty string.
    Empty,
    /// The key is longer than the backend's limit (in bytes). Keys are never truncated.
    TooLong {
        /// Length of the rejected key in bytes.
        len: usize,
        /// The configured limit in bytes.
        max: usize,
    },
    /// The key contains an ASCII control character (newline, NUL, ...).
    ControlCharacter,
    /// A required input that carries the key (a header, path or query parameter) is absent.
    Missing {
        /// What was looked for, for example `header "idempotency-key"`.
        source: String,
    },
    /// The input that carries the key is present but unusable (for example not UTF-8).
    Malformed {
        /// What was wrong, in words a client can act on.
        reason: String,
    },
    /// A multi-key lock was asked for no key at all.
    NoKeys,
    /// A multi-key lock was asked for more keys than
    /// [`MAX_KEYS`](crate::MAX_KEYS).
    TooManyKeys {
        /// How many keys were asked for.
        count: usize,
        /// The limit.
        max: usize,
    },
    /// A multi-key lock was asked for the same key twice.
    DuplicateKey {
        /// The key given more than once.
        key: String,
    },
}

impl fmt::Display for KeyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KeyError::Empty => f.write_str("the lock key is empty"),
            KeyError::TooLong { len, max } => {
                write!(
                    f,
                    "the lock key is {len} bytes long; the limit is {max} bytes"
                )
            }
            KeyError::ControlCharacter => f.write_str("the lock key contains a control character"),
            KeyError::Missing { source } => write!(f, "the request has no {source}"),
            KeyError::Malformed { reason } => f.write_str(reason),
            KeyError::NoKeys => f.write_str("no lock key was given"),
            KeyError::TooManyKeys { count, max } => {
                write!(f, "{count} lock keys were given; the limit is {max}")
            }
            // Not the key itself: it comes from the client, unchecked (it may be huge).
            KeyError::DuplicateKey { .. } => f.write_str("the same lock key was given twice"),
        }
    }
}

impl StdError for KeyError {}

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
            | BuildError::Eviction { .. } => None,
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The chain as anyhow's `{:#}` prints it: every level's Display joined by ": ".
    fn chain(error: &(dyn StdError + 'static)) -> String {
        let mut levels = vec![error.to_string()];
        let mut source = error.source();
        while let Some(e) = source {
            levels.push(e.to_string());
            source = e.source();
        }
        levels.join(": ")
    }

    #[test]
    fn every_variant_names_its_cause_once() {
        let io = std::io::Error::new(std::io::ErrorKind::ConnectionReset, "reset by peer");
        let backend = LockError::backend("release", io);
        assert_eq!(
            chain(&backend),
            "lock backend failed during release: reset by peer"
        );
        let key = LockError::InvalidKey(KeyError::Empty);
        assert_eq!(chain(&key), "the lock key is empty");
        let build = BuildError::Connect {
            source: Box::new(std::io::Error::other("connection refused")),
        };
        assert_eq!(
            chain(&build),
            "cannot connect to the lock backend: connection refused"
        );
        let rights = BuildError::Rights {
            user: "app".into(),
            right: "run EVALSHA".into(),
            source: Box::new(std::io::Error::other("NOPERM")),
        };
        assert_eq!(
            chain(&rights),
            "the ACL user `app` may not run EVALSHA: NOPERM"
        );
        let eviction = BuildError::Eviction {
            policy: "allkeys-lru".into(),
        };
        assert!(chain(&eviction).contains("`allkeys-lru`"));
    }
}

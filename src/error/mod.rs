//! The error types: [`LockError`] of every lock operation, [`BuildError`] of building a
//! backend.
//!
//! Each error's `Display` says only its own part and leaves its cause to
//! [`source`](StdError::source) (the std convention), so a chain printed level by level,
//! as anyhow's `{:#}` does, names every cause once. Their `Debug` is that message, then
//! each cause on a line of its own: what `main` returning `Result<(), Box<dyn Error>>`
//! prints, and `unwrap()`.

use std::error::Error as StdError;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

/// The `Debug` of the crate's errors: the message, then each cause on a line of its own.
/// So `main() -> Result<(), Box<dyn Error>>` with `?`, `unwrap()` and `expect()` print what
/// `Display` says and why (as anyhow's `Debug` does), not the variant's fields and the
/// driver's structs.
pub(crate) fn debug_chain(
    error: &(dyn StdError + 'static),
    f: &mut fmt::Formatter<'_>,
) -> fmt::Result {
    write!(f, "{error}")?;
    let mut cause = error.source();
    let mut last = String::new();
    if cause.is_some() {
        f.write_str("\n\nCaused by:")?;
    }
    while let Some(e) = cause {
        // A driver's error often repeats its source's text (sqlx's `Database` error says
        // what the server's error says): each text once.
        let text = e.to_string();
        if !last.contains(&text) {
            write!(f, "\n    {text}")?;
        }
        last = text;
        cause = e.source();
    }
    Ok(())
}

/// `Debug` as [`debug_chain`] for each of the crate's public errors.
macro_rules! debug_as_chain {
    ($($error:ty),* $(,)?) => {
        $(
            impl fmt::Debug for $error {
                fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                    $crate::error::debug_chain(self, f)
                }
            }
        )*
    };
}

debug_as_chain!(
    LockError,
    BackendError,
    KeyError,
    BuildError,
    crate::idempotency::IdempotencyError,
);

/// Why a lock could not be taken, kept, or released.
///
/// The layer turns each variant into an HTTP response (see
/// [`LockLayer::on_rejection`](crate::LockLayer::on_rejection)); code that calls
/// [`LockBackend::lock`](crate::LockBackend::lock) directly gets it as an error.
#[derive(Clone)]
#[non_exhaustive]
pub enum LockError {
    /// Another owner holds the lock and the caller did not wait
    /// ([`LockRequest::try_once`](crate::LockRequest::try_once) or a fail-fast layer).
    Contended {
        /// The user-facing key that was contended.
        key: String,
        /// When to try again (see [`retry_after`](LockError::retry_after)).
        retry_after: Option<Duration>,
    },
    /// The lock stayed held for the whole wait.
    TimedOut {
        /// The user-facing key that was waited for.
        key: String,
        /// How long the caller waited.
        waited: Duration,
        /// When to try again (see [`retry_after`](LockError::retry_after)).
        retry_after: Option<Duration>,
    },
    /// This process already has the configured number of tasks queued for the key,
    /// so the request was shed instead of queued.
    QueueFull {
        /// The user-facing key whose local queue is full.
        key: String,
    },
    /// Every permit of the key's semaphore was taken and the caller did not wait
    /// ([`LockRequest::permits`](crate::LockRequest::permits) with `try_once`, or a
    /// fail-fast layer with [`permits`](crate::LockLayer::permits)): 429 from the layer.
    PermitsTaken {
        /// The user-facing key whose permits are taken.
        key: String,
        /// How many permits the acquisition asked of.
        permits: u32,
        /// When to try again (see [`retry_after`](LockError::retry_after)).
        retry_after: Option<Duration>,
    },
    /// The owner holds the key shared and asked for it exclusively. A shared hold cannot
    /// be upgraded (two readers upgrading would wait for each other forever): release it
    /// first, or take the exclusive hold from the start (a writer may take shared holds of
    /// its own key). Retrying does not help.
    UpgradeRefused {
        /// The user-facing key held shared.
        key: String,
    },
    /// The acquisition asked for a semaphore of zero permits, which nobody can ever take.
    ZeroPermits {
        /// The user-facing key of the semaphore.
        key: String,
    },
    /// The backend does not offer this kind of lock (a shared hold or a permit on a store
    /// that keeps exclusive locks only): the route's configuration is at fault, not the
    /// request, and retrying does not help.
    Unsupported {
        /// The user-facing key that was asked for.
        key: String,
        /// What the backend lacks, in its own words.
        what: &'static str,
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
    /// The layer uses this for the `Retry-After` header (see the
    /// [table](crate::layer::response)). For a refusal for contention ([`Contended`](Self::Contended),
    /// [`PermitsTaken`](Self::PermitsTaken), [`TimedOut`](Self::TimedOut)) it is what the
    /// acquisition was told: a layer's mean hold time bounded by the holder's remaining
    /// lease, or its [`retry_after`](crate::LockLayer::retry_after) setting; from the lock
    /// API, [`LockRequest::retry_after`](crate::LockRequest::retry_after) if set, else the
    /// holder's remaining lease as the store reported it (for a semaphore, the earliest
    /// permit's). A 429 or 503 without one says 1 s, as do the other 503s.
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            LockError::Contended { retry_after, .. } => *retry_after,
            // A 429 always says when to come back, as a 503 does.
            LockError::PermitsTaken { retry_after, .. } => {
                Some(retry_after.unwrap_or(Duration::from_secs(1)))
            }
            // A 503 always says when to come back: the holder's lease, else a second.
            LockError::TimedOut { retry_after, .. } => {
                Some(retry_after.unwrap_or(Duration::from_secs(1)))
            }
            LockError::QueueFull { .. } | LockError::Backend(_) | LockError::Lost { .. } => {
                Some(Duration::from_secs(1))
            }
            LockError::InvalidKey(_)
            | LockError::NotALock { .. }
            | LockError::UpgradeRefused { .. }
            | LockError::Unsupported { .. }
            | LockError::ZeroPermits { .. } => None,
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
        !matches!(
            self,
            LockError::InvalidKey(_)
                | LockError::NotALock { .. }
                | LockError::UpgradeRefused { .. }
                | LockError::Unsupported { .. }
                | LockError::ZeroPermits { .. }
        )
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
            LockError::PermitsTaken { key, permits, .. } => {
                write!(f, "all {permits} permits of `{key}` are taken")
            }
            LockError::UpgradeRefused { key } => write!(
                f,
                "lock `{key}` is held shared by this owner, which cannot upgrade it to exclusive"
            ),
            LockError::ZeroPermits { key } => {
                write!(f, "a semaphore of zero permits was asked of `{key}`")
            }
            LockError::Unsupported { key, what } => {
                write!(f, "lock `{key}` cannot be taken: {what}")
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
#[derive(Clone, PartialEq, Eq)]
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
    /// A multi-key lock was asked for more different keys than
    /// [`MAX_KEYS`](crate::lock::MAX_KEYS).
    TooManyKeys {
        /// How many keys were asked for.
        count: usize,
        /// The limit.
        max: usize,
    },
}

impl KeyError {
    /// The message, naming the key as `what` ("lock key", "idempotency key").
    pub(crate) fn describe(&self, f: &mut fmt::Formatter<'_>, what: &str) -> fmt::Result {
        match self {
            KeyError::Empty => write!(f, "the {what} is empty"),
            KeyError::TooLong { len, max } => {
                write!(
                    f,
                    "the {what} is {len} bytes long; the limit is {max} bytes"
                )
            }
            KeyError::ControlCharacter => write!(f, "the {what} contains a control character"),
            KeyError::Missing { source } => write!(f, "the request has no {source}"),
            KeyError::Malformed { reason } => f.write_str(reason),
            KeyError::NoKeys => f.write_str("no lock key was given"),
            KeyError::TooManyKeys { count, max } => {
                write!(f, "{count} lock keys were given; the limit is {max}")
            }
        }
    }
}

impl fmt::Display for KeyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.describe(f, "lock key")
    }
}

impl StdError for KeyError {}

mod build;

pub use self::build::{BuildError, ConnectFailure};

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
            addr: "127.0.0.1:6390".into(),
            failure: ConnectFailure::Refused,
            source: Box::new(std::io::Error::other("Connection refused (os error 111)")),
        };
        assert_eq!(
            chain(&build),
            "the connection to 127.0.0.1:6390 was refused: nothing listens there (is the \
             server running, on this host and port?): Connection refused (os error 111)"
        );
        let rights = BuildError::Rights {
            user: "app".into(),
            right: "run EVALSHA".into(),
            addr: "127.0.0.1:6390".into(),
            source: Box::new(std::io::Error::other("NOPERM")),
        };
        assert_eq!(
            chain(&rights),
            "the user `app` of the server at 127.0.0.1:6390 may not run EVALSHA: NOPERM"
        );
        let eviction = BuildError::Eviction {
            policy: "allkeys-lru".into(),
            addr: "127.0.0.1:6390".into(),
        };
        assert!(chain(&eviction).contains("`allkeys-lru`"));
    }

    /// What `main() -> Result<(), Box<dyn Error>>` prints of a `?`-returned error, and
    /// `unwrap()` of a failed call: the message, then its causes, not the variant's fields.
    #[test]
    fn debug_is_the_message_then_its_causes() {
        let build = BuildError::Connect {
            addr: "127.0.0.1:6390".into(),
            failure: ConnectFailure::Refused,
            source: Box::new(std::io::Error::other("Connection refused (os error 111)")),
        };
        assert_eq!(
            format!("{build:?}"),
            "the connection to 127.0.0.1:6390 was refused: nothing listens there (is the \
             server running, on this host and port?)\n\nCaused by:\n    Connection refused \
             (os error 111)"
        );
        let io = std::io::Error::new(std::io::ErrorKind::ConnectionReset, "reset by peer");
        let backend = LockError::backend("release", io);
        assert_eq!(
            format!("{backend:?}"),
            "lock backend failed during release\n\nCaused by:\n    reset by peer"
        );
        let key = LockError::InvalidKey(KeyError::Empty);
        assert_eq!(format!("{key:?}"), "the lock key is empty");

        // A driver's error that repeats its source's text: the text once.
        #[derive(Debug)]
        struct Driver(std::io::Error);
        impl fmt::Display for Driver {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "error returned from database: {}", self.0)
            }
        }
        impl StdError for Driver {
            fn source(&self) -> Option<&(dyn StdError + 'static)> {
                Some(&self.0)
            }
        }
        let driver = Driver(std::io::Error::other("role \"app\" does not exist"));
        let url = BuildError::Url {
            source: Box::new(driver),
        };
        assert_eq!(
            format!("{url:?}"),
            "invalid URL\n\nCaused by:\n    error returned from database: role \"app\" does \
             not exist"
        );
    }
}

//! Why a command did not complete ([`CommandError`]), and what a failed command says about
//! its connection.

use std::fmt;
use std::sync::Arc;

use redis::RedisError;

use crate::redis::UnexpectedReply;
use crate::redis::replicas::Unreplicated;
use crate::redis::scripts;

/// Why a command did not complete.
#[derive(Debug)]
pub(crate) enum CommandError {
    /// No connection could be had; nothing was sent.
    Connect(ConnectError),
    /// Redis answered with an error, or the transport failed after sending.
    Redis(RedisError),
    /// An acquisition too few replicas acknowledged in time (and that was given back).
    Unreplicated(Unreplicated),
    /// A script answered with something it never returns.
    Unexpected(UnexpectedReply),
}

/// Why no connection could be had.
#[derive(Debug, Clone)]
pub(crate) enum ConnectError {
    /// Opening a connection failed.
    Failed(Arc<RedisError>),
    /// No connection came within the connect timeout; the last failed attempt, if any.
    TimedOut(Option<Arc<RedisError>>),
}

impl CommandError {
    /// True when Redis refused the command because a key holds a value this crate never
    /// writes: another type of value (`WRONGTYPE`), or a fencing counter or token that
    /// leaves no exact token after it (`BADTOKEN`, from the scripts' token.lua). Retrying
    /// cannot help until the value is removed.
    pub(crate) fn is_foreign_value(&self) -> bool {
        matches!(self, CommandError::Redis(e) if matches!(e.code(), Some("WRONGTYPE" | "BADTOKEN")))
    }

    /// True when the Redis user may not run the command (ACL).
    pub(crate) fn is_no_permission(&self) -> bool {
        matches!(self, CommandError::Redis(e) if e.code() == Some("NOPERM"))
    }

    /// True when a cluster refused the command while its topology changes (MOVED, ASK
    /// or TRYAGAIN that redis-rs could not follow in time, CLUSTERDOWN, MASTERDOWN during
    /// a failover): nothing ran, and a later try may succeed.
    pub(crate) fn is_topology_change(&self) -> bool {
        matches!(self, CommandError::Redis(e) if e.is_cluster_error() || e.code() == Some("MASTERDOWN"))
    }

    /// True when the server refused the command as a replica (`READONLY`): it did not
    /// run, and a retry on a new connection reaches whichever server is primary now.
    pub(crate) fn is_read_only(&self) -> bool {
        matches!(self, CommandError::Redis(e) if is_read_only(e))
    }

    /// True when the command may have run even though no reply arrived.
    pub(crate) fn is_ambiguous(&self) -> bool {
        match self {
            CommandError::Connect(_) => false,
            CommandError::Redis(e) => is_transport(e),
            CommandError::Unreplicated(_) | CommandError::Unexpected(_) => false,
        }
    }
}

// Each level says only its own part and leaves the cause to `source`, so a chain printed
// level by level (anyhow's `{:#}`) names the cause once.
impl fmt::Display for CommandError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let what = match self {
            CommandError::Connect(ConnectError::Failed(_)) => "cannot connect to Redis",
            CommandError::Connect(ConnectError::TimedOut(_)) => {
                "timed out waiting for a Redis connection"
            }
            CommandError::Redis(_) => "Redis command failed",
            // Transparent: it says all there is, and has no cause of its own.
            CommandError::Unreplicated(e) => return e.fmt(f),
            CommandError::Unexpected(e) => return e.fmt(f),
        };
        f.write_str(what)
    }
}

impl std::error::Error for CommandError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            CommandError::Connect(ConnectError::Failed(e))
            | CommandError::Connect(ConnectError::TimedOut(Some(e))) => Some(cause(e)),
            CommandError::Redis(e) => Some(cause(e)),
            CommandError::Connect(ConnectError::TimedOut(None))
            | CommandError::Unreplicated(_)
            | CommandError::Unexpected(_) => None,
        }
    }
}

impl CommandError {
    /// The Redis error behind this one: the server's reply, or why a connection failed.
    pub(crate) fn redis_error(&self) -> Option<&RedisError> {
        match self {
            CommandError::Connect(ConnectError::Failed(e))
            | CommandError::Connect(ConnectError::TimedOut(Some(e))) => Some(e),
            CommandError::Redis(e) => Some(e),
            CommandError::Connect(ConnectError::TimedOut(None))
            | CommandError::Unreplicated(_)
            | CommandError::Unexpected(_) => None,
        }
    }

    /// The cause alone, for an error whose own words already say what failed (a build
    /// that could not connect).
    pub(crate) fn into_cause(self) -> Box<dyn std::error::Error + Send + Sync> {
        match self {
            CommandError::Connect(ConnectError::Failed(e)) => Box::new(RedisCause(e)),
            CommandError::Redis(e) => Box::new(RedisCause(Arc::new(e))),
            other => Box::new(other),
        }
    }
}

/// The error to show as the cause: a `RedisError` that wraps another (an I/O or server
/// error) prints that error's text as its own, so the wrapped one stands in for it.
fn cause(e: &RedisError) -> &(dyn std::error::Error + 'static) {
    std::error::Error::source(e).unwrap_or(e)
}

/// A `RedisError` as one level of a chain: the text of [`cause`], and that cause's source.
#[derive(Debug)]
pub(crate) struct RedisCause(Arc<RedisError>);

impl From<RedisError> for RedisCause {
    fn from(e: RedisError) -> Self {
        RedisCause(Arc::new(e))
    }
}

impl fmt::Display for RedisCause {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(cause(&self.0), f)
    }
}

impl std::error::Error for RedisCause {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        cause(&self.0).source()
    }
}

pub(crate) fn is_transport(e: &RedisError) -> bool {
    e.is_io_error() || e.is_timeout() || e.is_connection_dropped() || e.is_unrecoverable_error()
}

pub(crate) fn is_read_only(e: &RedisError) -> bool {
    e.kind() == redis::ServerErrorKind::ReadOnly.into()
}

/// What an ACL refusal was about.
pub(crate) enum Refused {
    Command,
    Key,
    Channel,
}

/// Whether Redis refused `error`'s command (or a command inside a script) for lack of
/// rights, and which kind of right.
pub(crate) fn refused(error: &CommandError) -> Option<Refused> {
    let e = error.redis_error()?;
    let text = e.to_string();
    let direct = e.code() == Some("NOPERM");
    if !direct && !text.contains("The user executing the script can't") {
        return None;
    }
    Some(if text.contains("channel") {
        Refused::Channel
    } else if text.contains("keys") {
        Refused::Key
    } else {
        Refused::Command
    })
}

/// What a refusal inside the `name` script (of `source`) was about: the command on the line
/// Redis names (`... script: <sha>, on @user_script:263.`), or the command Redis names
/// itself (Redis 6: `... to run the 'publish' command`); failing both, every command the
/// script calls. (Also for the operator's calls, which `build()` does not probe.)
pub(crate) fn refused_call(
    error: &CommandError,
    name: &str,
    source: &str,
    sharded: bool,
) -> String {
    let text = error
        .redis_error()
        .map(ToString::to_string)
        .unwrap_or_default();
    let on_line = text
        .split("@user_script:")
        .nth(1)
        .and_then(|rest| rest.split(|c: char| !c.is_ascii_digit()).next())
        .and_then(|line| line.parse().ok())
        .and_then(|line| scripts::command_on_line(source, line, sharded));
    let named = || {
        let rest = text.split("to run the '").nth(1)?;
        Some(rest.split('\'').next()?.to_ascii_uppercase())
    };
    match on_line.or_else(named) {
        Some(command) => format!("run {command} (the {name} script calls it)"),
        None => format!(
            "run the {name} script (it calls {})",
            scripts::commands(source, sharded)
        ),
    }
}

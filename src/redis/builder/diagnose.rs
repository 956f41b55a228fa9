//! Why a build-time connection failed, in words a user can act on: each failure is named
//! with the server's address and classified (refused, unknown host, timeout, a database
//! index out of range, a TLS certificate that did not verify, ...).
//!
//! Where the error alone cannot tell, the server is asked once more, on the failure path
//! only and within the connect timeout: redis-rs reports a failed DNS lookup as an
//! uncategorised I/O error and a cluster's unreachable seeds as one line of text, and a
//! `rediss://` URL against a plaintext port fails as a timeout (a plaintext Redis waits
//! for the end of a line that the TLS hello may never contain) or as a garbled handshake.
//! So the host is looked up again, a TCP connection is tried, and for TLS a plaintext
//! `PING` is sent: a `+` or `-` reply is a plaintext Redis.

use std::io::ErrorKind as IoKind;
use std::sync::Arc;
use std::time::Duration;

use futures_util::future::join_all;
use redis::RedisError;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpStream, lookup_host};
use tokio::time::timeout;

use crate::error::{BuildError, ConnectFailure};
use crate::redis::connection::cluster::ClusterNodes;
use crate::redis::connection::pool::{CommandError, ConnectError};
use crate::redis::connection::tls::{NOT_TLS_LIKE, handshake_failure};

/// Who a build connects as and where, for its errors.
#[derive(Debug, Clone)]
pub(crate) struct Peer {
    /// The ACL user the connections log in as (`default` when the URL names none).
    pub(crate) user: String,
    /// `host:port` of the server, or of every seed (comma-separated) of a cluster.
    pub(crate) addr: String,
    /// Whether the URLs ask for TLS.
    pub(crate) tls: bool,
    /// The database index the URL selects.
    pub(crate) db: i64,
}

impl Peer {
    /// Who connects with `info` and where (`addr` when several servers are tried alike).
    pub(crate) fn of(info: &redis::ConnectionInfo, addr: Option<String>) -> Self {
        let settings = info.redis_settings();
        Peer {
            user: settings.username().unwrap_or("default").to_owned(),
            addr: addr.unwrap_or_else(|| info.addr().to_string()),
            tls: matches!(info.addr(), redis::ConnectionAddr::TcpTls { .. }),
            db: settings.db(),
        }
    }

    /// The error of a failed build-time command: refused credentials, a failed TLS
    /// handshake, or a connection failure of the kind the error shows.
    pub(crate) fn failure(&self, error: CommandError) -> BuildError {
        let addr = self.addr.clone();
        let failure = match error.redis_error() {
            Some(e) if is_auth_refusal(e) => {
                return BuildError::Auth {
                    user: self.user.clone(),
                    addr,
                    source: error.into_cause(),
                };
            }
            Some(e) => {
                if let Some(handshake) = handshake_failure(e) {
                    return BuildError::Tls {
                        reason: handshake.reason,
                        addr: Some(addr),
                        certificate: handshake.certificate,
                        source: Some(error.into_cause()),
                    };
                }
                self.classify(e)
            }
            None if matches!(error, CommandError::Connect(ConnectError::TimedOut(_))) => {
                ConnectFailure::TimedOut
            }
            None => ConnectFailure::Other,
        };
        BuildError::Connect {
            addr,
            failure,
            source: error.into_cause(),
        }
    }

    /// A command or connect that did not end within its timeout.
    pub(crate) fn timed_out(&self, elapsed: tokio::time::error::Elapsed) -> BuildError {
        BuildError::Connect {
            addr: self.addr.clone(),
            failure: ConnectFailure::TimedOut,
            source: Box::new(elapsed),
        }
    }

    fn classify(&self, e: &RedisError) -> ConnectFailure {
        let closed = if self.tls {
            ConnectFailure::Closed
        } else {
            ConnectFailure::ClosedOnPlaintext
        };
        if let Some(io) = io_error(e) {
            return match io.kind() {
                IoKind::ConnectionRefused => ConnectFailure::Refused,
                IoKind::TimedOut | IoKind::WouldBlock => ConnectFailure::TimedOut,
                IoKind::ConnectionReset
                | IoKind::ConnectionAborted
                | IoKind::UnexpectedEof
                | IoKind::BrokenPipe => closed,
                _ => ConnectFailure::Other,
            };
        }
        // redis-rs' own words for a refused SELECT; Redis' for an index out of range.
        let refused_select = e.to_string().contains("refused to switch database");
        if refused_select && e.detail().is_some_and(|d| d.contains("DB index")) {
            return ConnectFailure::NoDatabase { db: self.db };
        }
        // Without an I/O error the kind is unknown (a cluster's failed seeds come as one line
        // of text): `diagnose` asks the server(s) again.
        ConnectFailure::Other
    }
}

/// Whether the server refused the credentials (`WRONGPASS`, `NOAUTH`).
fn is_auth_refusal(e: &RedisError) -> bool {
    e.kind() == redis::ErrorKind::AuthenticationFailed
        || matches!(e.code(), Some("WRONGPASS" | "NOAUTH"))
}

/// The I/O error behind `e`, if it is one.
fn io_error(e: &RedisError) -> Option<&std::io::Error> {
    let mut level = std::error::Error::source(e);
    while let Some(cause) = level {
        if let Some(io) = cause.downcast_ref::<std::io::Error>() {
            return Some(io);
        }
        // A `RedisError` keeps its cause in an `Arc`, which is its source: look inside.
        level = match cause.downcast_ref::<Arc<dyn std::error::Error + Send + Sync>>() {
            Some(shared) => Some(&**shared),
            None => cause.source(),
        };
    }
    None
}

/// `error` made more precise by asking its server(s) again, where the error alone left the
/// kind open (see the module docs). `tls`: whether the URLs ask for TLS.
pub(crate) async fn diagnose(error: BuildError, tls: bool, limit: Duration) -> BuildError {
    match error {
        BuildError::Connect {
            addr,
            failure,
            source,
        } => {
            let failure = match failure {
                ConnectFailure::Other => probe(&addr, limit).await.unwrap_or(failure),
                other => other,
            };
            let unclear = matches!(
                failure,
                ConnectFailure::Other | ConnectFailure::TimedOut | ConnectFailure::Closed
            );
            if tls && unclear {
                if let Some(plaintext) = plaintext_server(&addr, limit).await {
                    return not_tls(plaintext, Some(source));
                }
            }
            BuildError::Connect {
                addr,
                failure,
                source,
            }
        }
        BuildError::Tls {
            addr: Some(addr),
            reason,
            certificate: None,
            source,
        } if reason == NOT_TLS_LIKE => match plaintext_server(&addr, limit).await {
            Some(plaintext) => not_tls(plaintext, source),
            None => BuildError::Tls {
                reason,
                addr: Some(addr),
                certificate: None,
                source,
            },
        },
        other => other,
    }
}

/// A TLS cluster's build error, made precise where redis-rs left it one line of text (its
/// seeds' failures joined, a handshake's reason among them): each seed is connected to
/// alone, as one server is, and the first whose TLS handshake fails is the error, with
/// what went wrong (a client certificate missing, a certificate not trusted) named.
pub(crate) async fn seed_handshake(
    error: BuildError,
    nodes: &ClusterNodes,
    limit: Duration,
) -> BuildError {
    let BuildError::Connect {
        addr,
        failure: ConnectFailure::Other,
        ..
    } = &error
    else {
        return error;
    };
    let seeds = targets(addr).into_iter().map(|(host, port)| async move {
        let client = nodes.node_client(host, port).ok()?;
        let refused = match timeout(limit, client.get_multiplexed_async_connection()).await {
            Ok(Err(refused)) => refused,
            _ => return None,
        };
        let handshake = handshake_failure(&refused)?;
        Some(BuildError::Tls {
            reason: handshake.reason,
            addr: Some(format!("{host}:{port}")),
            certificate: handshake.certificate,
            source: Some(CommandError::Redis(refused).into_cause()),
        })
    });
    let found = join_all(seeds).await.into_iter().flatten().next();
    found.unwrap_or(error)
}

fn not_tls(addr: String, source: Option<Box<dyn std::error::Error + Send + Sync>>) -> BuildError {
    BuildError::Tls {
        reason: "does not speak TLS (is it a plaintext port? use `redis://`)",
        addr: Some(addr),
        certificate: None,
        source,
    }
}

/// The `(host, port)` of each server of `addr` (`host:port`, comma-separated); none for a
/// Unix socket.
fn targets(addr: &str) -> Vec<(&str, u16)> {
    addr.split(", ")
        .filter_map(|one| {
            let (host, port) = one.rsplit_once(':')?;
            Some((host, port.parse().ok()?))
        })
        .collect()
}

/// The failure every server of `addr` shows to a DNS lookup and a TCP connect, if they all
/// show the same one. The servers are asked together, so a cluster's unreachable seeds
/// take one timeout, not one each.
async fn probe(addr: &str, limit: Duration) -> Option<ConnectFailure> {
    let probes = targets(addr).into_iter().map(|(host, port)| async move {
        match timeout(limit, lookup_host((host, port))).await {
            Ok(Err(_)) => Some(ConnectFailure::UnknownHost),
            Err(_) => None,
            Ok(Ok(_)) => match timeout(limit, TcpStream::connect((host, port))).await {
                Err(_) => Some(ConnectFailure::TimedOut),
                Ok(Err(e)) if e.kind() == IoKind::ConnectionRefused => {
                    Some(ConnectFailure::Refused)
                }
                Ok(_) => None,
            },
        }
    });
    let mut failures = join_all(probes).await.into_iter();
    let first = failures.next()??;
    failures
        .all(|failure| failure.as_ref() == Some(&first))
        .then_some(first)
}

/// A server of `addr` that answers a plaintext `PING` as Redis does (`+PONG`, or an error
/// such as `-NOAUTH`).
async fn plaintext_server(addr: &str, limit: Duration) -> Option<String> {
    let pings = targets(addr).into_iter().map(|(host, port)| async move {
        let ping = async {
            let mut stream = TcpStream::connect((host, port)).await?;
            stream.write_all(b"PING\r\n").await?;
            let mut first = [0u8; 1];
            stream.read_exact(&mut first).await?;
            Ok::<_, std::io::Error>(first[0])
        };
        match timeout(limit, ping).await {
            Ok(Ok(b'+' | b'-')) => Some(format!("{host}:{port}")),
            _ => None,
        }
    });
    join_all(pings).await.into_iter().flatten().next()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_are_read_back_from_the_address_of_an_error() {
        assert_eq!(targets("127.0.0.1:6379"), [("127.0.0.1", 6379)]);
        assert_eq!(
            targets("a:7000, b:7001"),
            [("a", 7000), ("b", 7001)],
            "a cluster's seeds"
        );
        assert_eq!(
            targets("::1:6379"),
            [("::1", 6379)],
            "IPv6, as redis-rs prints it"
        );
        assert!(targets("/run/redis.sock").is_empty(), "a Unix socket");
    }
}

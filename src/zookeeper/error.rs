//! Why a ZooKeeper call failed, and what that means for the core.

use std::fmt;

use zookeeper_client::Error as ClientError;

use crate::core::store::Failure;

/// Why a call to ZooKeeper failed.
#[derive(Debug)]
pub(crate) enum ZkError {
    /// zookeeper-client's error: no connection, the session, or the server's refusal.
    Client(ClientError),
    /// A node held something this crate never writes.
    Foreign,
    /// ZooKeeper answered with something it never sends for this call.
    Unexpected(&'static str),
    /// A hold kept changing under a versioned write (never for long: only this backend's
    /// session writes its own node).
    Contended,
    /// An idempotency record of this many bytes is more than ZooKeeper takes in a request.
    RecordTooLarge(usize),
}

impl From<ClientError> for ZkError {
    fn from(e: ClientError) -> Self {
        ZkError::Client(e)
    }
}

impl fmt::Display for ZkError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            // The cause is the source.
            ZkError::Client(_) => f.write_str("ZooKeeper call failed"),
            ZkError::Foreign => f.write_str("the lock's node in ZooKeeper holds something else"),
            ZkError::Contended => f.write_str("the hold kept changing during the call"),
            ZkError::Unexpected(what) => write!(f, "unexpected ZooKeeper reply: {what}"),
            ZkError::RecordTooLarge(bytes) => write!(
                f,
                "the idempotency record ({bytes} bytes) is over ZooKeeper's request size limit \
                 (jute.maxbuffer, 1 MiB by default): not stored; lower the layer's \
                 max_response_body"
            ),
        }
    }
}

impl std::error::Error for ZkError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            ZkError::Client(e) => Some(e),
            _ => None,
        }
    }
}

impl ZkError {
    /// The backend's session is over (expired, or its client closed, as when the runtime
    /// it ran on went away): a new one is needed, and every hold under the old one is gone.
    pub(crate) fn session_ended(&self) -> bool {
        matches!(
            self,
            ZkError::Client(ClientError::SessionExpired | ClientError::ClientClosed)
        )
    }

    /// The connection the call went out on failed before its answer came. zookeeper-client
    /// fails the calls in flight with the error that ended their connection: a
    /// `ConnectionLoss` when the server closed it, and a custom error (its only use of
    /// one on a call) when reading or writing failed or the server went silent for the
    /// connection's timeout ("no response from connection in ...", as after the process
    /// was paused). The client then reconnects, or finds its session expired.
    pub(super) fn connection_failed(&self) -> bool {
        matches!(
            self,
            ZkError::Client(ClientError::ConnectionLoss | ClientError::Custom(_))
        )
    }
}

impl Failure for ZkError {
    fn may_have_run(&self) -> bool {
        // A request sent whose answer never came (the connection dropped, the deadline
        // passed) may have been applied by the ensemble.
        self.connection_failed() || matches!(self, ZkError::Client(ClientError::Timeout))
    }

    fn is_transient(&self) -> bool {
        match self {
            ZkError::Client(e) => matches!(
                e,
                ClientError::ConnectionLoss
                    | ClientError::Custom(_)
                    | ClientError::Timeout
                    | ClientError::NoHosts
                    | ClientError::SessionExpired
                    | ClientError::SessionMoved
                    | ClientError::ClientClosed
                    | ClientError::Throttled
                    | ClientError::NotReadOnly
            ),
            ZkError::Contended => true,
            ZkError::Foreign | ZkError::Unexpected(_) | ZkError::RecordTooLarge(_) => false,
        }
    }

    fn is_foreign(&self) -> bool {
        matches!(self, ZkError::Foreign)
    }
}

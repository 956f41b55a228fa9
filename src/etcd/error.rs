//! Why an etcd call failed, and what that means for the core.

use std::fmt;

use etcd_client::Error as ClientError;

use crate::core::store::Failure;

/// The gRPC status codes the backend tells apart (etcd-client does not re-export tonic's
/// `Code`; these numbers are gRPC's, fixed by its specification).
pub(crate) mod code {
    pub(crate) const CANCELLED: i32 = 1;
    pub(crate) const UNKNOWN: i32 = 2;
    pub(crate) const INVALID_ARGUMENT: i32 = 3;
    pub(crate) const DEADLINE_EXCEEDED: i32 = 4;
    pub(crate) const NOT_FOUND: i32 = 5;
    pub(crate) const PERMISSION_DENIED: i32 = 7;
    pub(crate) const RESOURCE_EXHAUSTED: i32 = 8;
    pub(crate) const FAILED_PRECONDITION: i32 = 9;
    pub(crate) const ABORTED: i32 = 10;
    pub(crate) const UNAVAILABLE: i32 = 14;
    pub(crate) const UNAUTHENTICATED: i32 = 16;
}

/// Why a call to etcd failed.
#[derive(Debug)]
pub(crate) enum EtcdError {
    /// etcd-client's error: no connection, the transport, or the server's refusal.
    Client(ClientError),
    /// The backend's lease is gone (expired or revoked): every hold under it with it.
    LeaseLost,
    /// A key held something this crate never writes.
    Foreign,
    /// etcd answered with something it never sends for this call.
    Unexpected(&'static str),
    /// A hold kept changing under a compare-and-swap (never for long: only this backend
    /// writes its own hold).
    Contended,
    /// An idempotency record of this many bytes is more than etcd takes in one request.
    RecordTooLarge(usize),
}

impl From<ClientError> for EtcdError {
    fn from(e: ClientError) -> Self {
        EtcdError::Client(e)
    }
}

impl fmt::Display for EtcdError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            // The cause is the source.
            EtcdError::Client(_) => f.write_str("etcd call failed"),
            EtcdError::LeaseLost => f.write_str("the backend's etcd lease is gone"),
            EtcdError::Foreign => f.write_str("the lock's key in etcd holds something else"),
            EtcdError::Contended => f.write_str("the hold kept changing during the call"),
            EtcdError::Unexpected(what) => write!(f, "unexpected etcd reply: {what}"),
            EtcdError::RecordTooLarge(bytes) => write!(
                f,
                "the idempotency record ({bytes} bytes) is over etcd's request size limit \
                 (--max-request-bytes, 1.5 MiB by default): not stored; lower the layer's \
                 max_response_body or raise the limit"
            ),
        }
    }
}

impl std::error::Error for EtcdError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            EtcdError::Client(e) => Some(e),
            _ => None,
        }
    }
}

impl EtcdError {
    /// The gRPC status code of a call the server (or the channel) answered.
    pub(crate) fn code(&self) -> Option<i32> {
        match self {
            EtcdError::Client(e) => status_code(e),
            _ => None,
        }
    }

    /// etcd refused a request for its size: over its `--max-request-bytes` ("request is
    /// too large"), or over its gRPC message limit (that plus 512 KiB).
    pub(crate) fn is_too_large(&self) -> bool {
        match self {
            EtcdError::Client(ClientError::GRpcStatus(status)) => match i32::from(status.code()) {
                code::INVALID_ARGUMENT => status.message().contains("too large"),
                code::RESOURCE_EXHAUSTED => status.message().contains("larger than max"),
                _ => false,
            },
            _ => false,
        }
    }

    /// etcd refused a put naming a lease it does not have.
    pub(crate) fn is_lease_not_found(&self) -> bool {
        match self {
            EtcdError::LeaseLost => true,
            EtcdError::Client(ClientError::GRpcStatus(status)) => {
                i32::from(status.code()) == code::NOT_FOUND
                    && status.message().contains("lease not found")
            }
            EtcdError::Client(ClientError::LeaseKeepAliveError(message)) => {
                message.contains("lease not found")
            }
            _ => false,
        }
    }
}

impl Failure for EtcdError {
    fn may_have_run(&self) -> bool {
        matches!(self, EtcdError::Client(e) if unanswered(e))
    }

    fn is_transient(&self) -> bool {
        match self {
            EtcdError::Client(ClientError::TransportError(_) | ClientError::IoError(_)) => true,
            EtcdError::Client(_) => matches!(
                self.code(),
                Some(
                    code::UNAVAILABLE
                        | code::DEADLINE_EXCEEDED
                        | code::CANCELLED
                        | code::UNKNOWN
                        | code::ABORTED
                        | code::RESOURCE_EXHAUSTED
                )
            ),
            EtcdError::LeaseLost | EtcdError::Contended => true,
            EtcdError::Foreign | EtcdError::Unexpected(_) | EtcdError::RecordTooLarge(_) => false,
        }
    }

    fn is_foreign(&self) -> bool {
        matches!(self, EtcdError::Foreign)
    }
}

/// A call the channel sent and whose answer never came (the server went away, the
/// deadline passed): the cluster may have applied it.
pub(crate) fn unanswered(e: &ClientError) -> bool {
    matches!(
        status_code(e),
        Some(code::UNAVAILABLE | code::DEADLINE_EXCEEDED | code::CANCELLED | code::UNKNOWN)
    )
}

/// The gRPC status code of a call the server (or the channel) answered.
pub(crate) fn status_code(e: &ClientError) -> Option<i32> {
    match e {
        ClientError::GRpcStatus(status) => Some(i32::from(status.code())),
        _ => None,
    }
}

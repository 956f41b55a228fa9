//! Lock failures as gRPC statuses (feature `grpc`), for tonic services: what
//! [`LockLayer::grpc`](crate::LockLayer::grpc) answers with, and the `?` of a tonic
//! handler that takes a lock itself.
//!
//! | error | code | retry delay |
//! |---|---|---|
//! | [`Contended`](LockError::Contended) | `ABORTED` | as `Retry-After` |
//! | [`PermitsTaken`](LockError::PermitsTaken) | `RESOURCE_EXHAUSTED` | as `Retry-After` |
//! | [`TimedOut`](LockError::TimedOut), [`QueueFull`](LockError::QueueFull), [`Backend`](LockError::Backend), [`Lost`](LockError::Lost) | `UNAVAILABLE` | as `Retry-After` |
//! | [`InvalidKey`](LockError::InvalidKey) | `INVALID_ARGUMENT` | none |
//! | [`NotALock`](LockError::NotALock) | `FAILED_PRECONDITION` | none |
//! | [`UpgradeRefused`](LockError::UpgradeRefused), [`ZeroPermits`](LockError::ZeroPermits), [`Unsupported`](LockError::Unsupported) | `INTERNAL` | none |
//!
//! The delay is the one an HTTP rejection gives in `Retry-After` (see
//! [`response`](super::response)), at millisecond precision, said twice in the ways gRPC
//! clients read it: as a `google.rpc.RetryInfo` in the status details (read with
//! `tonic_types::StatusExt::get_details_retry_info`, or Go's and Java's `errdetails`), and
//! as the `grpc-retry-pushback-ms` trailer, which a channel with a retry policy for the
//! code waits for before its next attempt (gRFC A6). The message is the problem+json
//! body's title and detail.
//!
//! ```
//! use std::time::Duration;
//! use tonic::Code;
//! use tonic_types::StatusExt;
//! use tower_lock::LockError;
//!
//! let busy = LockError::Contended {
//!     key: "order:42".into(),
//!     retry_after: Some(Duration::from_millis(1500)),
//! };
//! let status = tonic::Status::from(busy);
//! assert_eq!(status.code(), Code::Aborted);
//! assert_eq!(status.metadata().get("grpc-retry-pushback-ms").unwrap(), "1500");
//! let retry = status.get_details_retry_info().expect("a retry delay");
//! assert_eq!(retry.retry_delay, Some(Duration::from_millis(1500)));
//! ```

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::Response;
use http_body_util::Full;
use tonic::metadata::MetadataValue;
use tonic::{Code, Status};
use tonic_types::{ErrorDetails, StatusExt};

use crate::error::LockError;
use crate::layer::response::explain;

/// The trailer a gRPC channel's retry policy reads the server's delay from (gRFC A6).
const PUSHBACK: &str = "grpc-retry-pushback-ms";

impl LockError {
    /// The gRPC code a tonic service answers this error with (see the
    /// [table](crate::layer::grpc)): `ABORTED`, `RESOURCE_EXHAUSTED`, `UNAVAILABLE`,
    /// `INVALID_ARGUMENT`, `FAILED_PRECONDITION` or `INTERNAL`.
    pub fn grpc_code(&self) -> Code {
        match self {
            LockError::Contended { .. } => Code::Aborted,
            LockError::PermitsTaken { .. } => Code::ResourceExhausted,
            LockError::TimedOut { .. }
            | LockError::QueueFull { .. }
            | LockError::Lost { .. }
            | LockError::Backend(_) => Code::Unavailable,
            LockError::InvalidKey(_) => Code::InvalidArgument,
            // Retrying cannot help until an operator removes the foreign data.
            LockError::NotALock { .. } => Code::FailedPrecondition,
            // The server's own configuration is at fault, not the request.
            LockError::UpgradeRefused { .. }
            | LockError::ZeroPermits { .. }
            | LockError::Unsupported { .. } => Code::Internal,
        }
    }
}

/// The status [`LockLayer::grpc`](crate::LockLayer::grpc) answers with, so that a tonic
/// handler taking a lock itself ends the acquisition with `?`.
impl From<LockError> for Status {
    fn from(error: LockError) -> Status {
        let (_, title, detail) = explain(&error);
        let message = format!("{title}: {detail}");
        let code = error.grpc_code();
        let mut status = match error.retry_after() {
            Some(delay) => {
                let details = ErrorDetails::with_retry_info(Some(delay));
                let mut status = Status::with_error_details(code, message, details);
                status
                    .metadata_mut()
                    .insert(PUSHBACK, MetadataValue::from(millis(delay)));
                status
            }
            None => Status::new(code, message),
        };
        // The error itself, for a handler or interceptor that looks behind the status.
        status.set_source(Arc::new(error));
        status
    }
}

/// The trailers-only gRPC response (HTTP 200, `content-type: application/grpc`, the
/// status in the headers) of [`LockLayer::grpc`](crate::LockLayer::grpc) for `error`.
/// Start an [`on_rejection`](crate::LockLayer::on_rejection) from it, or from
/// `tonic::Status::from(error)`, to change a part and keep the rest.
pub fn grpc_rejection(error: LockError) -> Response<Full<Bytes>> {
    Status::from(error).into_http()
}

/// Whole milliseconds, rounded up, at least 1: a pushback of 0 would retry at once.
fn millis(delay: Duration) -> u64 {
    let millis = u64::try_from(delay.as_millis()).unwrap_or(u64::MAX);
    let rounded = millis.saturating_add(u64::from(delay.subsec_nanos() % 1_000_000 > 0));
    rounded.max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pushback_rounds_up_to_whole_milliseconds() {
        assert_eq!(millis(Duration::from_micros(1)), 1);
        assert_eq!(millis(Duration::from_millis(3)), 3);
        assert_eq!(millis(Duration::from_micros(3001)), 4);
        assert_eq!(millis(Duration::ZERO), 1);
    }
}

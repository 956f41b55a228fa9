//! The idempotency layer's refusals, as problem+json responses (RFC 9457).

use std::fmt;
use std::time::Duration;

use bytes::Bytes;
use http::{Response, StatusCode};
use http_body_util::Full;

use crate::error::{KeyError, LockError};
use crate::layer::response::{default_rejection, problem};

const TYPE_BASE: &str =
    "https://docs.rs/tower-lock/latest/tower_lock/enum.IdempotencyError.html#variant.";

/// Why the idempotency layer answered a request itself instead of running the handler or
/// replaying its first response, and the status of its answer:
///
/// | error | status |
/// |---|---|
/// | [`MissingKey`](IdempotencyError::MissingKey) (a route that requires the header) | 400 |
/// | [`InvalidKey`](IdempotencyError::InvalidKey) (empty, too long, not a visible ASCII string) | 400 |
/// | [`InFlight`](IdempotencyError::InFlight) (the first request with the key still runs) | 409, `Retry-After` |
/// | [`Mismatch`](IdempotencyError::Mismatch) (the key was used for a different request) | 422 |
/// | [`BodyTooLarge`](IdempotencyError::BodyTooLarge) (the request body is over the limit) | 413 |
/// | [`BodyUnreadable`](IdempotencyError::BodyUnreadable) (the body failed while read) | 400 |
/// | [`Lock`](IdempotencyError::Lock) (the store unreachable, a wait that ran out, a lost lock) | as [`LockError::status`] |
#[derive(Clone)]
#[non_exhaustive]
pub enum IdempotencyError {
    /// The route requires an idempotency key and the request has none.
    MissingKey {
        /// The header the key is read from.
        header: String,
    },
    /// The idempotency key cannot be used.
    InvalidKey(KeyError),
    /// A request with the same key is still being handled (the IETF draft's 409).
    InFlight {
        /// About when the first request will have finished.
        retry_after: Option<Duration>,
    },
    /// The key was first used for a different request (method, path, chosen headers or
    /// body differ: the draft's 422).
    Mismatch,
    /// The request body is larger than the layer buffers to fingerprint it.
    BodyTooLarge {
        /// The limit, in bytes.
        limit: usize,
    },
    /// The request body failed while the layer read it (the client went away, or sent a
    /// broken body).
    BodyUnreadable {
        /// What failed.
        reason: String,
    },
    /// The key's lock or record could not be had (see [`LockError`]).
    Lock(LockError),
}

impl IdempotencyError {
    /// The status the layer answers with (see the [table](IdempotencyError)).
    pub fn status(&self) -> StatusCode {
        match self {
            IdempotencyError::MissingKey { .. }
            | IdempotencyError::InvalidKey(_)
            | IdempotencyError::BodyUnreadable { .. } => StatusCode::BAD_REQUEST,
            IdempotencyError::InFlight { .. } => StatusCode::CONFLICT,
            IdempotencyError::Mismatch => StatusCode::UNPROCESSABLE_ENTITY,
            IdempotencyError::BodyTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            IdempotencyError::Lock(error) => error.status(),
        }
    }
}

impl fmt::Display for IdempotencyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            IdempotencyError::MissingKey { header } => {
                write!(f, "the request has no {header} header")
            }
            IdempotencyError::InvalidKey(e) => e.describe(f, "idempotency key"),
            IdempotencyError::InFlight { .. } => {
                f.write_str("a request with this idempotency key is in progress")
            }
            IdempotencyError::Mismatch => {
                f.write_str("the idempotency key was used for a different request")
            }
            IdempotencyError::BodyTooLarge { limit } => {
                write!(f, "the request body is over {limit} bytes")
            }
            IdempotencyError::BodyUnreadable { reason } => {
                write!(f, "the request body could not be read: {reason}")
            }
            IdempotencyError::Lock(e) => e.fmt(f),
        }
    }
}

impl std::error::Error for IdempotencyError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            // The message is the key error's, in words of the idempotency key.
            IdempotencyError::Lock(e) => Some(e),
            _ => None,
        }
    }
}

/// The layer's response for `error`: its [`status`](IdempotencyError::status) and a
/// problem+json body; a [`Lock`](IdempotencyError::Lock) error gets the lock layer's
/// [`default_rejection`].
pub fn idempotency_rejection(error: &IdempotencyError) -> Response<Full<Bytes>> {
    let (variant, title, detail, retry_after) = match error {
        IdempotencyError::Lock(e) => return default_rejection(e),
        IdempotencyError::MissingKey { header } => (
            "MissingKey",
            "Idempotency key required",
            format!("This operation requires an idempotency key in the {header} header."),
            None,
        ),
        IdempotencyError::InvalidKey(_) => (
            "InvalidKey",
            "Invalid idempotency key",
            format!("The idempotency key cannot be used: {error}."),
            None,
        ),
        IdempotencyError::InFlight { retry_after } => (
            "InFlight",
            "Request in progress",
            "A request with this idempotency key is being processed. Retry after it has finished to get its response.".to_owned(),
            *retry_after,
        ),
        IdempotencyError::Mismatch => (
            "Mismatch",
            "Idempotency key reused",
            "This idempotency key was used for a different request. Use a new key for a new request.".to_owned(),
            None,
        ),
        IdempotencyError::BodyTooLarge { limit } => (
            "BodyTooLarge",
            "Request body too large",
            format!("Requests with an idempotency key are limited to {limit} bytes."),
            None,
        ),
        IdempotencyError::BodyUnreadable { .. } => (
            "BodyUnreadable",
            "Request body unreadable",
            "The request body could not be read to the end.".to_owned(),
            None,
        ),
    };
    problem(
        error.status(),
        &format!("{TYPE_BASE}{variant}"),
        title,
        &detail,
        retry_after,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn in_flight_is_409_with_retry_after_and_mismatch_422() {
        let busy = idempotency_rejection(&IdempotencyError::InFlight {
            retry_after: Some(Duration::from_millis(1500)),
        });
        assert_eq!(busy.status(), StatusCode::CONFLICT);
        assert_eq!(busy.headers()["retry-after"], "2");
        assert_eq!(
            idempotency_rejection(&IdempotencyError::Mismatch).status(),
            StatusCode::UNPROCESSABLE_ENTITY
        );
    }
}

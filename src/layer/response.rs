//! Turning lock failures into HTTP responses: `application/problem+json` (RFC 9457).
//!
//! ```
//! use std::time::Duration;
//! use tower_lock::LockError;
//! use tower_lock::layer::response::default_rejection;
//!
//! let busy = LockError::Contended {
//!     key: "order:42".into(),
//!     retry_after: Some(Duration::from_millis(1500)),
//! };
//! let response = default_rejection(&busy);
//! assert_eq!(response.status(), 409);
//! assert_eq!(response.headers()["content-type"], "application/problem+json");
//! assert_eq!(response.headers()["retry-after"], "2");
//! ```
//!
//! The layer answers with these responses by itself; replace them per layer with
//! [`LockLayer::on_rejection`](crate::LockLayer::on_rejection), for example to keep an
//! API's own error format, starting from [`default_rejection`] or
//! [`LockError::status`] rather than rebuilding the mapping below by hand.
//!
//! | error | status | `Retry-After` |
//! |---|---|---|
//! | [`Contended`](LockError::Contended) (fail-fast route, lock held) | 409 | the layer's mean hold time, at most the holder's remaining lease |
//! | [`PermitsTaken`](LockError::PermitsTaken) (fail-fast route, every permit taken) | 429 | the layer's mean hold time, at most the earliest permit's remaining lease |
//! | [`TimedOut`](LockError::TimedOut) (held for the whole wait) | 503 | the layer's mean hold time, at most the holder's remaining lease |
//! | [`QueueFull`](LockError::QueueFull) (too many local waiters) | 503 | 1 s |
//! | [`Backend`](LockError::Backend) (the store unreachable or failing) | 503 | 1 s |
//! | [`Lost`](LockError::Lost) (lease lost while the handler ran) | 503 | 1 s |
//! | [`NotALock`](LockError::NotALock) (the lock's name in the store holds foreign data) | 503 | none |
//! | [`InvalidKey`](LockError::InvalidKey) (empty, too long, malformed) | 400 | none |
//! | [`UpgradeRefused`](LockError::UpgradeRefused) (a shared hold asked for exclusively by its owner) | 500 | none |
//! | [`ZeroPermits`](LockError::ZeroPermits) (a semaphore of zero permits) | 500 | none |
//! | [`Unsupported`](LockError::Unsupported) (a shared hold or permit on a store that keeps exclusive locks only) | 500 | none |
//!
//! `Retry-After` is in whole seconds, rounded up, and at least 1. The first three say
//! what the work takes, not how long the holder's lease runs (30 s by default, which a
//! client of a 100 ms handler would wait for nothing): the mean of the layer's recent
//! hold times, bounded above by the remaining lease the store reported, since the lock
//! frees by then at the latest if its holder stops renewing it. Before any of the
//! layer's holds has ended they say 1 s. [`LockLayer::retry_after`](crate::LockLayer::retry_after)
//! fixes them per layer instead.
//!
//! With the `axum` feature (on by default), `LockError` is also an axum `IntoResponse`
//! giving the same response.

use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Response, StatusCode, header};
use http_body_util::{BodyExt, Full, combinators::UnsyncBoxBody};

use crate::error::LockError;
use crate::layer::body::BoxError;

/// The media type of every rejection body.
pub const PROBLEM_JSON: &str = "application/problem+json";

const TYPE_BASE: &str = "https://docs.rs/tower-lock/latest/tower_lock/enum.LockError.html#variant.";

impl LockError {
    /// The status the layer answers this error with by default: 409, 429, 503, 400 or 500 (see the
    /// [table](self)). For an [`on_rejection`](crate::LockLayer::on_rejection) that keeps
    /// the statuses but writes its own body.
    pub fn status(&self) -> StatusCode {
        match self {
            LockError::Contended { .. } => StatusCode::CONFLICT,
            LockError::PermitsTaken { .. } => StatusCode::TOO_MANY_REQUESTS,
            // The server's own configuration is at fault, not the request.
            LockError::UpgradeRefused { .. }
            | LockError::ZeroPermits { .. }
            | LockError::Unsupported { .. } => StatusCode::INTERNAL_SERVER_ERROR,
            LockError::InvalidKey(_) => StatusCode::BAD_REQUEST,
            LockError::TimedOut { .. }
            | LockError::QueueFull { .. }
            | LockError::Lost { .. }
            | LockError::NotALock { .. }
            | LockError::Backend(_) => StatusCode::SERVICE_UNAVAILABLE,
        }
    }
}

/// The layer's default response for `error`: its [`status`](LockError::status), a
/// `Retry-After` header when [`retry_after`](LockError::retry_after) knows one, and a
/// problem+json body. Start an [`on_rejection`](crate::LockLayer::on_rejection) from it
/// to change one part and keep the rest:
///
/// ```
/// use http::{HeaderValue, Request};
/// use tower_lock::{LockBackend, LockError, LockLayer};
/// use tower_lock::layer::response::default_rejection;
///
/// fn layer<B>(backend: impl LockBackend) -> LockLayer<impl Fn(&Request<B>) -> Option<String> + Clone> {
///     LockLayer::new(backend, |req: &Request<B>| Some(req.uri().path().to_owned()))
///         .on_rejection(|error: LockError| {
///             let mut response = default_rejection(&error);
///             // Clients of this API back off for at least 5 s after any 503.
///             if error.status() == 503 {
///                 response.headers_mut().insert("retry-after", HeaderValue::from_static("5"));
///             }
///             response
///         })
/// }
/// ```
pub fn default_rejection(error: &LockError) -> Response<Full<Bytes>> {
    let (variant, title, detail) = explain(error);
    problem(
        error.status(),
        &format!("{TYPE_BASE}{variant}"),
        title,
        &detail,
        error.retry_after(),
    )
}

/// What a rejection for `error` tells the client: the error's variant name (the problem
/// type), a title and a sentence of detail. The problem+json body and the gRPC status
/// message say the same.
pub(crate) fn explain(error: &LockError) -> (&'static str, &'static str, String) {
    match error {
        LockError::Contended { .. } => (
            "Contended",
            "Resource is locked",
            "Another request is working on this resource. Retry after it has finished.".to_owned(),
        ),
        LockError::TimedOut { waited, .. } => (
            "TimedOut",
            "Timed out waiting for a lock",
            format!(
                "Another request held this resource for the whole wait of {} ms. Retry later.",
                waited.as_millis()
            ),
        ),
        LockError::PermitsTaken { permits, .. } => (
            "PermitsTaken",
            "Too many concurrent requests for this resource",
            format!("All {permits} permits for this resource are in use. Retry after one is freed."),
        ),
        LockError::UpgradeRefused { .. } => (
            "UpgradeRefused",
            "Lock cannot be upgraded",
            "This request holds the resource's lock shared and the server asked for it exclusively, which would deadlock, so the request was not run. Retrying will not help.".to_owned(),
        ),
        LockError::Unsupported { .. } => (
            "Unsupported",
            "Lock not supported by the lock service",
            "The server asked its lock service for a kind of lock it does not offer, so the request was not run. Retrying will not help.".to_owned(),
        ),
        LockError::ZeroPermits { .. } => (
            "ZeroPermits",
            "Semaphore without permits",
            "The server asked for a semaphore of zero permits for this resource, which can never be taken. Retrying will not help.".to_owned(),
        ),
        LockError::QueueFull { .. } => (
            "QueueFull",
            "Too many requests waiting for this resource",
            "This server already has the maximum number of requests queued for this resource. Retry later.".to_owned(),
        ),
        LockError::InvalidKey(e) => (
            "InvalidKey",
            "Invalid lock key",
            format!("The request cannot be locked: {e}."),
        ),
        LockError::Lost { .. } => (
            "Lost",
            "Lock lost",
            "The lock protecting this request expired before the request finished, so the work was stopped. Retry.".to_owned(),
        ),
        LockError::NotALock { .. } => (
            "NotALock",
            "Resource cannot be locked",
            "The lock for this resource is stored under a key that holds other data, so the request was not run. Retrying will not help until that data is removed.".to_owned(),
        ),
        LockError::Backend(_) => (
            "Backend",
            "Lock service unavailable",
            "The lock service could not be reached. Retry later.".to_owned(),
        ),
    }
}

/// A problem+json response (RFC 9457) of `status`, with a `Retry-After` header when
/// `retry_after` is known: the rejections of this crate's layers.
pub(crate) fn problem(
    status: StatusCode,
    type_url: &str,
    title: &str,
    detail: &str,
    retry_after: Option<Duration>,
) -> Response<Full<Bytes>> {
    let body = serde_json::json!({
        "type": type_url,
        "title": title,
        "status": status.as_u16(),
        "detail": detail,
    });
    let mut response = Response::new(Full::from(body.to_string()));
    *response.status_mut() = status;
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(PROBLEM_JSON));
    if let Some(retry_after) = retry_after {
        headers.insert(
            header::RETRY_AFTER,
            HeaderValue::from(retry_after_secs(retry_after)),
        );
    }
    response
}

/// The same response as [`default_rejection`].
#[cfg(feature = "axum")]
#[cfg_attr(docsrs, doc(cfg(feature = "axum")))]
impl axum::response::IntoResponse for LockError {
    fn into_response(self) -> axum::response::Response {
        default_rejection(&self).map(axum::body::Body::new)
    }
}

/// Whole seconds, rounded up, at least 1.
fn retry_after_secs(d: Duration) -> u64 {
    let secs = d.as_secs() + u64::from(d.subsec_nanos() > 0);
    secs.max(1)
}

/// The body of every rejection once it is in the layer: boxed, since
/// [`on_rejection`](crate::LockLayer::on_rejection) picks its type and rejections are not
/// the hot path.
pub(crate) type RejectionBody = UnsyncBoxBody<Bytes, BoxError>;

pub(crate) type Rejection = dyn Fn(LockError) -> Response<RejectionBody> + Send + Sync;

/// A rejection, default or the application's, in the layer's body.
pub(crate) fn boxed_rejection<B>(response: Response<B>) -> Response<RejectionBody>
where
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    response.map(|body| body.map_err(Into::into).boxed_unsync())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_after_rounds_up_to_whole_seconds() {
        assert_eq!(retry_after_secs(Duration::from_millis(1)), 1);
        assert_eq!(retry_after_secs(Duration::from_millis(1000)), 1);
        assert_eq!(retry_after_secs(Duration::from_millis(1001)), 2);
        assert_eq!(retry_after_secs(Duration::ZERO), 1);
    }

    #[test]
    fn contended_is_409_problem_json_with_retry_after() {
        let response = default_rejection(&LockError::Contended {
            key: "k".into(),
            retry_after: Some(Duration::from_millis(2500)),
        });
        assert_eq!(response.status(), StatusCode::CONFLICT);
        assert_eq!(response.headers()[header::CONTENT_TYPE], PROBLEM_JSON);
        assert_eq!(response.headers()[header::RETRY_AFTER], "3");
    }
}

//! [`IdempotencyLayer`]: `Idempotency-Key` for unsafe requests, on top of the lock (see
//! [the guide](crate::guide::idempotency)).
//!
//! The layer and [`IdempotencyError`] are also at the crate root; here are its
//! [`IdempotencyService`], [`IdempotencyFuture`] and bodies, its defaults, its default
//! rejection ([`idempotency_rejection`]) and the trait of the backends that keep its
//! records ([`IdempotencyBackend`]).

// The builder and the `Layer` implementation are here; the service in `service.rs`, the
// request's course in `future.rs`, the stored record in `record.rs`, the fingerprint and
// scoped key in `fingerprint.rs`, the refusals in `response.rs`, and the seam a backend
// implements to keep records in `store.rs`.

mod fingerprint;
mod future;
mod record;
mod response;
mod service;
mod store;

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use http::header::{HeaderName, HeaderValue, SET_COOKIE};
use http::request::Parts;
use http::{HeaderMap, StatusCode};
use tower_layer::Layer;

pub use self::response::{IdempotencyError, idempotency_rejection};
pub use self::service::{IdempotencyBody, IdempotencyFuture, IdempotencyService, InnerBody};
pub use self::store::IdempotencyBackend;
use self::store::records_of;
pub(crate) use self::store::{CONTEXT as RECORD_CONTEXT, Records, RecordsOf, bounded};
use crate::error::KeyError;
use crate::lock::backend::Backend;
use crate::lock::retry::RetryAfter;
use crate::lock::{DEFAULT_LEASE, MAX_DURATION};

/// How long a completed request's response is replayed by default: 24 hours, as the IETF
/// draft suggests and payment APIs keep them.
pub const DEFAULT_RETENTION: Duration = Duration::from_secs(24 * 60 * 60);

/// The largest request body buffered to fingerprint it by default (1 MiB): larger ones
/// get 413.
pub const DEFAULT_MAX_REQUEST_BODY: usize = 1024 * 1024;

/// The largest response body stored for replay by default (1 MiB): a larger response is
/// sent as it comes and not stored (the key is freed without a record).
pub const DEFAULT_MAX_RESPONSE_BODY: usize = 1024 * 1024;

/// The longest idempotency key accepted by default, in bytes (Stripe's limit).
const DEFAULT_MAX_KEY_LEN: usize = 255;

type Scope = dyn Fn(&Parts) -> String + Send + Sync;
type Rejection = dyn Fn(IdempotencyError) -> http::Response<IdempotencyBody> + Send + Sync;
type StoreIf = dyn Fn(StatusCode) -> bool + Send + Sync;

#[derive(Clone)]
pub(crate) struct Config {
    pub(crate) store: Arc<dyn Backend>,
    pub(crate) records: Arc<dyn Records>,
    pub(crate) header: HeaderName,
    pub(crate) required: bool,
    pub(crate) scope: Arc<Scope>,
    pub(crate) fingerprint_headers: Vec<HeaderName>,
    pub(crate) max_key_len: usize,
    pub(crate) max_request_body: usize,
    pub(crate) max_response_body: usize,
    pub(crate) retention: Duration,
    pub(crate) lease: Duration,
    /// `None`: a duplicate of a request in flight gets 409 at once; `Some(wait)`: it waits
    /// up to `wait` for the first to finish, then gets its response.
    pub(crate) wait: Option<Duration>,
    pub(crate) store_if: Arc<StoreIf>,
    pub(crate) deny_headers: Vec<HeaderName>,
    pub(crate) replay_header: Option<(HeaderName, HeaderValue)>,
    /// Whether a request that holds its lock runs to its end when its client goes away.
    pub(crate) finish_when_client_gone: bool,
    pub(crate) rejection: Option<Arc<Rejection>>,
    /// What a 409 says of when to come back: the mean of the holds this layer's clones
    /// have seen end, one second before any has.
    pub(crate) retry: RetryAfter,
}

impl Config {
    pub(crate) fn reject(&self, error: IdempotencyError) -> http::Response<IdempotencyBody> {
        match &self.rejection {
            Some(reject) => reject(error),
            None => idempotency_rejection(&error).map(future::boxed),
        }
    }

    /// The request's idempotency key: `Ok(None)` when it has none and may go without.
    pub(crate) fn key(
        &self,
        headers: &HeaderMap,
    ) -> Result<Option<String>, response::IdempotencyError> {
        use response::IdempotencyError::{InvalidKey, MissingKey};
        let malformed = |reason: String| InvalidKey(KeyError::Malformed { reason });
        let mut values = headers.get_all(&self.header).into_iter();
        let Some(value) = values.next() else {
            return match self.required {
                true => Err(MissingKey {
                    header: self.header.to_string(),
                }),
                false => Ok(None),
            };
        };
        // Which of two keys the client meant is unknown: neither is used (as the `Header`
        // extractor refuses a lock key sent twice).
        if values.next().is_some() {
            let header = self.header.as_str();
            return Err(malformed(format!(
                "header {header:?} is sent more than once"
            )));
        }
        let not_ascii = || malformed("the idempotency key is not visible ASCII".to_owned());
        let value = value.to_str().map_err(|_| not_ascii())?;
        // The draft sends the key as a structured-field string: `"8e03978e-..."`.
        let key = value
            .strip_prefix('"')
            .and_then(|v| v.strip_suffix('"'))
            .unwrap_or(value);
        if key.is_empty() {
            return Err(InvalidKey(KeyError::Empty));
        }
        if key.len() > self.max_key_len {
            return Err(InvalidKey(KeyError::TooLong {
                len: key.len(),
                max: self.max_key_len,
            }));
        }
        if !key.bytes().all(|b| b.is_ascii_graphic() || b == b' ') {
            return Err(not_ascii());
        }
        Ok(Some(key.to_owned()))
    }
}

/// Makes unsafe requests idempotent under an `Idempotency-Key` header (the IETF httpapi
/// draft "The Idempotency-Key HTTP Header Field", as payment APIs such as Stripe's
/// practise it): the first request with a key runs the handler under the key's lock and
/// its response is stored; a retry with the same key gets that response again, marked
/// `Idempotency-Replayed: true`, without running the handler.
///
/// ```
/// use axum::{Router, routing::post};
/// use tower_lock::{IdempotencyLayer, MemoryBackend};
///
/// // Or a RedisBackend, PostgresBackend or MySqlBackend shared by every instance.
/// let backend = MemoryBackend::new();
/// let app: Router = Router::new()
///     .route("/payments", post(|| async { "charged" }))
///     .route_layer(
///         IdempotencyLayer::new(backend)
///             // Keys of two tenants never meet.
///             .scope(|req| {
///                 let tenant = req.headers.get("x-tenant").and_then(|v| v.to_str().ok());
///                 tenant.unwrap_or_default().to_owned()
///             }),
///     );
/// ```
///
/// What each request gets:
///
/// | the key | answer |
/// |---|---|
/// | new | the handler runs under the key's lock; its response is stored for [`retention`](Self::retention) (unless [`store_if`](Self::store_if) says no: 5xx by default) |
/// | completed, same request | the stored response (status, headers, body), replayed |
/// | completed, different request (method, path and query, [chosen headers](Self::fingerprint_header), body) | 422 |
/// | in flight | 409 with `Retry-After` (the mean hold of this layer's requests, 1 s before any ended, as [`LockLayer`](crate::LockLayer) says it), or with [`wait_for_first`](Self::wait_for_first) the first's response once it is done |
/// | missing | 400, or with [`optional`](Self::optional) the handler runs as without this layer |
/// | sent twice, empty, over [`max_key_len`](Self::max_key_len), not visible ASCII | 400 |
/// | body over [`max_request_body`](Self::max_request_body) | 413, nothing stored |
/// | the store unreachable | 503 (fail closed) |
///
/// A request that holds its lock runs to its end even if its client goes away (see
/// [`stop_when_client_gone`](Self::stop_when_client_gone)), so a retry after a lost reply
/// gets the stored response. A handler that panics, or whose instance dies, leaves no
/// record: a panic frees the key at once, a dead instance's lock expires after its
/// [`lease`](Self::lease), and the retry then runs the handler again. A lock lost while the handler runs (the lease ran out
/// while the store was unreachable) drops the handler and stores nothing, as the lock
/// layer does. See the [guide](crate::guide::idempotency).
#[derive(Clone)]
#[must_use = "a layer does nothing until it is applied to a service or a router"]
pub struct IdempotencyLayer {
    config: Config,
}

impl IdempotencyLayer {
    /// Idempotency keys from the `Idempotency-Key` header, required, their records in
    /// `backend`; duplicates in flight get 409 at once.
    pub fn new(backend: impl IdempotencyBackend) -> Self {
        crate::telemetry::describe_metrics();
        IdempotencyLayer {
            config: Config {
                store: backend.store(),
                records: records_of(&backend),
                header: HeaderName::from_static("idempotency-key"),
                required: true,
                scope: Arc::new(|_| String::new()),
                fingerprint_headers: Vec::new(),
                max_key_len: DEFAULT_MAX_KEY_LEN,
                max_request_body: DEFAULT_MAX_REQUEST_BODY,
                max_response_body: DEFAULT_MAX_RESPONSE_BODY,
                retention: DEFAULT_RETENTION,
                lease: DEFAULT_LEASE,
                wait: None,
                store_if: Arc::new(|status| !status.is_server_error()),
                deny_headers: vec![SET_COOKIE],
                replay_header: Some((
                    HeaderName::from_static("idempotency-replayed"),
                    HeaderValue::from_static("true"),
                )),
                finish_when_client_gone: true,
                rejection: None,
                retry: RetryAfter::estimate(),
            },
        }
    }

    /// Reads the key from `header` instead of `Idempotency-Key`.
    pub fn header(mut self, header: HeaderName) -> Self {
        self.config.header = header;
        self
    }

    /// Lets requests without the header through to the handler, unguarded (by default
    /// they get 400).
    pub fn optional(mut self) -> Self {
        self.config.required = false;
        self
    }

    /// The scope of a request's key, for example its authenticated tenant or account:
    /// keys are compared only within one scope, so two tenants sending the same key never
    /// see each other's responses. One scope for every request by default.
    pub fn scope<F>(mut self, scope: F) -> Self
    where
        F: Fn(&Parts) -> String + Send + Sync + 'static,
    {
        self.config.scope = Arc::new(scope);
        self
    }

    /// Adds `header` to what makes two requests the same (besides the method, the path
    /// and query, and the body): a retry must send it with the same values.
    pub fn fingerprint_header(mut self, header: HeaderName) -> Self {
        self.config.fingerprint_headers.push(header);
        self
    }

    /// The longest key accepted, in bytes (255 by default); longer ones get 400.
    pub fn max_key_len(mut self, max: usize) -> Self {
        self.config.max_key_len = max;
        self
    }

    /// The largest request body the layer buffers to fingerprint, in bytes (1 MiB by
    /// default); a larger one gets 413 and nothing is stored.
    pub fn max_request_body(mut self, max: usize) -> Self {
        self.config.max_request_body = max;
        self
    }

    /// The largest response body stored for replay, in bytes (1 MiB by default): a record
    /// is never larger than this and its headers. A larger response is sent on as it comes
    /// and not stored: the key is freed without a record, as for a 5xx.
    pub fn max_response_body(mut self, max: usize) -> Self {
        self.config.max_response_body = max;
        self
    }

    /// How long a completed request's response is kept for replay (24 hours by default,
    /// at least 1 ms); the store expires it after that.
    pub fn retention(mut self, retention: Duration) -> Self {
        self.config.retention = retention.clamp(Duration::from_millis(1), MAX_DURATION);
        self
    }

    /// The lease of the key's lock while the handler runs (30 s by default), renewed by
    /// the watchdog: after a crash of its instance, how long until a retry runs.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.config.lease = lease;
        self
    }

    /// A duplicate arriving while the first request runs waits up to `wait` for it and
    /// gets its response (or runs the handler itself, if the first left no record); 503
    /// if the wait runs out. By default it gets 409 at once.
    pub fn wait_for_first(mut self, wait: Duration) -> Self {
        self.config.wait = Some(wait);
        self
    }

    /// Which statuses are stored: by default all but 5xx. A response not stored frees the
    /// key without a record, so the client's retry runs the handler again.
    pub fn store_if<F>(mut self, store: F) -> Self
    where
        F: Fn(StatusCode) -> bool + Send + Sync + 'static,
    {
        self.config.store_if = Arc::new(store);
        self
    }

    /// Leaves `header` out of stored responses (`Set-Cookie` is left out by default;
    /// hop-by-hop headers always are).
    pub fn deny_header(mut self, header: HeaderName) -> Self {
        self.config.deny_headers.push(header);
        self
    }

    /// Stores `Set-Cookie` too, and every header but the hop-by-hop ones.
    pub fn allow_all_headers(mut self) -> Self {
        self.config.deny_headers.clear();
        self
    }

    /// The header a replayed response carries (`Idempotency-Replayed: true` by default);
    /// `None` marks nothing.
    pub fn replay_header(mut self, header: Option<(HeaderName, HeaderValue)>) -> Self {
        self.config.replay_header = header;
        self
    }

    /// Drops the handler when the client goes away (its request future is dropped: a
    /// closed connection, an outer timeout), as [`LockLayer`](crate::LockLayer) does: no
    /// record is stored, and the retry runs the handler again.
    ///
    /// By default a request that holds its key's lock runs to its end in a task of its
    /// own whatever the client does, so that the client's retry after a lost reply gets
    /// the stored response instead of a second run of a handler that stopped half-way.
    pub fn stop_when_client_gone(mut self) -> Self {
        self.config.finish_when_client_gone = false;
        self
    }

    /// Answers the layer's refusals with `rejection` instead of the default problem+json
    /// ([`idempotency_rejection`]), for example in an API's own error format. The closure
    /// returns an `http::Response` with any body of `Bytes` (axum's `Response` too).
    ///
    /// ```
    /// use axum::response::IntoResponse;
    /// use tower_lock::{IdempotencyError, IdempotencyLayer, MemoryBackend};
    ///
    /// let layer = IdempotencyLayer::new(MemoryBackend::new())
    ///     .on_rejection(|error: IdempotencyError| (error.status(), error.to_string()).into_response());
    /// # drop(layer);
    /// ```
    pub fn on_rejection<F, B>(mut self, rejection: F) -> Self
    where
        F: Fn(IdempotencyError) -> http::Response<B> + Send + Sync + 'static,
        B: http_body::Body<Data = bytes::Bytes> + Send + 'static,
        B::Error: Into<crate::layer::body::BoxError>,
    {
        self.config.rejection = Some(Arc::new(move |error| rejection(error).map(future::boxed)));
        self
    }
}

impl<S> Layer<S> for IdempotencyLayer {
    type Service = IdempotencyService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        IdempotencyService::new(inner, Arc::new(self.config.clone()))
    }
}

impl fmt::Debug for IdempotencyLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let c = &self.config;
        f.debug_struct("IdempotencyLayer")
            .field("header", &c.header)
            .field("required", &c.required)
            .field("retention", &c.retention)
            .field("lease", &c.lease)
            .field("wait", &c.wait)
            .finish_non_exhaustive()
    }
}

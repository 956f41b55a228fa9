//! The lock middleware: [`LockLayer`] (also at the crate root, with [`OnLockLost`]), the
//! [`LockService`] it wraps a service in, the [`ResponseFuture`] that holds the lock while
//! the handler runs, the [`ResponseBody`] that may hold it until the body is sent, and
//! rejections as responses ([`response`]).

// The builder and the `Layer` implementation are here; the service that takes the lock in
// `service.rs`, the response future in `future.rs`, the body in `body.rs`, rejections in
// `response.rs`.

pub(crate) mod body;
pub(crate) mod future;
#[cfg(feature = "grpc")]
#[cfg_attr(docsrs, doc(cfg(feature = "grpc")))]
pub mod grpc;
pub mod response;
pub(crate) mod service;

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::Response;
use tower_layer::Layer;

use crate::backend::LockBackend;
use crate::error::LockError;
use crate::layer::body::BoxError;
use crate::layer::response::{Rejection, RejectionBody, boxed_rejection, default_rejection};
use crate::lock::backend::Backend;
use crate::lock::policy::{Exclusive, Permits, ReadWrite, SharedIf};
use crate::lock::retry::RetryAfter;
use crate::lock::{DEFAULT_LEASE, DEFAULT_MAX_LOCAL_WAITERS, Mode};
use crate::telemetry::{self, Route};

pub use self::body::ResponseBody;
pub use self::future::ResponseFuture;
pub use self::service::LockService;

/// How long a request waits for a held lock by default.
pub const DEFAULT_WAIT: Duration = Duration::from_secs(5);

/// What the layer does when a held lock is lost while the handler still runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum OnLockLost {
    /// Drop the handler future (its work stops at its next `.await`) and answer with the
    /// rejection for [`LockError::Lost`] (503 by default).
    #[default]
    Abort,
    /// Let the handler finish; it can watch [`HeldLock::lost`](crate::HeldLock::lost) and
    /// must rely on the fencing token to keep its writes safe.
    Continue,
}

#[derive(Clone)]
pub(crate) struct Config {
    pub(crate) mode: Mode,
    pub(crate) lease: Duration,
    pub(crate) on_lost: OnLockLost,
    pub(crate) max_local_waiters: usize,
    pub(crate) hold_body: bool,
    pub(crate) rejection: Option<Arc<Rejection>>,
    /// The `route` label of the layer's metrics; unset: axum's matched path.
    pub(crate) route: Route,
    /// What a refusal for contention says about when to try again: by default the mean
    /// of this layer's hold times, shared by its clones and the services they wrap.
    pub(crate) retry: RetryAfter,
}

impl Config {
    pub(crate) fn reject(&self, error: LockError) -> Response<RejectionBody> {
        match &self.rejection {
            Some(reject) => reject(error),
            None => boxed_rejection(default_rejection(&error)),
        }
    }
}

/// Locks each request on a key taken from it, for exactly as long as its handler runs.
///
/// ```no_run
/// use std::time::Duration;
/// use axum::{Router, extract::Request, routing::post};
/// use tower_lock::{LockLayer, RedisBackend};
///
/// # async fn run() -> Result<(), tower_lock::BuildError> {
/// let backend = RedisBackend::connect("redis://127.0.0.1:6379").await?;
/// let app: Router = Router::new()
///     .route("/orders/{id}/pay", post(|| async { "paid" }))
///     .route_layer(
///         LockLayer::new(backend, |req: &Request| {
///             req.uri().path().strip_prefix("/orders/").map(str::to_owned)
///         })
///         .wait(Duration::from_secs(2)),
///     );
/// # drop(app);
/// # Ok(())
/// # }
/// ```
///
/// The key extractor returns `None` to let a request through unlocked. A request whose
/// lock cannot be had gets a response from [`on_rejection`](Self::on_rejection)
/// (problem+json with 409, 429, 503, 400 or 500 by default, see
/// [`response`]), so no `HandleErrorLayer` is needed.
///
/// Requests take the lock exclusively by default. [`read_write`](Self::read_write) and
/// [`shared_if`](Self::shared_if) let some take shared holds of it instead (readers that
/// do not exclude each other), and [`permits`](Self::permits) turns it into a semaphore
/// (at most `n` requests per key at once). Each sets the layer's hold policy, its second
/// type parameter `P` (see [`policy`](crate::lock::policy)).
///
/// For keys taken from a path parameter, a header or a query parameter, with a prefix per
/// route, see [`PathParam`](crate::PathParam), [`Header`](crate::Header) and
/// [`QueryParam`](crate::QueryParam).
///
/// # `Router::layer` or `Router::route_layer`
///
/// Both lock every request a route matched. Under `Router::layer` the layer also wraps
/// the router's fallback, but a request no route matched (a 404) passes through unlocked
/// to it: the layer recognises axum's fallback by the `OriginalUri` the router inserts
/// without a `MatchedPath` (with the `axum` feature; without it, every request is
/// locked). What `layer` still does differently:
///
/// - a request whose path matched but whose method did not (405 Method Not Allowed)
///   takes the lock, and a `PathParam` key is read for it, before the 405 is returned;
/// - a custom `.fallback(..)` handler runs unlocked, like the default 404;
/// - a router wrapped from outside and served as another router's `fallback_service`
///   looks like a fallback too and runs unlocked: wrap it with `nest_service`, or serve
///   `LockLayer::layer(router)` directly (outside any router, every request is locked).
///
/// `route_layer` wraps only the routes, so neither 404 nor 405 reaches the layer: prefer
/// it when every route under it needs the lock.
#[derive(Clone)]
#[must_use = "a layer does nothing until it is applied to a service or a router"]
pub struct LockLayer<K, P = Exclusive> {
    store: Arc<dyn Backend>,
    key: K,
    config: Arc<Config>,
    policy: P,
}

impl<K> LockLayer<K> {
    /// Locks requests on the key `key` extracts, using `backend`. Waits up to 5 s by default.
    pub fn new(backend: impl LockBackend, key: K) -> Self {
        telemetry::describe_metrics();
        LockLayer {
            store: backend.store(),
            key,
            policy: Exclusive,
            config: Arc::new(Config {
                mode: Mode::Wait(DEFAULT_WAIT),
                lease: DEFAULT_LEASE,
                on_lost: OnLockLost::default(),
                max_local_waiters: DEFAULT_MAX_LOCAL_WAITERS,
                hold_body: false,
                rejection: None,
                route: Route::default(),
                retry: RetryAfter::estimate(),
            }),
        }
    }

    /// A read/write lock per key: `GET`, `HEAD` and `OPTIONS` requests take shared holds,
    /// which any number of requests have at once, and other methods the exclusive one,
    /// which waits until no shared hold is left and keeps new ones out (see
    /// [`LockRequest::shared`](crate::LockRequest::shared)). A writer that waits is not
    /// starved by readers that arrive after it.
    ///
    /// A nested layer that takes the key exclusively under a shared hold of this one
    /// (the same request) is refused with 500
    /// ([`LockError::UpgradeRefused`]): take the
    /// exclusive hold in the outer layer.
    pub fn read_write(self) -> LockLayer<K, ReadWrite> {
        self.policy(ReadWrite)
    }

    /// Shared holds for the requests `shared` returns true for, the exclusive hold for
    /// the others (as [`read_write`](Self::read_write) does by method).
    ///
    /// ```
    /// use axum::extract::Request;
    /// use tower_lock::{LockLayer, MemoryBackend};
    ///
    /// // Reports are read in bulk under shared holds; everything else excludes them.
    /// let layer = LockLayer::new(MemoryBackend::new(), |_: &Request| Some("ledger"))
    ///     .shared_if(|req: &Request| req.uri().path().starts_with("/reports"));
    /// # drop(layer);
    /// ```
    pub fn shared_if<F>(self, shared: F) -> LockLayer<K, SharedIf<F>> {
        self.policy(SharedIf(shared))
    }

    /// A semaphore per key: every request takes one of `n` permits, so at most `n`
    /// requests of the key run at once, across instances (see
    /// [`LockRequest::permits`](crate::LockRequest::permits)). When all are taken a
    /// fail-fast route answers 429 Too Many Requests with `Retry-After`, and a waiting
    /// route waits for a permit to be freed, then answers 503 if its wait ran out.
    ///
    /// ```
    /// use axum::extract::Request;
    /// use tower_lock::{LockLayer, MemoryBackend};
    ///
    /// // At most 3 exports per tenant at once; the 4th gets a 429.
    /// let layer = LockLayer::new(MemoryBackend::new(), |req: &Request| {
    ///     req.headers().get("x-tenant")?.to_str().ok().map(|t| format!("exports:{t}"))
    /// })
    /// .permits(3)
    /// .fail_fast();
    /// # drop(layer);
    /// ```
    ///
    /// # Panics
    ///
    /// If `n` is 0: a semaphore nobody can ever take is a configuration bug, refused when
    /// the layer is built rather than answered 500 on every request.
    pub fn permits(self, n: u32) -> LockLayer<K, Permits> {
        assert!(
            n > 0,
            "LockLayer::permits(0): a semaphore of zero permits would refuse every request"
        );
        self.policy(Permits(n))
    }

    fn policy<P>(self, policy: P) -> LockLayer<K, P> {
        LockLayer {
            store: self.store,
            key: self.key,
            config: self.config,
            policy,
        }
    }
}

impl<K, P> LockLayer<K, P> {
    /// Waits up to `timeout` for a held lock, woken by its release; then answers 503 with
    /// `Retry-After`.
    pub fn wait(mut self, timeout: Duration) -> Self {
        Arc::make_mut(&mut self.config).mode = Mode::Wait(timeout);
        self
    }

    /// Does not wait: a request whose lock is held gets 409 at once.
    pub fn fail_fast(mut self) -> Self {
        Arc::make_mut(&mut self.config).mode = Mode::TryOnce;
        self
    }

    /// The lease (default 30 s), renewed by the watchdog every lease/3 while the handler
    /// runs. If the process dies the lock frees itself at most one lease later.
    pub fn lease(mut self, lease: Duration) -> Self {
        Arc::make_mut(&mut self.config).lease = lease;
        self
    }

    /// Fixes the `Retry-After` of this layer's 409 (fail-fast, lock held), 429 (fail-fast,
    /// every permit taken) and 503 (the wait ran out) to `retry_after`, rounded up to
    /// whole seconds. For routes whose handlers take a known time, or whose clients
    /// should back off by a policy of their own.
    ///
    /// Without it the layer says what its work takes: the mean time of its recent holds
    /// (an exponentially weighted mean, each new hold weighing 1/8), at most the holder's
    /// remaining lease as the store reports it, and at least 1 s. Before any of its holds
    /// has ended it says 1 s (a client that retries early is refused again at the cost
    /// of one request). The holds are the layer's own, whatever the route: the clones of
    /// a layer applied to several routes (by `Router::route_layer`) share one mean, and
    /// so do a read/write route's shared and exclusive holds. A hold that was lost is
    /// left out.
    ///
    /// ```
    /// use std::time::Duration;
    /// use axum::extract::Request;
    /// use tower_lock::{LockLayer, MemoryBackend};
    ///
    /// // A nightly export runs for minutes: clients come back in five.
    /// let layer = LockLayer::new(MemoryBackend::new(), |_: &Request| Some("export"))
    ///     .fail_fast()
    ///     .retry_after(Duration::from_secs(300));
    /// # drop(layer);
    /// ```
    ///
    /// The lock API sets it per acquisition with
    /// [`LockRequest::retry_after`](crate::LockRequest::retry_after).
    pub fn retry_after(mut self, retry_after: Duration) -> Self {
        Arc::make_mut(&mut self.config).retry = RetryAfter::Fixed(retry_after);
        self
    }

    /// Bounds the requests of this process queued for one key (default 1024); past it a
    /// request is answered 503 with `Retry-After` at once (see
    /// [`LockRequest::max_local_waiters`](crate::LockRequest::max_local_waiters)).
    pub fn max_local_waiters(mut self, max: usize) -> Self {
        Arc::make_mut(&mut self.config).max_local_waiters = max;
        self
    }

    /// What to do when the lock is lost while the handler runs (default
    /// [`OnLockLost::Abort`]).
    pub fn on_lock_lost(mut self, policy: OnLockLost) -> Self {
        Arc::make_mut(&mut self.config).on_lost = policy;
        self
    }

    /// Keeps the lock until the response body has been sent to its end, instead of
    /// releasing it when the handler returns. For handlers that stream work out in the
    /// body (an export, a long download) that must stay exclusive.
    ///
    /// The client sees the end of the body only after the release: the frame that ends it
    /// (by the stream's end or by a `content-length` the handler set) is sent after the
    /// release has run. A response with no body to send (to `HEAD`, a 204 or 304, an
    /// empty body) is released before it is returned, as without this option. A body dropped before its end (client
    /// gone) releases in the background. With [`OnLockLost::Abort`], losing the lock
    /// while the body is sent ends the body with an error, which aborts the response.
    pub fn hold_until_body_end(mut self) -> Self {
        Arc::make_mut(&mut self.config).hold_body = true;
        self
    }

    /// Names this layer in the crate's metrics: the `route` label of every acquisition
    /// and hold it makes. Without it the label is the path pattern axum matched
    /// (`/orders/{id}/pay`), or empty outside an axum router. Never a key: every value is
    /// its own time series, so keep labels to a fixed set. Without the `metrics` feature
    /// this does nothing (so an application's own optional metrics need no `cfg` here).
    ///
    /// ```
    /// # use axum::extract::Request;
    /// use tower_lock::{LockLayer, MemoryBackend};
    ///
    /// let layer = LockLayer::new(MemoryBackend::new(), |req: &Request| {
    ///     Some(req.uri().path().to_owned())
    /// })
    /// .metrics_label("checkout");
    /// # drop(layer);
    /// ```
    pub fn metrics_label(mut self, label: impl Into<std::borrow::Cow<'static, str>>) -> Self {
        Arc::make_mut(&mut self.config).route = Route::new(label.into());
        self
    }

    /// Builds the response for a request whose lock could not be taken or was lost,
    /// replacing the problem+json default. Start from
    /// [`default_rejection`] to change one part of
    /// it (a header, the body) and keep the rest, or ask
    /// [`LockError::status`](crate::LockError::status) to keep the statuses under a body
    /// of your own.
    ///
    /// The closure returns an `http::Response` with any body of [`Bytes`] (the same type
    /// with or without the `axum` feature): axum's `Response`, so an axum application
    /// ends it with `.into_response()`, or `http_body_util::Full<Bytes>` as
    /// `default_rejection` returns.
    ///
    /// ```
    /// use axum::{extract::Request, http::StatusCode, response::IntoResponse};
    /// use tower_lock::{LockError, LockLayer, MemoryBackend};
    ///
    /// let layer = LockLayer::new(MemoryBackend::new(), |req: &Request| {
    ///     Some(req.uri().path().to_owned())
    /// })
    /// .on_rejection(|error: LockError| (error.status(), "try again later").into_response());
    /// # drop(layer);
    /// ```
    pub fn on_rejection<F, B>(mut self, rejection: F) -> Self
    where
        F: Fn(LockError) -> Response<B> + Send + Sync + 'static,
        B: http_body::Body<Data = Bytes> + Send + 'static,
        B::Error: Into<BoxError>,
    {
        Arc::make_mut(&mut self.config).rejection =
            Some(Arc::new(move |error| boxed_rejection(rejection(error))));
        self
    }
}

#[cfg(feature = "grpc")]
impl<K, P> LockLayer<K, P> {
    /// Answers rejections as gRPC statuses, for a tonic server (feature `grpc`): `ABORTED`
    /// when the lock is held on a fail-fast route, `RESOURCE_EXHAUSTED` when every permit
    /// is taken, `UNAVAILABLE` when the wait ran out or the store is down,
    /// `INVALID_ARGUMENT` for a bad key, each with its retry delay in the status details
    /// and the `grpc-retry-pushback-ms` trailer (see [`crate::layer::grpc`]).
    ///
    /// A tonic server is a tower service of `http` requests, so the layer goes on it as on
    /// an axum router; the key closure reads the request's path (`/package.Service/Method`)
    /// and metadata (its headers), and the handler finds the [`HeldLock`](crate::HeldLock)
    /// in `request.extensions()`.
    ///
    /// ```
    /// use http::Request;
    /// use tower_lock::{LockLayer, MemoryBackend};
    ///
    /// // One lock per order, named by the caller's `x-order-id` metadata.
    /// let layer = LockLayer::new(MemoryBackend::new(), |req: &Request<tonic::body::Body>| {
    ///     let order = req.headers().get("x-order-id")?.to_str().ok()?;
    ///     Some(format!("order:{order}"))
    /// })
    /// .fail_fast()
    /// .grpc();
    /// // tonic::transport::Server::builder().layer(layer).add_service(..)
    /// # drop(layer);
    /// ```
    pub fn grpc(self) -> Self {
        self.on_rejection(crate::layer::grpc::grpc_rejection)
    }
}

impl<K, P: fmt::Debug> fmt::Debug for LockLayer<K, P> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LockLayer")
            .field("policy", &self.policy)
            .field("mode", &self.config.mode)
            .field("lease", &self.config.lease)
            .field("on_lost", &self.config.on_lost)
            .field("max_local_waiters", &self.config.max_local_waiters)
            .field("hold_until_body_end", &self.config.hold_body)
            .field("retry_after", &self.config.retry)
            .finish_non_exhaustive()
    }
}

impl<S, K: Clone, P: Clone> Layer<S> for LockLayer<K, P> {
    type Service = LockService<S, K, P>;

    fn layer(&self, inner: S) -> Self::Service {
        LockService::new(
            inner,
            self.store.clone(),
            (self.key.clone(), self.policy.clone()),
            self.config.clone(),
        )
    }
}

//! [`LockService`]: the middleware service.

use std::fmt;
use std::sync::Arc;
use std::task::{Context, Poll};

use http::{Request, Response};
use tower_service::Service;

use crate::error::LockError;
use crate::key::KeyExtractor;
use crate::layer::Config;
use crate::layer::body::ResponseBody;
use crate::layer::future::ResponseFuture;
use crate::lock::backend::Backend;
use crate::lock::held::push_outer;
use crate::lock::many::{ManyLockRequest, canonical};
use crate::lock::policy::{Exclusive, HoldPolicy};
use crate::lock::{HeldLock, LockRequest};
use crate::telemetry::{Labels, Outcome, Route};

/// Middleware that holds a distributed lock while the inner service handles a request.
/// Created by [`LockLayer`](crate::LockLayer).
///
/// # Backpressure
///
/// `poll_ready` is always ready. Each request's response future takes its lock first and
/// only then drives a clone of the inner service to readiness and calls it (as tower's
/// `Oneshot` does), so a request waiting for a lock holds none of the inner service's
/// capacity: a `ConcurrencyLimit` inside this layer counts only requests that hold their
/// lock, and requests for free keys are not held up behind requests waiting for a lock.
/// A request that has its lock keeps it while it waits for that capacity.
///
/// The flip side is that this service does not pass the inner service's backpressure
/// out: a limit meant to stop requests before they queue for locks belongs outside the
/// layer, and the wait for a lock is bounded by [`LockLayer::wait`](crate::LockLayer::wait)
/// and [`max_local_waiters`](crate::LockLayer::max_local_waiters), not by the inner
/// service.
#[derive(Clone)]
pub struct LockService<S, K, P = Exclusive> {
    inner: S,
    store: Arc<dyn Backend>,
    key: K,
    /// Which kind of hold each request takes (see [`policy`](crate::lock::policy)).
    policy: P,
    config: Arc<Config>,
}

impl<S, K, P> LockService<S, K, P> {
    pub(crate) fn new(
        inner: S,
        store: Arc<dyn Backend>,
        (key, policy): (K, P),
        config: Arc<Config>,
    ) -> Self {
        LockService {
            inner,
            store,
            key,
            policy,
            config,
        }
    }

    /// The wrapped service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The wrapped service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// Unwraps the service, dropping the layer's configuration.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<S: fmt::Debug, K, P> fmt::Debug for LockService<S, K, P> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LockService")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

impl<S, K, P, ReqBody, ResBody> Service<Request<ReqBody>> for LockService<S, K, P>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone,
    K: KeyExtractor<ReqBody>,
    P: HoldPolicy<ReqBody>,
    ResBody: http_body::Body,
{
    type Response = Response<ResponseBody<ResBody>>;
    type Error = S::Error;
    type Future = ResponseFuture<S, ReqBody>;

    /// Always ready: the inner service is driven to readiness by the response future, after
    /// the lock is taken, so requests waiting for a lock hold none of its capacity.
    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, mut request: Request<ReqBody>) -> Self::Future {
        if unmatched_by_router(&request) {
            return self.pass_through(request);
        }
        // Every key of a multi-key request is held the same way.
        let kind = self.policy.kind(&request);
        // Several keys are checked here, as one key is by its backend: a refusal takes
        // nothing.
        let keys = match self.key.extract_all(&request) {
            Ok(Some(keys)) if keys.len() == 1 => Ok(keys),
            Ok(Some(keys)) => canonical(keys, self.store.max_key_len()),
            Ok(None) => return self.pass_through(request),
            Err(e) => Err(e),
        };
        let mut keys = match keys {
            Ok(keys) => keys,
            Err(e) => {
                let route = route_of(&self.config, &request);
                Labels::new(self.store.metrics(), &route, kind.label())
                    .acquisition(Outcome::InvalidKey, None);
                return ResponseFuture::rejected(self.config.reject(LockError::InvalidKey(e)));
            }
        };
        // An outer layer has put its `HeldLock` into the extensions: nested layers take
        // their locks under the same owner, so one request re-enters instead of
        // deadlocking on itself. This layer's `HeldLock` replaces it; `HeldLocks` keeps it.
        let owner = match request.extensions().get::<HeldLock>().cloned() {
            Some(outer) => {
                let owner = outer.owner().clone();
                push_outer(request.extensions_mut(), outer);
                owner
            }
            None => self.store.new_owner(),
        };
        let route = route_of(&self.config, &request);
        let acquire = match (keys.pop(), keys.is_empty()) {
            (Some(key), true) => LockRequest::new(self.store.clone(), key)
                .kind(kind)
                .owner(owner)
                .lease(self.config.lease)
                .max_local_waiters(self.config.max_local_waiters)
                .mode(self.config.mode)
                .route(route)
                .retry(self.config.retry.clone())
                .into_future(),
            (last, _) => {
                keys.extend(last);
                ManyLockRequest::new(self.store.clone(), keys)
                    .kind(kind)
                    .owner(owner)
                    .lease(self.config.lease)
                    .max_local_waiters(self.config.max_local_waiters)
                    .route(route)
                    .retry(self.config.retry.clone())
                    .into_future(self.config.mode)
            }
        };
        ResponseFuture::acquiring(acquire, request, self.inner.clone(), self.config.clone())
    }
}

impl<S: Clone, K, P> LockService<S, K, P> {
    /// A request served unlocked, by a clone of the inner service that its response
    /// future drives to readiness, as a locked one's is.
    fn pass_through<ReqBody>(&self, request: Request<ReqBody>) -> ResponseFuture<S, ReqBody>
    where
        S: Service<Request<ReqBody>>,
    {
        ResponseFuture::pass_through(request, self.inner.clone(), self.config.clone())
    }
}

/// True for a request axum's router sent to its fallback (no route matched: a 404) under
/// `Router::layer`: the router inserts `OriginalUri` into every request it routes and
/// `MatchedPath` only into matched ones. Such a request has nothing to protect, so it
/// runs unlocked instead of taking a lock on its path or a 400 from `PathParam`.
///
/// A service outside any router has neither extension, and one behind `nest_service`
/// has no `MatchedPath` but a URI stripped of its prefix: both are locked.
#[cfg(feature = "axum")]
fn unmatched_by_router<B>(request: &Request<B>) -> bool {
    use axum::extract::{MatchedPath, OriginalUri};
    let extensions = request.extensions();
    extensions.get::<MatchedPath>().is_none()
        && extensions
            .get::<OriginalUri>()
            .is_some_and(|original| original.0 == *request.uri())
}

/// The `route` label of a request's metrics: the layer's, else the path pattern axum
/// matched.
fn route_of<B>(config: &Config, request: &Request<B>) -> Route {
    #[cfg(all(feature = "metrics", feature = "axum"))]
    if !config.route.is_set() {
        if let Some(path) = request.extensions().get::<axum::extract::MatchedPath>() {
            return Route::matched(path.as_str());
        }
    }
    let _ = request;
    config.route.clone()
}

/// Without the `axum` feature no router is known: every request is locked.
#[cfg(not(feature = "axum"))]
fn unmatched_by_router<B>(_: &Request<B>) -> bool {
    false
}

#[cfg(test)]
mod tests {
    use std::convert::Infallible;

    use bytes::Bytes;
    use http::{Request, Response, StatusCode, header};
    use http_body_util::{BodyExt, Full};
    use tower::{Layer, ServiceExt};

    use crate::layer::response::PROBLEM_JSON;
    use crate::{LockLayer, MemoryBackend};

    /// The point of the `axum` feature being optional: the layer over a plain tower
    /// service with an `http_body_util` body, naming no axum type (this test also runs
    /// under `--no-default-features`).
    #[tokio::test]
    async fn a_plain_tower_service_gets_a_problem_json_409() {
        let backend = MemoryBackend::new();
        let service = LockLayer::new(backend.clone(), |req: &Request<Full<Bytes>>| {
            Some(req.uri().path().to_owned())
        })
        .fail_fast()
        .layer(tower::service_fn(|_: Request<Full<Bytes>>| async {
            Ok::<_, Infallible>(Response::new(Full::from("done")))
        }));
        let request = || Request::post("/orders/1").body(Full::default()).unwrap();

        let held = backend.lock("/orders/1").try_once().await.unwrap();
        let busy = service.clone().oneshot(request()).await.unwrap();
        assert_eq!(busy.status(), StatusCode::CONFLICT);
        assert_eq!(busy.headers()[header::CONTENT_TYPE], PROBLEM_JSON);
        let body = busy.into_body().collect().await.unwrap().to_bytes();
        let problem: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(problem["status"], 409);
        assert_eq!(problem["title"], "Resource is locked");

        held.release().await.unwrap();
        let free = service.oneshot(request()).await.unwrap();
        assert_eq!(free.status(), StatusCode::OK);
        let body = free.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(body, "done");
    }
}

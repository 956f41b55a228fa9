//! [`LockService`]: the middleware service.

use std::fmt;
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::extract::{MatchedPath, OriginalUri};
use http::{Request, Response};
use tower_service::Service;

use crate::backend::Store;
use crate::body::ResponseBody;
use crate::error::LockError;
use crate::future::ResponseFuture;
use crate::held::push_outer;
use crate::key::KeyExtractor;
use crate::layer::Config;
use crate::lock::{HeldLock, LockRequest};

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
pub struct LockService<S, K> {
    inner: S,
    store: Arc<dyn Store>,
    key: K,
    config: Arc<Config>,
}

impl<S, K> LockService<S, K> {
    pub(crate) fn new(inner: S, store: Arc<dyn Store>, key: K, config: Arc<Config>) -> Self {
        LockService {
            inner,
            store,
            key,
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

impl<S: fmt::Debug, K> fmt::Debug for LockService<S, K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LockService")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

impl<S, K, ReqBody, ResBody> Service<Request<ReqBody>> for LockService<S, K>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone,
    K: KeyExtractor<ReqBody>,
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
        let key = match self.key.extract(&request) {
            Ok(Some(key)) => key,
            Ok(None) => return self.pass_through(request),
            Err(e) => {
                return ResponseFuture::rejected(self.config.reject(LockError::InvalidKey(e)));
            }
        };
        // An outer layer has put its `HeldLock` into the extensions: nested layers take
        // their locks under the same owner, so one request re-enters instead of
        // deadlocking on itself.
        // Its `HeldLock` is about to be replaced by this layer's: `HeldLocks` keeps it.
        let owner = match request.extensions().get::<HeldLock>().cloned() {
            Some(outer) => {
                let owner = outer.owner().clone();
                push_outer(request.extensions_mut(), outer);
                owner
            }
            None => self.store.new_owner(),
        };
        let acquire = LockRequest::new(self.store.clone(), key)
            .owner(owner)
            .lease(self.config.lease)
            .max_local_waiters(self.config.max_local_waiters)
            .mode(self.config.mode)
            .into_future();
        ResponseFuture::acquiring(acquire, request, self.inner.clone(), self.config.clone())
    }
}

impl<S: Clone, K> LockService<S, K> {
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
fn unmatched_by_router<B>(request: &Request<B>) -> bool {
    let extensions = request.extensions();
    extensions.get::<MatchedPath>().is_none()
        && extensions
            .get::<OriginalUri>()
            .is_some_and(|original| original.0 == *request.uri())
}

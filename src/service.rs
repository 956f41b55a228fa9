//! [`LockService`]: the middleware service.

use std::fmt;
use std::mem;
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::body::Body;
use axum::extract::{MatchedPath, OriginalUri};
use bytes::Bytes;
use http::{Request, Response};
use tower_service::Service;

use crate::backend::LockBackend;
use crate::error::LockError;
use crate::future::ResponseFuture;
use crate::held::push_outer;
use crate::key::KeyExtractor;
use crate::layer::Config;
use crate::lock::HeldLock;

/// Middleware that holds a distributed lock while the inner service handles a request.
/// Created by [`LockLayer`](crate::LockLayer).
#[derive(Clone)]
pub struct LockService<S, B, K> {
    inner: S,
    backend: B,
    key: K,
    config: Arc<Config>,
}

impl<S, B, K> LockService<S, B, K> {
    pub(crate) fn new(inner: S, backend: B, key: K, config: Arc<Config>) -> Self {
        LockService {
            inner,
            backend,
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

impl<S: fmt::Debug, B: fmt::Debug, K> fmt::Debug for LockService<S, B, K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LockService")
            .field("inner", &self.inner)
            .field("backend", &self.backend)
            .finish_non_exhaustive()
    }
}

impl<S, B, K, ReqBody, ResBody> Service<Request<ReqBody>> for LockService<S, B, K>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send,
    B: LockBackend,
    K: KeyExtractor<ReqBody>,
    ReqBody: Send + 'static,
    ResBody: http_body::Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<axum::BoxError>,
{
    type Response = Response<Body>;
    type Error = S::Error;
    type Future = ResponseFuture<S, ReqBody>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: Request<ReqBody>) -> Self::Future {
        if unmatched_by_router(&request) {
            return ResponseFuture::pass_through(self.inner.call(request));
        }
        let key = match self.key.extract(&request) {
            Ok(Some(key)) => key,
            Ok(None) => return ResponseFuture::pass_through(self.inner.call(request)),
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
            None => self.backend.new_owner(),
        };
        let acquire = self
            .backend
            .lock(key)
            .owner(owner)
            .lease(self.config.lease)
            .max_local_waiters(self.config.max_local_waiters)
            .mode(self.config.mode)
            .into_future();
        // The ready service handles this request after the lock is taken; the clone left
        // behind will be driven to readiness by the next `poll_ready`.
        let clone = self.inner.clone();
        let inner = mem::replace(&mut self.inner, clone);
        ResponseFuture::acquiring(acquire, request, inner, self.config.clone())
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

//! [`IdempotencyService`]: the middleware service, and its response future.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{Request, Response};
use http_body::Body;
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{Either, Full};
use tower_service::Service;

use super::Config;
use crate::layer::body::BoxError;
use crate::lock::BoxFuture;

/// The body of every response of the layer: the handler's (buffered when stored), a
/// replayed one, or a refusal.
pub type IdempotencyBody = UnsyncBoxBody<Bytes, BoxError>;

/// The body the inner service gets: the buffered body of a request with a key, the
/// request's own of one without (with [`optional`](crate::IdempotencyLayer::optional)).
pub type InnerBody<B> = Either<Full<Bytes>, B>;

/// Middleware that replays completed requests and runs the others under their key's
/// lock. Created by [`IdempotencyLayer`](crate::IdempotencyLayer).
///
/// `poll_ready` is always ready: each response future drives a clone of the inner
/// service to readiness once it holds the key's lock, as [`LockService`](crate::layer::LockService)
/// does.
#[derive(Clone)]
pub struct IdempotencyService<S> {
    inner: S,
    config: Arc<Config>,
}

impl<S> IdempotencyService<S> {
    pub(crate) fn new(inner: S, config: Arc<Config>) -> Self {
        IdempotencyService { inner, config }
    }

    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }
}

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for IdempotencyService<S>
where
    S: Service<Request<InnerBody<ReqBody>>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: Send,
    ReqBody: Body<Data = Bytes> + Send + 'static,
    ReqBody::Error: Into<BoxError>,
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    type Response = Response<IdempotencyBody>;
    type Error = S::Error;
    type Future = IdempotencyFuture<S::Error>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        // The clone that was driven to readiness (none was: `poll_ready` does not) goes
        // into the future; the service keeps a fresh one (tower's habit).
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        IdempotencyFuture(Box::pin(super::future::run(
            self.config.clone(),
            inner,
            request,
        )))
    }
}

/// The response future of [`IdempotencyService`]: boxed, since it buffers bodies and
/// makes several store calls in turn, next to which one allocation does not count.
pub struct IdempotencyFuture<E>(BoxFuture<'static, Result<Response<IdempotencyBody>, E>>);

impl<E> Future for IdempotencyFuture<E> {
    type Output = Result<Response<IdempotencyBody>, E>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.0.as_mut().poll(cx)
    }
}

impl<E> fmt::Debug for IdempotencyFuture<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotencyFuture").finish_non_exhaustive()
    }
}

impl<S: fmt::Debug> fmt::Debug for IdempotencyService<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotencyService")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

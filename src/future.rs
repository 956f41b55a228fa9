//! [`ResponseFuture`]: acquire, run the handler, release.
//!
//! The guard lives inside this future. When the handler completes, the release is awaited
//! before the response is returned, so a client's next request never finds its own lock.
//! If the future is dropped instead (client gone, an outer timeout, a panic unwinding
//! through the handler) the guard's `Drop` releases in a spawned task.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use axum::body::Body;
use bytes::Bytes;
use http::{Method, Request, Response};
use pin_project::pin_project;
use tower_service::Service;

use crate::body::{GuardedBody, sent_length};
use crate::error::LockError;
use crate::layer::{Config, OnLockLost};
use crate::lock::{BoxFuture, LockGuard};

/// Response future of [`LockService`](crate::LockService).
#[pin_project]
pub struct ResponseFuture<S, ReqBody>
where
    S: Service<Request<ReqBody>>,
{
    #[pin]
    kind: Kind<S, ReqBody>,
}

#[pin_project(project = KindProj)]
enum Kind<S, ReqBody>
where
    S: Service<Request<ReqBody>>,
{
    /// Waits for the lock (while `acquire` is set), then for the inner service's
    /// readiness, then calls it: a request that only waits for its lock pins none of the
    /// inner service's capacity.
    Calling {
        acquire: Option<BoxFuture<'static, Result<LockGuard, LockError>>>,
        guard: Option<LockGuard>,
        inner: S,
        request: Option<Request<ReqBody>>,
        config: Arc<Config>,
    },
    /// The inner service handles the request, under `held` unless it is unlocked.
    Running {
        #[pin]
        future: S::Future,
        held: Option<Holding>,
        config: Arc<Config>,
    },
    /// The handler's response waits for the release.
    Releasing {
        release: BoxFuture<'static, ()>,
        response: Option<Response<Body>>,
    },
    /// A rejection, answered without the inner service.
    Rejected { response: Option<Response<Body>> },
}

/// What a locked request holds while its handler runs.
struct Holding {
    guard: LockGuard,
    /// Resolves when the lock is lost; `None` unless the layer aborts on loss.
    lost: Option<BoxFuture<'static, ()>>,
    /// The request's method: the server sends no body in answer to `HEAD`.
    method: Method,
}

impl<S, ReqBody> ResponseFuture<S, ReqBody>
where
    S: Service<Request<ReqBody>>,
{
    pub(crate) fn acquiring(
        acquire: BoxFuture<'static, Result<LockGuard, LockError>>,
        request: Request<ReqBody>,
        inner: S,
        config: Arc<Config>,
    ) -> Self {
        Self::calling(Some(acquire), request, inner, config)
    }

    pub(crate) fn pass_through(request: Request<ReqBody>, inner: S, config: Arc<Config>) -> Self {
        Self::calling(None, request, inner, config)
    }

    fn calling(
        acquire: Option<BoxFuture<'static, Result<LockGuard, LockError>>>,
        request: Request<ReqBody>,
        inner: S,
        config: Arc<Config>,
    ) -> Self {
        ResponseFuture {
            kind: Kind::Calling {
                acquire,
                guard: None,
                inner,
                request: Some(request),
                config,
            },
        }
    }

    pub(crate) fn rejected(response: Response<Body>) -> Self {
        ResponseFuture {
            kind: Kind::Rejected {
                response: Some(response),
            },
        }
    }
}

impl<S, ReqBody> std::fmt::Debug for ResponseFuture<S, ReqBody>
where
    S: Service<Request<ReqBody>>,
{
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = match &self.kind {
            Kind::Calling {
                acquire: Some(_), ..
            } => "acquiring",
            Kind::Calling { .. } => "calling",
            Kind::Running { .. } => "running",
            Kind::Releasing { .. } => "releasing",
            Kind::Rejected { .. } => "rejected",
        };
        f.debug_struct("ResponseFuture")
            .field("state", &state)
            .finish()
    }
}

/// Releases `guard`, logging instead of failing: the response is ready either way, and a
/// lock whose release failed is freed by its lease.
pub(crate) fn release_logged(guard: LockGuard) -> BoxFuture<'static, ()> {
    Box::pin(async move {
        let held = guard.held().clone();
        match guard.release().await {
            Ok(()) => {}
            Err(LockError::Lost { .. }) => {
                tracing::warn!(
                    key = held.key(),
                    "lock was lost before the request finished"
                );
            }
            Err(error) => {
                tracing::warn!(key = held.key(), %error, "lock release not confirmed yet; retrying in the background")
            }
        }
    })
}

/// The error for a lock lost while `during`, logged once where it is found.
pub(crate) fn lost_error(guard: &LockGuard, during: &str) -> LockError {
    tracing::warn!(key = guard.key(), "lock lost while {during}; aborting it");
    LockError::Lost {
        key: guard.key().to_owned(),
    }
}

const POLLED_AFTER_COMPLETION: &str = "ResponseFuture polled after completion";

impl<S, ReqBody, ResBody> Future for ResponseFuture<S, ReqBody>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
    ResBody: http_body::Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<axum::BoxError>,
{
    type Output = Result<Response<Body>, S::Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut kind = self.project().kind;
        loop {
            let next = match kind.as_mut().project() {
                KindProj::Calling {
                    acquire,
                    guard,
                    inner,
                    request,
                    config,
                } => {
                    if let Some(acquiring) = acquire {
                        match ready!(acquiring.as_mut().poll(cx)) {
                            Ok(taken) => {
                                *guard = Some(taken);
                                *acquire = None;
                            }
                            Err(error) => {
                                let response = config.reject(error);
                                kind.set(Kind::Rejected {
                                    response: Some(response),
                                });
                                continue;
                            }
                        }
                    }
                    // An error drops the guard with the state: released in the background.
                    ready!(inner.poll_ready(cx))?;
                    let mut request = request.take().expect(POLLED_AFTER_COMPLETION);
                    let held = guard.take().map(|guard| {
                        request.extensions_mut().insert(guard.held().clone());
                        let lost = match config.on_lost {
                            OnLockLost::Abort => {
                                Some(Box::pin(guard.lost()) as BoxFuture<'static, ()>)
                            }
                            OnLockLost::Continue => None,
                        };
                        Holding {
                            guard,
                            lost,
                            method: request.method().clone(),
                        }
                    });
                    Kind::Running {
                        future: inner.call(request),
                        held,
                        config: config.clone(),
                    }
                }
                KindProj::Running {
                    future,
                    held,
                    config,
                } => {
                    let lost = held
                        .as_mut()
                        .and_then(|held| held.lost.as_mut())
                        .is_some_and(|lost| lost.as_mut().poll(cx).is_ready());
                    if let Some(held) = held.take_if(|_| lost) {
                        let response = config.reject(lost_error(&held.guard, "the handler ran"));
                        // Setting the state drops the handler future, then the guard
                        // releases whatever may be left in the background.
                        kind.set(Kind::Rejected {
                            response: Some(response),
                        });
                        drop(held);
                        continue;
                    }
                    // An error drops the guard with the state: released in the background.
                    let response = ready!(future.poll(cx))?;
                    let Some(held) = held.take() else {
                        return Poll::Ready(Ok(response.map(Body::new)));
                    };
                    let sent = sent_length(
                        &held.method,
                        response.status(),
                        response.headers(),
                        response.body(),
                    );
                    if let (true, Some(length)) = (config.hold_body, sent) {
                        return Poll::Ready(Ok(response.map(|body| {
                            Body::new(GuardedBody::new(body, held.guard, held.lost, length))
                        })));
                    }
                    Kind::Releasing {
                        release: release_logged(held.guard),
                        response: Some(response.map(Body::new)),
                    }
                }
                KindProj::Releasing { release, response } => {
                    ready!(release.as_mut().poll(cx));
                    return Poll::Ready(Ok(response.take().expect(POLLED_AFTER_COMPLETION)));
                }
                KindProj::Rejected { response } => {
                    return Poll::Ready(Ok(response.take().expect(POLLED_AFTER_COMPLETION)));
                }
            };
            kind.set(next);
        }
    }
}

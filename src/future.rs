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
use http::{Request, Response};
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
    state: State<S, ReqBody>,
}

#[pin_project(project = StateProj)]
enum State<S, ReqBody>
where
    S: Service<Request<ReqBody>>,
{
    Acquiring {
        acquire: BoxFuture<'static, Result<LockGuard, LockError>>,
        request: Option<Request<ReqBody>>,
        inner: Option<S>,
        config: Arc<Config>,
    },
    Running {
        #[pin]
        future: S::Future,
        guard: Option<LockGuard>,
        lost: Option<BoxFuture<'static, ()>>,
        config: Arc<Config>,
        method: http::Method,
    },
    Releasing {
        release: BoxFuture<'static, ()>,
        response: Option<Response<Body>>,
    },
    Unlocked {
        #[pin]
        future: S::Future,
    },
    Ready {
        response: Option<Response<Body>>,
    },
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
        ResponseFuture {
            state: State::Acquiring {
                acquire,
                request: Some(request),
                inner: Some(inner),
                config,
            },
        }
    }

    pub(crate) fn pass_through(future: S::Future) -> Self {
        ResponseFuture {
            state: State::Unlocked { future },
        }
    }

    pub(crate) fn rejected(response: Response<Body>) -> Self {
        ResponseFuture {
            state: State::Ready {
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
        let state = match &self.state {
            State::Acquiring { .. } => "acquiring",
            State::Running { .. } => "running",
            State::Releasing { .. } => "releasing",
            State::Unlocked { .. } => "unlocked",
            State::Ready { .. } => "ready",
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
        let mut state = self.project().state;
        loop {
            match state.as_mut().project() {
                StateProj::Acquiring {
                    acquire,
                    request,
                    inner,
                    config,
                } => {
                    let next = match ready!(acquire.as_mut().poll(cx)) {
                        Ok(guard) => {
                            let mut request = request.take().expect(POLLED_AFTER_COMPLETION);
                            let mut inner = inner.take().expect(POLLED_AFTER_COMPLETION);
                            request.extensions_mut().insert(guard.held().clone());
                            let lost = match config.on_lost {
                                OnLockLost::Abort => {
                                    Some(Box::pin(guard.lost()) as BoxFuture<'static, ()>)
                                }
                                OnLockLost::Continue => None,
                            };
                            State::Running {
                                method: request.method().clone(),
                                future: inner.call(request),
                                guard: Some(guard),
                                lost,
                                config: config.clone(),
                            }
                        }
                        Err(error) => State::Ready {
                            response: Some(config.reject(error)),
                        },
                    };
                    state.set(next);
                }
                StateProj::Running {
                    future,
                    guard,
                    lost,
                    config,
                    method,
                } => {
                    if let Some(lost) = lost {
                        if lost.as_mut().poll(cx).is_ready() {
                            let guard = guard.take().expect(POLLED_AFTER_COMPLETION);
                            let response = config.reject(lost_error(&guard, "the handler ran"));
                            // Setting the state drops the handler future, then the guard
                            // releases whatever may be left in the background.
                            state.set(State::Ready {
                                response: Some(response),
                            });
                            drop(guard);
                            continue;
                        }
                    }
                    let response = match ready!(future.poll(cx)) {
                        Ok(response) => response.map(Body::new),
                        // Dropping the guard with the state releases in the background.
                        Err(error) => return Poll::Ready(Err(error)),
                    };
                    let guard = guard.take().expect(POLLED_AFTER_COMPLETION);
                    let sent = sent_length(
                        method,
                        response.status(),
                        response.headers(),
                        response.body(),
                    );
                    if let (true, Some(length)) = (config.hold_body, sent) {
                        let lost = lost.take();
                        return Poll::Ready(Ok(response
                            .map(|body| Body::new(GuardedBody::new(body, guard, lost, length)))));
                    }
                    let release = release_logged(guard);
                    state.set(State::Releasing {
                        release,
                        response: Some(response),
                    });
                }
                StateProj::Releasing { release, response } => {
                    ready!(release.as_mut().poll(cx));
                    return Poll::Ready(Ok(response.take().expect(POLLED_AFTER_COMPLETION)));
                }
                StateProj::Unlocked { future } => {
                    return future.poll(cx).map_ok(|response| response.map(Body::new));
                }
                StateProj::Ready { response } => {
                    return Poll::Ready(Ok(response.take().expect(POLLED_AFTER_COMPLETION)));
                }
            }
        }
    }
}

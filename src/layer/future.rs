//! [`ResponseFuture`]: acquire, run the handler, release.
//!
//! The guard lives inside this future. When the handler completes with a response, the
//! release is awaited before the response is returned, so a client's next request never
//! finds its own lock. If the future is dropped instead (client gone, an outer timeout, a
//! panic unwinding through the handler), or the inner service fails with an error (which
//! axum handlers never do), the guard's `Drop` releases in a spawned task.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use http::{Method, Request, Response};
use pin_project::pin_project;
use tower_service::Service;

use crate::error::LockError;
use crate::layer::body::{BodyHold, ResponseBody, sent_length};
use crate::layer::response::RejectionBody;
use crate::layer::{Config, OnLockLost};
use crate::lock::held::LostSignal;
use crate::lock::{BoxFuture, HeldLock, LockGuard};

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
    /// The inner service handles the request, under `guard` unless it is unlocked.
    Running {
        #[pin]
        future: S::Future,
        guard: Option<LockGuard>,
        /// Resolves when the lock is lost; `None` unless the layer aborts on loss.
        #[pin]
        lost: Option<LostSignal>,
        /// The server sends no body in answer to `HEAD`: nothing to hold the lock through.
        method: Method,
        config: Arc<Config>,
    },
    /// The handler's response waits for the release.
    Releasing {
        release: Release,
        response: Option<S::Response>,
    },
    /// A rejection, answered without the inner service.
    Rejected {
        response: Option<Response<RejectionBody>>,
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

    pub(crate) fn rejected(response: Response<RejectionBody>) -> Self {
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

/// A release whose outcome is logged instead of returned: the response is ready either
/// way, and a lock whose release failed is freed by its lease.
pub(crate) struct Release {
    held: HeldLock,
    /// The backend's release; `None` if the guard had been released already.
    release: Option<BoxFuture<'static, Result<(), LockError>>>,
}

impl Release {
    pub(crate) fn new(guard: LockGuard) -> Self {
        Release {
            held: guard.held().clone(),
            release: guard.into_release(),
        }
    }
}

impl Future for Release {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let Some(release) = self.release.as_mut() else {
            return Poll::Ready(());
        };
        let outcome = ready!(release.as_mut().poll(cx));
        self.release = None;
        let key = self.held.key();
        match outcome {
            Ok(()) => {}
            Err(LockError::Lost { .. }) => {
                tracing::warn!(key, "lock was lost before the request finished");
            }
            Err(error) => {
                tracing::warn!(
                    key,
                    error = &error as &(dyn std::error::Error + 'static),
                    "lock release not confirmed yet; retrying in the background"
                )
            }
        }
        Poll::Ready(())
    }
}

/// The error for a lock lost while `during`, logged once where it is found.
pub(crate) fn lost_error(guard: &LockGuard, during: &str) -> LockError {
    tracing::warn!(key = guard.key(), "lock lost while {during}; aborting it");
    LockError::Lost {
        key: guard.key().to_owned(),
    }
}

/// The signal a guarded handler or body watches: only when the layer aborts on loss.
fn lost_signal(config: &Config, guard: &LockGuard) -> Option<LostSignal> {
    match config.on_lost {
        OnLockLost::Abort => Some(guard.held().lost_signal()),
        OnLockLost::Continue => None,
    }
}

const POLLED_AFTER_COMPLETION: &str = "ResponseFuture polled after completion";

impl<S, ReqBody, ResBody> Future for ResponseFuture<S, ReqBody>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
    ResBody: http_body::Body,
{
    type Output = Result<Response<ResponseBody<ResBody>>, S::Error>;

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
                    // Lost while the inner service got ready: `call` must not run, since a
                    // service may start its work there, before its future is polled.
                    if let Some(lost) = guard
                        .as_ref()
                        .filter(|g| g.is_lost() && config.on_lost == OnLockLost::Abort)
                    {
                        let response = config.reject(lost_error(lost, "waiting for the service"));
                        kind.set(Kind::Rejected {
                            response: Some(response),
                        });
                        continue;
                    }
                    let mut request = request.take().expect(POLLED_AFTER_COMPLETION);
                    if let Some(guard) = guard {
                        request.extensions_mut().insert(guard.held().clone());
                    }
                    Kind::Running {
                        method: request.method().clone(),
                        future: inner.call(request),
                        lost: guard.as_ref().and_then(|guard| lost_signal(config, guard)),
                        guard: guard.take(),
                        config: config.clone(),
                    }
                }
                KindProj::Running {
                    future,
                    guard,
                    mut lost,
                    method,
                    config,
                } => {
                    let lost_now = lost
                        .as_mut()
                        .as_pin_mut()
                        .is_some_and(|lost| lost.poll(cx).is_ready());
                    if let Some(guard) = guard.take_if(|_| lost_now) {
                        let response = config.reject(lost_error(&guard, "the handler ran"));
                        // Setting the state drops the handler future, then the guard
                        // releases whatever may be left in the background.
                        kind.set(Kind::Rejected {
                            response: Some(response),
                        });
                        drop(guard);
                        continue;
                    }
                    // An error drops the guard with the state: released in the background.
                    let response = ready!(future.poll(cx))?;
                    let Some(guard) = guard.take() else {
                        return Poll::Ready(Ok(response.map(ResponseBody::inner)));
                    };
                    let (status, headers) = (response.status(), response.headers());
                    match sent_length(method, status, headers, response.body()) {
                        Some(length) if config.hold_body => {
                            let lost = lost_signal(config, &guard);
                            let hold = BodyHold::new(guard, lost, length);
                            return Poll::Ready(Ok(
                                response.map(|body| ResponseBody::guarded(body, hold))
                            ));
                        }
                        _ => Kind::Releasing {
                            release: Release::new(guard),
                            response: Some(response),
                        },
                    }
                }
                KindProj::Releasing { release, response } => {
                    ready!(Pin::new(release).poll(cx));
                    let response = response.take().expect(POLLED_AFTER_COMPLETION);
                    return Poll::Ready(Ok(response.map(ResponseBody::inner)));
                }
                KindProj::Rejected { response } => {
                    let response = response.take().expect(POLLED_AFTER_COMPLETION);
                    return Poll::Ready(Ok(response.map(ResponseBody::rejection)));
                }
            };
            kind.set(next);
        }
    }
}

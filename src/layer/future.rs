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

/// Response future of [`LockService`](crate::layer::LockService).
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

/// What the poll of the running handler decided.
enum Ran<S: Service<Request<ReqBody>>, ReqBody, Out> {
    /// The next state.
    Next(Kind<S, ReqBody>),
    /// The lock was lost while the handler ran: answer this, then drop the guard.
    Aborted(Response<RejectionBody>, LockGuard),
    /// The response, ready to return.
    Done(Out),
}

/// The response type of a [`ResponseFuture`] over a service answering `ResBody`.
type Answer<ResBody> = Response<ResponseBody<ResBody>>;

/// What the poll of the running handler decided, for a service answering `ResBody`.
type Running<S, ReqBody, ResBody> = Ran<S, ReqBody, Answer<ResBody>>;

impl<S, ReqBody, ResBody> Future for ResponseFuture<S, ReqBody>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
    ResBody: http_body::Body,
{
    type Output = Result<Answer<ResBody>, S::Error>;

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
                } => ready!(Self::poll_calling(
                    cx, acquire, guard, inner, request, config
                ))?,
                KindProj::Running {
                    future,
                    guard,
                    lost,
                    method,
                    config,
                } => match ready!(Self::poll_running(cx, future, guard, lost, method, config))? {
                    Ran::Next(next) => next,
                    Ran::Aborted(response, guard) => {
                        // Setting the state drops the handler future, then the guard
                        // releases whatever may be left in the background.
                        kind.set(Kind::Rejected {
                            response: Some(response),
                        });
                        drop(guard);
                        continue;
                    }
                    Ran::Done(response) => return Poll::Ready(Ok(response)),
                },
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

impl<S, ReqBody, ResBody> ResponseFuture<S, ReqBody>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
    ResBody: http_body::Body,
{
    /// Waits for the lock (if it is still being taken), then for the inner service's
    /// readiness, and calls it: the next state, running or rejected.
    fn poll_calling(
        cx: &mut Context<'_>,
        acquire: &mut Option<BoxFuture<'static, Result<LockGuard, LockError>>>,
        guard: &mut Option<LockGuard>,
        inner: &mut S,
        request: &mut Option<Request<ReqBody>>,
        config: &Arc<Config>,
    ) -> Poll<Result<Kind<S, ReqBody>, S::Error>> {
        if let Some(acquiring) = acquire {
            match ready!(acquiring.as_mut().poll(cx)) {
                Ok(taken) => {
                    *guard = Some(taken);
                    *acquire = None;
                }
                Err(error) => return Poll::Ready(Ok(rejected(config.reject(error)))),
            }
        }
        // An error drops the guard with the state: released in the background.
        ready!(inner.poll_ready(cx))?;
        // Lost while the inner service got ready: `call` must not run, since a service may
        // start its work there, before its future is polled.
        if let Some(lost) = guard
            .as_ref()
            .filter(|g| g.is_lost() && config.on_lost == OnLockLost::Abort)
        {
            let response = config.reject(lost_error(lost, "waiting for the service"));
            return Poll::Ready(Ok(rejected(response)));
        }
        let mut request = request.take().expect(POLLED_AFTER_COMPLETION);
        if let Some(guard) = guard {
            request.extensions_mut().insert(guard.held().clone());
        }
        Poll::Ready(Ok(Kind::Running {
            method: request.method().clone(),
            future: inner.call(request),
            lost: guard.as_ref().and_then(|guard| lost_signal(config, guard)),
            guard: guard.take(),
            config: config.clone(),
        }))
    }

    /// Polls the handler, unless the lock was lost meanwhile: its response, with the lock
    /// held through the body or released first.
    fn poll_running(
        cx: &mut Context<'_>,
        future: Pin<&mut S::Future>,
        guard: &mut Option<LockGuard>,
        mut lost: Pin<&mut Option<LostSignal>>,
        method: &Method,
        config: &Arc<Config>,
    ) -> Poll<Result<Running<S, ReqBody, ResBody>, S::Error>> {
        let lost_now = lost
            .as_mut()
            .as_pin_mut()
            .is_some_and(|lost| lost.poll(cx).is_ready());
        if let Some(guard) = guard.take_if(|_| lost_now) {
            let response = config.reject(lost_error(&guard, "the handler ran"));
            return Poll::Ready(Ok(Ran::Aborted(response, guard)));
        }
        // An error drops the guard with the state: released in the background.
        let response = ready!(future.poll(cx))?;
        let Some(guard) = guard.take() else {
            return Poll::Ready(Ok(Ran::Done(response.map(ResponseBody::inner))));
        };
        let (status, headers) = (response.status(), response.headers());
        Poll::Ready(Ok(
            match sent_length(method, status, headers, response.body()) {
                Some(length) if config.hold_body => {
                    let lost = lost_signal(config, &guard);
                    let hold = BodyHold::new(guard, lost, length);
                    Ran::Done(response.map(|body| ResponseBody::guarded(body, hold)))
                }
                _ => Ran::Next(Kind::Releasing {
                    release: Release::new(guard),
                    response: Some(response),
                }),
            },
        ))
    }
}

/// The state of a rejection answered without the inner service.
fn rejected<S: Service<Request<ReqBody>>, ReqBody>(
    response: Response<RejectionBody>,
) -> Kind<S, ReqBody> {
    Kind::Rejected {
        response: Some(response),
    }
}

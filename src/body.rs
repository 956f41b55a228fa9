//! [`GuardedBody`]: a response body that holds the request's lock until it has been sent.

use std::pin::Pin;
use std::task::{Context, Poll, ready};

use axum::BoxError;
use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use pin_project::pin_project;

use crate::future::{lost_error, release_logged};
use crate::lock::{BoxFuture, LockGuard};

/// Wraps a response body for [`LockLayer::hold_until_body_end`](crate::LockLayer::hold_until_body_end).
///
/// At the end of the stream the release is driven from `poll_frame` before the end is
/// reported, so the client cannot see the whole body while the lock is still held. A body
/// dropped before its end (client gone) drops the guard, which releases in a spawned task.
#[pin_project]
pub(crate) struct GuardedBody<B> {
    #[pin]
    inner: B,
    guard: Option<LockGuard>,
    /// Resolves when the lock is lost; `None` unless the layer aborts on loss.
    lost: Option<BoxFuture<'static, ()>>,
    release: Option<BoxFuture<'static, ()>>,
}

impl<B> GuardedBody<B> {
    pub(crate) fn new(inner: B, guard: LockGuard, lost: Option<BoxFuture<'static, ()>>) -> Self {
        GuardedBody {
            inner,
            guard: Some(guard),
            lost,
            release: None,
        }
    }
}

impl<B> Body for GuardedBody<B>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.project();
        if let Some(release) = this.release {
            ready!(release.as_mut().poll(cx));
            *this.release = None;
            return Poll::Ready(None);
        }
        if let (Some(lost), Some(guard)) = (this.lost.as_mut(), this.guard.as_ref()) {
            if lost.as_mut().poll(cx).is_ready() {
                let error = lost_error(guard, "the body was sent");
                *this.lost = None;
                *this.guard = None;
                return Poll::Ready(Some(Err(error.into())));
            }
        }
        match ready!(this.inner.poll_frame(cx)) {
            Some(Ok(frame)) => Poll::Ready(Some(Ok(frame))),
            Some(Err(error)) => {
                // The stream failed: release in the background, the body is over anyway.
                *this.guard = None;
                Poll::Ready(Some(Err(error.into())))
            }
            None => match this.guard.take() {
                Some(guard) => {
                    let mut release = release_logged(guard);
                    if release.as_mut().poll(cx).is_pending() {
                        *this.release = Some(release);
                        return Poll::Pending;
                    }
                    Poll::Ready(None)
                }
                None => Poll::Ready(None),
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        // While the lock is held the end is not reached: the release still has to run.
        self.guard.is_none() && self.release.is_none() && self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        // Never exact: an exact size lets the server send a `content-length` response whose
        // last byte reaches the client before the release has run.
        let mut hint = SizeHint::new();
        hint.set_lower(self.inner.size_hint().lower());
        hint
    }
}

//! [`GuardedBody`]: a response body that holds the request's lock until it has been sent.

use std::pin::Pin;
use std::task::{Context, Poll, ready};

use axum::BoxError;
use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use pin_project::pin_project;

use http::{HeaderMap, Method, StatusCode, header};

use crate::future::{lost_error, release_logged};
use crate::lock::{BoxFuture, LockGuard};

/// Wraps a response body for [`LockLayer::hold_until_body_end`](crate::LockLayer::hold_until_body_end).
///
/// The frame that ends the body is held back until the release has run, so the client
/// cannot see the whole body while the lock is still held. hyper stops polling a body
/// once it has sent the `content-length` the handler declared, or once `is_end_stream` is
/// true: a release after the last frame would run after the client had it all. A body
/// dropped before its end (client gone) drops the guard, which releases in a spawned task.
#[pin_project]
pub(crate) struct GuardedBody<B> {
    #[pin]
    inner: B,
    guard: Option<LockGuard>,
    /// Resolves when the lock is lost; `None` unless the layer aborts on loss.
    lost: Option<BoxFuture<'static, ()>>,
    release: Option<BoxFuture<'static, ()>>,
    /// Bytes left until the declared `content-length`, where hyper stops polling.
    remaining: Option<u64>,
    /// The frame that ends the body, sent once the release has run.
    last: Option<Frame<Bytes>>,
}

impl<B> GuardedBody<B> {
    /// `content_length` is the length the response declares in its headers, if any.
    pub(crate) fn new(
        inner: B,
        guard: LockGuard,
        lost: Option<BoxFuture<'static, ()>>,
        content_length: Option<u64>,
    ) -> Self {
        GuardedBody {
            inner,
            guard: Some(guard),
            lost,
            release: None,
            remaining: content_length,
            last: None,
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
        let mut this = self.project();
        if let Some(release) = this.release {
            ready!(release.as_mut().poll(cx));
            *this.release = None;
            return Poll::Ready(this.last.take().map(Ok));
        }
        if let (Some(lost), Some(guard)) = (this.lost.as_mut(), this.guard.as_ref()) {
            if lost.as_mut().poll(cx).is_ready() {
                let error = lost_error(guard, "the body was sent");
                *this.lost = None;
                *this.guard = None;
                return Poll::Ready(Some(Err(error.into())));
            }
        }
        let frame = match ready!(this.inner.as_mut().poll_frame(cx)) {
            Some(Ok(frame)) => Some(frame),
            Some(Err(error)) => {
                // The stream failed: release in the background, the body is over anyway.
                *this.guard = None;
                return Poll::Ready(Some(Err(error.into())));
            }
            None => None,
        };
        if let (Some(remaining), Some(data)) = (
            this.remaining.as_mut(),
            frame.as_ref().and_then(Frame::data_ref),
        ) {
            *remaining = remaining.saturating_sub(data.len() as u64);
        }
        let ends = frame.is_none()
            || *this.remaining == Some(0)
            || this.inner.is_end_stream()
            || this.inner.size_hint().exact() == Some(0);
        let guard = match this.guard.take() {
            Some(guard) if ends => guard,
            guard => {
                *this.guard = guard;
                return Poll::Ready(frame.map(Ok));
            }
        };
        let mut release = release_logged(guard);
        if release.as_mut().poll(cx).is_pending() {
            *this.release = Some(release);
            *this.last = frame;
            return Poll::Pending;
        }
        Poll::Ready(frame.map(Ok))
    }

    fn is_end_stream(&self) -> bool {
        // While the lock is held the end is not reached: the release still has to run.
        self.guard.is_none()
            && self.release.is_none()
            && self.last.is_none()
            && self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        // Never exact: an exact size lets the server send a `content-length` response whose
        // last byte reaches the client before the release has run.
        let mut hint = SizeHint::new();
        hint.set_lower(self.inner.size_hint().lower());
        hint
    }
}

/// What the server will send of a response's body: `None` when it sends none or never
/// polls it (a `HEAD` request, 1xx/204/304, an empty body: holding the lock through such
/// a body would release it only after the client had the response), else the length it
/// declares, if any.
pub(crate) fn sent_length<B: Body>(
    method: &Method,
    status: StatusCode,
    headers: &HeaderMap,
    body: &B,
) -> Option<Option<u64>> {
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|value| value.to_str().ok()?.parse::<u64>().ok());
    let bodyless = method == Method::HEAD
        || status.is_informational()
        || status == StatusCode::NO_CONTENT
        || status == StatusCode::NOT_MODIFIED
        || body.is_end_stream()
        || declared == Some(0);
    (!bodyless).then_some(declared)
}

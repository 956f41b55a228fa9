//! [`ResponseBody`]: the layer's response body, and the hold that keeps the request's
//! lock until the body has been sent.

use std::fmt;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use http::{HeaderMap, Method, StatusCode, header};
use http_body::{Body, Frame, SizeHint};
use pin_project::pin_project;

use crate::layer::future::{Release, lost_error};
use crate::layer::response::RejectionBody;
use crate::lock::LockGuard;
use crate::lock::held::LostSignal;

/// The error type of [`ResponseBody`]: whatever the inner body or the lock failed with.
pub(crate) type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The response body of [`LockService`](crate::layer::LockService): the inner service's body `B`
/// as it is, or held under the request's lock until its end
/// ([`LockLayer::hold_until_body_end`](crate::LockLayer::hold_until_body_end)), or the
/// body of a rejection (409, 429, 503, 400, 500).
#[pin_project]
pub struct ResponseBody<B> {
    #[pin]
    kind: Kind<B>,
}

#[pin_project(project = KindProj)]
enum Kind<B> {
    Inner {
        #[pin]
        body: B,
    },
    /// The inner body, with the lock held until its end. The hold is boxed: it is the rare
    /// case, and should not make every response's body larger.
    Guarded {
        #[pin]
        body: B,
        hold: Pin<Box<BodyHold>>,
    },
    Rejection {
        #[pin]
        body: RejectionBody,
    },
}

impl<B> ResponseBody<B> {
    pub(crate) fn inner(body: B) -> Self {
        ResponseBody {
            kind: Kind::Inner { body },
        }
    }

    pub(crate) fn guarded(body: B, hold: BodyHold) -> Self {
        ResponseBody {
            kind: Kind::Guarded {
                body,
                hold: Box::pin(hold),
            },
        }
    }

    pub(crate) fn rejection(body: RejectionBody) -> Self {
        ResponseBody {
            kind: Kind::Rejection { body },
        }
    }
}

impl<B> fmt::Debug for ResponseBody<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match &self.kind {
            Kind::Inner { .. } => "inner",
            Kind::Guarded { .. } => "guarded",
            Kind::Rejection { .. } => "rejection",
        };
        f.debug_struct("ResponseBody").field("kind", &kind).finish()
    }
}

impl<B> Body for ResponseBody<B>
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
        match self.project().kind.project() {
            KindProj::Inner { body } => body.poll_frame(cx).map_err(Into::into),
            KindProj::Guarded { body, hold } => hold.as_mut().poll_frame(body, cx),
            KindProj::Rejection { body } => body.poll_frame(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Inner { body } => body.is_end_stream(),
            Kind::Guarded { body, hold } => hold.is_end_stream(body),
            Kind::Rejection { body } => body.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Inner { body } => body.size_hint(),
            Kind::Guarded { body, .. } => {
                // Never exact: an exact size lets the server send a `content-length`
                // response whose last byte reaches the client before the release has run.
                let mut hint = SizeHint::new();
                hint.set_lower(body.size_hint().lower());
                hint
            }
            Kind::Rejection { body } => body.size_hint(),
        }
    }
}

/// The lock a response body holds until it has been sent.
///
/// The frame that ends the body is held back until the release has run, so the client
/// cannot see the whole body while the lock is still held. hyper stops polling a body
/// once it has sent the `content-length` the handler declared, or once `is_end_stream` is
/// true: a release after the last frame would run after the client had it all. A body
/// dropped before its end (client gone) drops the guard, which releases in a spawned task.
#[pin_project]
pub(crate) struct BodyHold {
    guard: Option<LockGuard>,
    /// Resolves when the lock is lost; `None` unless the layer aborts on loss.
    #[pin]
    lost: Option<LostSignal>,
    release: Option<Release>,
    /// Bytes left until the declared `content-length`, where hyper stops polling.
    remaining: Option<u64>,
    /// The frame that ends the body, sent once the release has run.
    last: Option<Frame<Bytes>>,
}

impl BodyHold {
    /// `content_length` is the length the response declares in its headers, if any.
    pub(crate) fn new(
        guard: LockGuard,
        lost: Option<LostSignal>,
        content_length: Option<u64>,
    ) -> Self {
        BodyHold {
            guard: Some(guard),
            lost,
            release: None,
            remaining: content_length,
            last: None,
        }
    }

    fn poll_frame<B>(
        self: Pin<&mut Self>,
        mut body: Pin<&mut B>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>>
    where
        B: Body<Data = Bytes>,
        B::Error: Into<BoxError>,
    {
        let mut this = self.project();
        if let Some(release) = this.release {
            ready!(Pin::new(release).poll(cx));
            *this.release = None;
            return Poll::Ready(this.last.take().map(Ok));
        }
        if let (Some(lost), Some(guard)) = (this.lost.as_mut().as_pin_mut(), this.guard.as_ref()) {
            if lost.poll(cx).is_ready() {
                let error = lost_error(guard, "the body was sent");
                this.lost.set(None);
                *this.guard = None;
                return Poll::Ready(Some(Err(error.into())));
            }
        }
        let frame = match ready!(body.as_mut().poll_frame(cx)) {
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
            || body.is_end_stream()
            || body.size_hint().exact() == Some(0);
        let Some(guard) = this.guard.take_if(|_| ends) else {
            return Poll::Ready(frame.map(Ok));
        };
        let mut release = Release::new(guard);
        if Pin::new(&mut release).poll(cx).is_pending() {
            *this.release = Some(release);
            *this.last = frame;
            return Poll::Pending;
        }
        Poll::Ready(frame.map(Ok))
    }

    fn is_end_stream<B: Body>(&self, body: &B) -> bool {
        // While the lock is held the end is not reached: the release still has to run.
        self.guard.is_none()
            && self.release.is_none()
            && self.last.is_none()
            && body.is_end_stream()
    }
}

/// A `content-length` value as hyper reads it: a number, or a list of equal numbers
/// (`5, 5`), with spaces around them.
fn declared_length(value: &str) -> Option<u64> {
    let mut lengths = value.split(',').map(|part| part.trim().parse::<u64>().ok());
    let first = lengths.next()??;
    lengths.all(|n| n == Some(first)).then_some(first)
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
        .and_then(|value| declared_length(value.to_str().ok()?));
    let bodyless = method == Method::HEAD
        || status.is_informational()
        || status == StatusCode::NO_CONTENT
        || status == StatusCode::NOT_MODIFIED
        || body.is_end_stream()
        || declared == Some(0);
    (!bodyless).then_some(declared)
}

#[cfg(test)]
mod tests {
    use super::declared_length;

    #[test]
    fn content_length_is_read_as_hyper_reads_it() {
        assert_eq!(declared_length("5"), Some(5));
        assert_eq!(declared_length(" 5 , 5"), Some(5));
        assert_eq!(declared_length("5, 6"), None);
        assert_eq!(declared_length("five"), None);
    }
}

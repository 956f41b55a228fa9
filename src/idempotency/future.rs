//! One request's course through the idempotency layer: key, fingerprint, record, lock,
//! handler, record again.

use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use futures_util::StreamExt;
use futures_util::future::poll_fn;
use http::{Request, Response};
use http_body::{Body, Frame};
use http_body_util::{BodyExt, BodyStream, Either, Full, LengthLimitError, Limited, StreamBody};
use tower_service::Service;

use super::fingerprint::{Fingerprint, scoped_key};
use super::record::{Record, kept_headers};
use super::response::IdempotencyError;
use super::service::{IdempotencyBody, InnerBody};
use super::{Config, RECORD_CONTEXT};
use crate::error::LockError;
use crate::layer::body::BoxError;
use crate::layer::future::lost_error;
use crate::lock::held::push_outer;
use crate::lock::{Acquired, HeldLock, LockGuard, LockRequest, Mode};

/// What the store says of a key for a request.
enum Found {
    /// Nothing stored: the request is the first (or the first left no record).
    Nothing,
    /// A completed request's response, for a retry of it.
    Replay(Response<IdempotencyBody>),
}

pub(crate) async fn run<S, ReqBody, ResBody>(
    config: Arc<Config>,
    mut inner: S,
    request: Request<ReqBody>,
) -> Result<Response<IdempotencyBody>, S::Error>
where
    S: Service<Request<InnerBody<ReqBody>>, Response = Response<ResBody>> + Send + 'static,
    S::Future: Send,
    S::Error: Send + 'static,
    ReqBody: Body<Data = Bytes> + Send + 'static,
    ReqBody::Error: Into<BoxError>,
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    let key = match config.key(request.headers()) {
        Ok(Some(key)) => key,
        Ok(None) => {
            let response = call(&mut inner, request.map(Either::Right)).await?;
            return Ok(response.map(boxed));
        }
        Err(e) => return Ok(config.reject(e)),
    };
    let (parts, body) = request.into_parts();
    let body = match read_body(&config, body).await {
        Ok(body) => body,
        Err(rejected) => return Ok(rejected),
    };
    let key = scoped_key(&(config.scope)(&parts), &key);
    let fingerprint = Fingerprint::of(&parts, &config.fingerprint_headers, &body);
    let (guard, checked) = match lock_unless_recorded(&config, &key, fingerprint).await {
        Ok(locked) => locked,
        Err(answer) => return Ok(answer),
    };
    let lost = LockError::Lost { key: key.clone() };
    let locked = Locked {
        key,
        fingerprint,
        guard,
        checked,
    };
    let finish = finish(config.clone(), inner, parts, body, locked);
    if !config.finish_when_client_gone {
        return finish.await;
    }
    // Once the lock is held the work runs to its end in a task of its own, so that a
    // client that gives up (its timeout, a dropped connection: the reply it will retry
    // for) does not stop a handler half-way, after its charge and before its record.
    match tokio::spawn(finish).await {
        Ok(response) => response,
        // A panic goes on to the layers outside (a `CatchPanicLayer`), as without the task.
        Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
        // The runtime is shutting down: the task was dropped, and its lock released.
        Err(_) => Ok(config.reject(IdempotencyError::Lock(lost))),
    }
}

/// The request's whole body, within the layer's limit; otherwise the rejection to answer.
async fn read_body<B>(config: &Config, body: B) -> Result<Bytes, Response<IdempotencyBody>>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    match Limited::new(body, config.max_request_body).collect().await {
        Ok(body) => Ok(body.to_bytes()),
        Err(e) if e.is::<LengthLimitError>() => {
            Err(config.reject(IdempotencyError::BodyTooLarge {
                limit: config.max_request_body,
            }))
        }
        Err(e) => {
            // The client went away or sent a broken body: nothing to answer it.
            tracing::debug!(error = %e, "idempotency: request body unreadable");
            Err(config.reject(IdempotencyError::BodyUnreadable {
                reason: e.to_string(),
            }))
        }
    }
}

/// Takes `key`'s lock unless a completed request's record answers first: the guard, and
/// whether the store found no record as it took the hold; otherwise the answer (the
/// replay, or a rejection).
async fn lock_unless_recorded(
    config: &Config,
    key: &str,
    fingerprint: Fingerprint,
) -> Result<(LockGuard, bool), Response<IdempotencyBody>> {
    let mode = config.wait.map_or(Mode::TryOnce, Mode::Wait);
    let mut recorded = 0;
    loop {
        // A completed request is replayed without touching its lock, so that retries of a
        // finished request never contend with each other.
        match lookup(config, key, fingerprint).await {
            Ok(Found::Nothing) => {}
            Ok(Found::Replay(response)) => return Err(response),
            Err(e) => return Err(config.reject(e)),
        }
        let lock = LockRequest::new(config.store.clone(), key.to_owned())
            .lease(config.lease)
            .retry(config.retry.clone());
        let error = match lock.unless_recorded(mode).await {
            Ok(Acquired::Checked(guard)) => return Ok((guard, true)),
            Ok(Acquired::Unchecked(guard)) => return Ok((guard, false)),
            // A request with this key completed between the lookup and the lock: its
            // record, read next, is the answer (if it expired meanwhile, the lock is
            // tried again).
            Ok(Acquired::Recorded) if recorded < MAX_RECORDED => {
                recorded += 1;
                continue;
            }
            Ok(Acquired::Recorded) => {
                let error = LockError::backend(RECORD_CONTEXT, NotARecord::Unread);
                IdempotencyError::Lock(error)
            }
            // When to come back is the mean of the holds this layer has seen end, as the
            // lock layer says it.
            Err(LockError::Contended { retry_after, .. }) => {
                IdempotencyError::InFlight { retry_after }
            }
            Err(e) => IdempotencyError::Lock(e),
        };
        return Err(config.reject(error));
    }
}

/// How many times a request may find its key recorded by the lock and then find no
/// record to replay (it expired in between) before it gives up with a 503.
const MAX_RECORDED: u32 = 2;

/// A request that holds its key's lock.
struct Locked {
    key: String,
    fingerprint: Fingerprint,
    guard: LockGuard,
    /// The store found no record as it took the hold (see [`Acquired::Checked`]).
    checked: bool,
}

/// The rest of a request once it holds the lock: the record read again, the handler, the
/// response stored, the lock released.
async fn finish<S, ReqBody, ResBody>(
    config: Arc<Config>,
    mut inner: S,
    mut parts: http::request::Parts,
    body: Bytes,
    Locked {
        key,
        fingerprint,
        guard,
        checked,
    }: Locked,
) -> Result<Response<IdempotencyBody>, S::Error>
where
    S: Service<Request<InnerBody<ReqBody>>, Response = Response<ResBody>>,
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    // The first request may have finished between the lookup and the lock: it stores its
    // record before it releases, so the record is there now if it ever will be. A store
    // that checked it in the step that took the hold found none.
    let found = if checked {
        Ok(Found::Nothing)
    } else {
        lookup(&config, &key, fingerprint).await
    };
    match found {
        Ok(Found::Nothing) => {}
        Ok(Found::Replay(response)) => {
            release(guard).await;
            return Ok(response);
        }
        Err(e) => {
            release(guard).await;
            return Ok(config.reject(e));
        }
    }

    let held = guard.held().clone();
    if let Some(outer) = parts.extensions.remove::<HeldLock>() {
        push_outer(&mut parts.extensions, outer);
    }
    parts.extensions.insert(held.clone());
    let request = Request::from_parts(parts, Either::Left(Full::new(body)));
    // A lost lock drops the handler (the lock layer's default): its work stops at its
    // next await, and nothing is stored.
    let response = tokio::select! {
        biased;
        () = held.lost() => {
            let error = lost_error(&guard, "the idempotent handler ran");
            drop(guard);
            return Ok(config.reject(IdempotencyError::Lock(error)));
        }
        response = call(&mut inner, request) => response?,
    };
    let (parts, body) = response.into_parts();
    if !(config.store_if)(parts.status) {
        release(guard).await;
        return Ok(Response::from_parts(parts, boxed(body)));
    }
    let body = match buffer(body, config.max_response_body).await {
        Ok(body) => body,
        Err(streamed) => {
            tracing::warn!(
                key = %key,
                limit = config.max_response_body,
                "idempotency: response not stored (body over the limit, trailers or a body error)"
            );
            release(guard).await;
            return Ok(Response::from_parts(parts, streamed));
        }
    };
    let record = Record {
        fingerprint,
        status: parts.status,
        headers: kept_headers(&parts.headers, &config.deny_headers),
        body: body.clone(),
    };
    store_record(&config, key, held, record).await;
    release(guard).await;
    Ok(Response::from_parts(parts, boxed(Full::new(body))))
}

/// Stores the handler's `record` for `key` while `held` holds it. The handler ran:
/// whatever the store says now, its response is the answer, so a failure is only logged.
async fn store_record(config: &Config, key: String, held: HeldLock, record: Record) {
    let stored = config
        .records
        .store(key.clone(), held, record.encode(), config.retention);
    match stored.await {
        Ok(true) => {}
        Ok(false) => {
            tracing::warn!(key = %key, "idempotency: lock lost before the record was stored; not stored")
        }
        // As an error, with its causes: a backend error names only what it was doing.
        Err(e) => tracing::warn!(
            key = %key,
            error = &e as &(dyn std::error::Error + 'static),
            "idempotency: record not stored"
        ),
    }
}

/// The stored record of `key`, checked against the request's fingerprint.
async fn lookup(
    config: &Config,
    key: &str,
    fingerprint: Fingerprint,
) -> Result<Found, IdempotencyError> {
    let Some(raw) = config
        .records
        .fetch(key.to_owned())
        .await
        .map_err(IdempotencyError::Lock)?
    else {
        return Ok(Found::Nothing);
    };
    let Some(record) = Record::decode(raw) else {
        return Err(IdempotencyError::Lock(LockError::backend(
            "idempotency record",
            NotARecord::Unreadable,
        )));
    };
    if record.fingerprint != fingerprint {
        return Err(IdempotencyError::Mismatch);
    }
    Ok(Found::Replay(
        record
            .response(config.replay_header.as_ref())
            .map(|body| boxed(Full::new(body))),
    ))
}

/// Drives `inner` to readiness and calls it.
async fn call<S, B>(inner: &mut S, request: Request<B>) -> Result<S::Response, S::Error>
where
    S: Service<Request<B>>,
{
    poll_fn(|cx| inner.poll_ready(cx)).await?;
    inner.call(request).await
}

/// Releases the key's lock, after its record (if any) is stored.
async fn release(guard: LockGuard) {
    if let Err(e) = guard.release().await {
        // The lease frees it.
        tracing::warn!(error = %e, "idempotency: release failed");
    }
}

/// The whole of `body` if it ends within `limit` bytes with no trailers and no error;
/// otherwise the body to send on: what was read, then the rest as it comes.
async fn buffer<B>(body: B, limit: usize) -> Result<Bytes, IdempotencyBody>
where
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    let mut body = Box::pin(body);
    let mut whole = BytesMut::new();
    loop {
        let frame = match body.frame().await {
            None => return Ok(whole.freeze()),
            Some(Ok(frame)) => frame,
            Some(Err(e)) => {
                return Err(resume(whole, Err(e.into()), body));
            }
        };
        match frame.into_data() {
            Ok(data) if whole.len() + data.len() <= limit => whole.extend_from_slice(&data),
            Ok(data) => return Err(resume(whole, Ok(Frame::data(data)), body)),
            Err(trailers) => return Err(resume(whole, Ok(trailers), body)),
        }
    }
}

/// A body of `read`, then `next`, then the rest of `body`.
fn resume<B>(read: BytesMut, next: Result<Frame<Bytes>, BoxError>, body: B) -> IdempotencyBody
where
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    let head = futures_util::stream::iter([Ok(Frame::data(read.freeze())), next]);
    let rest = BodyStream::new(body.map_err(Into::into));
    StreamBody::new(head.chain(rest)).boxed_unsync()
}

pub(crate) fn boxed<B>(body: B) -> IdempotencyBody
where
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    body.map_err(Into::into).boxed_unsync()
}

/// A stored record the layer cannot replay.
#[derive(Debug)]
enum NotARecord {
    /// It cannot be read.
    Unreadable,
    /// The lock found it, again and again, and the store then did not return it.
    Unread,
}

impl std::fmt::Display for NotARecord {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            NotARecord::Unreadable => "the stored idempotency record cannot be read",
            NotARecord::Unread => {
                "the lock found the idempotency record, and then the store did not return it"
            }
        })
    }
}

impl std::error::Error for NotARecord {}

//! [`HeldLock`] and [`HeldLocks`] as axum extractors (with the `axum` feature); without
//! it, read them with [`HeldLocks::from_extensions`] or `extensions().get::<HeldLock>()`.
//!
//! ```
//! use axum::{Router, routing::post};
//! use tower_lock::{HeldLock, HeldLocks};
//!
//! // Rejected with 500 if no lock layer locked the request: a wiring mistake.
//! async fn pay(lock: HeldLock) -> String {
//!     format!("paid under token {}", lock.fencing_token())
//! }
//!
//! // On a route whose key closure may return `None`: runs unlocked then.
//! async fn quote(lock: Option<HeldLock>) -> &'static str {
//!     if lock.is_some() { "locked quote" } else { "unlocked quote" }
//! }
//!
//! // Under nested layers: every lock, outermost first.
//! async fn transfer(locks: HeldLocks) -> String {
//!     locks.iter().map(|l| format!("{}={}", l.key(), l.fencing_token())).collect()
//! }
//! # let _: Router = Router::new().route("/pay", post(pay)).route("/quote", post(quote))
//! #     .route("/transfer", post(transfer));
//! ```

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use http::Extensions;
use pin_project::pin_project;
use tokio_util::sync::{CancellationToken, WaitForCancellationFutureOwned};

use crate::lock::LockOwner;

struct HeldInner {
    key: String,
    owner: LockOwner,
    token: u64,
    /// A shared hold of a read/write lock (`token` is then the last writer's).
    shared: bool,
    lost: CancellationToken,
    /// The other keys of a multi-key lock with their tokens, after `key` in canonical
    /// order; empty for a single key.
    others: Vec<(String, u64)>,
    /// The other keys' `lost` of a multi-key lock (`lost` is the first key's), asked
    /// directly by `is_lost` and polled by `lost()`.
    parts: Vec<CancellationToken>,
}

/// A cheap, cloneable view of a held lock: its key, owner and fencing token, and a signal
/// for when it is lost.
///
/// The layer puts one into the request extensions (`extensions().get::<HeldLock>()`).
/// With the `axum` feature a handler takes it as an argument: `lock: HeldLock` (a 500 [`MissingHeldLock`](crate::lock::MissingHeldLock) if no
/// layer locked the request), `lock: Option<HeldLock>` on a route whose key closure may
/// return `None`, or [`HeldLocks`](crate::HeldLocks) for every lock of nested layers
/// (`HeldLock` is the innermost one).
#[derive(Clone)]
pub struct HeldLock {
    inner: Arc<HeldInner>,
}

impl HeldLock {
    pub(crate) fn new(key: String, owner: LockOwner, token: u64, lost: CancellationToken) -> Self {
        Self::new_many(key, token, Vec::new(), owner, (lost, Vec::new()))
    }

    /// A multi-key lock: `key` and `token` first in canonical order, then `others`.
    pub(crate) fn new_many(
        key: String,
        token: u64,
        others: Vec<(String, u64)>,
        owner: LockOwner,
        (lost, parts): (CancellationToken, Vec<CancellationToken>),
    ) -> Self {
        HeldLock {
            inner: Arc::new(HeldInner {
                key,
                owner,
                token,
                shared: false,
                lost,
                others,
                parts,
            }),
        }
    }

    /// The key as the application gave it. Of a multi-key lock
    /// ([`LockBackend::lock_many`](crate::LockBackend::lock_many)), the first key in
    /// canonical (byte) order; [`keys`](Self::keys) lists them all.
    pub fn key(&self) -> &str {
        &self.inner.key
    }

    /// Every key with its fencing token, in canonical (byte) order: one pair for a lock of
    /// one key, one per key for a multi-key lock.
    pub fn keys(&self) -> impl Iterator<Item = (&str, u64)> {
        let first = (self.inner.key.as_str(), self.inner.token);
        let others = self.inner.others.iter().map(|(k, t)| (k.as_str(), *t));
        std::iter::once(first).chain(others)
    }

    /// The fencing token of `key`, if this lock holds it.
    pub fn fencing_token_of(&self, key: &str) -> Option<u64> {
        self.keys().find(|(k, _)| *k == key).map(|(_, token)| token)
    }

    /// A shared (read) hold of the key's read/write lock
    /// ([`LockRequest::shared`](crate::LockRequest::shared)); its
    /// [`fencing_token`](Self::fencing_token) is then the token of the key's last exclusive
    /// acquisition, which other shared holders see too.
    pub fn is_shared(&self) -> bool {
        self.inner.shared
    }

    /// Marks a fresh handle as a shared hold.
    pub(crate) fn into_shared(mut self, shared: bool) -> Self {
        if let Some(inner) = Arc::get_mut(&mut self.inner) {
            inner.shared = shared;
        }
        self
    }

    /// The owner this lock is held under.
    pub fn owner(&self) -> &LockOwner {
        &self.inner.owner
    }

    /// A number strictly greater than the token of every earlier acquisition of this key
    /// (of a multi-key lock: of its first key; see [`keys`](Self::keys)),
    /// even across deletion of the lock. Send it with every write the lock protects and
    /// have the store refuse writes with a token lower than one it has seen: that keeps a
    /// paused or partitioned former holder from overwriting newer data.
    pub fn fencing_token(&self) -> u64 {
        self.inner.token
    }

    /// True once the lock is known to be lost (renewal found it gone, or Redis was
    /// unreachable until shortly before its lease could end there: 2% of the lease, at
    /// least 4 ms, so that the handler has stopped by then); for a multi-key lock, once
    /// any of its keys is.
    pub fn is_lost(&self) -> bool {
        self.inner.lost.is_cancelled() || self.inner.parts.iter().any(|p| p.is_cancelled())
    }

    /// Resolves when the lock is lost. Never resolves while it is held.
    pub fn lost(&self) -> impl Future<Output = ()> + Send + 'static {
        self.lost_signal()
    }

    /// [`lost`](Self::lost) as a named type, so the layer's futures hold it unboxed.
    pub(crate) fn lost_signal(&self) -> LostSignal {
        let first = self.inner.lost.clone().cancelled_owned();
        if self.inner.parts.is_empty() {
            return LostSignal::One { signal: first };
        }
        let rest = self.inner.parts.iter().map(|p| p.clone().cancelled_owned());
        LostSignal::Many {
            signals: std::iter::once(first).chain(rest).map(Box::pin).collect(),
        }
    }

    /// The tokens this lock is lost by: its key's, then (of a multi-key lock) the others'.
    pub(crate) fn lost_tokens(&self) -> impl Iterator<Item = CancellationToken> + '_ {
        std::iter::once(&self.inner.lost)
            .chain(&self.inner.parts)
            .cloned()
    }
}

impl fmt::Debug for HeldLock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut f = f.debug_struct("HeldLock");
        f.field("key", &self.inner.key);
        if !self.inner.others.is_empty() {
            f.field("other_keys", &self.inner.others);
        }
        f.field("owner", &self.inner.owner)
            .field("fencing_token", &self.inner.token)
            .field("shared", &self.inner.shared)
            .field("lost", &self.is_lost())
            .finish()
    }
}

/// Resolves when a lock is lost: when its key's signal does, or any key's of a multi-key
/// lock (polled directly, no task in between).
#[pin_project(project = LostSignalProj)]
pub(crate) enum LostSignal {
    One {
        #[pin]
        signal: WaitForCancellationFutureOwned,
    },
    Many {
        signals: Vec<Pin<Box<WaitForCancellationFutureOwned>>>,
    },
}

impl Future for LostSignal {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        match self.project() {
            LostSignalProj::One { signal } => signal.poll(cx),
            LostSignalProj::Many { signals } => {
                for signal in signals.iter_mut() {
                    if signal.as_mut().poll(cx).is_ready() {
                        return Poll::Ready(());
                    }
                }
                Poll::Pending
            }
        }
    }
}

/// The locks that outer layers took for this request, outermost first. The innermost
/// lock is the `HeldLock` extension itself, which each layer replaces with its own (so
/// `Extension<HeldLock>` and the `HeldLock` extractor see the innermost lock, and nested
/// layers find the request's owner there).
#[derive(Clone, Default)]
struct OuterLocks(Vec<HeldLock>);

/// Called by a layer about to lock a request that `outer` already holds a lock for: keeps
/// `outer` reachable after the layer's own lock replaces it as the `HeldLock` extension.
pub(crate) fn push_outer(extensions: &mut Extensions, outer: HeldLock) {
    match extensions.get_mut::<OuterLocks>() {
        Some(locks) => locks.0.push(outer),
        None => {
            extensions.insert(OuterLocks(vec![outer]));
        }
    }
}

/// Every lock the request holds, outermost layer first; empty when none was taken.
///
/// An axum extractor that never rejects (with the `axum` feature). With one lock layer it
/// holds the same lock as the [`HeldLock`] extractor; with nested layers (a lock per shop, then per order) it
/// gives the handler each key's fencing token. A nested layer that re-enters the same
/// key appears once per layer.
#[derive(Clone, Debug, Default)]
pub struct HeldLocks(Vec<HeldLock>);

impl HeldLocks {
    /// Reads the locks from a request's extensions.
    pub fn from_extensions(extensions: &Extensions) -> Self {
        let mut locks = extensions
            .get::<OuterLocks>()
            .map(|outer| outer.0.clone())
            .unwrap_or_default();
        locks.extend(extensions.get::<HeldLock>().cloned());
        HeldLocks(locks)
    }

    /// The locks, outermost first.
    pub fn iter(&self) -> std::slice::Iter<'_, HeldLock> {
        self.0.iter()
    }

    /// The innermost lock held on `key` (as the application gave it), if any.
    pub fn get(&self, key: &str) -> Option<&HeldLock> {
        self.0
            .iter()
            .rev()
            .find(|lock| lock.keys().any(|(k, _)| k == key))
    }

    /// How many locks the request holds.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// True when the request holds no lock.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The locks, outermost first.
    pub fn into_vec(self) -> Vec<HeldLock> {
        self.0
    }
}

impl<'a> IntoIterator for &'a HeldLocks {
    type Item = &'a HeldLock;
    type IntoIter = std::slice::Iter<'a, HeldLock>;

    fn into_iter(self) -> Self::IntoIter {
        self.iter()
    }
}

/// Rejection of the [`HeldLock`] extractor when no lock layer locked the request: 500,
/// since it is a wiring mistake (the layer is missing around the route, or sits inside
/// it), not the client's. A route whose key closure may return `None` takes
/// `Option<HeldLock>` instead.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MissingHeldLock;

impl fmt::Display for MissingHeldLock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(
            "missing request extension `tower_lock::HeldLock`: no LockLayer locked this request \
             (is the layer added around this route, and did its key closure return a key? \
             Take `Option<HeldLock>` on routes that may run unlocked)",
        )
    }
}

impl std::error::Error for MissingHeldLock {}

#[cfg(feature = "axum")]
mod extractors {
    use std::convert::Infallible;

    use axum::extract::{FromRequestParts, OptionalFromRequestParts};
    use axum::response::{IntoResponse, Response};
    use http::StatusCode;
    use http::request::Parts;

    use super::{HeldLocks, MissingHeldLock};
    use crate::lock::HeldLock;

    #[cfg_attr(docsrs, doc(cfg(feature = "axum")))]
    impl<S: Send + Sync> FromRequestParts<S> for HeldLocks {
        type Rejection = Infallible;

        async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Self::Rejection> {
            Ok(HeldLocks::from_extensions(&parts.extensions))
        }
    }

    #[cfg_attr(docsrs, doc(cfg(feature = "axum")))]
    impl<S: Send + Sync> FromRequestParts<S> for HeldLock {
        type Rejection = MissingHeldLock;

        async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Self::Rejection> {
            parts
                .extensions
                .get::<HeldLock>()
                .cloned()
                .ok_or(MissingHeldLock)
        }
    }

    #[cfg_attr(docsrs, doc(cfg(feature = "axum")))]
    impl<S: Send + Sync> OptionalFromRequestParts<S> for HeldLock {
        type Rejection = Infallible;

        async fn from_request_parts(
            parts: &mut Parts,
            _: &S,
        ) -> Result<Option<Self>, Self::Rejection> {
            Ok(parts.extensions.get::<HeldLock>().cloned())
        }
    }

    #[cfg_attr(docsrs, doc(cfg(feature = "axum")))]
    impl IntoResponse for MissingHeldLock {
        fn into_response(self) -> Response {
            (StatusCode::INTERNAL_SERVER_ERROR, self.to_string()).into_response()
        }
    }
}

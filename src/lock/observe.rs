//! What every backend records of an acquisition (its span and metrics) and of a hold's
//! end, and the owners acquisitions are made under.

use std::sync::atomic::{AtomicU64, Ordering};

use tokio::time::Instant;
use tracing::Instrument;

use crate::error::LockError;
use crate::lock::retry::RetryAfter;
use crate::lock::{Acquired, BoxFuture, HeldLock, LockGuard, LockOwner, LockRequest, Mode};
use crate::telemetry::{Hold, Labels, Namespace, Outcome};

/// What every backend records of an acquisition: the `lock.acquire` span (how long it
/// waited, its outcome and token) and the metrics.
pub(crate) struct Observe {
    span: tracing::Span,
    labels: Labels,
    waits: bool,
    retry: RetryAfter,
}

impl Observe {
    pub(crate) fn new(request: &LockRequest, max_key_len: usize, namespace: &Namespace) -> Self {
        // A rejected key may be huge or hold control characters: never log it raw.
        let shown = if request.key.len() <= max_key_len {
            request.key.as_str()
        } else {
            "<oversized key>"
        };
        let span = tracing::info_span!(
            "lock.acquire",
            key = ?shown,
            mode = match request.mode { Mode::TryOnce => "try_once", Mode::Wait(_) => "wait" },
            waited_ms = tracing::field::Empty,
            outcome = tracing::field::Empty,
            token = tracing::field::Empty,
        );
        Observe {
            span,
            labels: Labels::new(namespace, &request.route, request.kind.label()),
            waits: matches!(request.mode, Mode::Wait(_)),
            retry: request.retry.clone(),
        }
    }

    /// Runs the acquisition `acquire` makes, recording it.
    ///
    /// Takes a closure rather than the future: a future passed in would be stored twice in
    /// this one's state (once as captured, once as awaited), and every task queued for a
    /// key carries this state.
    pub(crate) fn run<T, F, Fut>(
        self,
        acquire: F,
    ) -> impl Future<Output = Result<T, LockError>> + Send + 'static
    where
        T: Observed,
        F: FnOnce() -> Fut + Send + 'static,
        Fut: Future<Output = Result<T, LockError>> + Send + 'static,
    {
        let Observe {
            span,
            labels,
            waits,
            retry,
        } = self;
        async move {
            let started = Instant::now();
            let mut result = {
                let _waiting = waits.then(|| labels.waiting());
                acquire().await
            };
            let waited = started.elapsed();
            let span = tracing::Span::current();
            span.record(
                "waited_ms",
                u64::try_from(waited.as_millis()).unwrap_or(u64::MAX),
            );
            let outcome = match result.as_mut().map(Observed::guard) {
                Ok(None) => Outcome::Recorded,
                Ok(Some(guard)) => {
                    span.record("token", guard.fencing_token());
                    guard.count_hold(labels.hold());
                    guard.time_hold(retry.clock());
                    if guard.is_reentry() {
                        Outcome::Reentered
                    } else {
                        Outcome::Acquired
                    }
                }
                Err(e) => {
                    retry.apply(e);
                    Outcome::of(e)
                }
            };
            span.record("outcome", outcome.as_str());
            // A refused key waited for nothing.
            let waited = (outcome != Outcome::InvalidKey).then_some(waited);
            labels.acquisition(outcome, waited);
            match &result {
                Err(e) => tracing::debug!(
                    error = e as &(dyn std::error::Error + 'static),
                    "lock acquisition failed"
                ),
                Ok(_) => tracing::debug!("lock acquisition finished"),
            }
            result
        }
        .instrument(span)
    }
}

/// What an acquisition comes to: a guard, or (the idempotency layer's) none.
pub(crate) trait Observed: Send + 'static {
    /// The hold taken, if any.
    fn guard(&mut self) -> Option<&mut LockGuard>;
}

impl Observed for LockGuard {
    fn guard(&mut self) -> Option<&mut LockGuard> {
        Some(self)
    }
}

impl Observed for Acquired {
    fn guard(&mut self) -> Option<&mut LockGuard> {
        match self {
            Acquired::Checked(guard) | Acquired::Unchecked(guard) => Some(guard),
            Acquired::Recorded => None,
        }
    }
}

/// Ends `hold` as its `release` starts; a release that finds the lock lost counts
/// [`Outcome::Lost`].
#[cfg(feature = "metrics")]
pub(crate) fn end_hold(
    hold: Hold,
    release: BoxFuture<'static, Result<(), LockError>>,
    held: &HeldLock,
) -> BoxFuture<'static, Result<(), LockError>> {
    if held.is_lost() {
        hold.end(true);
        return release;
    }
    let labels = hold.labels().clone();
    hold.end(false);
    Box::pin(async move {
        let result = release.await;
        if let Err(LockError::Lost { .. }) = result {
            labels.acquisition(Outcome::Lost, None);
        }
        result
    })
}

/// Without metrics there is nothing to count: the release as it is.
#[cfg(not(feature = "metrics"))]
pub(crate) fn end_hold(
    _: Hold,
    release: BoxFuture<'static, Result<(), LockError>>,
    _: &HeldLock,
) -> BoxFuture<'static, Result<(), LockError>> {
    release
}

/// Owner ids of one backend: `instance-uuid:sequence`, a fresh one per request.
pub(crate) struct OwnerIds {
    instance: String,
    sequence: AtomicU64,
}

impl OwnerIds {
    pub(crate) fn new() -> Self {
        OwnerIds {
            instance: uuid::Uuid::new_v4().simple().to_string(),
            sequence: AtomicU64::new(0),
        }
    }

    /// A new owner, never handed out before by any backend.
    pub(crate) fn next(&self) -> LockOwner {
        let seq = self.sequence.fetch_add(1, Ordering::Relaxed);
        LockOwner::new(format!("{}:{seq}", self.instance))
    }

    /// A number never returned before by this backend, to tell holds of one owner apart.
    pub(crate) fn serial(&self) -> u64 {
        self.sequence.fetch_add(1, Ordering::Relaxed)
    }

    /// The instance part of every owner id.
    pub(crate) fn instance(&self) -> &str {
        &self.instance
    }
}

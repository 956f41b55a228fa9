//! The core as a [`Backend`]: acquisitions (see `acquire/`), owners, and the operator
//! calls, each bounded by the command timeout.

use std::collections::BTreeSet;
use std::sync::Arc;

use futures_util::{StreamExt, TryFutureExt, stream};
use tokio::time::timeout;

use crate::core::store::Records;
use crate::core::{Core, Store};
use crate::error::LockError;
use crate::lock::backend::Backend;
use crate::lock::inspect::{LockInfo, Primitive};
use crate::lock::observe::Observe;
use crate::lock::{Acquired, BoxFuture, LockGuard, LockOwner, LockRequest};
use crate::telemetry::Namespace;

impl<S: Store> Backend for Core<S> {
    fn acquire(
        self: Arc<Self>,
        mut request: LockRequest,
    ) -> BoxFuture<'static, Result<LockGuard, LockError>> {
        request.unless_recorded = false;
        let observe = Observe::new(&request, self.settings.max_key_len, &self.metrics);
        Box::pin(observe.run(move || async move {
            match self.acquire_traced(request).await? {
                Acquired::Checked(guard) | Acquired::Unchecked(guard) => Ok(guard),
                // Not asked for: no attempt checked a record.
                Acquired::Recorded => Err(LockError::backend("acquire", UnaskedRecordCheck)),
            }
        }))
    }

    fn acquire_unless_recorded(
        self: Arc<Self>,
        mut request: LockRequest,
    ) -> BoxFuture<'static, Result<Acquired, LockError>> {
        request.unless_recorded &= self.capabilities.records == Records::InAttempt;
        let observe = Observe::new(&request, self.settings.max_key_len, &self.metrics);
        Box::pin(observe.run(move || self.acquire_traced(request)))
    }

    fn new_owner(&self) -> LockOwner {
        self.owners.next()
    }

    fn metrics(&self) -> &Namespace {
        &self.metrics
    }

    fn max_key_len(&self) -> usize {
        self.settings.max_key_len
    }

    fn inspect(
        self: Arc<Self>,
        key: String,
        of: Primitive,
    ) -> BoxFuture<'static, Result<LockInfo, LockError>> {
        let (inspect, limit) = (self.store.inspect(key, of), self.settings.command_timeout);
        Box::pin(async move {
            timeout(limit, inspect)
                .await
                .map_err(|elapsed| LockError::backend("inspect", elapsed))?
        })
    }

    fn list_held(
        self: Arc<Self>,
        prefix: String,
    ) -> BoxFuture<'static, Result<Vec<LockInfo>, LockError>> {
        Box::pin(self.held_under(prefix.into()))
    }

    fn force_release(
        self: Arc<Self>,
        key: String,
        of: Primitive,
    ) -> BoxFuture<'static, Result<LockInfo, LockError>> {
        let freeing = self.store.force_release(key, of);
        let limit = self.settings.command_timeout;
        Box::pin(async move {
            let freed = timeout(limit, freeing)
                .await
                .map_err(|elapsed| LockError::backend("force_release", elapsed))??;
            if !freed.is_free() {
                tracing::info!(
                    key = %freed.key,
                    mode = ?freed.mode,
                    holders = freed.holders,
                    "lock force-released"
                );
            }
            Ok(freed)
        })
    }
}

/// How many keys of a listing are inspected at once.
const INSPECTING: usize = 16;
/// How many times a listing inspects a key before its store's failure fails the listing.
const INSPECT_TRIES: usize = 3;

impl<S: Store> Core<S> {
    /// Every lock and semaphore held under `prefix`, page by page: each key a page names is
    /// inspected (at most [`INSPECTING`] at once, each call bounded by the command
    /// timeout), the free ones and those this backend cannot name left out; sorted by key,
    /// a key's lock before its semaphore.
    async fn held_under(self: Arc<Self>, prefix: Arc<str>) -> Result<Vec<LockInfo>, LockError> {
        let limit = self.settings.command_timeout;
        let mut seen = BTreeSet::new();
        let mut held = Vec::new();
        let mut from = None;
        loop {
            let page = timeout(limit, self.store.held_page(prefix.clone(), from))
                .await
                .map_err(|elapsed| LockError::backend("list_held", elapsed))??;
            let fresh = page.keys.into_iter().filter(|key| seen.insert(key.clone()));
            let mut inspected = stream::iter(fresh)
                .map(|(key, of)| {
                    self.clone()
                        .inspect_listed(key, of)
                        .map_ok(move |info| (info, of))
                })
                .buffer_unordered(INSPECTING);
            while let Some(info) = inspected.next().await {
                match info {
                    Ok((info, of)) if !info.is_free() => held.push((info, of)),
                    Ok(_) => {}
                    // A key this backend cannot name (longer than its `max_key_len`, taken
                    // by an instance with a larger one) is not one it can report on.
                    Err(LockError::InvalidKey(_)) => {}
                    Err(error) => return Err(error),
                }
            }
            match page.next {
                Some(next) => from = Some(next),
                None => break,
            }
        }
        held.sort_by(|(a, a_of), (b, b_of)| (&a.key, a_of).cmp(&(&b.key, b_of)));
        Ok(held.into_iter().map(|(info, _)| info).collect())
    }

    /// A listed key's snapshot, inspected again (up to [`INSPECT_TRIES`] in all) when the
    /// store failed to answer: one slow call of thousands fails no listing.
    async fn inspect_listed(
        self: Arc<Self>,
        key: String,
        of: Primitive,
    ) -> Result<LockInfo, LockError> {
        let mut tries = 1;
        loop {
            match self.clone().inspect(key.clone(), of).await {
                Err(LockError::Backend(_)) if tries < INSPECT_TRIES => tries += 1,
                answer => return answer,
            }
        }
    }
}

/// A record check's answer to an acquisition that did not ask for one.
#[derive(Debug)]
struct UnaskedRecordCheck;

impl std::fmt::Display for UnaskedRecordCheck {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the store answered a record check that was not asked for")
    }
}

impl std::error::Error for UnaskedRecordCheck {}

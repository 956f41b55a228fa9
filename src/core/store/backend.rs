//! The core as a [`Backend`]: acquisitions (see `acquire/`), owners, and the operator
//! calls, each bounded by the command timeout.

use std::sync::Arc;

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

/// A record check's answer to an acquisition that did not ask for one.
#[derive(Debug)]
struct UnaskedRecordCheck;

impl std::fmt::Display for UnaskedRecordCheck {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the store answered a record check that was not asked for")
    }
}

impl std::error::Error for UnaskedRecordCheck {}

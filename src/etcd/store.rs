//! The etcd store: the core's primitive calls as etcd transactions on the lock's
//! directory, every hold a key attached to the backend's lease.

use std::sync::Arc;
use std::time::Duration;

use etcd_client::{
    Client, Compare, CompareOp, GetOptions, KeyValue, KvClient, PutOptions, SortOrder, SortTarget,
    Txn, TxnOp, TxnOpResponse,
};

use super::error::EtcdError;
use super::keys::{EtcdKey, dir, hold_key};
use super::lease::Lease;
use super::watch::Listener;
use crate::core::hold_value::HoldValue;
use crate::core::runtime::Daemon;
use crate::core::store::{Attempt, Attempted, Release, Released, Sent, Store, StoreKey};
use crate::core::wakeups::Waiter;
use crate::core::watchdog::Due;
use crate::error::LockError;
use crate::lock::inspect::{LockInfo, LockMode, Primitive};
use crate::lock::{BoxFuture, Kind};

/// How many times a call goes round when its compare-and-swap finds the hold changed
/// under it (only this backend writes its hold, so once is the rule).
const ROUNDS: usize = 4;

/// etcd's default bound on the operations of one transaction is 128.
const RENEW_BATCH: usize = 100;

/// Locks in one etcd cluster, under the namespace's prefix.
pub(crate) struct EtcdStore {
    pub(crate) client: Client,
    pub(crate) lease: Arc<Lease>,
    pub(crate) listener: Listener,
    /// Keeps the lease alive while the backend lives, and revokes it at shutdown.
    pub(crate) keeper: Daemon,
    pub(crate) namespace: String,
    pub(crate) max_key_len: usize,
}

/// The one hold in a lock's directory, if any.
fn only_hold() -> GetOptions {
    GetOptions::new()
        .with_prefix()
        .with_sort(SortTarget::Create, SortOrder::Ascend)
        .with_limit(1)
}

/// A revision as a fencing token (revisions start at 1).
fn token(revision: i64) -> Result<u64, EtcdError> {
    u64::try_from(revision).map_err(|_| EtcdError::Unexpected("a negative revision"))
}

impl EtcdStore {
    fn kv(&self) -> KvClient {
        self.client.kv_client()
    }

    /// One exclusive attempt (see the module docs of `etcd`): puts this backend's key in
    /// the lock's directory if the directory is empty, in one transaction; else reads the
    /// hold there, and re-enters it if it is the holder's own.
    async fn attempt_exclusive(&self, key: &EtcdKey, holder: &str) -> Result<Attempted, EtcdError> {
        let dir = dir(&key.name);
        for _ in 0..ROUNDS {
            let lease = self.lease.for_hold().await?;
            let mine = hold_key(&key.name, lease);
            let take = Txn::new()
                .when([Compare::version(dir.clone(), CompareOp::Equal, 0).with_prefix()])
                .and_then([TxnOp::put(
                    mine.clone(),
                    HoldValue::new(holder).encode(),
                    Some(PutOptions::new().with_lease(lease)),
                )])
                .or_else([TxnOp::get(dir.clone(), Some(only_hold()))]);
            let reply = match self.kv().txn(take).await {
                Ok(reply) => reply,
                Err(e) => {
                    let e = EtcdError::from(e);
                    if e.is_lease_not_found() {
                        // Gone since it was last confirmed: a new one, and again.
                        self.lease.replace(lease).await?;
                        continue;
                    }
                    return Err(e);
                }
            };
            if reply.succeeded() {
                let revision = reply
                    .header()
                    .map(|h| h.revision())
                    .ok_or(EtcdError::Unexpected("a transaction without a header"))?;
                // The put is the transaction's only write: the key's create revision.
                return Ok(Attempted::Acquired {
                    token: token(revision)?,
                    count: 1,
                });
            }
            let Some(held) = first_kv(reply.op_responses()) else {
                // Freed between the compare and the read: go again.
                continue;
            };
            if held.key() != mine.as_bytes() {
                return Ok(Attempted::Held {
                    left: None,
                    queued: false,
                });
            }
            let mut value = HoldValue::parse(held.value()).ok_or(EtcdError::Foreign)?;
            if value.holder != holder {
                return Ok(Attempted::Held {
                    left: None,
                    queued: false,
                });
            }
            value.count += 1;
            let reenter = Txn::new()
                .when([Compare::mod_revision(
                    mine.clone(),
                    CompareOp::Equal,
                    held.mod_revision(),
                )])
                .and_then([TxnOp::put(
                    mine,
                    value.encode(),
                    Some(PutOptions::new().with_lease(held.lease())),
                )]);
            if self.kv().txn(reenter).await?.succeeded() {
                return Ok(Attempted::Acquired {
                    token: token(held.create_revision())?,
                    count: value.count,
                });
            }
        }
        Err(EtcdError::Contended)
    }

    /// One release of an exclusive hold: the count down, or the key deleted, compared on
    /// the hold's revision; a release already applied (its id recorded) changes nothing.
    ///
    /// The common case, a hold never re-entered under the current lease, is one
    /// transaction: *if the key holds exactly that, delete it, else read the directory*;
    /// what it read serves the general path.
    async fn release_exclusive(
        &self,
        key: &EtcdKey,
        release: &Release<'_>,
    ) -> Result<Released, EtcdError> {
        let dir = dir(&key.name);
        let mine = hold_key(&key.name, self.lease.id());
        let mut compares = vec![Compare::value(
            mine.clone(),
            CompareOp::Equal,
            HoldValue::new(release.holder.as_str()).encode(),
        )];
        if let Some(token) = release.only_token {
            let revision = i64::try_from(token).unwrap_or(i64::MAX);
            compares.push(Compare::create_revision(
                mine.clone(),
                CompareOp::Equal,
                revision,
            ));
        }
        let last = Txn::new()
            .when(compares)
            .and_then([TxnOp::delete(mine, None)])
            .or_else([TxnOp::get(dir.clone(), Some(only_hold()))]);
        let reply = self.kv().txn(last).await?;
        if reply.succeeded() {
            return Ok(Released::Freed);
        }
        let mut found = first_kv(reply.op_responses());
        for _ in 0..ROUNDS {
            let Some(held) = found.take() else {
                return Ok(Released::NotHeld);
            };
            let Some(mut value) = HoldValue::parse(held.value()) else {
                return Err(EtcdError::Foreign);
            };
            if value.holder != release.holder.as_str()
                || release
                    .only_token
                    .is_some_and(|t| token(held.create_revision()).ok() != Some(t))
            {
                return Ok(Released::NotHeld);
            }
            if value.released.iter().any(|id| id == release.release_id) {
                return Ok(Released::Remains);
            }
            let (op, released) = if value.count > 1 {
                value.count -= 1;
                value.released.push(release.release_id.to_owned());
                let keep = PutOptions::new().with_lease(held.lease());
                let put = TxnOp::put(held.key().to_vec(), value.encode(), Some(keep));
                (put, Released::Remains)
            } else {
                (TxnOp::delete(held.key().to_vec(), None), Released::Freed)
            };
            let swap = Txn::new()
                .when([Compare::mod_revision(
                    held.key().to_vec(),
                    CompareOp::Equal,
                    held.mod_revision(),
                )])
                .and_then([op])
                .or_else([TxnOp::get(dir.clone(), Some(only_hold()))]);
            let reply = self.kv().txn(swap).await?;
            if reply.succeeded() {
                return Ok(released);
            }
            found = first_kv(reply.op_responses());
        }
        Err(EtcdError::Contended)
    }

    /// Whether each hold of `batch` is still there under the lease `lease`.
    async fn check(&self, batch: &[Due], lease: i64) -> Result<Vec<bool>, EtcdError> {
        let reads: Vec<TxnOp> = batch
            .iter()
            .map(|d| TxnOp::get(hold_key(&d.key.0, lease), None))
            .collect();
        let reply = self.kv().txn(Txn::new().and_then(reads)).await?;
        let responses = reply.op_responses();
        if responses.len() != batch.len() {
            return Err(EtcdError::Unexpected("a renewal read"));
        }
        let mut held = Vec::with_capacity(batch.len());
        for (due, response) in batch.iter().zip(responses) {
            let TxnOpResponse::Get(found) = response else {
                return Err(EtcdError::Unexpected("a renewal read"));
            };
            let hold = found.kvs().first().filter(|kv| {
                HoldValue::parse(kv.value()).is_some_and(|v| v.holder == due.key.1.as_str())
            });
            held.push(hold.is_some());
        }
        Ok(held)
    }

    async fn snapshot(
        &self,
        user: String,
        of: Primitive,
        free: bool,
    ) -> Result<LockInfo, LockError> {
        let context = if free { "force_release" } else { "inspect" };
        let key = EtcdKey::new(&self.namespace, user, self.max_key_len)?;
        if of == Primitive::Semaphore {
            return Ok(LockInfo::free(key.user().to_owned(), None));
        }
        let dir = dir(&key.name);
        let fail = |e: etcd_client::Error| LockError::backend(context, EtcdError::from(e));
        let reply = self
            .kv()
            .get(dir.clone(), Some(only_hold()))
            .await
            .map_err(fail)?;
        let Some(held) = reply.kvs().first() else {
            return Ok(LockInfo::free(key.user().to_owned(), None));
        };
        let count = HoldValue::parse(held.value()).map_or(1, |v| v.count);
        if free {
            let delete = etcd_client::DeleteOptions::new().with_prefix();
            self.kv().delete(dir, Some(delete)).await.map_err(fail)?;
        }
        Ok(LockInfo {
            key: key.user().to_owned(),
            mode: LockMode::Exclusive,
            holders: 1,
            holds: u32::try_from(count).unwrap_or(u32::MAX),
            // At most the TTL: its holder renews it every third of that.
            lease_remaining: Some(self.lease.ttl()),
            fencing_token: token(held.create_revision()).ok(),
        })
    }
}

/// The first key a transaction's read found.
fn first_kv(responses: Vec<TxnOpResponse>) -> Option<KeyValue> {
    responses.into_iter().find_map(|r| match r {
        TxnOpResponse::Get(mut got) => got.take_kvs().into_iter().next(),
        _ => None,
    })
}

/// Why the etcd backend refuses shared locks and permits, for now.
const EXCLUSIVE_ONLY: &str =
    "the etcd backend supports exclusive locks only for now (no shared locks or permits)";

impl Store for EtcdStore {
    type Key = EtcdKey;
    type Error = EtcdError;
    // A release needs no particular connection.
    type Sent = ();

    fn key(&self, user: String, kind: Kind) -> Result<EtcdKey, LockError> {
        if kind != Kind::Exclusive {
            return Err(LockError::Unsupported {
                key: user,
                what: EXCLUSIVE_ONLY,
            });
        }
        Ok(EtcdKey::new(&self.namespace, user, self.max_key_len)?)
    }

    fn attempt(
        self: &Arc<Self>,
        key: &Arc<EtcdKey>,
        attempt: Attempt,
    ) -> BoxFuture<'static, Sent<Self>> {
        // Runs again on this caller's runtime if the one it ran on is gone.
        self.keeper.ensure_running();
        let (store, key) = (self.clone(), key.clone());
        Box::pin(async move {
            let attempted = match attempt.kind {
                Kind::Exclusive => store.attempt_exclusive(&key, attempt.holder.as_str()).await,
                // Refused by `key`.
                Kind::Shared | Kind::Permit(_) => Err(EtcdError::Unexpected(EXCLUSIVE_ONLY)),
            };
            (attempted, Some(()))
        })
    }

    fn release<'a>(
        &'a self,
        key: &'a EtcdKey,
        release: &'a Release<'a>,
    ) -> BoxFuture<'a, Result<Released, EtcdError>> {
        Box::pin(self.release_exclusive(key, release))
    }

    fn release_after<'a>(
        &'a self,
        key: &'a EtcdKey,
        release: &'a Release<'a>,
        (): (),
    ) -> BoxFuture<'a, bool> {
        Box::pin(async move { self.release(key, release).await.is_ok() })
    }

    fn renew<'a>(&'a self, batch: &'a [Due]) -> BoxFuture<'a, Result<Vec<bool>, EtcdError>> {
        Box::pin(async move {
            // One keep-alive answered confirms every hold under the lease.
            let lease = match self.lease.keep_alive().await {
                Ok(lease) => lease,
                Err(e) if e.is_lease_not_found() => return Ok(vec![false; batch.len()]),
                Err(e) => return Err(e),
            };
            self.check(batch, lease).await
        })
    }

    fn renewal_calls(&self, due: Vec<Due>) -> Vec<Vec<Due>> {
        due.chunks(RENEW_BATCH).map(<[Due]>::to_vec).collect()
    }

    fn subscribe(&self, key: &EtcdKey) -> Waiter {
        self.listener.register(&key.name)
    }

    fn releases_lost_holds(&self) -> bool {
        // The backend's lease outlives a hold that asked for no renewal.
        true
    }

    fn lease(&self, _lease: Duration) -> Duration {
        self.lease.hold_lease()
    }

    fn inspect(
        self: &Arc<Self>,
        user: String,
        of: Primitive,
    ) -> BoxFuture<'static, Result<LockInfo, LockError>> {
        let store = self.clone();
        Box::pin(async move { store.snapshot(user, of, false).await })
    }

    fn force_release(
        self: &Arc<Self>,
        user: String,
        of: Primitive,
    ) -> BoxFuture<'static, Result<LockInfo, LockError>> {
        let store = self.clone();
        Box::pin(async move { store.snapshot(user, of, true).await })
    }
}

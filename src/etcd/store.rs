//! The etcd store: the core's primitive calls as etcd transactions on the lock's
//! directory, every hold a key attached to the backend's lease. The attempts of each kind
//! are in `rw.rs` (exclusive and shared) and `permits.rs`; operators' calls in `inspect.rs`.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use etcd_client::{
    Compare, CompareOp, GetOptions, KeyValue, PutOptions, SortOrder, SortTarget, Txn, TxnOp,
    TxnOpResponse, TxnResponse,
};

use super::error::EtcdError;
use super::keys::{Entry, EtcdKey, hold_key, holder_key, is_semaphore};
use super::lease::Lease;
use super::line::Line;
use super::members::Members;
use super::orphans::Orphans;
use super::watch::Listener;
use crate::core::hold::value::HoldValue;
use crate::core::kit::turn::{self, EntryKind};
use crate::core::runtime::Daemon;
use crate::core::store::{
    Attempt, Attempted, Capabilities, Failure, HeldPage, LostHolds, PermitWaiters, Release,
    Released, Sent, Store,
};
use crate::core::wakeups::Waiter;
use crate::core::watchdog::Due;
use crate::error::LockError;
use crate::lock::inspect::{LockInfo, Primitive};
use crate::lock::{BoxFuture, Kind};

/// How many times a call goes round when its compare-and-swap finds the lock changed
/// under it: only this backend writes its hold, but a writer's line-up also fails when
/// the key it was to wait behind went meanwhile (see `rw.rs`), which a busy lock's
/// releases make happen again and again.
pub(super) const ROUNDS: usize = 16;

/// What a round of an attempt came to: an answer, or go round again (the keys changed
/// under it, or its lease is gone).
pub(super) type Round = Option<Attempted>;

/// etcd's default bound on the operations of one transaction is 128.
const RENEW_BATCH: usize = 100;

/// Locks in one etcd cluster, under the namespace's prefix.
pub(crate) struct EtcdStore {
    pub(crate) members: Arc<Members>,
    pub(crate) lease: Arc<Lease>,
    pub(crate) listener: Listener,
    /// Keeps the lease alive while the backend lives, and revokes it at shutdown.
    pub(crate) keeper: Daemon,
    /// The acquisitions by holder, and the keys their lost writes may put.
    pub(crate) orphans: Arc<Orphans>,
    /// Looks for those keys while there are lost writes (see `orphans.rs`).
    pub(crate) sweeper: Daemon,
    pub(crate) namespace: String,
    pub(crate) max_key_len: usize,
    /// Numbers the acquisitions (each waits on a channel of its own).
    pub(crate) acquisitions: AtomicU64,
}

/// The keys from `start` to `end`, oldest (lowest create revision) first.
pub(super) fn in_order(end: &str) -> GetOptions {
    GetOptions::new()
        .with_range(end)
        .with_sort(SortTarget::Create, SortOrder::Ascend)
}

/// A revision as a fencing token (revisions start at 1).
pub(super) fn token(revision: i64) -> Result<u64, EtcdError> {
    u64::try_from(revision).map_err(|_| EtcdError::Unexpected("a negative revision"))
}

/// The revision a transaction ran at (its only write's create revision, if it wrote).
pub(super) fn revision(reply: &TxnResponse) -> Result<i64, EtcdError> {
    reply
        .header()
        .map(|h| h.revision())
        .ok_or(EtcdError::Unexpected("a transaction without a header"))
}

/// Every key a transaction's reads found, read by read.
pub(super) fn found(responses: Vec<TxnOpResponse>) -> Vec<Vec<KeyValue>> {
    responses
        .into_iter()
        .filter_map(|r| match r {
            TxnOpResponse::Get(mut got) => Some(got.take_kvs()),
            _ => None,
        })
        .collect()
}

/// The keys read from a lock's (or a semaphore's) directory, in order, as the store kit's
/// ordering rule takes them: by create revision, a writer's key (a hold, a waiting writer)
/// keeping readers out. The rule counts every permit's key alike, whatever its kind.
pub(super) fn line_of(keys: &[KeyValue]) -> Vec<turn::Entry<i64>> {
    keys.iter()
        .map(|kv| turn::Entry {
            order: kv.create_revision(),
            kind: if Entry::of(kv.key()).is_some_and(Entry::is_writer) {
                EntryKind::Write
            } else {
                EntryKind::Read
            },
            own: false,
        })
        .collect()
}

/// The holder a key's value names, if it is a hold's value.
pub(super) fn holder_of(kv: &KeyValue) -> Option<String> {
    HoldValue::parse(kv.value()).map(|v| v.holder)
}

impl EtcdStore {
    /// Runs `txn`, whose writes go on the lease `lease`: `None` when that lease is gone
    /// (a new one was granted: the caller goes again).
    pub(super) async fn txn_on(
        &self,
        lease: i64,
        txn: Txn,
    ) -> Result<Option<TxnResponse>, EtcdError> {
        match self.members.txn(txn).await {
            Ok(reply) => Ok(Some(reply)),
            Err(e) => {
                let e = EtcdError::from(e);
                if e.is_lease_not_found() {
                    // Gone since it was last confirmed: a new one, and again.
                    self.lease.replace(lease).await?;
                    return Ok(None);
                }
                Err(e)
            }
        }
    }

    /// Goes `round` after round (each given the lease a hold goes on) until one answers,
    /// [`ROUNDS`] at the most.
    pub(super) async fn in_rounds<F, R>(&self, mut round: F) -> Result<Attempted, EtcdError>
    where
        F: FnMut(i64) -> R,
        R: Future<Output = Result<Round, EtcdError>>,
    {
        for _ in 0..ROUNDS {
            let lease = self.lease.for_hold().await?;
            if let Some(answer) = round(lease).await? {
                return Ok(answer);
            }
        }
        Err(EtcdError::Contended)
    }

    /// Re-enters the hold `held` of `value`'s holder: its count up, compared on its
    /// revision. `None` when it changed meanwhile.
    pub(super) async fn reenter(
        &self,
        held: &KeyValue,
        mut value: HoldValue,
    ) -> Result<Option<u64>, EtcdError> {
        value.count += 1;
        let reenter = Txn::new()
            .when([Compare::mod_revision(
                held.key().to_vec(),
                CompareOp::Equal,
                held.mod_revision(),
            )])
            .and_then([TxnOp::put(
                held.key().to_vec(),
                value.encode(),
                Some(PutOptions::new().with_lease(held.lease())),
            )]);
        Ok(self
            .members
            .txn(reenter)
            .await?
            .succeeded()
            .then_some(value.count))
    }

    /// An acquisition that waits (`attempt.waits`) is woken when `kv`, which a read at
    /// `read_at` found, is deleted.
    pub(super) fn wait_behind(
        &self,
        key: &EtcdKey,
        attempt: &Attempt,
        kv: &KeyValue,
        read_at: i64,
    ) {
        if attempt.waits.is_some() {
            let wakeups = self.listener.wakeups();
            let behind = self.listener.behind();
            behind.key(wakeups, &key.channel, kv.key().to_vec(), read_at);
        }
    }

    /// One release of a hold: the count down, or the key deleted, compared on the hold's
    /// revision; a release already applied (its id recorded) changes nothing.
    ///
    /// The common case, a hold never re-entered under the current lease, is one
    /// transaction: *if the key holds exactly that, delete it, else read it*; what it read
    /// serves the general path.
    async fn release_hold(
        &self,
        key: &EtcdKey,
        release: &Release<'_>,
    ) -> Result<Released, EtcdError> {
        let holder = release.holder.as_str();
        let mine = key_of(&key.name, release.kind, self.lease.id(), holder);
        let mut compares = vec![Compare::value(
            mine.clone(),
            CompareOp::Equal,
            HoldValue::new(release.holder.as_str()).encode(),
        )];
        // A shared hold's token is the last writer's, not its key's revision: a shared
        // hold is told from the same holder's later one by nothing but its release id.
        let only_token = release.only_token.filter(|_| release.kind != Kind::Shared);
        if let Some(token) = only_token {
            let revision = i64::try_from(token).unwrap_or(i64::MAX);
            compares.push(Compare::create_revision(
                mine.clone(),
                CompareOp::Equal,
                revision,
            ));
        }
        // A writer's waiting key stays while it holds (see `rw.rs`): it goes with the hold.
        let delete = || {
            let mut ops = vec![TxnOp::delete(mine.clone(), None)];
            if release.kind == Kind::Exclusive {
                let waited = holder_key(&key.name, Entry::Queued, self.lease.id(), holder);
                ops.push(TxnOp::delete(waited, None));
            }
            ops
        };
        let last = Txn::new()
            .when(compares)
            .and_then(delete())
            .or_else([TxnOp::get(mine.clone(), None)]);
        let reply = self.members.txn(last).await?;
        if reply.succeeded() {
            return Ok(Released::Freed);
        }
        let mut read = found(reply.op_responses()).into_iter().flatten().next();
        for _ in 0..ROUNDS {
            let Some(held) = read.take() else {
                return Ok(Released::NotHeld);
            };
            let (ops, released) = match release_of(&held, release, only_token, delete)? {
                Step::Write(ops, released) => (ops, released),
                Step::Answer(answer) => return Ok(answer),
            };
            let swap = Txn::new()
                .when([Compare::mod_revision(
                    held.key().to_vec(),
                    CompareOp::Equal,
                    held.mod_revision(),
                )])
                .and_then(ops)
                .or_else([TxnOp::get(mine.clone(), None)]);
            let reply = self.members.txn(swap).await?;
            if reply.succeeded() {
                return Ok(released);
            }
            read = found(reply.op_responses()).into_iter().flatten().next();
        }
        Err(EtcdError::Contended)
    }

    /// Whether each hold of `batch` is still there under the lease `lease`.
    async fn check(&self, batch: &[Due], lease: i64) -> Result<Vec<bool>, EtcdError> {
        let reads: Vec<TxnOp> = batch
            .iter()
            .map(|d| {
                let (name, holder) = (&*d.key.0, d.key.1.as_str());
                // The watchdog knows a hold by its lock's name and its holder.
                let kind = if is_semaphore(name) {
                    Kind::Permit(1)
                } else if holder.starts_with("r:") {
                    Kind::Shared
                } else {
                    Kind::Exclusive
                };
                TxnOp::get(key_of(name, kind, lease, holder), None)
            })
            .collect();
        let reply = self.members.read(Txn::new().and_then(reads)).await?;
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
                HoldValue::parse(kv.value())
                    .is_some_and(|v| v.holder == due.key.1.as_str() && v.count > 0)
            });
            held.push(hold.is_some());
        }
        Ok(held)
    }
}

/// What a release does to the holder's key it read.
enum Step {
    /// These writes, compared on the key's revision, and what they come to.
    Write(Vec<TxnOp>, Released),
    /// Nothing to write: the answer.
    Answer(Released),
}

/// What the release `release` does to `held`, the holder's key as read (`only_token`: the
/// token it must carry; `delete`: the writes that free it).
fn release_of(
    held: &KeyValue,
    release: &Release<'_>,
    only_token: Option<u64>,
    delete: impl Fn() -> Vec<TxnOp>,
) -> Result<Step, EtcdError> {
    let Some(mut value) = HoldValue::parse(held.value()) else {
        return Err(EtcdError::Foreign);
    };
    if value.holder != release.holder.as_str()
        || only_token.is_some_and(|t| token(held.create_revision()).ok() != Some(t))
    {
        return Ok(Step::Answer(Released::NotHeld));
    }
    if value.released.iter().any(|id| id == release.release_id) {
        return Ok(Step::Answer(Released::Remains));
    }
    Ok(if value.count > 1 {
        value.count -= 1;
        value.released.push(release.release_id.to_owned());
        let keep = PutOptions::new().with_lease(held.lease());
        let put = TxnOp::put(held.key().to_vec(), value.encode(), Some(keep));
        Step::Write(vec![put], Released::Remains)
    } else if value.count == 0 {
        // A permit still waiting in line: given back as never held.
        Step::Write(delete(), Released::NotHeld)
    } else {
        Step::Write(delete(), Released::Freed)
    })
}

/// The key of `holder`'s hold of `kind` in the lock `name` under the lease `lease`.
fn key_of(name: &str, kind: Kind, lease: i64, holder: &str) -> String {
    match kind {
        Kind::Exclusive => hold_key(name, lease),
        Kind::Shared => holder_key(name, Entry::Reader, lease, holder),
        Kind::Permit(_) => holder_key(name, Entry::Permit, lease, holder),
    }
}

impl Store for EtcdStore {
    type Key = EtcdKey;
    type Error = EtcdError;
    // A release needs no particular connection.
    type Sent = ();

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            // The backend's lease outlives a hold that asked for no renewal.
            lost_holds: LostHolds::MayRemain,
            // A permit waiter keeps its key in line, and a freed permit wakes the oldest
            // waiter of each backend (see permits.rs).
            permit_waiters: PermitWaiters::InStore,
            ..Capabilities::default()
        }
    }

    fn key(&self, user: String, kind: Kind) -> Result<EtcdKey, LockError> {
        let semaphore = matches!(kind, Kind::Permit(_));
        let serial = self.acquisitions.fetch_add(1, Ordering::Relaxed);
        let key = EtcdKey::new(&self.namespace, user, self.max_key_len, semaphore, serial)?;
        let (behind, wakeups) = (self.listener.behind(), self.listener.wakeups());
        let line = Line::new(
            self.members.clone(),
            (behind.clone(), wakeups.clone()),
            self.orphans.clone(),
        );
        Ok(key.waiting_in(line))
    }

    fn attempt(
        self: &Arc<Self>,
        key: &Arc<EtcdKey>,
        attempt: Attempt,
    ) -> BoxFuture<'static, Sent<Self>> {
        // Runs again on this caller's runtime if the one it ran on is gone.
        self.keeper.ensure_running();
        self.sweeper.ensure_running();
        let (store, key) = (self.clone(), key.clone());
        Box::pin(async move {
            // Whatever it waited behind, it tries now.
            store.listener.behind().tried(&key.channel);
            key.attempts(attempt.holder.as_str());
            let attempted = match attempt.kind {
                Kind::Exclusive => store.attempt_exclusive(&key, &attempt).await,
                Kind::Shared => store.attempt_shared(&key, &attempt).await,
                Kind::Permit(permits) => store.attempt_permit(&key, &attempt, permits).await,
            };
            if attempted.as_ref().is_err_and(Failure::may_have_run) {
                key.lost_write();
            }
            (attempted, Some(()))
        })
    }

    fn release<'a>(
        &'a self,
        key: &'a EtcdKey,
        release: &'a Release<'a>,
    ) -> BoxFuture<'a, Result<Released, EtcdError>> {
        Box::pin(self.release_hold(key, release))
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
        self.listener.register(&key.channel)
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

    fn held_page(
        self: &Arc<Self>,
        prefix: Arc<str>,
        from: Option<String>,
    ) -> BoxFuture<'static, Result<HeldPage, LockError>> {
        let store = self.clone();
        Box::pin(async move { store.held_keys(&prefix, from).await })
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

//! The seam between the core and a store: the primitive calls every store answers, and
//! the capabilities only some stores have, each declared in one typed place.
//!
//! The core (`src/core/`) owns what makes a hold safe whatever the store: the per-key
//! queue, the try -> subscribe -> try again -> wait loop, the cancel-safe attempt, the
//! guard and its release on every exit path, the handoffs in memory, the watchdog and the
//! re-check after a store may have lost data. A store speaks its own protocol and answers
//! a handful of primitive calls. What the core relies on, call by call:
//!
//! - [`attempt`](Store::attempt): one atomic try. It takes a new hold (a fresh fencing
//!   token above every token issued for the key, `reserve` more reserved above it for a
//!   run of holders in memory), or re-enters the holder's own hold (count up, same token,
//!   the lease extended but never shortened), or says who holds the key and for about how
//!   long. The lease is measured on the store's clock, never the application's, and starts
//!   no sooner than the call was sent (the core counts it from there). A run of the same
//!   attempt twice (a client that sends a call again by itself) must not take two holds.
//! - [`release`](Store::release): gives back one hold, idempotently per `release_id`: a
//!   retry after a lost reply never decrements twice, and a hold already gone answers
//!   [`Released::NotHeld`]. A final release wakes the key's waiters in the same atomic
//!   step (a release that fails leaves the lock held). With a successor it may hand the
//!   key straight to it under a new token instead ([`Released::HandedOver`]).
//!   [`release_after`](Store::release_after) sends one behind an attempt of unknown
//!   outcome, on what that attempt went out on.
//! - [`renew`](Store::renew): one call for a batch of holds, extending each lease (never
//!   shortening it) if the holder still holds it, and saying for each whether it does. A
//!   batch must not fail as a whole because one key is bad.
//! - [`subscribe`](Store::subscribe): a [`Waiter`] woken by every release of the key
//!   (a hint: the core tries again), by a confirmed subscription, and by every reconnect
//!   of the store's listening connection (messages may have been missed meanwhile).
//! - [`key`](Store::key), [`inspect`](Store::inspect),
//!   [`force_release`](Store::force_release) and [`held_page`](Store::held_page): the
//!   store's names of a key, and the operator's calls.
//! - What its errors mean ([`Failure`]): a call that may have run without a reply, a
//!   transient failure worth a retry, a key that is not a lock.
//!
//! The other calls have defaults that fit a store without the matching feature: waiting
//! writers to withdraw, a lease the store bounds, renewal calls split by shard, the
//! holder's remaining lease, takeovers and releases to replay after a failover.
//!
//! What differs in how the core must treat a store is one value the store declares once,
//! its [`Capabilities`] (`capabilities.rs`): whether its answers come at once (memory) or
//! over a network, whether its client may run a call twice, who
//! lines up permit waiters, whether a hold found lost may remain, where idempotency
//! records are checked. Each variant says what the core then does; the default is the
//! plain store. A store that keeps a line of waiting holders and grants freed keys to its
//! head (Redis) answers with [`InLine`] and declares [`Grants`] (`line.rs`): a store
//! without a line never sees either.
//!
//! The Redis scripts and the SQL functions answer in one integer form, read by
//! `replies.rs` for those stores: the engine sees only [`Attempted`] and [`Released`].
//!
//! Every call returns a boxed future: a store call is a network round trip, next to which
//! one allocation does not count, and a boxed future can be detached into a task when the
//! caller goes away (see `call.rs`).

pub(crate) mod backend;
pub(crate) mod capabilities;
pub(crate) mod line;
pub(crate) mod methods;
pub(crate) mod replies;
pub(crate) mod takeovers;

use std::error::Error as StdError;
use std::sync::Arc;
use std::time::Duration;

pub(crate) use super::store::capabilities::{
    Answers, Calls, Capabilities, LostHolds, PermitWaiters, Records,
};
pub(crate) use super::store::line::{Grants, InLine};
pub(crate) use super::store::takeovers::Takeovers;

use super::queue::Claim;
use super::wakeups::Waiter;
use super::watchdog::Due;
use crate::error::LockError;
use crate::lock::inspect::{LockInfo, Primitive};
use crate::lock::{BoxFuture, Kind, LockOwner};

/// What an acquisition attempt's call came back with, and what it went out on (`None`
/// when nothing was sent): a store may undo an attempt of unknown outcome on the same
/// connection, so that the undo runs after it.
pub(crate) type Sent<S> = (
    Result<Attempted, <S as Store>::Error>,
    Option<<S as Store>::Sent>,
);

/// A store of locks, as the core drives it (see the module docs for what each call must
/// guarantee).
pub(crate) trait Store: Send + Sync + Sized + 'static {
    /// The store's names of one user key.
    type Key: StoreKey;
    /// Why a call failed.
    type Error: Failure;
    /// What an attempt went out on (a connection), to undo it behind the attempt.
    type Sent: Send + 'static;

    /// What the store does beyond the primitive calls (see [`Capabilities`]), read once
    /// when the core is made. The plain store's by default.
    fn capabilities(&self) -> Capabilities {
        Capabilities::default()
    }

    /// The names of `user`'s lock of `kind` (a semaphore may live apart from the lock),
    /// refusing a key the store cannot hold.
    fn key(&self, user: String, kind: Kind) -> Result<Self::Key, LockError>;

    /// One acquisition attempt (see the module docs).
    fn attempt(
        self: &Arc<Self>,
        key: &Arc<Self::Key>,
        attempt: Attempt,
    ) -> BoxFuture<'static, Sent<Self>>;

    /// One release of one hold (see the module docs).
    fn release<'a>(
        &'a self,
        key: &'a Self::Key,
        release: &'a Release<'a>,
    ) -> BoxFuture<'a, Result<Released, Self::Error>>;

    /// Sends `release` behind an attempt of unknown outcome, on what that attempt went out
    /// on. Returns whether the store answered (any answer settles it); the core retries
    /// a plain release otherwise.
    fn release_after<'a>(
        &'a self,
        key: &'a Self::Key,
        release: &'a Release<'a>,
        sent: Self::Sent,
    ) -> BoxFuture<'a, bool>;

    /// One renewal call for `batch` (see the module docs): for each hold, whether its holder
    /// still holds it. A due hold with `renew == false` is only checked.
    fn renew<'a>(&'a self, batch: &'a [Due]) -> BoxFuture<'a, Result<Vec<bool>, Self::Error>>;

    /// Splits the holds due for renewal into calls (one per shard where a call must stay
    /// on one). One call by default.
    fn renewal_calls(&self, due: Vec<Due>) -> Vec<Vec<Due>> {
        vec![due]
    }

    /// Registers a waiter for releases of `key`.
    fn subscribe(&self, key: &Self::Key) -> Waiter;

    /// The store's grants of freed keys to the head of its line of waiting holders, when it
    /// makes them (see [`Grants`]). None by default.
    fn grants(&self) -> Option<&dyn Grants<Self::Key>> {
        None
    }

    /// How long the key's current holder may still hold it, for `Retry-After` when another
    /// task of this process has the key: `None` when unknown (the default: a store whose
    /// holds last as long as their holder's session or lease lives).
    fn remaining(self: &Arc<Self>, _key: &Arc<Self::Key>) -> BoxFuture<'static, Option<Duration>> {
        Box::pin(std::future::ready(None))
    }

    /// An exclusive attempt that may have registered as a waiting writer (kept out by
    /// shared holders), or in the store's line of waiting holders, stops waiting: withdraw
    /// it, and wake the key's waiters if `wake` (a store also wakes them when the holder
    /// left the head of the line of a free key).
    /// The default does nothing: a store that keeps neither waiting writers nor a line.
    fn withdraw_writer(
        self: &Arc<Self>,
        _key: &Arc<Self::Key>,
        _holder: LockOwner,
        _wake: bool,
    ) -> BoxFuture<'static, ()> {
        Box::pin(std::future::ready(()))
    }

    /// The lease a hold asking for `lease` gets (a store may bound it).
    fn lease(&self, lease: Duration) -> Duration {
        lease
    }

    /// Announcements that another server took over (a failover), so a release waiting to
    /// retry does so at once.
    fn takeovers(&self) -> Takeovers {
        Takeovers::none()
    }

    /// A snapshot of `user`'s lock or semaphore, for operators (see
    /// `LockBackend::inspect`): never owner ids.
    fn inspect(
        self: &Arc<Self>,
        user: String,
        of: Primitive,
    ) -> BoxFuture<'static, Result<LockInfo, LockError>>;

    /// One page of the keys under `prefix` (the beginning of a user key, any characters)
    /// whose lock or semaphore may be held now, for `LockBackend::list_held`: read from
    /// `from` (the cursor of the page before; `None`: the first page) in one bounded call
    /// that holds the store up no longer than any other (a page, never the whole keyspace
    /// at once). A key may come on two pages, and may be free by the time the core
    /// inspects it; a key held for the whole listing comes on some page. `next` is `None`
    /// on the last page.
    fn held_page(
        self: &Arc<Self>,
        prefix: Arc<str>,
        from: Option<String>,
    ) -> BoxFuture<'static, Result<HeldPage, LockError>>;

    /// Frees `user`'s lock or semaphore whatever holds it (see
    /// `LockBackend::force_release`): fenced above every token issued or reserved, the
    /// waiters woken, and every backend on the store told, so that the holder's re-checks
    /// its holds and finds it lost. Returns what was freed.
    fn force_release(
        self: &Arc<Self>,
        user: String,
        of: Primitive,
    ) -> BoxFuture<'static, Result<LockInfo, LockError>>;

    /// A final release of the hold of `token` (its holder as the store keeps it, and its
    /// kind) went through (freed or handed on): a store that may lose it in a failover
    /// remembers it to do it again.
    fn released(
        &self,
        _key: &Arc<Self::Key>,
        _hold: (&LockOwner, Kind),
        _token: u64,
        _lease: Duration,
        _generation: u64,
    ) {
    }
}

/// A page of [`Store::held_page`]: user keys whose lock (or semaphore) may be held, and
/// where the next page starts.
#[derive(Debug, Default)]
pub(crate) struct HeldPage {
    pub(crate) keys: Vec<(String, Primitive)>,
    /// The store's cursor for the next page; `None`: this page was the last.
    pub(crate) next: Option<String>,
}

/// A store's names of one user key.
pub(crate) trait StoreKey: Send + Sync + 'static {
    /// The key as the application gave it (errors, spans, `HeldLock::key`).
    fn user(&self) -> &str;
    /// The lock's name in the store: one per lock, shared by every holder of it (the
    /// watchdog and the local queue are keyed by it).
    fn lock(&self) -> &Arc<str>;
}

/// What a failed store call says.
pub(crate) trait Failure: StdError + Send + Sync + 'static {
    /// The call may have run though its reply never came (a transport failure after
    /// sending): its effect must be assumed, or undone.
    fn may_have_run(&self) -> bool;
    /// A later try may succeed (no connection, a failover under way, a replica that
    /// refused a write): worth retrying a release for.
    fn is_transient(&self) -> bool;
    /// The key holds something other than this crate's lock: retrying cannot help.
    fn is_foreign(&self) -> bool;
}

/// One acquisition attempt.
pub(crate) struct Attempt {
    /// The identity the store keeps the hold under (see [`holder`](super::holder)).
    pub(crate) holder: LockOwner,
    /// The owner it is for (the one a shared hold's re-entry and upgrade checks compare).
    pub(crate) owner: LockOwner,
    pub(crate) kind: Kind,
    pub(crate) lease: Duration,
    /// How long the acquisition may still wait (`None`: it does not): an exclusive one kept
    /// out by shared holders registers as a waiting writer for that long, so that new
    /// shared holds queue behind it.
    pub(crate) waits: Option<Duration>,
    /// Fencing tokens to reserve above a new hold's own for a run of holders in memory.
    pub(crate) reserve: u64,
    /// Leave a free key to other instances that wait for it: this process just released
    /// it to let them go first, leaving its fencing counter at this value. A store stops
    /// yielding once the counter is past it (another instance took the key since), even if
    /// its sign that others wait (a subscription, a registered waiter) is still there. A
    /// store that keeps waiting holders in line and gives a free key only to the head of
    /// the line (Redis) needs no yield: it treats a yielding attempt as any other.
    pub(crate) yielding: Option<u64>,
    /// Check the key's idempotency record as the hold is taken: while it exists, take no
    /// new hold and answer [`Attempted::Recorded`] (only for an exclusive hold of the
    /// idempotency layer, on a store that declares [`Records::InAttempt`]).
    pub(crate) record: bool,
    /// A number this backend never used before: the attempt's id, so that a store that
    /// runs a call twice takes one hold, and the id of the release that gives back a hold
    /// the store must undo itself (`holder@serial`, `holder#serial`).
    pub(crate) serial: u64,
}

/// What one attempt found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Attempted {
    /// The holder holds the key now, with fencing token `token`; `count > 1`: a re-entry
    /// (the token is the outer hold's).
    Acquired { token: u64, count: u64 },
    /// Another holder has it, for about `left` longer (`None`: no end known; for a free
    /// key another waiting holder's turn). `queued`: the attempt registered as a waiting
    /// writer, or in the store's line of waiting holders: the acquisition withdraws
    /// ([`Store::withdraw_writer`]) when it stops waiting without the key.
    Held {
        left: Option<Duration>,
        queued: bool,
    },
    /// Free, and left to the other instances that wait for it (a yielding attempt).
    LeftToOthers,
    /// The owner holds the key shared and asked for it exclusively.
    UpgradeRefused,
    /// The key's idempotency record exists ([`Attempt::record`]): nothing was taken, and
    /// the attempt left the store's waiting writers and line.
    Recorded,
    /// An answer of a store's line of waiting holders (see [`InLine`]): only a store that
    /// keeps one gives it.
    Line(InLine),
    /// A release of this backend came to the store before the attempt and was sent after
    /// it ([`Release::serial`]): nothing was taken, and the attempt left the waiting
    /// writers and the line. Only a store whose calls may run twice
    /// ([`Calls::MayRunTwice`]) gives it, to refuse a copy of the attempt that its client
    /// sent again late, after its owner moved on; an attempt that is no copy tries again at
    /// once under a new serial.
    Overtaken,
}

/// One release of one hold.
pub(crate) struct Release<'a> {
    /// The identity the store keeps the hold under.
    pub(crate) holder: &'a LockOwner,
    pub(crate) kind: Kind,
    /// Tells this hold's release from the holder's others (its re-entries): a retry of
    /// the same release is recognised.
    pub(crate) release_id: &'a str,
    /// Re-applied while outer holds of the holder remain.
    pub(crate) lease: Duration,
    /// A task of this process to hand the key to, when the run may go on.
    pub(crate) successor: Option<&'a Claim>,
    /// The run of this process's holders is spent: free the key if another instance
    /// waits, rather than hand it on.
    pub(crate) run_spent: bool,
    /// An earlier call of this release may have run.
    pub(crate) may_have_run: bool,
    /// Act only on the hold of this token (a release done again after a failover).
    pub(crate) only_token: Option<u64>,
    /// The last token issued in memory under this hold, when holders of this process got
    /// it that way: the key's next token must exceed it.
    pub(crate) issued: Option<u64>,
    /// Tokens to reserve above a handoff's own for the successor's run.
    pub(crate) reserve: u64,
    /// A number taken from the counter of [`Attempt::serial`] when this release was made
    /// (or the serial of the attempt it undoes): every attempt of this backend sent before
    /// it has one up to it, so a store whose client may send an attempt again late can
    /// refuse such a copy ([`Attempted::Overtaken`]).
    pub(crate) serial: u64,
}

/// What a release did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Released {
    /// The key went to the successor under this new token.
    HandedOver(u64),
    /// The key was freed (or turned over to its shared holders) and its waiters woken.
    Freed,
    /// An outer hold of the holder remains (or this hold was already given back).
    Remains,
    /// The holder does not hold the key (its lease ran out, it was freed, or a retried
    /// final release).
    NotHeld,
}

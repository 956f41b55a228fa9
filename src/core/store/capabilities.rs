//! What a store does beyond the primitive calls, declared once: [`Store::capabilities`]
//! is read when the core is made, kept in it, and consulted only where the core acts on
//! it. Each variant says what the core then does.
//!
//! [`Store::capabilities`]: super::Store::capabilities

/// What a store declares of itself. The default is the plain store: its calls go over a
/// network and run once, it lines up no permit waiters itself, a hold found lost is gone
/// from it, and it checks no idempotency records as it takes a hold.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Capabilities {
    pub(crate) answers: Answers,
    pub(crate) calls: Calls,
    pub(crate) permit_waiters: PermitWaiters,
    pub(crate) lost_holds: LostHolds,
    pub(crate) records: Records,
}

/// When a call's answer comes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) enum Answers {
    /// Over a network, on the runtime: a release owed when its guard is dropped is finished
    /// by a task.
    #[default]
    Later,
    /// At once: every call's future is ready when first polled (the memory store). A
    /// release owed when its guard is dropped is finished where it is dropped, also
    /// outside any runtime (a guard dropped after its runtime shut down).
    AtOnce,
}

/// How many times the store's client may run one call.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) enum Calls {
    /// At most once: a call without a reply may have run, never twice.
    #[default]
    RunOnce,
    /// Twice, on the client's own (a cluster client sends a call again when its connection
    /// dropped before the reply). The core then sends every release as one whose earlier
    /// run may have freed the lock ([`Release::may_have_run`](super::Release)): a final
    /// release that finds the lock gone may be the second run of one that freed it. And
    /// the store may refuse an attempt that a release of this backend overtook
    /// ([`Attempted::Overtaken`](super::Attempted)): the core sends it again at once
    /// under a new serial, a few times.
    MayRunTwice,
}

/// Who lines up the tasks that wait for a semaphore's permits.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) enum PermitWaiters {
    /// The core: one waiting task per process waits in the store, the others behind it in
    /// the process's gate (`queue::gate`).
    #[default]
    Gated,
    /// The store: each attempt that will wait keeps its place in the store, and a release
    /// wakes the waiter whose turn it is (etcd's waiting keys). Every waiting task then
    /// waits in the store, and the core's gate is not used.
    #[cfg_attr(
        not(feature = "etcd"),
        expect(
            dead_code,
            reason = "etcd is the store that lines permit waiters up itself"
        )
    )]
    InStore,
}

/// What becomes of a hold whose holder was told it is lost.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) enum LostHolds {
    /// It is gone from the store (or goes with its lease): no release is sent, since its
    /// owner may hold the key anew and a release of the old hold would take that away.
    #[default]
    Gone,
    /// The store may still keep it: its holds live under one lease or session for all of
    /// them, which outlives a hold that asked for no renewal or whose deadline passed. Its
    /// release is sent anyway, in the background, of its own token only
    /// ([`Release::only_token`](super::Release)), so that a newer hold of the same owner is
    /// left alone.
    MayRemain,
}

/// Where a key's idempotency record is checked for the idempotency layer.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) enum Records {
    /// Apart from the lock: the layer reads the record before it takes the lock, and again
    /// once it holds it.
    #[default]
    Apart,
    /// By the attempt that takes a new hold, in the same atomic step
    /// ([`Attempt::record`](super::Attempt)): while the record exists the attempt takes
    /// nothing and answers [`Attempted::Recorded`](super::Attempted). The layer then reads
    /// the record once before the lock, not again under a hold taken that way.
    InAttempt,
}

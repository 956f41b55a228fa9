//! Handoffs in memory: a run of this process's holders taking turns under one hold in the
//! store, with no store call between them.
//!
//! When a holder releases a key that another task of the backend waits for, and the hold
//! is confirmed (its last acquisition or renewal was acknowledged less than half a lease
//! ago, less a margin for clock drift), the hold passes to that task as it is: the store
//! goes on knowing it under the first holder's identity, the watchdog goes on renewing it,
//! and the new holder gets its own owner (re-entries are per request: see `Reentry`) and
//! the next fencing token of the block that the store reserved when it granted the hold
//! (its counter was set above it, so a later holder elsewhere gets a higher token). All
//! holders of the run share the hold's `lost` signal: when the watchdog finds it lost, the
//! current holder sees it and the queue moves on to the store.
//!
//! A run serves the tasks that were queued for the key when it began, each once, in the
//! order they queued: the next task, if it queued after the run began, waits for the next
//! run, so that no task waits for more than one turn of every other (a fixed quantum would
//! let one instance's late arrivals go first again and again while another instance
//! waits). A run also ends after `max_local_handoffs` handoffs or
//! `max_local_handoff_time`, when its block of tokens is used up, or when the hold is not
//! confirmed: the release then goes to the store, which frees the key if other instances
//! wait for it, else hands it to the next task under a new hold.

use tokio::time::Instant;

use crate::core::Store;
use crate::core::hold::release::WatchedHold;
use crate::core::store::StoreKey;
use crate::core::watchdog::handoff_window;
use crate::lock::{HeldLock, Kind, LockGuard};

/// What the store confirmed of a hold it granted.
#[derive(Clone, Copy)]
pub(crate) struct Granted {
    pub(in crate::core) token: u64,
    /// The highest fencing token reserved for the hold (the counter was set there): tokens
    /// up to it may be issued to later holders in this process without asking the store.
    pub(in crate::core) reserved: u64,
    /// When the acquisition or handoff that granted it was sent.
    pub(in crate::core) sent_at: Instant,
    /// The run of this process's holders it goes on with, when a handoff through the store
    /// granted it before the run was over.
    pub(in crate::core) continues: Option<Run>,
}

/// The holders of this process taking turns under one hold in the store: the first took it
/// there, the others got it in memory (see [`WatchedHold::hand_over_in_memory`]).
#[derive(Clone, Copy)]
pub(in crate::core) struct Run {
    /// When the hold in the store was granted (its call sent): the run's time counts from here.
    pub(in crate::core) started: Instant,
    /// Handoffs in memory so far.
    pub(in crate::core) handoffs: u32,
    /// The last fencing token issued, and the highest one the store reserved for the run.
    pub(in crate::core) last: u64,
    pub(in crate::core) reserved: u64,
    /// Where the key's line in this process ended when the run began (see
    /// [`Slot::line_end`](crate::core::queue::Slot::line_end)): the run serves only the tasks
    /// queued before it, each once, so that a task never waits for more than one turn of
    /// every other task, here or in another instance.
    pub(in crate::core) line_end: u64,
}

impl Run {
    /// The run a grant begins (or goes on with); `line_end`: where the key's line ends
    /// now, for a run that begins.
    pub(in crate::core) fn new(granted: Granted, line_end: u64) -> Self {
        match granted.continues {
            Some(run) => Run {
                last: granted.token,
                reserved: granted.reserved.max(granted.token),
                ..run
            },
            None => Run {
                started: granted.sent_at,
                handoffs: 0,
                last: granted.token,
                reserved: granted.reserved.max(granted.token),
                line_end,
            },
        }
    }
}

impl<S: Store> WatchedHold<S> {
    /// Passes the hold to the next task of this backend queued for the key, in memory,
    /// if the run may go on (see the module's doc); else gives it back.
    pub(in crate::core) fn hand_over_in_memory(mut self: Box<Self>) -> Result<(), Box<Self>> {
        let hold = &mut self.hold;
        let run = hold.run;
        // (A re-entry has no slot: it never passes on by itself.)
        if hold.kind != Kind::Exclusive
            || hold.slot.is_none()
            || run.last >= run.reserved
            || self.lost.is_cancelled()
        {
            return Err(self);
        }
        let confirmed =
            hold.core
                .watchdog
                .confirmed(hold.key.lock(), &hold.holder, self.generation);
        if confirmed.is_none_or(|at| Instant::now() >= at + handoff_window(hold.lease)) {
            return Err(self);
        }
        // The successor must hold as this hold was taken (lease and renewal), which the
        // watchdog's entry stands for; another one gets the lock through the store (the slot
        // stays with this hold, and the successor reserved for that release).
        let fits = hold
            .reserve_successor()
            .is_some_and(|claim| claim.lease == hold.lease && claim.renew == self.renew);
        // Asked once the successor is known: whether it queued before the run began.
        if !fits || hold.run_spent() {
            return Err(self);
        }
        let Some(slot) = hold.slot.take() else {
            return Err(self);
        };
        let token = hold.run.last + 1;
        let (successor, slot) = match slot.hand_over_in_memory(&hold.holder, token) {
            Ok(handed) => handed,
            Err(slot) => {
                hold.slot = Some(slot);
                return Err(self);
            }
        };
        hold.slot = Some(slot);
        hold.run.handoffs += 1;
        hold.run.last = token;
        let held = HeldLock::new(
            hold.key.user().to_owned(),
            successor.claim.owner.clone(),
            token,
            self.lost.clone(),
        );
        successor.hand_over(LockGuard::new(held, self));
        Ok(())
    }
}

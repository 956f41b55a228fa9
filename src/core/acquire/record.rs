//! The idempotency record check an acquisition's attempts may make: on a store that checks
//! a key's record as it takes a new hold ([`Records::InAttempt`]), an exclusive acquisition
//! of the idempotency layer asks each attempt to, and says what its hold means for the
//! record.
//!
//! [`Records::InAttempt`]: crate::core::store::Records::InAttempt

use crate::core::acquire::Taken;
use crate::lock::{Acquired, Kind, LockGuard};

/// Whether an acquisition's attempts check the key's idempotency record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(in crate::core) enum RecordCheck {
    /// They do not: the layer reads the record itself once it holds the lock.
    Unasked,
    /// Each attempt checks it ([`Attempt::record`](crate::core::store::Attempt)): while
    /// the record exists, no new hold is taken and the acquisition ends
    /// [`Acquired::Recorded`].
    InAttempts,
}

impl RecordCheck {
    /// The check an acquisition of `kind` asks for when `unless_recorded` (only an exclusive
    /// hold is checked; the backend has cleared the ask on a store that cannot make it).
    pub(in crate::core) fn of(unless_recorded: bool, kind: Kind) -> Self {
        if unless_recorded && kind == Kind::Exclusive {
            RecordCheck::InAttempts
        } else {
            RecordCheck::Unasked
        }
    }

    /// Whether attempts check the record.
    pub(in crate::core) fn asked(self) -> bool {
        self == RecordCheck::InAttempts
    }

    /// `guard`, of the hold `taken`, as the acquisition's result: checked when an attempt
    /// that checked the record took it as a new hold. Not a re-entry (`reentry`: of a hold
    /// of this process, or `taken` one in the store), whose outer hold may have stored
    /// the record, nor a grant, which no attempt of this acquisition checked (the holder
    /// that released may have stored one).
    pub(in crate::core) fn result(
        self,
        guard: LockGuard,
        taken: &Taken,
        reentry: bool,
    ) -> Acquired {
        if self.asked() && !taken.reentry && !reentry && !taken.granted {
            Acquired::Checked(guard)
        } else {
            Acquired::Unchecked(guard)
        }
    }
}

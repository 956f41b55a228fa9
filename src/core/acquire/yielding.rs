//! The yield after a run of this process's holders ended: the release that ended it woke
//! the other instances that wait for the key, and passed the key's slot to the next task
//! here. That task skips its first try, and then, until one of the others takes the key
//! (this task finds it held, or the store finds the fencing counter moved past the value
//! that release left), or for at most a run's time (they may have given up), it does not
//! take the key while the store sees another instance wait for it
//! ([`Attempt::yielding`](crate::core::store::Attempt)).

use std::time::Duration;

use tokio::time::Instant;

/// The yield of one acquisition: until when, and the fencing counter the release left.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Yielding(Option<(Instant, u64)>);

impl Yielding {
    /// The yield of an acquisition whose slot came from a release that ended this
    /// process's run, leaving the key's fencing counter at `fence` (none when `None`):
    /// for `run_time` from now, and no longer than `deadline`.
    pub(super) fn after(fence: Option<u64>, run_time: Duration, deadline: Instant) -> Self {
        Yielding(fence.map(|fence| ((Instant::now() + run_time).min(deadline), fence)))
    }

    /// The fence to send with an attempt while the yield lasts.
    pub(super) fn fence(self) -> Option<u64> {
        self.lasting().map(|(_, fence)| fence)
    }

    /// `nap`, or the yield's end if that comes first: the acquisition then tries to take
    /// the key as any other.
    pub(super) fn nap(self, nap: Instant) -> Instant {
        self.lasting().map_or(nap, |(until, _)| nap.min(until))
    }

    /// Another instance took the key: the yield is done.
    pub(super) fn end(&mut self) {
        self.0 = None;
    }

    fn lasting(self) -> Option<(Instant, u64)> {
        self.0.filter(|(until, _)| Instant::now() < *until)
    }
}

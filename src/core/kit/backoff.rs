//! Capped exponential backoff: the wait before the next try of something that keeps
//! failing (a reconnect, a release, a retried withdrawal), doubled after each try up to a
//! bound, and started over once a try succeeds.

use std::time::Duration;

/// The first wait of every backoff in the crate: short enough that a blip costs nothing,
/// long enough that a store that refuses at once is not hammered.
pub(crate) const INITIAL_BACKOFF: Duration = Duration::from_millis(20);

/// Waits that double from `initial` up to `max`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Backoff {
    initial: Duration,
    max: Duration,
    next: Duration,
}

impl Backoff {
    /// Waits from `initial`, doubled after each up to `max` (never below `initial`).
    pub(crate) fn new(initial: Duration, max: Duration) -> Self {
        Backoff {
            initial,
            max: max.max(initial),
            next: initial,
        }
    }

    /// Waits from [`INITIAL_BACKOFF`] up to `max`.
    pub(crate) fn up_to(max: Duration) -> Self {
        Backoff::new(INITIAL_BACKOFF, max)
    }

    /// The wait before the next try; the one after it is twice as long, up to the bound.
    pub(crate) fn next(&mut self) -> Duration {
        let wait = self.next;
        self.next = self.next.saturating_mul(2).min(self.max);
        wait
    }

    /// Waits the next wait, unless `shutdown` comes first: whether to try again.
    #[cfg(feature = "zookeeper")]
    pub(crate) async fn pause(&mut self, shutdown: &tokio_util::sync::CancellationToken) -> bool {
        tokio::select! {
            () = tokio::time::sleep(self.next()) => true,
            () = shutdown.cancelled() => false,
        }
    }

    /// The wait [`next`](Self::next) would return, without moving on.
    pub(crate) fn peek(&self) -> Duration {
        self.next
    }

    /// Starts over from the first wait: the last try succeeded.
    pub(crate) fn reset(&mut self) {
        self.next = self.initial;
    }

    /// Goes straight to the longest wait: what failed will not pass soon (a refusal for
    /// lack of rights).
    pub(crate) fn exhaust(&mut self) {
        self.next = self.max;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn waits_double_up_to_the_bound_and_start_over_on_reset() {
        let mut backoff = Backoff::new(20 * MS, 100 * MS);
        let waits: Vec<_> = (0..5).map(|_| backoff.next()).collect();
        assert_eq!(waits, [20 * MS, 40 * MS, 80 * MS, 100 * MS, 100 * MS]);
        backoff.reset();
        assert_eq!((backoff.peek(), backoff.next()), (20 * MS, 20 * MS));
        backoff.exhaust();
        assert_eq!(backoff.next(), 100 * MS);
    }

    #[test]
    fn a_bound_below_the_first_wait_keeps_the_first_wait() {
        let mut backoff = Backoff::new(20 * MS, MS);
        assert_eq!((backoff.next(), backoff.next()), (20 * MS, 20 * MS));
    }

    #[test]
    fn a_huge_bound_does_not_overflow() {
        let mut backoff = Backoff::new(Duration::MAX / 2 + MS, Duration::MAX);
        backoff.next();
        assert_eq!(backoff.next(), Duration::MAX);
    }
}

//! `Retry-After` from what the work takes, not from the holder's lease.
//!
//! A fail-fast 409 for a 100 ms handler used to say the holder's remaining lease (30 s
//! by default): a client that honours it waits 300 times too long. A layer instead keeps
//! the mean of its recent hold times and answers with that, bounded above by the holder's
//! remaining lease (the lock frees by then at the latest, if its holder stops renewing).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::time::Instant;

use crate::error::LockError;

/// What a layer answers before any of its holds has ended: a hold time is not known yet,
/// and a client that comes back too early costs one more request, one too late a second.
pub(crate) const UNSEEN: Duration = Duration::from_secs(1);

/// How an acquisition refused for contention says when to try again: the `retry_after`
/// of [`LockError::Contended`], [`PermitsTaken`](LockError::PermitsTaken) and
/// [`TimedOut`](LockError::TimedOut).
#[derive(Clone, Debug)]
pub(crate) enum RetryAfter {
    /// The holder's remaining lease, as the store reported it (the lock API's default).
    Lease,
    /// The mean of the holds recorded here, at most the holder's remaining lease;
    /// [`UNSEEN`] before any hold ended (a layer's default).
    Estimate(Arc<HoldTimes>),
    /// This, whatever the store reported (`retry_after` on a layer or a request).
    Fixed(Duration),
}

impl RetryAfter {
    /// A new estimate of hold times, shared by the clones of what it is set on.
    pub(crate) fn estimate() -> Self {
        RetryAfter::Estimate(Arc::default())
    }

    /// Rewrites a refusal's `retry_after` (the remaining lease the store reported) by this
    /// rule; other errors keep theirs.
    pub(crate) fn apply(&self, error: &mut LockError) {
        if let LockError::Contended { retry_after, .. }
        | LockError::PermitsTaken { retry_after, .. }
        | LockError::TimedOut { retry_after, .. } = error
        {
            *retry_after = self.retry_after(*retry_after);
        }
    }

    fn retry_after(&self, lease: Option<Duration>) -> Option<Duration> {
        match self {
            RetryAfter::Lease => lease,
            RetryAfter::Fixed(fixed) => Some(*fixed),
            RetryAfter::Estimate(times) => {
                let estimate = times.mean().unwrap_or(UNSEEN);
                Some(lease.map_or(estimate, |lease| estimate.min(lease)))
            }
        }
    }

    /// The clock of a hold taken under this rule, when its time is wanted.
    pub(crate) fn clock(&self) -> Option<HoldClock> {
        match self {
            RetryAfter::Estimate(times) => Some(HoldClock {
                times: times.clone(),
                since: Instant::now(),
            }),
            RetryAfter::Lease | RetryAfter::Fixed(_) => None,
        }
    }
}

/// An exponentially weighted mean of hold times, updated without a lock.
///
/// The weight of a new hold is 1/8, as TCP's smoothed round-trip time (RFC 6298): the
/// mean follows a change of the handler's pace within a few dozen holds, and one outlier
/// moves it by an eighth of its difference.
#[derive(Debug, Default)]
pub(crate) struct HoldTimes {
    /// The mean in seconds, as `f64` bits; 0.0 (all bits zero) before the first hold.
    mean: AtomicU64,
}

impl HoldTimes {
    fn mean(&self) -> Option<Duration> {
        let mean = f64::from_bits(self.mean.load(Ordering::Relaxed));
        (mean > 0.0).then(|| Duration::from_secs_f64(mean))
    }

    fn record(&self, held: Duration) {
        // Above zero, so that a first hold of no measurable time still counts as seen.
        let held = held.as_secs_f64().max(f64::MIN_POSITIVE);
        let update = |bits| {
            let mean = f64::from_bits(bits);
            let next = if mean > 0.0 {
                mean + (held - mean) / 8.0
            } else {
                held
            };
            Some(next.to_bits())
        };
        // `update` always returns `Some`: the result is never an error.
        let _ = self
            .mean
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, update);
    }
}

/// Times one hold, for the [`HoldTimes`] of the layer that took it.
#[derive(Debug)]
pub(crate) struct HoldClock {
    times: Arc<HoldTimes>,
    since: Instant,
}

impl HoldClock {
    /// Records the hold as ended now. A clock dropped without it records nothing.
    pub(crate) fn end(self) {
        self.times.record(self.since.elapsed());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn contended(lease: Option<Duration>) -> LockError {
        LockError::Contended {
            key: "k".into(),
            retry_after: lease,
        }
    }

    fn applied(rule: &RetryAfter, lease: Option<Duration>) -> Option<Duration> {
        let mut error = contended(lease);
        rule.apply(&mut error);
        error.retry_after()
    }

    const LEASE: Option<Duration> = Some(Duration::from_secs(30));

    #[test]
    fn an_estimate_says_the_mean_hold_bounded_by_the_lease() {
        let rule = RetryAfter::estimate();
        assert_eq!(applied(&rule, LEASE), Some(UNSEEN), "before any hold");
        let RetryAfter::Estimate(times) = &rule else {
            unreachable!()
        };
        times.record(Duration::from_millis(800));
        assert_eq!(applied(&rule, LEASE), Some(Duration::from_millis(800)));
        times.record(Duration::from_millis(1600));
        // 800 + (1600 - 800) / 8
        let mean = applied(&rule, LEASE).unwrap();
        assert!(mean.abs_diff(Duration::from_millis(900)) < Duration::from_micros(1));
        let short_lease = Some(Duration::from_millis(300));
        assert_eq!(
            applied(&rule, short_lease),
            short_lease,
            "the lease bounds it"
        );
        assert_eq!(applied(&rule, None), Some(mean), "no lease reported");
    }

    #[test]
    fn a_first_hold_of_no_time_counts_as_seen() {
        let times = HoldTimes::default();
        times.record(Duration::ZERO);
        assert!(times.mean().is_some_and(|mean| mean < UNSEEN));
    }

    #[test]
    fn a_fixed_setting_wins_and_the_lease_rule_keeps_the_store_s_answer() {
        let fixed = Duration::from_secs(45);
        assert_eq!(applied(&RetryAfter::Fixed(fixed), LEASE), Some(fixed));
        assert_eq!(applied(&RetryAfter::Lease, LEASE), LEASE);
        assert_eq!(applied(&RetryAfter::Lease, None), None);
        // Errors other than contention keep their own.
        let mut lost = LockError::Lost { key: "k".into() };
        RetryAfter::Fixed(Duration::from_secs(45)).apply(&mut lost);
        assert_eq!(lost.retry_after(), Some(Duration::from_secs(1)));
    }
}

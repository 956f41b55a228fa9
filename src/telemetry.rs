//! Metrics through the [`metrics`](https://docs.rs/metrics) facade (feature `metrics`).
//!
//! The application installs a recorder (a Prometheus exporter, say); without one every
//! call here is a no-op of the facade, and without the feature this module is empty
//! no-ops that compile away. Labels are bounded: the backend's namespace, the layer's
//! route label, the kind of hold (`mode`), the outcome. Never a key.
//!
//! The bottom layer: the metrics' names and labels take plain values, so that every other
//! layer may record through it. What the lock API records of an acquisition and a hold is
//! in `lock/observe.rs`.

use crate::error::LockError;

/// The `outcome` label of [`ACQUISITIONS`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Outcome {
    Acquired,
    Reentered,
    /// The idempotency layer's acquisition found the key's record in the store, and took
    /// nothing (the request is replayed).
    Recorded,
    Contended,
    PermitsTaken,
    UpgradeRefused,
    ZeroPermits,
    Unsupported,
    TimedOut,
    QueueFull,
    BackendError,
    NotALock,
    InvalidKey,
    /// Counted when a hold that was lost ends (it was counted as acquired before).
    Lost,
}

impl Outcome {
    pub(crate) fn of(error: &LockError) -> Self {
        match error {
            LockError::Contended { .. } => Outcome::Contended,
            LockError::PermitsTaken { .. } => Outcome::PermitsTaken,
            LockError::UpgradeRefused { .. } => Outcome::UpgradeRefused,
            LockError::ZeroPermits { .. } => Outcome::ZeroPermits,
            LockError::Unsupported { .. } => Outcome::Unsupported,
            LockError::TimedOut { .. } => Outcome::TimedOut,
            LockError::QueueFull { .. } => Outcome::QueueFull,
            LockError::InvalidKey(_) => Outcome::InvalidKey,
            LockError::Lost { .. } => Outcome::Lost,
            LockError::NotALock { .. } => Outcome::NotALock,
            LockError::Backend(_) => Outcome::BackendError,
        }
    }

    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Outcome::Acquired => "acquired",
            Outcome::Reentered => "reentered",
            Outcome::Recorded => "recorded",
            Outcome::Contended => "contended",
            Outcome::PermitsTaken => "permits_taken",
            Outcome::UpgradeRefused => "upgrade_refused",
            Outcome::ZeroPermits => "zero_permits",
            Outcome::Unsupported => "unsupported",
            Outcome::TimedOut => "timed_out",
            Outcome::QueueFull => "queue_full",
            Outcome::BackendError => "backend_error",
            Outcome::NotALock => "not_a_lock",
            Outcome::InvalidKey => "invalid_key",
            Outcome::Lost => "lost",
        }
    }
}

#[cfg(feature = "metrics")]
pub use self::on::describe_metrics;
#[cfg(feature = "metrics")]
pub(crate) use self::on::*;

#[cfg(not(feature = "metrics"))]
pub(crate) use self::off::*;

#[cfg(feature = "metrics")]
mod on {
    use std::time::Duration;

    use std::sync::Arc;

    use metrics::{Label, SharedString, Unit};
    use tokio::time::Instant;

    use super::*;

    /// Acquisitions by outcome (see [`Outcome`]).
    pub(super) const ACQUISITIONS: &str = "tower_lock_acquisitions_total";
    /// Seconds from asking for a lock to having it (or giving up).
    pub(super) const WAIT: &str = "tower_lock_wait_seconds";
    /// Seconds from having a lock to its release.
    pub(super) const HOLD: &str = "tower_lock_hold_seconds";
    /// Lock holds of this process now.
    pub(super) const HELD: &str = "tower_lock_held";
    /// Requests of this process waiting for a lock now.
    pub(super) const WAITERS: &str = "tower_lock_waiters";
    /// Release channels the backend's subscriber is subscribed to now.
    pub(super) const SUBSCRIBED: &str = "tower_lock_subscribed_channels";
    /// Times the subscriber connection was opened again after the first.
    pub(super) const RECONNECTS: &str = "tower_lock_subscriber_reconnects_total";
    /// Renewal calls of the watchdog that failed (each is retried until the lease runs out).
    pub(super) const RENEWALS_FAILED: &str = "tower_lock_renewals_failed_total";

    /// Describes every metric of the crate to the installed recorder: their units and
    /// help texts. Called when a layer or a backend is built; call it again if the
    /// recorder was installed after them.
    ///
    /// The metrics of acquisitions and holds (`tower_lock_acquisitions_total`,
    /// `tower_lock_wait_seconds`, `tower_lock_hold_seconds`, `tower_lock_held`,
    /// `tower_lock_waiters`) carry the labels `namespace` (the backend's), `route` (the
    /// layer's [`metrics_label`](crate::LockLayer::metrics_label), else the path pattern
    /// axum matched, else empty) and `mode`, the kind of hold asked for: `exclusive`,
    /// `shared` (a read of [`read_write`](crate::LockLayer::read_write) or
    /// [`shared_if`](crate::LockLayer::shared_if)) or `permit`
    /// ([`permits`](crate::LockLayer::permits)), so that a route's reads and writes are
    /// separate series; the acquisitions also carry `outcome`. The backend's own metrics
    /// (`tower_lock_subscribed_channels`, `tower_lock_subscriber_reconnects_total`,
    /// `tower_lock_renewals_failed_total`) carry `namespace` only.
    pub fn describe_metrics() {
        use metrics::{describe_counter, describe_gauge, describe_histogram};
        describe_counter!(
            ACQUISITIONS,
            Unit::Count,
            "Lock acquisitions by kind of hold (`mode`) and outcome; `lost` counts holds that were lost when they end"
        );
        describe_histogram!(
            WAIT,
            Unit::Seconds,
            "Time from asking for a lock to having it or giving up, by kind of hold (`mode`)"
        );
        describe_histogram!(
            HOLD,
            Unit::Seconds,
            "Time a lock was held, by kind of hold (`mode`)"
        );
        describe_gauge!(
            HELD,
            Unit::Count,
            "Lock holds of this process (a re-entry is a hold of its own)"
        );
        describe_gauge!(
            WAITERS,
            Unit::Count,
            "Requests of this process waiting for a lock"
        );
        describe_gauge!(
            SUBSCRIBED,
            Unit::Count,
            "Release channels the lock subscriber is subscribed to"
        );
        describe_counter!(
            RECONNECTS,
            Unit::Count,
            "Times the lock subscriber connection was opened again"
        );
        describe_counter!(
            RENEWALS_FAILED,
            Unit::Count,
            "Watchdog renewal calls that failed (each is retried)"
        );
    }

    /// The `namespace` label of a backend.
    #[derive(Clone, Debug)]
    pub struct Namespace(SharedString);

    impl Namespace {
        pub(crate) fn new(namespace: &str) -> Self {
            Namespace(SharedString::from(Arc::<str>::from(namespace)))
        }

        fn label(&self) -> Label {
            Label::new("namespace", self.0.clone())
        }

        /// Moves the gauge of subscribed channels from `before` to `now`.
        pub(crate) fn subscribed_channels(&self, before: usize, now: usize) {
            if before != now {
                let gauge = metrics::gauge!(SUBSCRIBED, vec![self.label()]);
                gauge.increment(now as f64 - before as f64);
            }
        }

        pub(crate) fn subscriber_reconnected(&self) {
            metrics::counter!(RECONNECTS, vec![self.label()]).increment(1);
        }

        pub(crate) fn renewal_failed(&self) {
            metrics::counter!(RENEWALS_FAILED, vec![self.label()]).increment(1);
        }
    }

    /// The `route` label of an acquisition: the layer's
    /// [`metrics_label`](crate::LockLayer::metrics_label), else axum's matched path,
    /// else empty.
    #[derive(Clone, Debug, Default)]
    pub(crate) struct Route(Option<SharedString>);

    impl Route {
        /// A label set once and cloned for every acquisition: shared, not copied.
        pub(crate) fn new(label: std::borrow::Cow<'static, str>) -> Self {
            Route(Some(match label {
                std::borrow::Cow::Borrowed(label) => SharedString::const_str(label),
                std::borrow::Cow::Owned(label) => SharedString::from(Arc::<str>::from(label)),
            }))
        }

        /// The path pattern axum matched, shared by every acquisition of the request.
        #[cfg(feature = "axum")]
        pub(crate) fn matched(path: &str) -> Self {
            Route(Some(SharedString::from(Arc::<str>::from(path))))
        }

        /// Whether a label was set.
        #[cfg(feature = "axum")]
        pub(crate) fn is_set(&self) -> bool {
            self.0.is_some()
        }
    }

    /// The labels of one acquisition and its hold.
    #[derive(Clone, Debug)]
    pub(crate) struct Labels(Arc<[Label; 3]>);

    impl Labels {
        /// The labels of an acquisition of the kind of hold `mode` names (see
        /// `Kind::label`).
        pub(crate) fn new(namespace: &Namespace, route: &Route, mode: &'static str) -> Self {
            let route = route.0.clone().unwrap_or(SharedString::const_str(""));
            Labels(Arc::new([
                namespace.label(),
                Label::new("route", route),
                Label::from_static_parts("mode", mode),
            ]))
        }

        fn with_outcome(&self, outcome: Outcome) -> Vec<Label> {
            let mut labels = self.0.to_vec();
            labels.push(Label::from_static_parts("outcome", outcome.as_str()));
            labels
        }

        /// Counts one acquisition's outcome, and how long it waited.
        pub(crate) fn acquisition(&self, outcome: Outcome, waited: Option<Duration>) {
            metrics::counter!(ACQUISITIONS, self.with_outcome(outcome)).increment(1);
            if let Some(waited) = waited {
                metrics::histogram!(WAIT, self.0.to_vec()).record(waited.as_secs_f64());
            }
        }

        /// Counts a waiting request until the returned value is dropped.
        pub(crate) fn waiting(&self) -> Waiting {
            let gauge = metrics::gauge!(WAITERS, self.0.to_vec());
            gauge.increment(1.0);
            Waiting(gauge)
        }

        /// Counts a held lock until [`Hold::end`]. The gauge counted up is the one counted
        /// down, even if the recorder changes meanwhile.
        pub(crate) fn hold(&self) -> Hold {
            let held = metrics::gauge!(HELD, self.0.to_vec());
            held.increment(1.0);
            Hold {
                labels: self.clone(),
                held,
                since: Instant::now(),
            }
        }
    }

    /// One request counted in [`WAITERS`].
    pub(crate) struct Waiting(metrics::Gauge);

    impl Drop for Waiting {
        fn drop(&mut self) {
            self.0.decrement(1.0);
        }
    }

    /// One lock counted in [`HELD`]; its end records [`HOLD`], and [`Outcome::Lost`] if it
    /// was lost.
    pub(crate) struct Hold {
        labels: Labels,
        held: metrics::Gauge,
        since: Instant,
    }

    impl Hold {
        pub(crate) fn end(self, lost: bool) {
            let labels = &self.labels;
            self.held.decrement(1.0);
            metrics::histogram!(HOLD, labels.0.to_vec()).record(self.since.elapsed().as_secs_f64());
            if lost {
                labels.acquisition(Outcome::Lost, None);
            }
        }

        /// The labels the hold is counted under.
        pub(crate) fn labels(&self) -> &Labels {
            &self.labels
        }
    }
}

/// The same names as `on`, doing nothing: the crate calls them unconditionally.
#[cfg(not(feature = "metrics"))]
mod off {
    use std::time::Duration;

    use super::Outcome;

    pub(crate) fn describe_metrics() {}

    #[derive(Clone, Debug)]
    pub struct Namespace;

    impl Namespace {
        pub(crate) fn new(_: &str) -> Self {
            Namespace
        }
        pub(crate) fn subscribed_channels(&self, _: usize, _: usize) {}
        pub(crate) fn subscriber_reconnected(&self) {}
        pub(crate) fn renewal_failed(&self) {}
    }

    #[derive(Clone, Debug, Default)]
    pub(crate) struct Route(());

    impl Route {
        pub(crate) fn new(_: std::borrow::Cow<'static, str>) -> Self {
            Route(())
        }
    }

    #[derive(Clone, Debug)]
    pub(crate) struct Labels;

    impl Labels {
        pub(crate) fn new(_: &Namespace, _: &Route, _: &'static str) -> Self {
            Labels
        }
        pub(crate) fn acquisition(&self, _: Outcome, _: Option<Duration>) {}
        pub(crate) fn waiting(&self) -> Waiting {
            Waiting
        }
        pub(crate) fn hold(&self) -> Hold {
            Hold
        }
    }

    pub(crate) struct Waiting;

    pub(crate) struct Hold;

    impl Hold {
        pub(crate) fn end(self, _: bool) {}
    }
}

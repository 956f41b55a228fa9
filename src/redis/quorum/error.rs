//! What a quorum call's failure means to the core.

use std::error::Error as StdError;
use std::fmt;
use std::time::Duration;

use crate::core::store::Failure;
use crate::redis::connection::pool::CommandError;

/// Why one master gave no answer to a call.
#[derive(Debug)]
pub(crate) enum MasterFailure {
    /// Its command failed.
    Failed(CommandError),
    /// It did not answer within the quorum's time for one master: the call may have run.
    TimedOut,
    /// It was down when the backend was built, and has not passed the build's checks
    /// since: it takes no part in acquisitions.
    Unchecked,
}

impl MasterFailure {
    pub(crate) fn may_have_run(&self) -> bool {
        match self {
            MasterFailure::Failed(e) => e.may_have_run(),
            MasterFailure::TimedOut => true,
            MasterFailure::Unchecked => false,
        }
    }

    pub(crate) fn is_foreign(&self) -> bool {
        matches!(self, MasterFailure::Failed(e) if e.is_foreign())
    }
}

impl fmt::Display for MasterFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MasterFailure::Failed(e) => e.fmt(f),
            MasterFailure::TimedOut => f.write_str("the master did not answer in time"),
            MasterFailure::Unchecked => f.write_str(
                "the master was down when the backend was built and has not been checked since",
            ),
        }
    }
}

impl StdError for MasterFailure {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        match self {
            MasterFailure::Failed(e) => Some(e),
            MasterFailure::TimedOut | MasterFailure::Unchecked => None,
        }
    }
}

/// A quorum call that settled nothing.
#[derive(Debug)]
pub(crate) enum QuorumError {
    /// Fewer than a majority of the masters answered (the lock service is down: 503).
    NoMajority {
        answered: usize,
        masters: usize,
        /// A master may have run the call without answering.
        may_have_run: bool,
        /// One of the failures, for the message.
        cause: Option<MasterFailure>,
    },
    /// A majority granted, but later than the lease's validity allows: given back.
    TooSlow {
        elapsed: Duration,
        validity: Duration,
    },
    /// A master's answer that settles the call alone: the key holds something else.
    Foreign(MasterFailure),
}

impl QuorumError {
    /// The error of a call that fewer than a majority of `masters` answered.
    pub(crate) fn no_majority(
        answered: usize,
        masters: usize,
        failures: impl IntoIterator<Item = MasterFailure>,
    ) -> Self {
        let mut may_have_run = false;
        let mut cause = None;
        for failure in failures {
            may_have_run |= failure.may_have_run();
            if failure.is_foreign() {
                return QuorumError::Foreign(failure);
            }
            cause.get_or_insert(failure);
        }
        QuorumError::NoMajority {
            answered,
            masters,
            may_have_run,
            cause,
        }
    }
}

impl fmt::Display for QuorumError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            QuorumError::NoMajority {
                answered, masters, ..
            } => write!(
                f,
                "only {answered} of {masters} Redis masters answered; a lock needs a majority \
                 ({})",
                masters / 2 + 1
            ),
            QuorumError::TooSlow { elapsed, validity } => write!(
                f,
                "a majority of the Redis masters granted the lock after {elapsed:?}, past its \
                 validity of {validity:?}"
            ),
            QuorumError::Foreign(e) => e.fmt(f),
        }
    }
}

impl StdError for QuorumError {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        match self {
            QuorumError::NoMajority { cause, .. } => cause.as_ref().map(|e| e as _),
            QuorumError::TooSlow { .. } => None,
            QuorumError::Foreign(e) => e.source(),
        }
    }
}

impl Failure for QuorumError {
    fn may_have_run(&self) -> bool {
        match self {
            QuorumError::NoMajority { may_have_run, .. } => *may_have_run,
            QuorumError::TooSlow { .. } => false,
            QuorumError::Foreign(e) => e.may_have_run(),
        }
    }

    fn is_transient(&self) -> bool {
        !matches!(self, QuorumError::Foreign(_))
    }

    fn is_foreign(&self) -> bool {
        matches!(self, QuorumError::Foreign(_))
    }
}

//! Jobs that run at most once per period across the instances of a service (the daily
//! report, the hourly cleanup): [`JobRequest`], made by `backend.job(name)`, and what a run
//! came to, [`JobRun`].
//!
//! A run takes the job's lock (the key `job:<name>`) without waiting, reads when the job
//! last completed, and runs the work only if the period has passed since; once the work
//! completes it records the completion, under the same lock, for one period. Time is the
//! store's: the record lives `period` on the store's clock (Redis's expiry, the SQL
//! server's clock, an etcd lease, the ZooKeeper ensemble's clock), never the hosts', so
//! the instances' clock skew does not matter, however short the work.
//!
//! ```
//! use std::time::Duration;
//! use tower_lock::{JobRun, MemoryBackend};
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), tower_lock::LockError> {
//! let backend = MemoryBackend::new(); // any store: RedisBackend, PostgresBackend, ...
//! let daily = || backend.job("daily-report").at_most_once_per(Duration::from_secs(86_400));
//! assert!(matches!(daily().run(|| async { "report" }).await?, JobRun::Ran("report")));
//! // Another instance, or this one, within the day:
//! match daily().run(|| async { "report" }).await? {
//!     JobRun::Ran(_) => unreachable!("at most once per period"),
//!     JobRun::Skipped { next_in } => assert!(next_in <= Duration::from_secs(86_400)),
//! }
//! # Ok(())
//! # }
//! ```

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;

use crate::error::LockError;
use crate::idempotency::Records;
use crate::lock::backend::Backend;
use crate::lock::{Acquired, DEFAULT_LEASE, LockRequest, Mode};

/// What the key of a job's lock starts with: `job:<name>`.
pub const JOB_PREFIX: &str = "job:";

/// What a [`JobRequest::run`] came to.
#[derive(Debug, Clone, PartialEq, Eq)]
#[must_use]
pub enum JobRun<T> {
    /// This instance ran the work, and recorded its completion: its output.
    Ran(T),
    /// The work was not run: it completed less than a period ago, or another instance is
    /// running it. It will not run again (here or anywhere) before `next_in`: the time
    /// left of the period since its last completion, or a whole period when another
    /// instance runs it now (the period starts over once that run completes).
    Skipped {
        /// How long until the job may run again, at the earliest.
        next_in: Duration,
    },
}

/// A run of a job that runs at most once per period across instances, made by
/// `backend.job(name)`: set its [`period`](Self::at_most_once_per), then
/// [`run`](Self::run) it.
#[must_use = "a job does nothing until it is run"]
pub struct JobRequest {
    store: Arc<dyn Backend>,
    records: Arc<dyn Records>,
    name: String,
    period: Duration,
    lease: Duration,
}

impl JobRequest {
    pub(crate) fn new(store: Arc<dyn Backend>, records: Arc<dyn Records>, name: String) -> Self {
        JobRequest {
            store,
            records,
            name,
            period: Duration::ZERO,
            lease: DEFAULT_LEASE,
        }
    }

    /// Runs the work only if it last completed at least `period` ago, on the store's
    /// clock. Without it (a period of zero) a run only keeps two instances from running the
    /// work at once.
    pub fn at_most_once_per(mut self, period: Duration) -> Self {
        self.period = period;
        self
    }

    /// The lease of the job's lock while the work runs (default [`DEFAULT_LEASE`], 30 s),
    /// renewed by the watchdog: an instance that stops mid-run (killed, cut off) frees the
    /// job for the others about one lease later, with no completion recorded.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }

    /// Runs `work` if the period has passed since the job last completed and no other
    /// instance runs it now; records its completion for one period once it returns.
    ///
    /// - `Ok(JobRun::Ran(output))`: this instance ran it, and its completion is recorded.
    /// - `Ok(JobRun::Skipped { next_in })`: it completed less than a period ago, or runs
    ///   elsewhere now (see [`JobRun::Skipped`]).
    /// - `Err(LockError::Lost)`: the job's lock was lost while the work ran (its future is
    ///   dropped then, as the layer drops a handler's): nothing is recorded, and the next
    ///   run anywhere runs it again. `Err(LockError::Backend)` from the store: before the
    ///   work, it did not run; after it (the completion could not be recorded), it ran
    ///   and may run again before a period has passed.
    ///
    /// So completed work runs at least once per period (an instance that crashes during
    /// it records nothing), and work that completes runs at most once per period.
    pub async fn run<F, Fut, T>(self, work: F) -> Result<JobRun<T>, LockError>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = T>,
    {
        let key = format!("{JOB_PREFIX}{}", self.name);
        // A completed job is skipped without touching its lock.
        if let Some(next_in) = self.completed_within(&key).await? {
            return Ok(JobRun::Skipped { next_in });
        }
        // A store that checks the completion as it takes the hold (Redis) takes none
        // while it exists; on the others it is read again once the lock is held.
        let taken = LockRequest::new(self.store.clone(), key.clone())
            .lease(self.lease)
            .metrics_label("job")
            .unless_recorded(Mode::TryOnce)
            .await;
        let guard = match taken {
            Ok(Acquired::Checked(guard)) => guard,
            Ok(Acquired::Unchecked(guard)) => match self.completed_within(&key).await? {
                None => guard,
                // Completed between the first read and the lock.
                Some(next_in) => {
                    guard.release().await?;
                    return Ok(JobRun::Skipped { next_in });
                }
            },
            // Completed between the first read and the lock; expired since, if no time is
            // left.
            Ok(Acquired::Recorded) => {
                let next_in = self.completed_within(&key).await?.unwrap_or_default();
                return Ok(JobRun::Skipped { next_in });
            }
            Err(LockError::Contended { .. }) => {
                return Ok(JobRun::Skipped {
                    next_in: self.period,
                });
            }
            Err(error) => return Err(error),
        };
        let output = tokio::select! {
            output = work() => output,
            () = guard.lost() => return Err(LockError::Lost { key }),
        };
        if !self.period.is_zero() {
            let held = guard.held().clone();
            let completion = Bytes::from(held.fencing_token().to_be_bytes().to_vec());
            // Stored only while this run's hold still holds the key: a run that lost it
            // (paused past its lease) cannot record over a newer run.
            if !self
                .records
                .store(key.clone(), held, completion, self.period)
                .await?
            {
                return Err(LockError::Lost { key });
            }
        }
        // The completion is recorded: a release that fails leaves the lock to its lease,
        // and the job is skipped for its period whatever happens to it.
        if let Err(error) = guard.release().await {
            tracing::debug!(job = %self.name, %error, "job's lock not released; its lease frees it");
        }
        Ok(JobRun::Ran(output))
    }

    /// How long the job's last completion has left of its period, if it is within one.
    async fn completed_within(&self, key: &str) -> Result<Option<Duration>, LockError> {
        if self.period.is_zero() {
            return Ok(None);
        }
        // A completion is recorded for one period: what a store reads as more (etcd's
        // TTL in whole seconds, rounded up; ZooKeeper's clock read across a round trip)
        // is that period.
        let left = self.records.remaining(key.to_owned()).await?;
        Ok(left.map(|left| left.min(self.period)))
    }
}

impl fmt::Debug for JobRequest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("JobRequest")
            .field("name", &self.name)
            .field("period", &self.period)
            .field("lease", &self.lease)
            .finish_non_exhaustive()
    }
}

//! Jobs at most once per period, written once and run on every store: four callers that
//! keep calling a job with a period of 1 s never run it twice within a period (measured
//! from a completion to the next start) nor two at once; a run cut off mid-work records
//! nothing and cannot record over the run that took over; a run that never completed
//! leaves the job to the next caller.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{Mutex, mpsc};
use tokio::time::{Instant, timeout};
use tower_lock::idempotency::IdempotencyBackend;
use tower_lock::{JobRun, LockError};

/// Generous bound on anything that should happen at once: catches hangs only.
const HANG: Duration = Duration::from_secs(10);
const PERIOD: Duration = Duration::from_secs(1);
/// How long the callers keep calling.
const WINDOW: Duration = Duration::from_secs(5);
/// What the store's clock and this host's may differ by over a period (rounding to
/// milliseconds, the time a call takes to reach the store).
const SLACK: Duration = Duration::from_millis(10);

async fn four_callers_run_a_job_at_most_once_per_period<B: IdempotencyBackend>(b: [B; 3]) {
    let runs: Arc<Mutex<Vec<(Instant, Instant)>>> = Arc::default();
    let running = Arc::new(Mutex::new(()));
    let end = Instant::now() + WINDOW;
    let callers: Vec<_> = [&b[0], &b[1], &b[2], &b[0]]
        .into_iter()
        .map(|backend| {
            let (backend, runs, running) = (backend.clone(), runs.clone(), running.clone());
            tokio::spawn(async move {
                let mut skipped = 0;
                while Instant::now() < end {
                    let (runs, running) = (runs.clone(), running.clone());
                    let run = backend
                        .job("report")
                        .at_most_once_per(PERIOD)
                        .run(|| async move {
                            let _alone = running.try_lock().expect("two runs at once");
                            let started = Instant::now();
                            tokio::time::sleep(Duration::from_millis(20)).await;
                            runs.lock().await.push((started, Instant::now()));
                        });
                    match run.await {
                        Ok(JobRun::Ran(())) => {}
                        Ok(JobRun::Skipped { next_in }) => {
                            assert!(next_in <= PERIOD, "{next_in:?}");
                            skipped += 1;
                        }
                        Err(e) => panic!("the job failed: {e}"),
                    }
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                skipped
            })
        })
        .collect();
    let mut skipped = 0;
    for caller in callers {
        skipped += caller.await.expect("caller");
    }
    let runs = runs.lock().await.clone();
    eprintln!("{} runs and {skipped} skips in {WINDOW:?}", runs.len());
    assert!(!runs.is_empty(), "the job never ran");
    // At most once per period: a run begins a period after the last completed, at the
    // earliest, so a window of 5 periods holds 6 runs at the most.
    assert!(runs.len() <= 6, "{} runs", runs.len());
    for pair in runs.windows(2) {
        let ((_, completed), (next, _)) = (pair[0], pair[1]);
        assert!(
            next + SLACK >= completed + PERIOD,
            "ran again {:?} after a completion",
            next - completed
        );
    }
}

/// A run of `name` on `backend` whose work never ends, spawned, once its work started.
async fn started_run<B: IdempotencyBackend>(
    backend: &B,
    name: &str,
) -> tokio::task::JoinHandle<Result<JobRun<()>, LockError>> {
    let (started, mut starts) = mpsc::unbounded_channel();
    let run = backend
        .job(name)
        .at_most_once_per(PERIOD * 60)
        .run(|| async move {
            let _ = started.send(());
            std::future::pending::<()>().await;
        });
    let run = tokio::spawn(run);
    timeout(HANG, starts.recv()).await.expect("the run starts");
    run
}

/// A run whose lock an operator frees mid-work (as its lease would run out under a
/// paused holder) has its work dropped and records nothing, and the run that took over
/// records its completion, which stands.
async fn a_run_cut_off_mid_work_records_nothing_over_the_next<B: IdempotencyBackend>(b: [B; 3]) {
    let first = started_run(&b[0], "cleanup").await;
    let freed = b[2]
        .force_release("job:cleanup")
        .await
        .expect("force_release");
    assert!(!freed.is_free(), "the run held the job's lock: {freed:?}");
    let cut_off = timeout(HANG * 2, first)
        .await
        .expect("the cut-off run ends")
        .expect("task");
    assert!(
        matches!(cut_off, Err(LockError::Lost { .. })),
        "{cut_off:?}"
    );

    let next = b[1]
        .job("cleanup")
        .at_most_once_per(PERIOD * 60)
        .run(|| async { 7 });
    assert_eq!(next.await.expect("the next run"), JobRun::Ran(7));
    let again = b[0]
        .job("cleanup")
        .at_most_once_per(PERIOD * 60)
        .run(|| async { 8 });
    match again.await.expect("a run within the period") {
        JobRun::Skipped { next_in } => {
            assert!(
                next_in > PERIOD * 50 && next_in <= PERIOD * 60,
                "{next_in:?}"
            );
        }
        ran => panic!("ran twice within the period: {ran:?}"),
    }
}

/// A run that never completed (its caller went away mid-work: a crash) records nothing:
/// the next caller runs the job.
async fn a_run_that_never_completed_leaves_the_job_to_the_next<B: IdempotencyBackend>(b: [B; 3]) {
    let first = started_run(&b[0], "warm").await;
    first.abort();
    // The aborted run's lock is released in the background: wait for it (woken by the
    // release), then run.
    let freed = timeout(HANG, b[1].lock("job:warm").wait(HANG))
        .await
        .expect("released");
    freed
        .expect("the job's lock")
        .release()
        .await
        .expect("release");
    let next = b[1]
        .job("warm")
        .at_most_once_per(PERIOD * 60)
        .run(|| async { 1 });
    assert_eq!(next.await.expect("run"), JobRun::Ran(1));
}

crate::for_each_store_and_consensus!(
    four_callers_run_a_job_at_most_once_per_period,
    a_run_cut_off_mid_work_records_nothing_over_the_next,
    a_run_that_never_completed_leaves_the_job_to_the_next;
    not on etcd or zookeeper:
);

//! Leaders in processes of their own, on every store: the leader's process killed
//! (SIGKILL), paused past its lease (SIGSTOP) or cut off from its store (a proxy that goes
//! silent) is replaced by the waiting candidate under a higher epoch, and the old leader's
//! work is dropped once it can learn it lost. The times are printed, never asserted.

use crate::support;

use std::time::{Duration, Instant};

use support::child::{self, ChildProcess};
use support::proxy::FaultProxy;
use tower_lock::idempotency::IdempotencyBackend;
use tower_lock::{JobRun, Leadership, LockError};

/// Settings passed to a candidate process.
const STORE: &str = "TOWER_LOCK_TEST_LEADER_STORE";
const ADDR: &str = "TOWER_LOCK_TEST_LEADER_ADDR";
const NAMESPACE: &str = "TOWER_LOCK_TEST_LEADER_NAMESPACE";
/// The candidates' lease (on etcd the backend's lease, on ZooKeeper its session): short,
/// so that a stopped leader is replaced within seconds.
const LEASE: Duration = Duration::from_secs(3);
/// How often a leader's work reports that it runs.
const STEP: Duration = Duration::from_millis(100);

#[tokio::test]
#[ignore = "entry point of the candidate processes that the leader fault tests spawn"]
async fn candidate_process() {
    if child::role().is_none() {
        return;
    }
    let (store, addr, namespace) = (
        child::setting(STORE),
        child::setting(ADDR),
        child::setting(NAMESPACE),
    );
    match store.as_str() {
        "redis" => {
            let builder = support::builder(&addr).namespace(namespace);
            play(builder.build().await.expect("redis backend")).await
        }
        "quorum" => {
            let urls: Vec<String> = addr.split(',').map(str::to_owned).collect();
            let builder = support::quorum::builder_on(&urls).namespace(namespace);
            play(builder.build().await.expect("quorum backend")).await
        }
        "postgres" => {
            let builder = tower_lock::PostgresBackend::builder(addr)
                .namespace(namespace)
                .migrate()
                .connect_timeout(Duration::from_secs(10))
                .command_timeout(Duration::from_secs(1));
            play(builder.build().await.expect("postgres backend")).await
        }
        "mariadb" => {
            let builder = support::mariadb::builder_on(&addr)
                .namespace(namespace)
                .command_timeout(Duration::from_secs(1));
            play(builder.build().await.expect("mariadb backend")).await
        }
        #[cfg(feature = "etcd")]
        "etcd" => {
            let builder = support::etcd::builder_on(&[addr])
                .namespace(namespace)
                .lease_ttl(LEASE)
                .command_timeout(Duration::from_secs(1));
            play(builder.build().await.expect("etcd backend")).await
        }
        "zookeeper" => {
            let builder = support::zookeeper::builder_on(&addr)
                .namespace(namespace)
                .session_timeout(LEASE)
                .command_timeout(Duration::from_secs(1));
            play(builder.build().await.expect("zookeeper backend")).await
        }
        other => panic!("unknown store {other}"),
    }
}

/// Plays the child's role on `backend`: a candidate, or a job's runner.
async fn play<B: IdempotencyBackend>(backend: B) {
    match child::role().as_deref() {
        Some("candidate") => campaign(backend).await,
        Some("job") => run_job(backend).await,
        other => panic!("unknown role {other:?}"),
    }
}

/// The job the job runners run, with a period far longer than the test.
const JOB: &str = "nightly";
const JOB_PERIOD: Duration = Duration::from_secs(600);
/// Set for a runner that waits for the job's lock to be free before it runs the job.
const WAIT_FIRST: &str = "TOWER_LOCK_TEST_JOB_WAIT_FIRST";

/// Runs the job once and reports `working 0` when its work starts, then its outcome:
/// `outcome 1` ran, `2` skipped, `3` lost, `4` the completion not recorded (the store did
/// not answer). The first runner's work returns once it sees it was paused, the one that
/// waited for the lock returns at once.
async fn run_job<B: IdempotencyBackend>(backend: B) {
    let waited = std::env::var_os(WAIT_FIRST).is_some();
    if waited {
        let free = backend
            .lock(format!("job:{JOB}"))
            .wait(Duration::from_secs(60))
            .await;
        free.expect("the job's lock frees")
            .release()
            .await
            .expect("release");
    }
    let job = backend.job(JOB).at_most_once_per(JOB_PERIOD).lease(LEASE);
    let outcome = job
        .run(|| async {
            child::report("working 0");
            // The first runner's work returns once this process has been paused (a step
            // that took longer than the lease), so that it completes only after its lease
            // ran out; the runner that waited for the lock returns at once.
            if waited {
                return;
            }
            loop {
                let step = std::time::Instant::now();
                tokio::time::sleep(STEP).await;
                if step.elapsed() > LEASE {
                    break;
                }
            }
        })
        .await;
    child::report(match outcome {
        Ok(JobRun::Ran(())) => "outcome 1",
        Ok(JobRun::Skipped { .. }) => "outcome 2",
        Err(LockError::Lost { .. }) => "outcome 3",
        // The store did not answer the completion's write (a ZooKeeper session that
        // expired while this process was paused, not yet known as such): not recorded.
        Err(e @ LockError::Backend(_)) => {
            eprintln!(
                "the job's completion was not recorded: {}",
                support::chain(&e)
            );
            "outcome 4"
        }
        Err(e) => panic!("the job failed: {}", support::chain(&e)),
    });
    std::future::pending::<()>().await;
}

/// A job runner paused past its lease mid-work records nothing when it resumes (its work
/// is dropped, or its completion refused), and the run that took over meanwhile stands.
async fn a_job_runner_paused_past_its_lease_records_nothing(store: &str, addr: &str) {
    const RAN: u64 = 1;
    const SKIPPED: u64 = 2;
    const LOST: u64 = 3;
    const NOT_RECORDED: u64 = 4;
    let ns = format!("job-{}", uuid::Uuid::new_v4().simple());
    let settings = |wait: bool| {
        let mut settings = vec![
            (STORE, store.to_owned()),
            (ADDR, addr.to_owned()),
            (NAMESPACE, ns.clone()),
        ];
        if wait {
            settings.push((WAIT_FIRST, "1".to_owned()));
        }
        settings
    };
    let entry = "leader_faults::candidate_process";
    let mut paused = ChildProcess::spawn(entry, "job", &settings(false));
    assert_eq!(next_event(&mut paused, false).await.what, "working");
    paused.pause();
    let mut next = ChildProcess::spawn(entry, "job", &settings(true));
    assert_eq!(next_event(&mut next, false).await.what, "working");
    assert_eq!(expect(&mut next, "outcome").await.epoch, RAN);
    paused.resume();
    let outcome = expect(&mut paused, "outcome").await.epoch;
    assert!(
        matches!(outcome, LOST | NOT_RECORDED),
        "the paused run recorded: {outcome}"
    );
    let mut later = ChildProcess::spawn(entry, "job", &settings(false));
    assert_eq!(
        expect(&mut later, "outcome").await.epoch,
        SKIPPED,
        "the completion stands"
    );
    eprintln!("{store}: a job runner paused past its lease recorded nothing");
}

/// Campaigns for `proc` and reports: `campaigning`, `leads EPOCH`, `working EPOCH` every
/// [`STEP`] while leading, `stopped EPOCH` when the work is dropped.
async fn campaign<B: IdempotencyBackend>(backend: B) {
    struct Stopped(u64);
    impl Drop for Stopped {
        fn drop(&mut self) {
            child::report(&format!(
                "stopped {} {}",
                self.0,
                support::netns::now_micros()
            ));
        }
    }
    child::report("campaigning");
    let run = backend
        .leader("proc")
        .lease(LEASE)
        .run(|leadership: Leadership| async move {
            let epoch = leadership.fencing_token();
            let _stopped = Stopped(epoch);
            child::report(&format!("leads {epoch} {}", support::netns::now_micros()));
            loop {
                tokio::time::sleep(STEP).await;
                child::report(&format!("working {epoch}"));
            }
        });
    run.await.expect("the campaign ends only with an error");
}

/// One report of a candidate: what, the epoch, and when (µs since the epoch), if said.
struct Report {
    what: String,
    epoch: u64,
    at: Option<u64>,
}

async fn next_event(candidate: &mut ChildProcess, skip_working: bool) -> Report {
    loop {
        let line = candidate.next_report().await.expect("the candidate runs");
        let mut parts = line.split(' ');
        let what = parts.next().unwrap_or_default().to_owned();
        if what == "campaigning" || (skip_working && what == "working") {
            continue;
        }
        let epoch = parts.next().and_then(|e| e.parse().ok());
        let epoch = epoch.unwrap_or_else(|| panic!("unexpected report {line:?}"));
        let at = parts.next().and_then(|t| t.parse().ok());
        return Report { what, epoch, at };
    }
}

async fn expect(candidate: &mut ChildProcess, what: &str) -> Report {
    let report = next_event(candidate, true).await;
    assert_eq!(report.what, what, "epoch {}", report.epoch);
    report
}

/// A candidate of `store` at `addr`, in `namespace`, once it says it campaigns.
async fn spawn(store: &str, addr: &str, namespace: &str) -> ChildProcess {
    let settings = [
        (STORE, store.to_owned()),
        (ADDR, addr.to_owned()),
        (NAMESPACE, namespace.to_owned()),
    ];
    let mut candidate =
        ChildProcess::spawn("leader_faults::candidate_process", "candidate", &settings);
    assert_eq!(
        candidate.next_report().await.as_deref(),
        Some("campaigning")
    );
    candidate
}

/// `addr` with each `127.0.0.1:PORT` in it behind a proxy of its own.
async fn proxied(addr: &str) -> (String, Vec<FaultProxy>) {
    let mut out = String::new();
    let mut proxies = Vec::new();
    let mut rest = addr;
    while let Some(at) = rest.find("127.0.0.1:") {
        out.push_str(&rest[..at]);
        let after = &rest[at + "127.0.0.1:".len()..];
        let digits = after
            .find(|c: char| !c.is_ascii_digit())
            .unwrap_or(after.len());
        let upstream = format!("127.0.0.1:{}", &after[..digits]);
        let proxy = FaultProxy::start(
            "127.0.0.1:0".parse().expect("addr"),
            upstream.parse().expect("upstream"),
        )
        .await;
        out.push_str(&proxy.addr().to_string());
        proxies.push(proxy);
        rest = &after[digits..];
    }
    out.push_str(rest);
    (out, proxies)
}

/// The three faults, each in a namespace of its own: the leader killed, paused past its
/// lease, cut off from the store.
async fn the_leader_killed_paused_or_cut_off_is_replaced(store: &str, addr: &str) {
    let namespace = || format!("leader-{}", uuid::Uuid::new_v4().simple());

    // Killed: the candidate leads once the dead leader's lease runs out.
    let ns = namespace();
    let mut leader = spawn(store, addr, &ns).await;
    let first = expect(&mut leader, "leads").await;
    let mut candidate = spawn(store, addr, &ns).await;
    let killed = Instant::now();
    leader.kill().await;
    let next = expect(&mut candidate, "leads").await;
    assert!(
        next.epoch > first.epoch,
        "{} after {}",
        next.epoch,
        first.epoch
    );
    eprintln!(
        "{store}: leader killed, replaced after {:?}",
        killed.elapsed()
    );
    drop(candidate);

    // Paused past its lease: replaced; once resumed, its work is dropped.
    let ns = namespace();
    let mut leader = spawn(store, addr, &ns).await;
    let first = expect(&mut leader, "leads").await;
    let mut candidate = spawn(store, addr, &ns).await;
    leader.pause();
    let paused = Instant::now();
    let next = expect(&mut candidate, "leads").await;
    assert!(
        next.epoch > first.epoch,
        "{} after {}",
        next.epoch,
        first.epoch
    );
    let replaced = paused.elapsed();
    leader.resume();
    let mut late_steps = 0;
    let stopped = loop {
        let report = next_event(&mut leader, false).await;
        match report.what.as_str() {
            "working" => late_steps += 1,
            "stopped" => break report,
            other => panic!("the paused leader said {other} before it stopped"),
        }
    };
    assert_eq!(stopped.epoch, first.epoch);
    eprintln!(
        "{store}: leader paused, replaced after {replaced:?}; resumed, it stopped after {late_steps} more steps"
    );
    drop((leader, candidate));

    // Cut off from the store: it stops its work, and the candidate leads.
    let ns = namespace();
    let (cut_addr, proxies) = proxied(addr).await;
    let mut leader = spawn(store, &cut_addr, &ns).await;
    let first = expect(&mut leader, "leads").await;
    let mut candidate = spawn(store, addr, &ns).await;
    for proxy in &proxies {
        proxy.stall();
    }
    let stopped = expect(&mut leader, "stopped").await;
    assert_eq!(stopped.epoch, first.epoch);
    let next = expect(&mut candidate, "leads").await;
    assert!(
        next.epoch > first.epoch,
        "{} after {}",
        next.epoch,
        first.epoch
    );
    let margin = |stopped: u64, leads: u64| leads as i64 - stopped as i64;
    if let (Some(stopped), Some(leads)) = (stopped.at, next.at) {
        eprintln!(
            "{store}: leader cut off stopped its work {} ms before the next leader began",
            margin(stopped, leads) / 1000
        );
    }
}

/// Every fault of this file on `store` at `addr`: the leader's, then the job runner's.
async fn faults(store: &str, addr: &str) {
    the_leader_killed_paused_or_cut_off_is_replaced(store, addr).await;
    a_job_runner_paused_past_its_lease_records_nothing(store, addr).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_redis() {
    crate::needs!(Redis);
    let server = support::RedisServer::start();
    faults("redis", &server.url()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_quorum() {
    crate::needs!(Redis);
    let quorum = support::quorum::shared();
    let _turn = quorum.shared_turn().await;
    let urls = quorum.urls().join(",");
    faults("quorum", &urls).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_postgres() {
    crate::needs!(Postgres);
    let url = support::postgres::shared().url();
    faults("postgres", &url).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_mariadb() {
    crate::needs!(MariaDb);
    let url = support::mariadb::shared().url();
    faults("mariadb", &url).await;
}

#[cfg(feature = "etcd")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_etcd() {
    crate::needs!(Etcd);
    let endpoint = support::etcd::shared().endpoint();
    faults("etcd", &endpoint).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_zookeeper() {
    crate::needs!(ZooKeeper);
    let hosts = support::zookeeper::shared().hosts();
    faults("zookeeper", &hosts).await;
}

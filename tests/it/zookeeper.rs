//! ZooKeeper: what `build()` refuses, what the session does for the holds under it, the
//! leader of a three-server ensemble killed mid-run, ZooKeeper down, no herd (exclusive,
//! read/write and permit waiters), a holder killed with SIGKILL, a holder partitioned from
//! the ensemble (stops before its lock is freed, the margin printed) and digest
//! authentication. The semantics every store keeps run in the conformance suite
//! (conformance.rs and the files it names: `on_zookeeper::*`).

use crate::support;

use std::time::Duration;

use axum::Router;
use axum::extract::Request;
use axum::routing::post;
use support::child::{self, ChildProcess};
use support::counted::{self, Counted};
use support::netns::{CutOffHolder, Net};
use support::zookeeper::{self as zk, ZkEnsemble, ZkServer};
use tower_lock::{BuildError, ConnectFailure, LockError, LockLayer};

/// Generous bound on anything that should happen at once: catches hangs only.
const HANG: Duration = Duration::from_secs(10);

#[tokio::test]
async fn build_refuses_misconfiguration_naming_the_cause() {
    crate::needs!(ZooKeeper);
    let refused = tower_lock::ZooKeeperBackend::builder("").build().await;
    let Err(error @ BuildError::Setting { name: "hosts", .. }) = &refused else {
        panic!("no host is refused: {refused:?}");
    };
    assert!(error.to_string().contains("host:port"), "{error}");
    for bad in ["zk-without-port", "127.0.0.1:notaport", ":2181"] {
        let refused = tower_lock::ZooKeeperBackend::builder(bad).build().await;
        assert!(
            matches!(refused, Err(BuildError::Url { .. })),
            "{bad}: {refused:?}"
        );
    }
    let refused = tower_lock::ZooKeeperBackend::builder("127.0.0.1:2181")
        .namespace("..")
        .build()
        .await;
    assert!(
        matches!(refused, Err(BuildError::Namespace { .. })),
        "{refused:?}"
    );

    // Nothing listens there.
    let port = support::process::free_port().expect("a free port");
    let refused = zk::builder_on(&format!("127.0.0.1:{port}")).build().await;
    assert!(
        matches!(
            refused,
            Err(BuildError::Connect {
                failure: ConnectFailure::Refused | ConnectFailure::TimedOut,
                ..
            })
        ),
        "{refused:?}"
    );

    // A chroot that does not exist.
    let hosts = format!("{}/no/such/chroot", zk::shared().hosts());
    let refused = zk::builder_on(&hosts).build().await;
    let Err(error @ BuildError::Setting { name: "hosts", .. }) = &refused else {
        panic!("a missing chroot is refused: {refused:?}");
    };
    assert!(error.to_string().contains("chroot"), "{error}");
}

#[tokio::test]
async fn fencing_tokens_are_zxids_increasing_across_instances() {
    crate::needs!(ZooKeeper);
    let namespace = zk::fresh_namespace();
    let (a, b) = (
        zk::backend_in(&namespace).await,
        zk::backend_in(&namespace).await,
    );
    let mut last = 0;
    for backend in [&a, &b, &a, &b, &b] {
        let guard = backend.lock("k").try_once().await.expect("free");
        assert!(
            guard.fencing_token() > last,
            "{} after {last}",
            guard.fencing_token()
        );
        last = guard.fencing_token();
        let info = backend.inspect("k").await.expect("inspect");
        assert_eq!(info.fencing_token, Some(last));
        guard.release().await.expect("released");
    }
}

const HOSTS: &str = "TOWER_LOCK_TEST_ZOOKEEPER";
const NAMESPACE: &str = "TOWER_LOCK_TEST_NAMESPACE";
/// `after-pause`: the holder waits for its hold to be lost, then locks again.
const WAKES: &str = "TOWER_LOCK_TEST_WAKES";

#[tokio::test]
#[ignore = "entry point of the child processes that the tests spawn"]
async fn child_process() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .try_init();
    if child::role().as_deref() == Some("holder") {
        let backend = zk::builder_on(&child::setting(HOSTS))
            .namespace(child::setting(NAMESPACE))
            .session_timeout(Duration::from_secs(2))
            .build()
            .await
            .expect("backend");
        let guard = backend.lock("k").try_once().await.expect("uncontended");
        child::report(&format!("held {}", guard.fencing_token()));
        if child::setting(WAKES) == "after-pause" {
            // Paused past its session's timeout, then resumed.
            let session = backend.session_id();
            tokio::time::timeout(HANG, guard.lost())
                .await
                .expect("lost fires");
            child::report("lost");
            // A call made while the client finds its connection dead (the server went
            // silent on it for the pause) fails, transient: a 503 to a request, which
            // its client sends again. The calls after it go out on the new session.
            let mut failed = 0;
            let other = loop {
                match backend.lock("other").wait(HANG).await {
                    Ok(guard) => break guard,
                    Err(e) if e.is_transient() && failed < 3 => {
                        failed += 1;
                        eprintln!("a call while the session was replaced: {e:?}");
                    }
                    Err(e) => panic!("a new session: {e:?}"),
                }
            };
            let renewed = backend.session_id() != session;
            child::report(&format!("new session {renewed}"));
            other.release().await.expect("released");
            return;
        }
        if child::setting(WAKES) == "report-lost" {
            // Cut off from the ensemble: reports when its hold is given up.
            tokio::time::timeout(HANG, guard.lost())
                .await
                .expect("lost fires");
            child::report(&format!("lost {}", support::netns::now_micros()));
        }
        std::future::pending::<()>().await;
    }
}

/// A holder on its own host, whose way to the ensemble is cut (the Jepsen hosts of
/// `support::netns`): the holder gives its hold up (`lost()`, its handler aborted) before
/// the ensemble expires its session and frees the lock for others.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_partitioned_from_the_ensemble_stops_before_its_lock_is_freed() {
    crate::needs!(ZooKeeper);
    const TEST: &str = "zookeeper partition";
    if !Net::available() {
        support::netns::skip(TEST);
        return;
    }
    let server = zk::shared();
    let namespace = zk::fresh_namespace();
    let mut holder = CutOffHolder::start(
        server.hosts().parse().expect("host:port"),
        |netns, store| {
            let settings = [
                (HOSTS, store.to_string()),
                (NAMESPACE, namespace.clone()),
                (WAKES, "report-lost".to_owned()),
            ];
            ChildProcess::spawn_in(netns, "zookeeper::child_process", "holder", &settings)
        },
    )
    .await;
    let observer = zookeeper_client::Client::connect(&server.hosts())
        .await
        .expect("observer");
    let lock = format!("/{namespace}/{{k}}");
    let (holds, _) = observer.get_children(&lock).await.expect("the lock's node");
    let [hold] = holds.as_slice() else {
        panic!("one hold: {holds:?}");
    };
    let (stat, deleted) = observer
        .check_and_watch_stat(&format!("{lock}/{hold}"))
        .await
        .expect("watch");
    assert!(stat.is_some(), "the hold's node exists");
    let lost = holder.cut().await;
    let event = tokio::time::timeout(HANG, deleted.changed())
        .await
        .expect("the session expires");
    let freed = support::netns::now_micros();
    assert_eq!(event.event_type, zookeeper_client::EventType::NodeDeleted);
    support::netns::report_margin("ZooKeeper", lost, freed);
    let next = zk::backend_in(&namespace)
        .await
        .lock("k")
        .try_once()
        .await
        .expect("free once the session expired");
    assert!(next.fencing_token() > holder.token);
}

#[tokio::test]
async fn an_expired_session_reports_its_holds_lost_and_a_new_session_serves() {
    crate::needs!(ZooKeeper);
    let namespace = zk::fresh_namespace();
    let waiter = zk::backend_in(&namespace).await;
    let settings = [
        (HOSTS, zk::shared().hosts()),
        (NAMESPACE, namespace.clone()),
        (WAKES, "after-pause".to_owned()),
    ];
    let mut holder = ChildProcess::spawn("zookeeper::child_process", "holder", &settings);
    let report = holder
        .next_report()
        .await
        .expect("the child reports its lock");
    let paused_token: u64 = report
        .strip_prefix("held ")
        .and_then(|t| t.parse().ok())
        .unwrap_or_else(|| panic!("unexpected report {report:?}"));
    // The holder's process stops (a GC pause, a frozen VM) with its connection open.
    holder.pause();
    // Its session of 2 s expires: ZooKeeper deletes its node and the waiter gets the lock.
    let next = tokio::time::timeout(HANG, waiter.lock("k").wait(HANG))
        .await
        .expect("no hang")
        .expect("freed when the paused holder's session expired");
    assert!(next.fencing_token() > paused_token);
    holder.resume();
    assert_eq!(holder.next_report().await.as_deref(), Some("lost"));
    assert_eq!(
        holder.next_report().await.as_deref(),
        Some("new session true")
    );
    holder.assert_success().await;
    assert!(
        !next.is_lost(),
        "the expired holder's release left the new hold alone"
    );
    next.release().await.expect("released");
}

#[tokio::test]
async fn a_holder_killed_with_sigkill_frees_its_lock_when_its_session_expires() {
    crate::needs!(ZooKeeper);
    let namespace = zk::fresh_namespace();
    let waiter = zk::backend_in(&namespace).await;
    let settings = [
        (HOSTS, zk::shared().hosts()),
        (NAMESPACE, namespace.clone()),
        (WAKES, "never".to_owned()),
    ];
    let mut holder = ChildProcess::spawn("zookeeper::child_process", "holder", &settings);
    let report = holder
        .next_report()
        .await
        .expect("the child reports its lock");
    let killed_token: u64 = report
        .strip_prefix("held ")
        .and_then(|t| t.parse().ok())
        .unwrap_or_else(|| panic!("unexpected report {report:?}"));
    assert!(matches!(
        waiter.lock("k").try_once().await,
        Err(LockError::Contended { .. })
    ));
    holder.kill().await;
    // Its session of 2 s, no longer pinged, expires: ZooKeeper deletes its node and the
    // watch on it wakes the waiter.
    let next = tokio::time::timeout(HANG, waiter.lock("k").wait(HANG))
        .await
        .expect("no hang")
        .expect("freed when the killed holder's session expired");
    assert!(next.fencing_token() > killed_token);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zookeeper_down_answers_503_holds_are_lost_and_service_resumes() {
    crate::needs!(ZooKeeper);
    support::init_tracing();
    let mut server = ZkServer::start();
    let backend = zk::builder_on(&server.hosts())
        .session_timeout(Duration::from_secs(2))
        .command_timeout(Duration::from_millis(500))
        .build()
        .await
        .expect("backend");
    let app = Router::new()
        .route("/lock/{key}", post(|| async { "locked" }))
        .route_layer(
            LockLayer::new(backend.clone(), |req: &Request| {
                req.uri().path().strip_prefix("/lock/").map(str::to_owned)
            })
            .fail_fast(),
        );
    assert_eq!(
        support::call(&app, http::Method::POST, "/lock/a")
            .await
            .status,
        200
    );
    let held = backend.lock("held").try_once().await.expect("free");

    server.kill();
    assert_eq!(
        support::call(&app, http::Method::POST, "/lock/a")
            .await
            .status,
        503,
        "ZooKeeper unreachable: the store's failure"
    );
    tokio::time::timeout(HANG, held.lost())
        .await
        .expect("a hold whose session cannot be confirmed is lost");

    server.start_again();
    support::eventually("requests are served again", || async {
        support::call(&app, http::Method::POST, "/lock/a")
            .await
            .status
            == 200
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiting_instances_watch_the_holders_node_once_each_and_keep_one_node_in_line() {
    crate::needs!(ZooKeeper);
    // A server of its own: its counters count this test's calls only.
    let server = ZkServer::start();
    let holder = instance(&server).await;
    let waiting = [instance(&server).await, instance(&server).await];
    let guard = holder.lock("k").try_once().await.expect("uncontended");
    let nodes = server.mntr("zk_znode_count");
    let waiters = counted::spawn_waiters(&waiting, "k", 10);
    server.registered(&waiting, 4).await;
    // One watch per waiting instance, on the holder's node, whatever its waiters number.
    support::eventually(
        "each waiting instance watches the holder's node",
        || async { server.mntr("zk_watch_count") == 2 },
    )
    .await;
    let watches = server.four("wchc").expect("wchc");
    assert_eq!(watches.matches("/{k}/").count(), 2, "{watches}");
    // Each waiting instance keeps one node in line, whatever its waiters number.
    assert_eq!(server.mntr("zk_znode_count"), nodes + 2);
    assert!(listings(&server) > 0, "the attempts' listings are counted");
    no_attempt_for_a_while(&server).await;
    guard.release().await.expect("release");
    counted::all_served(waiters).await;
}

/// An instance on `server` whose renewals and pings fall outside the window of
/// [`no_attempt_for_a_while`].
async fn instance(server: &ZkServer) -> tower_lock::ZooKeeperBackend {
    zk::builder_on(&server.hosts())
        // Renewals come a sixth of it apart.
        .session_timeout(Duration::from_secs(5))
        .build()
        .await
        .expect("backend")
}

/// The listings of nodes' children `server` answered: every attempt lists the lock's
/// nodes. (Renewals are multi-reads, counted apart.)
fn listings(server: &ZkServer) -> u64 {
    server.mntr("zk_response_packet_get_children_cache_hits")
        + server.mntr("zk_response_packet_get_children_cache_misses")
}

/// Asserts that no attempt reaches `server` for far longer than any polling interval.
async fn no_attempt_for_a_while(server: &ZkServer) {
    let before = listings(server);
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        listings(server),
        before,
        "no attempt while the lock is held"
    );
}

/// Spawns `acquire` (a waiter of its own, not lined up behind another task in-process:
/// a shared hold or a permit) and returns once it has made its attempts (`attempts`
/// listings: it tried, subscribed and tried again) and waits.
async fn spawn_waiter<F>(
    server: &ZkServer,
    attempts: u64,
    acquire: F,
) -> tokio::task::JoinHandle<()>
where
    F: std::future::Future<Output = Result<tower_lock::LockGuard, LockError>> + Send + 'static,
{
    let before = listings(server);
    let waiter = tokio::spawn(async move {
        let guard = acquire.await.expect("served once the key is free");
        guard.release().await.expect("released");
    });
    support::eventually("the waiter has tried twice", || async {
        listings(server) >= before + attempts
    })
    .await;
    waiter
}

/// Waits (generously) until every waiter of [`spawn_waiter`] was served.
async fn all_served(waiters: impl IntoIterator<Item = tokio::task::JoinHandle<()>>) {
    for waiter in waiters {
        tokio::time::timeout(HANG, waiter)
            .await
            .expect("served")
            .expect("acquired after the release, and released");
    }
}

/// Curator's read/write lock without a herd: a writer kept out by two readers (of one
/// instance) waits in line behind them, watching only the reader just before it; readers
/// that come after it wait behind it, watching only its node, one watch per instance.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readers_and_a_writer_wait_on_one_node_each_without_polling() {
    crate::needs!(ZooKeeper);
    let server = ZkServer::start();
    let (holder, writing, reading) = (
        instance(&server).await,
        instance(&server).await,
        instance(&server).await,
    );
    // Two shared holds of one session, of two owners.
    let r1 = holder.lock("k").shared().try_once().await.expect("free");
    let r2 = holder.lock("k").shared().try_once().await.expect("shared");
    let nodes = server.mntr("zk_znode_count");
    // Its attempts: a listing, its node created, a listing; then one more.
    let writer = spawn_waiter(&server, 3, writing.lock("k").wait(Duration::from_secs(60))).await;
    // The writer waits with a node in line, so that later readers queue behind it.
    assert_eq!(server.mntr("zk_znode_count"), nodes + 1);
    let mut readers = Vec::new();
    for _ in 0..5 {
        let read = reading.lock("k").shared().wait(Duration::from_secs(60));
        readers.push(spawn_waiter(&server, 2, read).await);
    }
    let watches = server.four("wchc").expect("wchc");
    assert_eq!(server.mntr("zk_watch_count"), 2, "{watches}");
    assert_eq!(
        watches
            .matches(&format!("{:016x}-r-", holder.session_id()))
            .count(),
        1,
        "the writer watches the last reader's node: {watches}"
    );
    assert_eq!(
        watches
            .matches(&format!("{:016x}-", writing.session_id()))
            .count(),
        1,
        "the readers' instance watches the writer's node: {watches}"
    );
    // Readers leave no node behind.
    assert_eq!(server.mntr("zk_znode_count"), nodes + 1);
    no_attempt_for_a_while(&server).await;
    r1.release().await.expect("released");
    r2.release().await.expect("released");
    all_served(std::iter::once(writer).chain(readers)).await;
}

/// A permit waiter watches the permits it waits behind, never the semaphore's children,
/// and leaves no node behind; the other waiting tasks of its instance wait behind it in the
/// process.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn permit_waiters_watch_the_held_permits_once_without_polling() {
    crate::needs!(ZooKeeper);
    let server = ZkServer::start();
    let (holder, waiting) = (instance(&server).await, instance(&server).await);
    let held = [
        holder.lock("k").permits(2).try_once().await.expect("free"),
        holder.lock("k").permits(2).try_once().await.expect("free"),
    ];
    let nodes = server.mntr("zk_znode_count");
    let mut waiters = Vec::new();
    for queued in 0..5 {
        let acquire = waiting.lock("k").permits(2).wait(Duration::from_secs(60));
        // The first waits in ZooKeeper (it tries, watches, tries again); the others try
        // once and wait behind it in their process.
        let attempts = if queued == 0 { 2 } else { 1 };
        waiters.push(spawn_waiter(&server, attempts, acquire).await);
        support::eventually("the waiter waits behind the first", || async {
            waiting.stats().local_waiters == queued
        })
        .await;
    }
    let watches = server.four("wchc").expect("wchc");
    assert_eq!(server.mntr("zk_watch_count"), 2, "{watches}");
    assert_eq!(watches.matches("/{k}:permits/").count(), 2, "{watches}");
    assert_eq!(server.mntr("zk_znode_count"), nodes);
    no_attempt_for_a_while(&server).await;
    for guard in held {
        guard.release().await.expect("released");
    }
    all_served(waiters).await;
}

/// Three servers; four tasks of two instances take one key in turns while the leader is
/// killed: requests are served again after the election, no two tasks ever hold the key
/// at once, and the tokens, taken in hold order, strictly increase across the failover.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_leader_killed_mid_run_loses_no_hold_and_tokens_keep_increasing() {
    crate::needs!(ZooKeeper);
    let mut ensemble = ZkEnsemble::start();
    let namespace = zk::fresh_namespace();
    let mut instances = Vec::new();
    for _ in 0..2 {
        let backend = zk::builder_on(&ensemble.hosts())
            .namespace(&namespace)
            // Room for the client to move to another server and the election to end.
            .session_timeout(Duration::from_secs(5))
            .build()
            .await
            .expect("backend on the ensemble");
        instances.push(backend);
    }
    let mut leader = None;
    let seen = support::failover::take_turns_across(&instances, || {
        let index = ensemble.leader().expect("a leader");
        ensemble.members[index].kill();
        leader = Some(index);
    })
    .await;
    eprintln!(
        "leader server.{} killed after {} holds; {} holds in all, {} failed acquisitions",
        leader.map_or(0, |i| i + 1),
        seen.at_kill,
        seen.holds,
        seen.failures
    );
}

/// Three servers, the follower a backend's session is on stopped (a minority, which
/// ZooKeeper survives): that backend moves its session to another server and takes and
/// releases every hold, and one built with the stopped server first in its connection
/// string builds and does the same.
#[test]
fn a_server_down_costs_no_call() {
    crate::needs!(ZooKeeper);
    let mut ensemble = ZkEnsemble::start();
    let namespace = zk::fresh_namespace();
    support::logged_on_this_thread("tower_lock=info", async |_| {
        // The client picks a server at random: built again until its session is on a
        // follower (two servers in three are).
        let mut running = None;
        for _ in 0..32 {
            let backend = zk::builder_on(&ensemble.hosts())
                .namespace(&namespace)
                .session_timeout(Duration::from_secs(5))
                .build()
                .await
                .expect("a backend on the ensemble");
            let leader = ensemble.leader().expect("a leader");
            let sid = format!("sid={:#x},", backend.session_id());
            let on = ensemble
                .members
                .iter()
                .position(|m| m.four("cons").is_some_and(|c| c.contains(&sid)));
            if let Some(on) = on.filter(|&on| on != leader) {
                running = Some((backend, on));
                break;
            }
        }
        let (running, down) = running.expect("a session on a follower in 32 builds");
        assert_eq!(
            support::failover::holds(&running, 4).await,
            Vec::<String>::new()
        );
        ensemble.members[down].kill();
        let failures = support::failover::holds(&running, 50).await;
        assert!(
            failures.is_empty(),
            "a backend that ran before: {failures:#?}"
        );
        let mut hosts: Vec<String> = ensemble.members.iter().map(ZkServer::hosts).collect();
        hosts.rotate_left(down);
        let fresh = zk::builder_on(&hosts.join(","))
            .namespace(&namespace)
            .build()
            .await
            .expect("builds with a server down");
        let failures = support::failover::holds(&fresh, 50).await;
        assert!(failures.is_empty(), "a backend built since: {failures:#?}");
    });
}

#[tokio::test]
async fn force_release_frees_the_key_and_its_holders_see_lost() {
    crate::needs!(ZooKeeper);
    let namespace = zk::fresh_namespace();
    let holder = zk::builder_on(&zk::shared().hosts())
        .namespace(&namespace)
        .session_timeout(Duration::from_secs(3))
        .build()
        .await
        .expect("backend");
    let operator = zk::backend_in(&namespace).await;
    // Two holds, renewed in one call: each is found gone on its own.
    let guard = holder.lock("k").try_once().await.expect("free");
    let kept = holder.lock("kept").try_once().await.expect("free");
    let freed = operator.force_release("k").await.expect("force-released");
    assert_eq!(freed.holders, 1);
    assert_eq!(freed.fencing_token, Some(guard.fencing_token()));
    assert!(operator.inspect("k").await.expect("inspect").is_free());
    tokio::time::timeout(HANG, guard.lost())
        .await
        .expect("the holder sees lost at its next renewal");
    assert!(
        !kept.is_lost(),
        "the other hold of the same renewal is kept"
    );
    let next = operator.lock("k").try_once().await.expect("free");
    assert!(next.fencing_token() > guard.fencing_token());
    kept.release().await.expect("released");
}

#[tokio::test]
async fn digest_auth_keeps_the_locks_nodes_to_the_services_identity() {
    crate::needs!(ZooKeeper);
    let namespace = zk::fresh_namespace();
    let with = |user: &str, password: &str| {
        zk::builder_on(&zk::shared().hosts())
            .namespace(&namespace)
            .digest(user, password)
    };
    let refused = with("app:x", "secret").build().await;
    assert!(
        matches!(refused, Err(BuildError::Setting { name: "digest", .. })),
        "{refused:?}"
    );
    let service = with("app", "secret").build().await.expect("backend");
    let guard = service.lock("order-1").try_once().await.expect("free");

    // Another instance of the service, configured alike, sees the hold.
    let twin = with("app", "secret").build().await.expect("backend");
    assert!(matches!(
        twin.lock("order-1").try_once().await,
        Err(LockError::Contended { .. })
    ));

    // A wrong password is another identity; so is no authentication at all: both are
    // refused at build, naming the right they lack.
    for other in [
        with("app", "wrong").build().await,
        zk::builder_on(&zk::shared().hosts())
            .namespace(&namespace)
            .build()
            .await,
    ] {
        let Err(error @ BuildError::Rights { .. }) = &other else {
            panic!("another identity is refused at build: {other:?}");
        };
        assert!(error.to_string().contains(&namespace), "{error}");
        assert!(error.to_string().contains("digest"), "{error}");
    }

    // Nor can a raw client of no identity read or delete the hold.
    let raw = zookeeper_client::Client::connect(&zk::shared().hosts())
        .await
        .expect("raw client");
    let lock = format!("/{namespace}/{{order-1}}");
    assert!(
        matches!(
            raw.get_children(&lock).await,
            Err(zookeeper_client::Error::NoAuth)
        ),
        "the lock's node is closed to others"
    );
    let admin = zookeeper_client::Client::connector()
        .with_auth("digest", b"app:secret")
        .connect(&zk::shared().hosts())
        .await
        .expect("authenticated client");
    let (holds, _) = admin.get_children(&lock).await.expect("the service lists");
    assert_eq!(holds.len(), 1, "{holds:?}");
    assert!(matches!(
        raw.delete(&format!("{lock}/{}", holds[0]), None).await,
        Err(zookeeper_client::Error::NoAuth)
    ));
    assert!(!guard.is_lost());
    guard.release().await.expect("released");
    twin.lock("order-1")
        .try_once()
        .await
        .expect("free after the release")
        .release()
        .await
        .expect("released");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn instances_take_the_lock_in_the_order_they_began_waiting() {
    crate::needs!(ZooKeeper);
    let namespace = zk::fresh_namespace();
    let holder = zk::backend_in(&namespace).await;
    let mut instances = Vec::new();
    for _ in 0..4 {
        instances.push(zk::backend_in(&namespace).await);
    }
    let observer = zookeeper_client::Client::connect(&zk::shared().hosts())
        .await
        .expect("observer");
    let observer = &observer;
    let namespace = &namespace;
    // Each waiting instance keeps one node in line behind the holder's.
    let in_line = |key: &'static str| async move {
        match observer
            .get_children(&format!("/{namespace}/{{{key}}}"))
            .await
        {
            Ok((nodes, _)) => nodes.len().saturating_sub(1),
            Err(zookeeper_client::Error::NoNode) => 0,
            Err(e) => panic!("the lock's nodes: {e}"),
        }
    };
    support::turns::instances_take_the_lock_in_the_order_they_began_waiting(
        holder, instances, in_line,
    )
    .await;
}

/// A waiting writer whose attempt was held up until its acquisition gave up puts its node
/// in line after the acquisition withdrew it. Once the attempt's reply is in, that node is
/// withdrawn: left there, it would keep the lock from every later holder for as long as
/// the session lives (a whole Jepsen run's key, behind a command timed out in an election).
#[tokio::test]
async fn a_waiting_node_put_after_its_acquisition_gave_up_is_withdrawn() {
    crate::needs!(ZooKeeper);
    let namespace = zk::fresh_namespace();
    let holder = zk::backend_in(&namespace).await;
    let held = holder.lock("k").try_once().await.expect("uncontended");
    let proxy = proxy_to(zk::shared()).await;
    let late = zk::builder_on(&proxy.addr().to_string())
        .namespace(&namespace)
        .command_timeout(Duration::from_millis(300))
        // Pings 10 s apart: what the proxy holds is the attempt.
        .session_timeout(Duration::from_secs(30))
        .build()
        .await
        .expect("backend through the proxy");
    let observer = zk::admin().await;
    let lock = format!("/{namespace}/{{k}}");
    let (_, before) = observer.get_children(&lock).await.expect("the lock's node");

    // The attempt waits in the proxy until the acquisition gives up.
    proxy.stall_requests();
    let gave_up = late.lock("k").wait(HANG).await;
    assert!(
        matches!(gave_up, Err(LockError::Backend { .. })),
        "{gave_up:?}"
    );
    assert!(proxy.held_requests() > 0, "the attempt waited in the proxy");
    proxy.resume();

    // Its node comes into the line (one change of the children), and must go (another),
    // leaving the holder's alone.
    loop {
        let (nodes, stat, changed) = observer
            .get_and_watch_children(&lock)
            .await
            .expect("the lock's node");
        if nodes.len() == 1 && stat.cversion >= before.cversion + 2 {
            break;
        }
        tokio::time::timeout(HANG, changed.changed())
            .await
            .unwrap_or_else(|_| panic!("the late node stays in line: {nodes:?}"));
    }
    held.release().await.expect("released");
    let next = zk::backend_in(&namespace).await;
    next.lock("k")
        .wait(HANG)
        .await
        .expect("free once its holder released it")
        .release()
        .await
        .expect("released");
}

/// A waiter that stops waiting withdraws its node from the line. A withdrawal whose
/// connection is lost on its way is sent again once the session is connected again: a node
/// left in line keeps the lock from every later holder for as long as the session lives.
#[tokio::test]
async fn a_withdrawal_whose_connection_was_lost_is_sent_again() {
    crate::needs!(ZooKeeper);
    let namespace = zk::fresh_namespace();
    let holder = zk::backend_in(&namespace).await;
    let held = holder.lock("k").try_once().await.expect("uncontended");
    let proxy = proxy_to(zk::shared()).await;
    let waiting = zk::builder_on(&proxy.addr().to_string())
        .namespace(&namespace)
        // Pings 10 s apart: what the proxy holds is the withdrawal.
        .session_timeout(Duration::from_secs(30))
        .build()
        .await
        .expect("backend through the proxy");
    let observer = zk::admin().await;
    let lock = format!("/{namespace}/{{k}}");
    let line = || async {
        let (nodes, _) = observer.get_children(&lock).await.expect("the lock's node");
        nodes.len()
    };
    let waits = waiting.clone();
    let waiter = tokio::spawn(async move { waits.lock("k").wait(HANG * 6).await.map(drop) });
    support::eventually("the waiter's node is in line", || async {
        line().await == 2
    })
    .await;

    // The withdrawal waits in the proxy, and its connection is cut under it.
    proxy.stall_requests();
    let held_back = proxy.held_requests();
    waiter.abort();
    assert!(waiter.await.is_err_and(|e| e.is_cancelled()), "cancelled");
    support::eventually("the withdrawal waits in the proxy", || async {
        proxy.held_requests() > held_back
    })
    .await;
    proxy.reject();
    support::eventually("the connection is cut", || async {
        proxy.open_connections() == 0
    })
    .await;
    proxy.resume();
    proxy.accept();

    support::eventually("the waiter's node leaves the line", || async {
        line().await == 1
    })
    .await;
    held.release().await.expect("released");
    drop(waiting);
}

/// A session the client gave up may still be kept by the servers: the client gives its
/// session up when it heard nothing for 7/5 of the session timeout, while the servers keep
/// it for as long as they hear from it (here: its pings and reconnections get through, the
/// answers do not), or a new leader counts its timeout from its own start. Its nodes (a
/// hold whose release never went out, a waiting node) then keep their locks from everyone.
/// The backend closes the session it replaces, which deletes them at once.
#[test]
fn a_session_the_client_gave_up_is_closed_at_the_servers() {
    crate::needs!(ZooKeeper);
    let namespace = zk::fresh_namespace();
    // A server of its own, whose log tells a closed session from an expired one.
    let server = ZkServer::start_logged();
    support::logged_on_this_thread("tower_lock=info", async |log| {
        let proxy = proxy_to(&server).await;
        let abandoning = zk::builder_on(&proxy.addr().to_string())
            .namespace(&namespace)
            .session_timeout(Duration::from_secs(2))
            .build()
            .await
            .expect("backend through the proxy");
        let held = abandoning.lock("k").try_once().await.expect("uncontended");
        let abandoned = format!("{:#x}", abandoning.session_id());
        // What the server logs is what this test reads.
        assert!(
            server.log().contains("Created server with tickTime"),
            "the server logs (slf4j-simple on its class path)"
        );

        proxy.stall_replies();
        let gave_up = format!("the session {abandoned} ended (Expired)");
        tokio::time::timeout(3 * HANG, log.until(&gave_up, 1))
            .await
            .expect("the client gives its session up");
        proxy.resume();

        let waiter = zk::builder_on(&server.hosts())
            .namespace(&namespace)
            .build()
            .await
            .expect("backend");
        waiter
            .lock("k")
            .wait(HANG)
            .await
            .expect("the given-up session's hold goes")
            .release()
            .await
            .expect("released");
        assert!(held.is_lost(), "the hold of the given-up session is lost");
        assert!(
            !server
                .log()
                .contains(&format!("Expiring session {abandoned}")),
            "the session was closed, not left to expire"
        );
        assert_ne!(format!("{:#x}", abandoning.session_id()), abandoned);
    });
}

/// A fault proxy on loopback in front of `server`.
async fn proxy_to(server: &ZkServer) -> support::proxy::FaultProxy {
    let upstream: std::net::SocketAddr = server.hosts().parse().expect("host:port");
    let listen = std::net::SocketAddr::from(([127, 0, 0, 1], 0));
    support::proxy::FaultProxy::start(listen, upstream).await
}

//! Semaphores: `lock(key).permits(n)` and the layer's `.permits(n)`. At most `n` holders
//! at once, each permit with its own owner, lease and token; 429 when all are taken on a
//! fail-fast route; a crashed holder's permit comes back after its lease. Every body runs
//! on Redis (three backends of one server), in memory, on the SQL stores, on etcd and on
//! ZooKeeper.

use crate::support;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::extract::Request;
use axum::routing::post;
use http::Method;
use support::child::{self, ChildProcess};
use support::{Gate, RedisServer, call};
use tower_lock::{LockBackend, LockError, LockLayer};

/// Generous bound on any wait that should end: catches hangs only.
const HANG: Duration = Duration::from_secs(10);
/// The url of the test's server, for the child process.
const URL: &str = "TOWER_LOCK_TEST_REDIS_URL";
/// The lease of the child's permit: short, so the test that outlives it stays short.
const CHILD_LEASE: Duration = Duration::from_secs(2);

// On etcd and ZooKeeper a permit lives under its backend's lease or session, whatever
// lease it asked for: the body of a permit whose own lease runs out does not apply.
for_each_store_and_consensus!(
    three_permits_let_at_most_three_of_thirty_requests_in_and_serve_them_all,
    fail_fast_with_every_permit_taken_answers_429_with_retry_after,
    a_second_acquisition_by_one_owner_reenters_its_permit,
    zero_permits_are_refused_and_take_nothing;
    not on etcd or zookeeper:
    each_permit_has_its_own_lease_and_token,
);

fn exports_key(_: &Request) -> Option<&'static str> {
    Some("exports")
}

/// A layer that locks every request on the key `exports`.
fn exports_layer<B: LockBackend>(b: &B) -> LockLayer<fn(&Request) -> Option<&'static str>> {
    LockLayer::new(
        b.clone(),
        exports_key as fn(&Request) -> Option<&'static str>,
    )
}

fn permits_taken(result: &Result<tower_lock::LockGuard, LockError>, n: u32) -> bool {
    matches!(result, Err(LockError::PermitsTaken { permits, .. }) if *permits == n)
}

async fn three_permits_let_at_most_three_of_thirty_requests_in_and_serve_them_all<
    B: LockBackend,
>(
    b: [B; 3],
) {
    let (gate, inside, most) = (
        Gate::default(),
        Arc::new(AtomicUsize::new(0)),
        Arc::new(AtomicUsize::new(0)),
    );
    let apps: Vec<Router> = b
        .iter()
        .map(|b| {
            let (gate, inside, most) = (gate.clone(), inside.clone(), most.clone());
            let export = move || {
                let (gate, inside, most) = (gate.clone(), inside.clone(), most.clone());
                async move {
                    // Measured inside the handler, under the permit.
                    let now = inside.fetch_add(1, Ordering::SeqCst) + 1;
                    most.fetch_max(now, Ordering::SeqCst);
                    gate.pass().await;
                    tokio::time::sleep(Duration::from_millis(2)).await;
                    inside.fetch_sub(1, Ordering::SeqCst);
                }
            };
            Router::new()
                .route("/export", post(export))
                .route_layer(exports_layer(b).permits(3).wait(Duration::from_secs(60)))
        })
        .collect();
    let requests: Vec<_> = (0..30)
        .map(|i| {
            let app = apps[i % apps.len()].clone();
            tokio::spawn(async move {
                tokio::time::timeout(Duration::from_secs(60), call(&app, Method::POST, "/export"))
                    .await
                    .expect("served within a minute")
                    .status
            })
        })
        .collect();
    // Three get in at once, while the other 27 wait for a permit.
    gate.wait_inside(3).await;
    gate.open();
    for request in requests {
        assert_eq!(
            request.await.expect("no panic"),
            200,
            "every request is served"
        );
    }
    assert_eq!(
        most.load(Ordering::SeqCst),
        3,
        "never more than 3 in the handler"
    );
}

async fn fail_fast_with_every_permit_taken_answers_429_with_retry_after<B: LockBackend>(b: [B; 3]) {
    let app = Router::new()
        .route("/export", post(|| async { "exported" }))
        .route_layer(exports_layer(&b[0]).permits(3).fail_fast());
    let mut held = Vec::new();
    for b in &b {
        held.push(
            b.lock("exports")
                .permits(3)
                .try_once()
                .await
                .expect("a permit"),
        );
    }
    let full = call(&app, Method::POST, "/export").await;
    assert!(full.problem(429).contains("3 permits"), "{full:?}");
    let retry_after: u64 = full.headers[http::header::RETRY_AFTER]
        .to_str()
        .expect("text")
        .parse()
        .expect("seconds");
    assert!(retry_after >= 1, "{full:?}");
    let problem: serde_json::Value = serde_json::from_str(&full.body).expect("problem+json");
    assert!(
        problem["type"]
            .as_str()
            .is_some_and(|t| t.ends_with("PermitsTaken")),
        "{problem}"
    );
    held.pop()
        .expect("three")
        .release()
        .await
        .expect("released");
    assert_eq!(call(&app, Method::POST, "/export").await.status, 200);
    for guard in held {
        guard.release().await.expect("released");
    }
}

async fn a_second_acquisition_by_one_owner_reenters_its_permit<B: LockBackend>(b: [B; 3]) {
    let outer = b[0]
        .lock("exports")
        .permits(2)
        .try_once()
        .await
        .expect("free");
    let inner = b[0]
        .lock("exports")
        .permits(2)
        .reentrant(outer.held())
        .try_once()
        .await
        .expect("re-entered");
    assert_eq!(
        inner.fencing_token(),
        outer.fencing_token(),
        "the same permit"
    );
    // The owner holds one permit, not two: another owner gets the second.
    let other = b[1]
        .lock("exports")
        .permits(2)
        .try_once()
        .await
        .expect("the second permit");
    assert!(permits_taken(
        &b[2].lock("exports").permits(2).try_once().await,
        2
    ));
    inner.release().await.expect("released");
    let still = b[2].lock("exports").permits(2).try_once().await;
    assert!(
        permits_taken(&still, 2),
        "the outer hold keeps the permit: {still:?}"
    );
    outer.release().await.expect("released");
    let freed = b[2]
        .lock("exports")
        .permits(2)
        .try_once()
        .await
        .expect("freed by the last release");
    freed.release().await.expect("released");
    other.release().await.expect("released");
}

async fn each_permit_has_its_own_lease_and_token<B: LockBackend>(b: [B; 3]) {
    let lapsing = b[0]
        .lock("exports")
        .permits(2)
        .lease(Duration::from_millis(300))
        .without_watchdog()
        .try_once()
        .await
        .expect("free");
    // Renewed every third of its lease: a second of room for a renewal delayed on a loaded
    // machine.
    let renewed = b[1]
        .lock("exports")
        .permits(2)
        .lease(Duration::from_millis(1500))
        .try_once()
        .await
        .expect("the second permit");
    assert!(
        renewed.fencing_token() > lapsing.fencing_token(),
        "a token per permit"
    );
    assert!(permits_taken(
        &b[2].lock("exports").permits(2).try_once().await,
        2
    ));
    tokio::time::timeout(HANG, lapsing.lost())
        .await
        .expect("the unrenewed permit lapses");
    // Its permit is free again (at the latest when the store has expired it); the renewed
    // one is kept.
    let next = b[2]
        .lock("exports")
        .permits(2)
        .wait(HANG)
        .await
        .expect("the lapsed permit");
    assert!(next.fencing_token() > renewed.fencing_token());
    assert!(!renewed.is_lost(), "the other permit is kept");
    assert!(matches!(
        lapsing.release().await,
        Err(LockError::Lost { .. })
    ));
    renewed.release().await.expect("still held");
    next.release().await.expect("still held");
}

async fn zero_permits_are_refused_and_take_nothing<B: LockBackend>(b: [B; 3]) {
    let refused = b[0].lock("exports").permits(0).try_once().await;
    assert!(
        matches!(&refused, Err(LockError::ZeroPermits { key }) if key == "exports"),
        "{refused:?}"
    );
    let waited = tokio::time::timeout(HANG, b[0].lock("exports").permits(0).wait(Duration::MAX))
        .await
        .expect("refused at once");
    assert!(
        matches!(waited, Err(LockError::ZeroPermits { .. })),
        "{waited:?}"
    );
    // Nothing taken: the only permit of a semaphore of one, and the key's lock, are free.
    let permit = b[1]
        .lock("exports")
        .permits(1)
        .try_once()
        .await
        .expect("free");
    let lock = b[1].lock("exports").try_once().await.expect("free");
    permit.release().await.expect("released");
    lock.release().await.expect("released");

    let layer = exports_layer(&b[2]);
    let built = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| layer.permits(0)));
    let panic = built.expect_err("a layer of zero permits is refused when built");
    let message = panic
        .downcast_ref::<&str>()
        .map(|m| m.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned());
    assert!(
        message.as_deref().is_some_and(|m| m.contains("permits(0)")),
        "{message:?}"
    );
}

#[tokio::test]
#[ignore = "entry point of the child process that the crash test spawns"]
async fn child_process() {
    match child::role().as_deref() {
        None => {}
        Some("permit-holder") => {
            let backend = support::backend(&child::setting(URL)).await;
            let guard = backend
                .lock("exports")
                .permits(3)
                .lease(CHILD_LEASE)
                .try_once()
                .await
                .expect("a free permit");
            child::report(&format!("held {}", guard.fencing_token()));
            std::future::pending::<()>().await;
        }
        Some(other) => panic!("unknown child role {other}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_holder_process_gives_its_permit_back_after_its_lease_and_no_other_is_lost() {
    crate::needs!(Redis);
    let server = RedisServer::start();
    let backend = server.backend().await;
    let mut mine = Vec::new();
    for _ in 0..2 {
        let guard = backend
            .lock("exports")
            .permits(3)
            .lease(CHILD_LEASE)
            .try_once()
            .await;
        mine.push(guard.expect("a free permit"));
    }
    let mut holder = ChildProcess::spawn(
        "semaphore::child_process",
        "permit-holder",
        &[(URL, server.url())],
    );
    let report = holder
        .next_report()
        .await
        .expect("the child reports its permit");
    assert!(report.starts_with("held "), "{report}");
    holder.kill().await;

    // The dead holder's permit still counts until its lease ends...
    assert!(permits_taken(
        &backend.lock("exports").permits(3).try_once().await,
        3
    ));
    // ...and then comes back.
    let back = backend
        .lock("exports")
        .permits(3)
        .wait(HANG)
        .await
        .expect("the crashed permit");
    // The two permits held meanwhile (renewed past their lease) are kept, and nothing else
    // is free: three permits, three holders.
    assert!(mine.iter().all(|g| !g.is_lost()));
    assert!(permits_taken(
        &backend.lock("exports").permits(3).try_once().await,
        3
    ));
    for guard in mine {
        guard.release().await.expect("still held");
    }
    back.release().await.expect("still held");
    // No permit leaked: all three can be taken again.
    let mut again = Vec::new();
    for _ in 0..3 {
        again.push(
            backend
                .lock("exports")
                .permits(3)
                .try_once()
                .await
                .expect("a free permit"),
        );
    }
}

/// Permit waiters of one process wait behind one of them (no herd): with both permits
/// held elsewhere, ten waiting tasks of one backend are one contender in Redis and nine
/// tasks in line in the process; a release wakes that one, which takes the permit, and the
/// next in line tries once. Before, every waiting task tried again after every release.
#[tokio::test]
async fn permit_waiters_of_one_process_wait_behind_one_contender() {
    crate::needs!(Redis);
    let server = RedisServer::start();
    let (holders, waiters) = (server.backend().await, server.backend().await);
    let permit = |b: &tower_lock::RedisBackend| b.lock("exports").permits(2);
    let mut held = Vec::new();
    for _ in 0..2 {
        held.push(permit(&holders).try_once().await.expect("a free permit"));
    }
    let (got, mut served) = tokio::sync::mpsc::unbounded_channel();
    for _ in 0..10 {
        let (waiters, got) = (waiters.clone(), got.clone());
        tokio::spawn(async move {
            let guard = permit(&waiters).wait(HANG).await.expect("a permit in time");
            let _ = got.send(guard);
        });
    }
    support::queued(&waiters, 9).await;
    let scripts = ["evalsha", "eval"];
    let before = server.command_calls(&scripts).await;
    held.pop().expect("held").release().await.expect("released");
    let first = served
        .recv()
        .await
        .expect("the contender takes the freed permit");
    // The next task in line goes through and tries once (refused: both permits held).
    support::queued(&waiters, 8).await;
    let calls = server.command_calls(&scripts).await - before;
    assert!(
        calls <= 3,
        "{calls} scripts: the release, the contender's attempt, and at most one more"
    );
    // Every task is served in the end, one permit at a time.
    drop(first);
    for guard in held {
        drop(guard);
    }
    for _ in 0..9 {
        drop(served.recv().await.expect("served"));
    }
}

//! An instance killed with -9 while its handler runs: a child process of this binary.

use std::time::Duration;

use axum::Router;
use axum::routing::post;
use tower_lock::IdempotencyLayer;

use super::support::child::{self, ChildProcess};
use super::support::{self, RedisServer, lock_key};
use super::{Payments, app, payment, scoped, send};

/// Settings passed to the child instance.
const URL: &str = "TOWER_LOCK_TEST_REDIS_URL";
/// The lease of the child's lock: how long after its death the retry runs.
const CHILD_LEASE: Duration = Duration::from_secs(2);

#[tokio::test]
#[ignore = "entry point of the child instance that the crash test spawns"]
async fn child_process() {
    match child::role().as_deref() {
        None => {}
        Some("instance") => serve_until_killed().await,
        Some(other) => panic!("unknown child role {other}"),
    }
}

/// An instance whose handler reports that it runs, then never returns.
async fn serve_until_killed() {
    let backend = support::backend(&child::setting(URL)).await;
    let app = Router::new()
        .route(
            "/payments",
            post(|| async {
                child::report("charging");
                std::future::pending::<&str>().await
            }),
        )
        .route_layer(IdempotencyLayer::new(backend).lease(CHILD_LEASE));
    let request = payment("/payments", Some("k1"), "", "{}");
    // Never answers: the parent kills this process while the handler runs.
    let _ = tower::ServiceExt::oneshot(app, request).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_killed_mid_handler_leaves_no_record_and_the_retry_runs_once_after_the_lease() {
    let server = RedisServer::start();
    let mut instance =
        ChildProcess::spawn("crash::child_process", "instance", &[(URL, server.url())]);
    assert_eq!(instance.next_report().await.as_deref(), Some("charging"));
    instance.kill().await;

    let lock = lock_key(&scoped("", "k1"));
    assert!(
        !server.exists(&format!("{lock}:record")).await,
        "a dead instance stores nothing"
    );
    let payments = Payments::default();
    let app = app(
        IdempotencyLayer::new(server.backend().await).wait_for_first(Duration::from_secs(20)),
        &payments,
    );
    // Waits for the dead instance's lease to run out, then runs.
    let retry = send(&app, payment("/payments", Some("k1"), "", "{}")).await;
    assert_eq!(
        (retry.status, retry.body.as_str()),
        (201, "charged 1 for {}")
    );
    let again = send(&app, payment("/payments", Some("k1"), "", "{}")).await;
    assert_eq!(again.headers["idempotency-replayed"], "true");
    assert_eq!(payments.runs(), 1);
}

//! An instance killed with -9 while its handler runs: a child process of this binary, on
//! Redis, etcd and ZooKeeper.

use std::time::Duration;

use axum::Router;
use axum::routing::post;
use tower_lock::IdempotencyLayer;
use tower_lock::idempotency::IdempotencyBackend;

use super::support::child::{self, ChildProcess};
#[cfg(feature = "etcd")]
use super::support::etcd;
use super::support::{self, RedisServer, lock_key, zookeeper};
use super::{Payments, app, payment, scoped, send};

/// Settings passed to the child instance: its store, the store's address, its namespace.
const STORE: &str = "TOWER_LOCK_TEST_STORE";
const URL: &str = "TOWER_LOCK_TEST_REDIS_URL";
const NAMESPACE: &str = "TOWER_LOCK_TEST_NAMESPACE";
/// The lease of the child's lock: how long after its death the retry runs (on etcd the
/// backend's lease, on ZooKeeper its session's timeout).
const CHILD_LEASE: Duration = Duration::from_secs(2);

#[tokio::test]
#[ignore = "entry point of the child instance that the crash test spawns"]
async fn child_process() {
    match child::role().as_deref() {
        None => {}
        Some("instance") => match child::setting(STORE).as_str() {
            "redis" => serve_until_killed(support::backend(&child::setting(URL)).await).await,
            #[cfg(feature = "etcd")]
            "etcd" => {
                let endpoints = [child::setting(URL)];
                let builder = etcd::builder_on(&endpoints).namespace(child::setting(NAMESPACE));
                serve_until_killed(builder.lease_ttl(CHILD_LEASE).build().await.expect("etcd"))
                    .await;
            }
            "zookeeper" => {
                let builder = zookeeper::builder_on(&child::setting(URL))
                    .namespace(child::setting(NAMESPACE))
                    .session_timeout(CHILD_LEASE);
                serve_until_killed(builder.build().await.expect("ZooKeeper")).await;
            }
            other => panic!("unknown store {other}"),
        },
        Some(other) => panic!("unknown child role {other}"),
    }
}

/// An instance on `backend` whose handler reports that it runs, then never returns.
async fn serve_until_killed<B: IdempotencyBackend>(backend: B) {
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

/// Kills an instance on `store` at `url` in `namespace` mid-handler; `stored` then says
/// whether the store holds a record; the retry runs on `backend`, once the dead
/// instance's lock is gone.
async fn killed_mid_handler<B: IdempotencyBackend>(
    store: &str,
    url: String,
    namespace: &str,
    stored: impl AsyncFnOnce() -> bool,
    backend: B,
) {
    let settings = [
        (STORE, store.to_owned()),
        (URL, url),
        (NAMESPACE, namespace.to_owned()),
    ];
    let mut instance =
        ChildProcess::spawn("idempotency::crash::child_process", "instance", &settings);
    assert_eq!(instance.next_report().await.as_deref(), Some("charging"));
    instance.kill().await;
    assert!(!stored().await, "a dead instance stores nothing");
    let payments = Payments::default();
    let app = app(
        IdempotencyLayer::new(backend).wait_for_first(Duration::from_secs(20)),
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_killed_mid_handler_leaves_no_record_and_the_retry_runs_once_after_the_lease() {
    crate::needs!(Redis);
    let server = RedisServer::start();
    let record = format!("{}:record", lock_key(&scoped("", "k1")));
    let stored = async || server.exists(&record).await;
    let backend = server.backend().await;
    killed_mid_handler("redis", server.url(), "", stored, backend).await;
}

#[cfg(feature = "etcd")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_etcd_instance_killed_mid_handler_leaves_no_record_and_the_retry_runs_once() {
    crate::needs!(Etcd);
    let namespace = etcd::fresh_namespace();
    let dir = format!("{}}}", scoped("", "k1"));
    let stored = async || {
        let keys = etcd::keys_in(&namespace, &dir).await;
        keys.iter().any(|k| k.ends_with("/d"))
    };
    let backend = etcd::backend_in(&namespace).await;
    let url = etcd::shared().endpoint();
    killed_mid_handler("etcd", url, &namespace, stored, backend).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_zookeeper_instance_killed_mid_handler_leaves_no_record_and_the_retry_runs_once() {
    crate::needs!(ZooKeeper);
    let namespace = zookeeper::fresh_namespace();
    let stored = async || {
        let client = zookeeper::admin().await;
        let buckets = client.list_children(&format!("/{namespace}/records")).await;
        !buckets.expect("the records' node").is_empty()
    };
    let backend = zookeeper::backend_in(&namespace).await;
    let url = zookeeper::shared().hosts();
    killed_mid_handler("zookeeper", url, &namespace, stored, backend).await;
}

//! Records on ZooKeeper: a persistent node in a bucket of the namespace's `records` node
//! (not under the lock's container), its data the retention and the record, stored only
//! while the hold node that ran the handler is there, deleted by the backend's janitor
//! once expired, and refused with an error naming `jute.maxbuffer` when ZooKeeper would not
//! take it. Each test in a namespace of its own on the binary's shared ZooKeeper.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::routing::post;
use tower_lock::{IdempotencyLayer, ZooKeeperBackend};
use zookeeper_client::Client;

use super::support::eventually;
use super::support::zookeeper::{self, admin};
use super::{Payments, app, pay_with, scoped, tenant, twice_too_large_to_store};

/// A backend in a namespace of its own, and the namespace.
async fn backend() -> (ZooKeeperBackend, String) {
    let namespace = zookeeper::fresh_namespace();
    (zookeeper::backend_in(&namespace).await, namespace)
}

/// The paths of the record nodes in `namespace`, in every bucket.
async fn records(client: &Client, namespace: &str) -> Vec<String> {
    let root = format!("/{namespace}/records");
    let mut found = Vec::new();
    for bucket in client.list_children(&root).await.expect("buckets") {
        let bucket = format!("{root}/{bucket}");
        for name in client.list_children(&bucket).await.expect("records") {
            found.push(format!("{bucket}/{name}"));
        }
    }
    found
}

/// The lock node of tenant acme's idempotency key `key` in `namespace`.
fn lock(namespace: &str, key: &str) -> String {
    format!("/{namespace}/{{{}}}", scoped("acme", key))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_zookeeper_record_is_a_persistent_node_beside_the_locks_with_its_retention() {
    crate::needs!(ZooKeeper);
    let (backend, namespace) = backend().await;
    let payments = Payments::default();
    let layer = IdempotencyLayer::new(backend).retention(Duration::from_secs(600));
    let app = app(layer, &payments);
    assert_eq!(pay_with(&app, "k1", "{}").await.body, "charged 1 for {}");
    let client = admin().await;
    let found = records(&client, &namespace).await;
    let [record] = found.as_slice() else {
        panic!("one record: {found:?}");
    };
    let name = format!("{{{}}}", scoped("acme", "k1"));
    assert!(record.ends_with(&format!("/{name}")), "{record}");
    let (data, stat) = client.get_data(record).await.expect("the record");
    assert_eq!(
        stat.ephemeral_owner, 0,
        "persistent: it outlives the session"
    );
    assert_eq!(data[..8], 600_000_u64.to_be_bytes(), "its retention, in ms");
    // Nothing of it under the lock's container, which ZooKeeper may then delete.
    let under_lock = client.list_children(&lock(&namespace, "k1")).await;
    assert!(under_lock.is_err() || under_lock.is_ok_and(|c| c.is_empty()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_zookeeper_record_is_deleted_by_the_janitor_and_the_key_runs_again() {
    crate::needs!(ZooKeeper);
    let (backend, namespace) = backend().await;
    let payments = Payments::default();
    let layer = IdempotencyLayer::new(backend).retention(Duration::from_millis(1));
    let app = app(layer, &payments);
    assert_eq!(pay_with(&app, "k1", "{}").await.status, 201);
    let client = admin().await;
    assert_eq!(records(&client, &namespace).await.len(), 1);
    // Nothing reads the record meanwhile: only the janitor deletes it.
    eventually("the janitor deletes the expired record", || async {
        records(&client, &namespace).await.is_empty()
    })
    .await;
    assert_eq!(pay_with(&app, "k1", "{}").await.body, "charged 2 for {}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_zookeeper_record_is_refused_when_the_hold_node_that_ran_the_handler_is_gone() {
    crate::needs!(ZooKeeper);
    let (backend, namespace) = backend().await;
    // The handler deletes its own hold node (the only node under the lock's), unannounced.
    let lock = lock(&namespace, "k1");
    let runs = Arc::new(AtomicUsize::new(0));
    let pay = {
        let runs = runs.clone();
        move || async move {
            let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
            let client = admin().await;
            let holds = client.list_children(&lock).await.expect("the hold");
            for hold in holds {
                client
                    .delete(&format!("{lock}/{hold}"), None)
                    .await
                    .expect("delete");
            }
            format!("charged {n}")
        }
    };
    let app = Router::new()
        .route("/payments", post(pay))
        .route_layer(IdempotencyLayer::new(backend).scope(tenant));
    // The handler's answer, or 503 if the backend's watchdog saw the hold go first (its
    // renewals come every sixth of the test server's short session timeout): either way
    // nothing is stored, by the store call's check or because the request was dropped.
    let first = pay_with(&app, "k1", "{}").await;
    assert!(
        first.body == "charged 1" || first.status == 503,
        "{}: {}",
        first.status,
        first.body
    );
    let client = admin().await;
    assert_eq!(records(&client, &namespace).await, Vec::<String>::new());
    let retry = pay_with(&app, "k1", "{}").await;
    assert_eq!(retry.body, "charged 2");
    assert!(retry.headers.get("idempotency-replayed").is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_over_zookeepers_request_limit_is_not_stored_and_the_warning_names_it() {
    crate::needs!(ZooKeeper);
    let (backend, namespace) = backend().await;
    twice_too_large_to_store(backend, "k1", 1_100_000, "jute.maxbuffer").await;
    let client = admin().await;
    assert_eq!(records(&client, &namespace).await, Vec::<String>::new());
}

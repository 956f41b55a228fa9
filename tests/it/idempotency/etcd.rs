//! Records on etcd: a key in the lock's directory on a lease of its own (its retention, so
//! etcd deletes it), stored only while the hold that ran the handler is there, and refused
//! with an error naming etcd's request limit when etcd would not take it. Each test in a
//! namespace of its own on the binary's shared etcd.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::routing::post;
use tower_lock::{EtcdBackend, IdempotencyLayer};

use super::support::etcd::{self, admin, keys_in, keys_under};
use super::support::eventually;
use super::{Payments, app, pay_with, scoped, tenant, twice_too_large_to_store};

/// A backend in a namespace of its own, with a lease so long that its watchdog renews
/// nothing while a test runs (a hold deleted by hand stays unnoticed by it).
async fn backend() -> (EtcdBackend, String) {
    let namespace = etcd::fresh_namespace();
    let backend = etcd::builder(&namespace)
        .lease_ttl(Duration::from_secs(900))
        .build()
        .await
        .expect("backend connects to the test etcd");
    (backend, namespace)
}

/// The lock directory of tenant acme's idempotency key `key` in `namespace`.
fn dir(namespace: &str, key: &str) -> String {
    format!("{namespace}:{{{}}}", scoped("acme", key))
}

/// The keys in that directory.
async fn keys(namespace: &str, key: &str) -> Vec<String> {
    keys_in(namespace, &format!("{}}}", scoped("acme", key))).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_etcd_record_sits_in_the_lock_directory_on_a_lease_of_its_retention() {
    crate::needs!(Etcd);
    let (backend, namespace) = backend().await;
    let payments = Payments::default();
    let retention = Duration::from_millis(600_001);
    let layer = IdempotencyLayer::new(backend.clone()).retention(retention);
    let app = app(layer, &payments);
    assert_eq!(pay_with(&app, "k1", "{}").await.status, 201);
    let (dir, record) = (
        dir(&namespace, "k1"),
        format!("{}/d", dir(&namespace, "k1")),
    );
    // The record, and the fence record every lock leaves under its backend's lease; the
    // hold is gone.
    assert_eq!(
        keys(&namespace, "k1").await,
        [record.clone(), format!("{dir}/f")]
    );
    let stored = keys_under(record).await;
    let lease = stored.first().expect("the record").lease();
    assert_ne!(lease, backend.lease_id(), "a lease of its own");
    let left = admin()
        .await
        .lease_time_to_live(lease, None)
        .await
        .expect("time to live");
    assert_eq!(
        left.granted_ttl(),
        601,
        "the retention rounded up to whole seconds"
    );
    assert!(left.ttl() > 0 && left.ttl() <= 601, "TTL {}", left.ttl());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_etcd_record_is_deleted_with_its_lease_and_the_key_runs_again() {
    crate::needs!(Etcd);
    let (backend, namespace) = backend().await;
    let payments = Payments::default();
    let layer = IdempotencyLayer::new(backend).retention(Duration::from_millis(1));
    let app = app(layer, &payments);
    assert_eq!(pay_with(&app, "k1", "{}").await.status, 201);
    let record = format!("{}/d", dir(&namespace, "k1"));
    assert!(keys(&namespace, "k1").await.contains(&record));
    eventually("etcd deletes the record with its lease", || async {
        !keys(&namespace, "k1").await.contains(&record)
    })
    .await;
    assert_eq!(pay_with(&app, "k1", "{}").await.body, "charged 2 for {}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_etcd_record_is_refused_when_the_hold_that_ran_the_handler_is_gone() {
    crate::needs!(Etcd);
    let (backend, namespace) = backend().await;
    // The handler deletes its own hold's key, unannounced: the backend's watchdog hears of
    // it at its next renewal, minutes later. The store call's compare finds it gone.
    let hold = format!("{}/h{:016x}", dir(&namespace, "k1"), backend.lease_id());
    let runs = Arc::new(AtomicUsize::new(0));
    let pay = {
        let runs = runs.clone();
        move || async move {
            let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
            admin().await.delete(hold, None).await.expect("delete");
            format!("charged {n}")
        }
    };
    let app = Router::new()
        .route("/payments", post(pay))
        .route_layer(IdempotencyLayer::new(backend).scope(tenant));
    assert_eq!(pay_with(&app, "k1", "{}").await.body, "charged 1");
    let fence = format!("{}/f", dir(&namespace, "k1"));
    assert_eq!(keys(&namespace, "k1").await, [fence], "nothing stored");
    let retry = pay_with(&app, "k1", "{}").await;
    assert_eq!(retry.body, "charged 2");
    assert!(retry.headers.get("idempotency-replayed").is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_over_etcds_request_limit_is_not_stored_and_the_warning_names_the_limit() {
    crate::needs!(Etcd);
    let (backend, namespace) = backend().await;
    // Both over etcd's --max-request-bytes (1.5 MiB), the second over its gRPC message
    // limit too (that plus 512 KiB).
    for size in [1_800_000, 3_000_000] {
        let key = format!("k{size}");
        twice_too_large_to_store(backend.clone(), &key, size, "--max-request-bytes").await;
        let fence = format!("{}/f", dir(&namespace, &key));
        assert_eq!(keys(&namespace, &key).await, [fence]);
    }
}

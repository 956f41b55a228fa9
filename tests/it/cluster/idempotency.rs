//! `IdempotencyLayer` on a cluster: each record lives on the shard of its lock (one hash
//! slot), stored and replayed there by the record script and its reads.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use axum::Router;
use axum::routing::post;
use tower_lock::IdempotencyLayer;

use super::support::cluster::Cluster;
use super::support::{lock_key, oneshot};

pub async fn records_live_on_the_shard_of_their_lock_and_replay(cluster: &Cluster) {
    let runs = Arc::new(AtomicUsize::new(0));
    let mut apps = Vec::new();
    for _ in 0..2 {
        let runs = runs.clone();
        let charge = post(move || async move {
            format!("charged {}", runs.fetch_add(1, Ordering::SeqCst) + 1)
        });
        let layer = IdempotencyLayer::new(cluster.backend().await);
        apps.push(Router::new().route("/pay", charge).route_layer(layer));
    }
    let pay = |key: &str| {
        http::Request::post("/pay")
            .header("idempotency-key", key)
            .body(axum::body::Body::empty())
            .expect("request")
    };
    // The lock the layer takes for a key of the default (empty) scope.
    let lock = |key: &str| lock_key(&format!("idempotency:0::{key}"));
    for (n, port) in cluster.primaries().into_iter().enumerate() {
        let key = (0..10_000)
            .map(|i| format!("pay{i}"))
            .find(|k| cluster.primary_of(&lock(k)) == port)
            .expect("a key on every shard");
        let first = oneshot(&apps[0], pay(&key)).await;
        assert_eq!(first.body, format!("charged {}", n + 1));
        assert!(cluster.exists_on(port, &format!("{}:record", lock(&key))));
        let replay = oneshot(&apps[1], pay(&key)).await;
        assert_eq!(replay.body, first.body);
        assert_eq!(replay.headers["idempotency-replayed"], "true");
    }
    assert_eq!(runs.load(Ordering::SeqCst), 3, "one run per key");
}

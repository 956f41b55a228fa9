//! Idempotency records on the quorum: stored on every master, read from all of them, and
//! checked on every master by the acquisition, so that a record outlives a minority of
//! masters and one master's copy ends an acquisition as recorded.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::routing::post;
use tower_lock::{IdempotencyLayer, RedisBackend};

use crate::support::{self, Reply, quorum};

/// Generous bound on anything that should happen soon: catches hangs only.
const HANG: Duration = Duration::from_secs(20);

/// Charges once per run.
async fn charge(State(runs): State<Arc<AtomicUsize>>) -> String {
    format!("charged {}", runs.fetch_add(1, Ordering::SeqCst) + 1)
}

fn app(backend: RedisBackend, runs: &Arc<AtomicUsize>) -> Router {
    Router::new()
        .route("/pay", post(charge))
        .route_layer(IdempotencyLayer::new(backend).wait_for_first(HANG))
        .with_state(runs.clone())
}

async fn pay(app: &Router, key: &str) -> Reply {
    let request = http::Request::post("/pay")
        .header("idempotency-key", key)
        .body(axum::body::Body::empty())
        .expect("request");
    support::oneshot(app, request).await
}

/// The record key of idempotency key `key` (no scope) on `backend`'s masters.
fn record_key(backend: &RedisBackend, key: &str) -> String {
    format!("{}:{{idempotency:0::{key}}}:record", backend.namespace())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_outlives_the_first_master_and_another_killed_and_the_retry_replays() {
    crate::needs!(Redis);
    let quorum = quorum::shared();
    let _turn = quorum.exclusive().await;
    let backends = quorum.backends(2).await;
    let runs = Arc::default();
    let apps: Vec<Router> = backends.into_iter().map(|b| app(b, &runs)).collect();
    let first = pay(&apps[0], "k1").await;
    assert_eq!((first.status, first.body.as_str()), (200, "charged 1"));
    // The first master (where a quorum kept records before) and one more: a majority is
    // left, and the record with it.
    quorum.kill(0);
    quorum.kill(1);
    let retry = pay(&apps[1], "k1").await;
    assert_eq!((retry.status, retry.body.as_str()), (200, "charged 1"));
    assert_eq!(retry.headers["idempotency-replayed"], "true");
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the handler ran once");
    quorum.restart(0);
    quorum.restart(1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_on_one_master_ends_a_waiting_acquisition_as_recorded() {
    crate::needs!(Redis);
    let quorum = quorum::shared();
    let _turn = quorum.shared_turn().await;
    let backends = quorum.backends(2).await;
    let runs = Arc::default();
    let app = app(backends[0].clone(), &runs);
    // A record for k1's request: k0's, of the same path and body.
    assert_eq!(pay(&app, "k0").await.body, "charged 1");
    let held = backends[1]
        .lock("idempotency:0::k1")
        .wait(HANG)
        .await
        .expect("k1 held by another instance");
    let request = tokio::spawn({
        let app = app.clone();
        async move { pay(&app, "k1").await }
    });
    // Past its lookup (which found nothing) and its first attempt: it waits for a release.
    support::eventually("the request waits for the lock", || async {
        backends[0].stats().channels_with_waiters == 1
    })
    .await;
    // The record appears on one master only (the others lost it, say): the four others
    // grant, the fifth says recorded, and the acquisition ends as recorded.
    let mut last = redis::Client::open(quorum.urls()[4].as_str())
        .expect("url")
        .get_multiplexed_async_connection()
        .await
        .expect("the last master");
    let record: Vec<u8> = redis::cmd("GET")
        .arg(record_key(&backends[0], "k0"))
        .query_async(&mut last)
        .await
        .expect("k0's record");
    for (i, url) in quorum.urls().iter().enumerate().take(4) {
        let mut master = redis::Client::open(url.as_str())
            .expect("url")
            .get_multiplexed_async_connection()
            .await
            .expect("master");
        let deleted: i64 = redis::cmd("DEL")
            .arg(record_key(&backends[0], "k0"))
            .query_async(&mut master)
            .await
            .expect("DEL");
        assert_eq!(deleted, 1, "k0's record was stored on master {i}");
    }
    let () = redis::cmd("SET")
        .arg(record_key(&backends[0], "k1"))
        .arg(record)
        .query_async(&mut last)
        .await
        .expect("k1's record");
    held.release().await.expect("released");
    let reply = tokio::time::timeout(HANG, request)
        .await
        .expect("answered")
        .expect("request");
    assert_eq!((reply.status, reply.body.as_str()), (200, "charged 1"));
    assert_eq!(reply.headers["idempotency-replayed"], "true");
    assert_eq!(
        runs.load(Ordering::SeqCst),
        1,
        "the handler ran for k0 only"
    );
    // Nobody kept k1's lock: the holds the four masters granted were given back.
    let lock = backends[1]
        .inspect("idempotency:0::k1")
        .await
        .expect("inspect");
    assert!(lock.is_free(), "{lock:?}");
}

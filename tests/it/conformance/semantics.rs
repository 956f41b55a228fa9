//! The semantics every store must keep on one instance (a route's status codes, re-entry,
//! tokens, leases, the local queue), written once and run on every store: a difference
//! between two stores shows up as a failing test. Each body gets three instances of its
//! store and uses the first.

use crate::support;

use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::Request;
use axum::routing;
use http::StatusCode;
use tower::ServiceExt;
use tower_lock::{HeldLock, LockBackend, LockError, LockLayer};

/// Generous bound on anything that should happen at once: catches hangs only.
const HANG: Duration = Duration::from_secs(10);

for_each_store_and_consensus!(
    fail_fast_route_answers_409_while_another_owner_holds_the_key,
    waiting_route_is_served_once_the_holder_releases,
    waiting_route_times_out_with_503_and_retry_after,
    nested_layers_reenter_under_one_owner,
    fencing_tokens_strictly_increase_per_key,
    handler_panic_releases_the_lock,
    empty_and_oversized_keys_are_400_and_lock_nothing,
    reentry_counts_up_and_the_last_release_frees_the_key,
    renewed_hold_outlives_its_lease,
    local_queue_bound_sheds_with_queue_full,
    waiters_are_served_in_arrival_order,
    a_second_acquisition_by_the_slot_owner_keeps_later_waiters_queued;
    // A hold on etcd or ZooKeeper lives under its backend's lease or session, renewed for
    // every hold of it: no hold runs out on its own lease there.
    not on etcd or zookeeper:
    unrenewed_lease_runs_out_fires_lost_and_frees_the_key,
);

/// Waits until `n` tasks are queued for `key` behind its holder (who must hold it): a
/// request that would wait alongside at most `n` is refused as full exactly then, and
/// otherwise, waiting for no time, leaves the queue at once (a task arriving meanwhile
/// stands behind it for that instant: its bound must allow one more). Both stores share
/// the queue.
async fn queued<B: LockBackend>(b: &B, key: &str, n: usize) {
    support::eventually(&format!("{n} task(s) queued for {key}"), || async {
        let probe = b.lock(key).max_local_waiters(n).wait(Duration::ZERO).await;
        matches!(probe, Err(LockError::QueueFull { .. }))
    })
    .await;
}

fn path_key(req: &Request) -> Option<String> {
    req.uri().path().strip_prefix("/lock/").map(str::to_owned)
}

async fn token(lock: axum::Extension<HeldLock>) -> String {
    lock.fencing_token().to_string()
}

async fn panics() -> &'static str {
    panic!("handler panics")
}

fn app(layer: LockLayer<fn(&Request) -> Option<String>>) -> Router {
    Router::new()
        .route("/lock/{key}", routing::post(token))
        // The empty key.
        .route("/lock/", routing::post(token))
        .route("/panic/{key}", routing::post(panics))
        .route_layer(layer)
}

fn layer<B: LockBackend>(backend: &B) -> LockLayer<fn(&Request) -> Option<String>> {
    LockLayer::new(backend.clone(), path_key as fn(&Request) -> Option<String>)
}

async fn call(app: &Router, path: &str) -> (StatusCode, http::HeaderMap, String) {
    let request = Request::post(path).body(Body::empty()).expect("request");
    let response = tokio::time::timeout(HANG, app.clone().oneshot(request))
        .await
        .expect("no hang")
        .expect("infallible");
    let (parts, body) = response.into_parts();
    let body = axum::body::to_bytes(body, usize::MAX).await.expect("body");
    (
        parts.status,
        parts.headers,
        String::from_utf8_lossy(&body).into_owned(),
    )
}

async fn fail_fast_route_answers_409_while_another_owner_holds_the_key<B: LockBackend>(
    [b, ..]: [B; 3],
) {
    let app = app(layer(&b).fail_fast());
    let guard = b.lock("a").try_once().await.expect("free");
    assert_eq!(call(&app, "/lock/a").await.0, StatusCode::CONFLICT);
    assert_eq!(
        call(&app, "/lock/b").await.0,
        StatusCode::OK,
        "other keys are free"
    );
    guard.release().await.expect("released");
    assert_eq!(call(&app, "/lock/a").await.0, StatusCode::OK);
}

async fn waiting_route_is_served_once_the_holder_releases<B: LockBackend>([b, ..]: [B; 3]) {
    let app = app(layer(&b).wait(HANG));
    let guard = b.lock("a").try_once().await.expect("free");
    let waiting = tokio::spawn({
        let app = app.clone();
        async move { call(&app, "/lock/a").await }
    });
    queued(&b, "a", 1).await;
    assert!(!waiting.is_finished(), "the request waits for the holder");
    let held_token = guard.fencing_token();
    guard.release().await.expect("released");
    let (status, _, body) = waiting.await.expect("no panic");
    assert_eq!(status, StatusCode::OK);
    assert!(body.parse::<u64>().expect("a token") > held_token);
}

async fn waiting_route_times_out_with_503_and_retry_after<B: LockBackend>([b, ..]: [B; 3]) {
    let app = app(layer(&b).wait(Duration::from_millis(200)));
    let _guard = b.lock("a").try_once().await.expect("free");
    let (status, headers, _) = call(&app, "/lock/a").await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    let retry_after: u64 = headers
        .get(http::header::RETRY_AFTER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
        .expect("Retry-After in seconds");
    assert!(retry_after >= 1);
}

async fn nested_layers_reenter_under_one_owner<B: LockBackend>([b, ..]: [B; 3]) {
    let app = Router::new()
        .route("/lock/{key}", routing::post(token))
        .route_layer(layer(&b).wait(Duration::from_secs(1)))
        .route_layer(layer(&b).wait(Duration::from_secs(1)));
    let (status, _, _) = call(&app, "/lock/a").await;
    assert_eq!(status, StatusCode::OK, "the inner layer re-entered");
    assert!(
        b.lock("a").try_once().await.is_ok(),
        "both holds were released"
    );
}

async fn fencing_tokens_strictly_increase_per_key<B: LockBackend>([b, ..]: [B; 3]) {
    let mut last = 0;
    for key in ["a", "b", "a", "a", "b"] {
        let guard = b.lock(key).try_once().await.expect("free");
        assert!(guard.fencing_token() > last);
        last = guard.fencing_token();
        guard.release().await.expect("released");
    }
}

async fn handler_panic_releases_the_lock<B: LockBackend>([b, ..]: [B; 3]) {
    let app = app(layer(&b).fail_fast()).layer(tower_http::catch_panic::CatchPanicLayer::new());
    assert_eq!(
        call(&app, "/panic/a").await.0,
        StatusCode::INTERNAL_SERVER_ERROR
    );
    let guard = tokio::time::timeout(HANG, b.lock("a").wait(HANG))
        .await
        .expect("no hang");
    assert!(guard.is_ok(), "the panicking request's lock was released");
}

async fn empty_and_oversized_keys_are_400_and_lock_nothing<B: LockBackend>([b, ..]: [B; 3]) {
    let app = app(layer(&b).fail_fast());
    let long = format!("/lock/{}", "k".repeat(2000));
    for path in ["/lock/", long.as_str()] {
        let (status, headers, _) = call(&app, path).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{path:.20}");
        assert_eq!(
            headers.get(http::header::CONTENT_TYPE).expect("typed"),
            "application/problem+json"
        );
    }
    assert!(matches!(
        b.lock("").try_once().await,
        Err(LockError::InvalidKey(_))
    ));
}

async fn reentry_counts_up_and_the_last_release_frees_the_key<B: LockBackend>([b, ..]: [B; 3]) {
    let outer = b.lock("a").try_once().await.expect("free");
    let inner = b
        .lock("a")
        .reentrant(outer.held())
        .try_once()
        .await
        .expect("re-enters");
    assert_eq!(inner.fencing_token(), outer.fencing_token());
    inner.release().await.expect("released");
    assert!(matches!(
        b.lock("a").try_once().await,
        Err(LockError::Contended { .. })
    ));
    outer.release().await.expect("released");
    assert!(b.lock("a").try_once().await.is_ok());
}

async fn unrenewed_lease_runs_out_fires_lost_and_frees_the_key<B: LockBackend>([b, ..]: [B; 3]) {
    let guard = b
        .lock("a")
        .lease(Duration::from_millis(300))
        .without_watchdog()
        .try_once()
        .await
        .expect("free");
    tokio::time::timeout(HANG, guard.lost())
        .await
        .expect("lost fires when the lease runs out");
    // `lost` fires no later than the store frees the key (the holder stops first), so
    // the next owner may have to wait a moment.
    let next = b.lock("a").wait(HANG).await.expect("the key is freed");
    assert!(next.fencing_token() > guard.fencing_token());
    assert!(matches!(guard.release().await, Err(LockError::Lost { .. })));
    assert!(!next.is_lost(), "the stale release left the new hold alone");
}

async fn renewed_hold_outlives_its_lease<B: LockBackend>([b, ..]: [B; 3]) {
    // Renewed every third of it: a lease of seconds leaves the renewals that much room on
    // a loaded machine.
    let lease = Duration::from_secs(2);
    let guard = b.lock("a").lease(lease).try_once().await.expect("free");
    tokio::time::sleep(2 * lease).await;
    assert!(!guard.is_lost());
    assert!(matches!(
        b.lock("a").try_once().await,
        Err(LockError::Contended { .. })
    ));
    guard.release().await.expect("still held, so released");
}

async fn local_queue_bound_sheds_with_queue_full<B: LockBackend>([b, ..]: [B; 3]) {
    let guard = b.lock("a").try_once().await.expect("free");
    // Queued under the default bound: a tight one could shed it for the instant a probe of
    // `queued` stands in line.
    let first = {
        let b = b.clone();
        tokio::spawn(async move { b.lock("a").wait(HANG).await })
    };
    queued(&b, "a", 1).await;
    let shed = b.lock("a").max_local_waiters(1).wait(HANG).await;
    assert!(matches!(shed, Err(LockError::QueueFull { .. })), "{shed:?}");
    guard.release().await.expect("released");
    assert!(first.await.expect("no panic").is_ok());
}

async fn waiters_are_served_in_arrival_order<B: LockBackend>([b, ..]: [B; 3]) {
    let guard = b.lock("a").try_once().await.expect("free");
    let (order_tx, mut order) = tokio::sync::mpsc::unbounded_channel();
    for i in 0..5 {
        let (waiter, order_tx) = (b.clone(), order_tx.clone());
        tokio::spawn(async move {
            let guard = waiter.lock("a").wait(HANG).await.expect("served");
            order_tx.send(i).expect("receiver lives");
            guard.release().await.expect("released");
        });
        // Arrival order is what the test controls.
        queued(&b, "a", i + 1).await;
    }
    drop(order_tx);
    guard.release().await.expect("released");
    let mut served = Vec::new();
    while let Some(i) = order.recv().await {
        served.push(i);
    }
    assert_eq!(served, [0, 1, 2, 3, 4]);
}

/// Owner X is queued for `a` when the key is released, and before its task runs, X takes
/// `a` a second time: the key must stay queued, so a later waiter waits for X instead of
/// failing as contended (a MemoryBackend bug found in review).
async fn a_second_acquisition_by_the_slot_owner_keeps_later_waiters_queued<B: LockBackend>(
    [b, ..]: [B; 3],
) {
    let first = b.lock("a").try_once().await.expect("free");
    let x = b.lock("x").try_once().await.expect("free");
    let owner = x.held().clone();
    let queued_x = {
        let (b, owner) = (b.clone(), owner.clone());
        tokio::spawn(async move { b.lock("a").reentrant(&owner).wait(HANG).await })
    };
    queued(&b, "a", 1).await;
    let later = {
        let b = b.clone();
        tokio::spawn(async move { b.lock("a").wait(HANG).await })
    };
    queued(&b, "a", 2).await;
    first.release().await.expect("released");
    let again = b
        .lock("a")
        .reentrant(&owner)
        .try_once()
        .await
        .expect("the owner re-enters");
    let queued = queued_x.await.expect("no panic").expect("served");
    assert!(!later.is_finished(), "the later waiter still waits for X");
    queued.release().await.expect("released");
    again.release().await.expect("released");
    let served = later.await.expect("no panic");
    assert!(served.is_ok(), "{served:?}");
    drop(x);
}

/// MemoryBackend only: what has no Redis counterpart to compare with.
mod memory_only {
    use std::time::Duration;

    use tower_lock::MemoryBackend;

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .expect("a runtime")
    }

    #[test]
    fn a_guard_dropped_outside_any_runtime_releases_without_panicking() {
        let backend = MemoryBackend::new();
        let (outer, inner) = runtime().block_on(async {
            let outer = backend
                .lock("k")
                .lease(Duration::from_secs(60))
                .without_watchdog()
                .try_once()
                .await
                .expect("free");
            // A renewing re-entry: its release re-arms the outer hold's expiry.
            let inner = backend
                .lock("k")
                .reentrant(outer.held())
                .try_once()
                .await
                .expect("re-enters");
            (outer, inner)
        });
        drop(inner);
        drop(outer);
        assert_eq!(backend.held(), 0);
    }

    #[test]
    fn an_operator_call_never_awaited_changes_nothing() {
        let backend = MemoryBackend::new();
        runtime().block_on(async {
            let guard = backend.lock("k").try_once().await.expect("free");
            drop(backend.force_release("k"));
            drop(backend.force_release_permits("k"));
            let held = backend.inspect("k").await.expect("inspect");
            assert_eq!((held.holders, guard.is_lost()), (1, false));
            guard.release().await.expect("still held");
        });
    }

    #[test]
    fn tokens_of_a_new_backend_are_above_those_of_an_earlier_one() {
        let earlier = runtime().block_on(async {
            let guard = MemoryBackend::new().lock("k").try_once().await;
            guard.expect("free").fencing_token()
        });
        let later = runtime().block_on(async {
            let guard = MemoryBackend::new().lock("k").try_once().await;
            guard.expect("free").fencing_token()
        });
        assert!(later > earlier, "{later} after {earlier}");
    }
}

//! `Retry-After` says what the work takes: a layer's mean hold time, not the holder's
//! lease. Hold times are known by construction: a handler that returns at once, or one
//! held at a gate the test opens no earlier than a known time.

use crate::support;

use std::net::SocketAddr;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::routing::post;
use support::{Gate, RedisServer, Reply, http_client, post as post_to, serve};
use tower_lock::lock::policy::HoldPolicy;
use tower_lock::{LockError, LockLayer, RedisBackend};

/// The lease of the holders the tests set up: what `Retry-After` said before.
const LEASE: Duration = Duration::from_secs(30);

type KeyFn = fn(&Request) -> Option<String>;

/// An app whose `/quick/{key}` returns at once and `/gated/{key}` waits at `gate`, both
/// under one layer keyed by the last path segment.
async fn app<P: HoldPolicy<Body>>(
    server: &RedisServer,
    gate: &Gate,
    configure: impl FnOnce(LockLayer<KeyFn>) -> LockLayer<KeyFn, P>,
) -> (SocketAddr, RedisBackend) {
    let backend = server.backend().await;
    let key: KeyFn = |req| req.uri().path().rsplit('/').next().map(str::to_owned);
    let app = Router::new()
        .route("/quick/{key}", post(|| async { "done" }))
        .route(
            "/gated/{key}",
            post(|State(gate): State<Gate>| async move { gate.pass().await }),
        )
        .with_state(gate.clone())
        .route_layer(configure(LockLayer::new(backend.clone(), key)));
    (serve(app).await, backend)
}

/// The `Retry-After` of a rejection with `status`, in seconds.
fn retry_after(reply: &Reply, status: u16) -> u64 {
    reply.problem(status);
    let header = reply
        .headers
        .get("retry-after")
        .expect("a Retry-After header");
    header.to_str().unwrap().parse().expect("whole seconds")
}

/// Holds `key` from another instance under a lease of [`LEASE`].
async fn hold(server: &RedisServer, key: &str) -> tower_lock::LockGuard {
    let other = server.backend().await;
    other
        .lock(key)
        .lease(LEASE)
        .try_once()
        .await
        .expect("free key")
}

#[tokio::test]
async fn a_fail_fast_409_behind_a_short_handler_says_one_second_not_the_lease() {
    crate::needs!(Redis);
    let server = RedisServer::start();
    let (addr, _) = app(&server, &Gate::default(), |l| l.fail_fast()).await;
    let client = http_client();
    let held = hold(&server, "k").await;
    // Before any hold of the layer has ended: 1 s.
    let first = post_to(&client, addr, "/quick/k").await;
    assert_eq!(retry_after(&first, 409), 1, "{first:?}");
    held.release().await.expect("released");
    // A hold of a handler that returns at once.
    assert_eq!(post_to(&client, addr, "/quick/k").await.status, 200);
    let held = hold(&server, "k").await;
    let busy = post_to(&client, addr, "/quick/k").await;
    assert_eq!(retry_after(&busy, 409), 1, "{busy:?}");
    held.release().await.expect("released");
}

#[tokio::test]
async fn a_long_handler_s_409_says_about_its_hold_time() {
    crate::needs!(Redis);
    const HELD_FOR: Duration = Duration::from_secs(2);
    let server = RedisServer::start();
    let gate = Gate::default();
    let (addr, _) = app(&server, &gate, |l| l.fail_fast()).await;
    let client = http_client();
    // One hold of at least HELD_FOR: the gate opens no earlier.
    let long = tokio::spawn({
        let client = client.clone();
        async move { post_to(&client, addr, "/gated/k").await.status }
    });
    gate.wait_inside(1).await;
    tokio::time::sleep(HELD_FOR).await;
    gate.open();
    assert_eq!(long.await.expect("task"), 200);

    let held = hold(&server, "k").await;
    let busy = post_to(&client, addr, "/gated/k").await;
    let seconds = retry_after(&busy, 409);
    // At least the hold seen; the upper bound only catches a lease (30 s) said instead.
    assert!(
        (HELD_FOR.as_secs()..=10).contains(&seconds),
        "Retry-After {seconds} after a hold of at least {HELD_FOR:?}"
    );
    held.release().await.expect("released");
}

#[tokio::test]
async fn an_explicit_retry_after_wins_on_the_layer_and_the_lock_api() {
    crate::needs!(Redis);
    let server = RedisServer::start();
    let fixed = Duration::from_secs(7);
    let (addr, backend) = app(&server, &Gate::default(), |l| {
        l.fail_fast().retry_after(fixed)
    })
    .await;
    let client = http_client();
    assert_eq!(post_to(&client, addr, "/quick/k").await.status, 200);
    let held = hold(&server, "k").await;
    let busy = post_to(&client, addr, "/quick/k").await;
    assert_eq!(retry_after(&busy, 409), 7, "{busy:?}");
    // Without the layer: the setting of the request, else the holder's remaining lease.
    let api = backend.lock("k").retry_after(fixed).try_once().await;
    assert!(
        matches!(&api, Err(LockError::Contended { retry_after: Some(d), .. }) if *d == fixed),
        "{api:?}"
    );
    let api = backend.lock("k").try_once().await;
    assert!(
        matches!(&api, Err(LockError::Contended { retry_after: Some(d), .. }) if *d > fixed && *d <= LEASE),
        "{api:?}"
    );
    held.release().await.expect("released");
}

#[tokio::test]
async fn a_429_and_the_503_of_a_wait_that_ran_out_say_the_hold_time_too() {
    crate::needs!(Redis);
    let server = RedisServer::start();
    let gate = Gate::default();
    let (permits, _) = app(&server, &gate, |l| l.permits(1).fail_fast()).await;
    let (waiting, _) = app(&server, &gate, |l| l.wait(Duration::from_millis(200))).await;
    let client = http_client();
    // A short hold on each layer, so that each has a mean to say.
    assert_eq!(post_to(&client, permits, "/quick/p").await.status, 200);
    assert_eq!(post_to(&client, waiting, "/quick/w").await.status, 200);

    let other = server.backend().await;
    let permit = other
        .lock("p")
        .permits(1)
        .lease(LEASE)
        .try_once()
        .await
        .expect("free permit");
    let taken = post_to(&client, permits, "/quick/p").await;
    assert_eq!(retry_after(&taken, 429), 1, "{taken:?}");
    permit.release().await.expect("released");

    let held = hold(&server, "w").await;
    let timed_out = post_to(&client, waiting, "/quick/w").await;
    assert!(timed_out.body.contains("Timed out"), "{timed_out:?}");
    assert_eq!(retry_after(&timed_out, 503), 1, "{timed_out:?}");
    held.release().await.expect("released");
}

#[tokio::test]
async fn a_multi_key_route_s_409_says_the_hold_time_too() {
    crate::needs!(Redis);
    let server = RedisServer::start();
    let backend = server.backend().await;
    let both = |req: &Request| -> Vec<String> {
        let last = req.uri().path().rsplit('/').next().unwrap_or_default();
        vec![format!("{last}:from"), format!("{last}:to")]
    };
    let app = Router::new()
        .route("/transfer/{id}", post(|| async { "done" }))
        .route_layer(LockLayer::new(backend, both).fail_fast());
    let addr = serve(app).await;
    let client = http_client();
    assert_eq!(post_to(&client, addr, "/transfer/t").await.status, 200);
    // The second key is held: the first is taken, then given back.
    let held = hold(&server, "t:to").await;
    let busy = post_to(&client, addr, "/transfer/t").await;
    assert_eq!(retry_after(&busy, 409), 1, "{busy:?}");
    held.release().await.expect("released");
}

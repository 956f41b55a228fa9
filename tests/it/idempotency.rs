//! `IdempotencyLayer` through axum, on a throwaway Redis, on `MemoryBackend` and on the
//! binary's shared PostgreSQL, MariaDB, etcd and ZooKeeper: replays, duplicates in flight
//! across three instances, mismatches, tenants, 5xx, bodies, expiry, lost locks and
//! crashed instances.

use crate::support;

#[path = "idempotency/crash.rs"]
mod crash;
#[cfg(feature = "etcd")]
#[path = "idempotency/etcd.rs"]
mod etcd;
#[path = "idempotency/records.rs"]
mod records;
#[path = "idempotency/sql.rs"]
mod sql;
#[path = "idempotency/zookeeper.rs"]
mod zookeeper;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::post;
use support::{Gate, Reply, eventually};
use tower_lock::idempotency::IdempotencyBackend;
use tower_lock::{IdempotencyLayer, MemoryBackend};

/// Counts handler runs; holds them in `gate` when one is set.
#[derive(Clone, Default)]
struct Payments {
    runs: Arc<AtomicUsize>,
    gate: Option<Gate>,
}

impl Payments {
    fn gated() -> Self {
        Payments {
            gate: Some(Gate::default()),
            ..Payments::default()
        }
    }

    fn runs(&self) -> usize {
        self.runs.load(Ordering::SeqCst)
    }
}

/// Charges once per run: 201, a header naming the charge, a cookie, the body echoed.
async fn pay(State(payments): State<Payments>, body: Bytes) -> impl IntoResponse {
    let n = payments.runs.fetch_add(1, Ordering::SeqCst) + 1;
    if let Some(gate) = &payments.gate {
        gate.pass().await;
    }
    (
        StatusCode::CREATED,
        [
            ("x-charge", format!("ch_{n}")),
            ("set-cookie", "s=1".into()),
        ],
        format!("charged {n} for {}", String::from_utf8_lossy(&body)),
    )
}

/// Fails with 500 on its first run, then charges.
async fn flaky(State(payments): State<Payments>) -> impl IntoResponse {
    match payments.runs.fetch_add(1, Ordering::SeqCst) {
        0 => (StatusCode::INTERNAL_SERVER_ERROR, "card network down"),
        _ => (StatusCode::CREATED, "charged"),
    }
}

/// Answers 2 KiB, in two chunks.
async fn big(State(payments): State<Payments>) -> Body {
    payments.runs.fetch_add(1, Ordering::SeqCst);
    let chunks = [Bytes::from(vec![b'a'; 1024]), Bytes::from(vec![b'b'; 1024])];
    Body::from_stream(futures_util::stream::iter(
        chunks.map(Ok::<_, std::io::Error>),
    ))
}

/// Panics on its first run, then charges.
async fn panics_once(State(payments): State<Payments>) -> &'static str {
    if payments.runs.fetch_add(1, Ordering::SeqCst) == 0 {
        panic!("the handler panics");
    }
    "charged"
}

/// The scope of a request: its `x-tenant` header.
fn tenant(parts: &http::request::Parts) -> String {
    parts
        .headers
        .get("x-tenant")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned()
}

fn app(layer: IdempotencyLayer, payments: &Payments) -> Router {
    Router::new()
        .route("/payments", post(pay))
        .route("/flaky", post(flaky))
        .route("/panics", post(panics_once))
        .route("/big", post(big))
        .route_layer(layer.scope(tenant))
        .layer(tower_http::catch_panic::CatchPanicLayer::new())
        .with_state(payments.clone())
}

/// Three instances of one service on `b`'s three backends, sharing `payments`.
fn apps<B: IdempotencyBackend>(
    b: &[B; 3],
    payments: &Payments,
    layer: impl Fn(IdempotencyLayer) -> IdempotencyLayer,
) -> [Router; 3] {
    b.clone()
        .map(|backend| app(layer(IdempotencyLayer::new(backend)), payments))
}

/// A POST to `path` with `key` (if any) for tenant `t`, carrying `body`.
fn payment(path: &str, key: Option<&str>, t: &str, body: impl Into<Body>) -> http::Request<Body> {
    let mut request = http::Request::post(path).header("x-tenant", t);
    if let Some(key) = key {
        request = request.header("idempotency-key", key);
    }
    request.body(body.into()).expect("request")
}

async fn send(app: &Router, request: http::Request<Body>) -> Reply {
    support::oneshot(app, request).await
}

async fn pay_with(app: &Router, key: &str, body: &'static str) -> Reply {
    send(app, payment("/payments", Some(key), "acme", body)).await
}

/// Sends the first payment of key `k1` on `app` and waits until its handler is inside
/// `gate`.
async fn first_inside(app: &Router, gate: &Gate) -> tokio::task::JoinHandle<Reply> {
    let first = tokio::spawn({
        let app = app.clone();
        async move { pay_with(&app, "k1", "{}").await }
    });
    gate.wait_inside(1).await;
    first
}

/// The lock key the layer takes for `key` of tenant `t`.
fn scoped(t: &str, key: &str) -> String {
    format!("idempotency:{}:{t}:{key}", t.len())
}

for_each_records_store!(
    a_retry_after_completion_replays_exactly_without_running_the_handler,
    duplicates_in_flight_on_three_instances_run_the_handler_once_and_get_409,
    duplicates_that_wait_for_the_first_get_its_response,
    the_same_key_with_a_different_body_is_422,
    two_tenants_with_the_same_key_are_independent,
    server_errors_are_not_stored_and_the_retry_runs,
    missing_and_invalid_keys_are_400_unless_optional,
    a_handler_that_panicked_left_no_record_and_the_retry_runs,
    a_body_over_the_limit_is_413_and_a_streamed_one_is_fingerprinted_whole,
    a_lock_lost_while_the_handler_runs_stores_nothing,
    a_response_over_the_limit_is_sent_whole_and_not_stored,
    a_request_whose_client_went_away_still_completes_and_is_replayed,
    a_dropped_request_that_stops_with_its_client_leaves_no_record,
);

async fn a_retry_after_completion_replays_exactly_without_running_the_handler<
    B: IdempotencyBackend,
>(
    b: [B; 3],
) {
    let payments = Payments::default();
    let apps = apps(&b, &payments, |l| l);
    let first = pay_with(&apps[0], "k1", "{\"amount\":10}").await;
    assert_eq!(first.status, 201);
    assert_eq!(first.body, "charged 1 for {\"amount\":10}");
    assert_eq!(first.headers["set-cookie"], "s=1");
    assert!(first.headers.get("idempotency-replayed").is_none());

    // On another instance too.
    for app in &apps[1..] {
        let retry = pay_with(app, "k1", "{\"amount\":10}").await;
        assert_eq!(retry.status, first.status);
        assert_eq!(retry.body, first.body);
        assert_eq!(retry.headers["idempotency-replayed"], "true");
        let mut replayed = retry.headers.clone();
        replayed.remove("idempotency-replayed");
        let mut expected = first.headers.clone();
        // Denied by default: a cookie is not handed to whoever retries.
        expected.remove("set-cookie");
        assert_eq!(replayed, expected);
    }
    assert_eq!(payments.runs(), 1, "the handler ran once");
}

async fn duplicates_in_flight_on_three_instances_run_the_handler_once_and_get_409<
    B: IdempotencyBackend,
>(
    b: [B; 3],
) {
    let payments = Payments::gated();
    let gate = payments.gate.clone().expect("gated");
    let apps = apps(&b, &payments, |l| l);
    let first = first_inside(&apps[0], &gate).await;
    for app in &apps[1..] {
        let duplicate = pay_with(app, "k1", "{}").await;
        duplicate.problem(409);
        // From the work, as the lock layer says it: no hold has ended on this instance
        // yet, so one second (not the 30 s lease).
        assert_eq!(duplicate.headers["retry-after"], "1");
    }
    gate.open();
    assert_eq!(first.await.expect("first").status, 201);
    assert_eq!(payments.runs(), 1);
    // Once done, a duplicate is a replay.
    assert_eq!(
        pay_with(&apps[2], "k1", "{}").await.body,
        "charged 1 for {}"
    );
    assert_eq!(payments.runs(), 1);
}

async fn duplicates_that_wait_for_the_first_get_its_response<B: IdempotencyBackend>(b: [B; 3]) {
    let payments = Payments::gated();
    let gate = payments.gate.clone().expect("gated");
    let apps = apps(&b, &payments, |l| l.wait_for_first(Duration::from_secs(20)));
    let replies: Vec<_> = apps
        .iter()
        .map(|app| {
            let app = app.clone();
            tokio::spawn(async move { pay_with(&app, "k1", "{}").await })
        })
        .collect();
    // One of the three runs; the two others wait (none can get past the lock).
    gate.wait_inside(1).await;
    gate.open();
    for reply in replies {
        let reply = reply.await.expect("request");
        assert_eq!(reply.status, 201);
        assert_eq!(reply.body, "charged 1 for {}");
    }
    assert_eq!(
        payments.runs(),
        1,
        "two duplicates replayed the first's response"
    );
}

async fn the_same_key_with_a_different_body_is_422<B: IdempotencyBackend>(b: [B; 3]) {
    let payments = Payments::default();
    let apps = apps(&b, &payments, |l| l);
    assert_eq!(
        pay_with(&apps[0], "k1", "{\"amount\":10}").await.status,
        201
    );
    pay_with(&apps[1], "k1", "{\"amount\":99}")
        .await
        .problem(422);
    // Another path with the same key is another request too.
    send(
        &apps[1],
        payment("/flaky", Some("k1"), "acme", "{\"amount\":10}"),
    )
    .await
    .problem(422);
    assert_eq!(payments.runs(), 1);
}

async fn two_tenants_with_the_same_key_are_independent<B: IdempotencyBackend>(b: [B; 3]) {
    let payments = Payments::default();
    let apps = apps(&b, &payments, |l| l);
    let acme = send(&apps[0], payment("/payments", Some("k1"), "acme", "x")).await;
    let globex = send(&apps[1], payment("/payments", Some("k1"), "globex", "y")).await;
    assert_eq!((acme.status, globex.status), (201, 201));
    assert_eq!(acme.body, "charged 1 for x");
    assert_eq!(globex.body, "charged 2 for y");
    // A tenant whose name and key spell another pair's meets nobody.
    let spelled = send(&apps[2], payment("/payments", Some("k1"), "acme:", "x")).await;
    assert_eq!(spelled.body, "charged 3 for x");
    let again = send(&apps[2], payment("/payments", Some("k1"), "acme", "x")).await;
    assert_eq!(again.body, acme.body);
    assert_eq!(payments.runs(), 3);
}

async fn server_errors_are_not_stored_and_the_retry_runs<B: IdempotencyBackend>(b: [B; 3]) {
    let payments = Payments::default();
    let apps = apps(&b, &payments, |l| l);
    let flaky = || payment("/flaky", Some("k1"), "acme", "");
    assert_eq!(send(&apps[0], flaky()).await.status, 500);
    assert_eq!(send(&apps[1], flaky()).await.status, 201);
    let replay = send(&apps[2], flaky()).await;
    assert_eq!((replay.status, replay.body.as_str()), (201, "charged"));
    assert_eq!(replay.headers["idempotency-replayed"], "true");
    assert_eq!(payments.runs(), 2);
}

async fn a_handler_that_panicked_left_no_record_and_the_retry_runs<B: IdempotencyBackend>(
    b: [B; 3],
) {
    let payments = Payments::default();
    // Every status stored: the 500 comes from the `CatchPanicLayer` outside, never from
    // the handler, so there is nothing to store.
    let apps = apps(&b, &payments, |l| l.store_if(|_| true));
    let panics = || payment("/panics", Some("k1"), "acme", "");
    assert_eq!(send(&apps[0], panics()).await.status, 500);
    released(&b[1], "k1").await;
    assert_eq!(send(&apps[1], panics()).await.body, "charged");
    let replay = send(&apps[2], panics()).await;
    assert_eq!(replay.headers["idempotency-replayed"], "true");
    assert_eq!(payments.runs(), 2);
}

async fn missing_and_invalid_keys_are_400_unless_optional<B: IdempotencyBackend>(b: [B; 3]) {
    let payments = Payments::default();
    let required = apps(&b, &payments, |l| l);
    let missing = send(&required[0], payment("/payments", None, "acme", "")).await;
    assert!(missing.problem(400).contains("idempotency-key"));
    let long = "k".repeat(256);
    let too_long = send(&required[0], payment("/payments", Some(&long), "acme", "")).await;
    assert_eq!(
        too_long.problem(400),
        "The idempotency key cannot be used: the idempotency key is 256 bytes long; the \
         limit is 255 bytes."
    );
    // Two headers: which one the client meant is unknown, so neither is used.
    let twice = http::Request::post("/payments")
        .header("x-tenant", "acme")
        .header("idempotency-key", "k1")
        .header("idempotency-key", "k2")
        .body(Body::empty())
        .expect("request");
    assert!(
        send(&required[0], twice)
            .await
            .problem(400)
            .contains("header \"idempotency-key\" is sent more than once"),
    );
    send(&required[0], payment("/payments", Some("\"\""), "acme", ""))
        .await
        .problem(400);
    assert_eq!(payments.runs(), 0);

    let optional = apps(&b, &payments, IdempotencyLayer::optional);
    for n in 1..=2 {
        let reply = send(&optional[0], payment("/payments", None, "acme", "")).await;
        assert_eq!(reply.body, format!("charged {n} for "));
    }
    // The draft's quoted form is the same key as the bare one.
    assert_eq!(
        pay_with(&optional[1], "\"k9\"", "").await.body,
        "charged 3 for "
    );
    assert_eq!(
        pay_with(&optional[2], "k9", "").await.body,
        "charged 3 for "
    );
}

async fn a_body_over_the_limit_is_413_and_a_streamed_one_is_fingerprinted_whole<
    B: IdempotencyBackend,
>(
    b: [B; 3],
) {
    let payments = Payments::default();
    let apps = apps(&b, &payments, |l| l.max_request_body(16));
    pay_with(&apps[0], "k1", "seventeen bytes!!")
        .await
        .problem(413);
    assert_eq!(payments.runs(), 0);
    // Nothing was stored: the same key with a body within the limit runs.
    assert_eq!(pay_with(&apps[0], "k1", "small").await.status, 201);

    let chunks = ["str", "ea", "med"].map(|c| Ok::<_, std::io::Error>(Bytes::from(c)));
    let streamed = Body::from_stream(futures_util::stream::iter(chunks));
    let reply = send(&apps[1], payment("/payments", Some("k2"), "acme", streamed)).await;
    assert_eq!(reply.body, "charged 2 for streamed");
    // The same bytes in one piece are the same request.
    assert_eq!(pay_with(&apps[2], "k2", "streamed").await.body, reply.body);
    assert_eq!(payments.runs(), 2);
}

async fn a_response_over_the_limit_is_sent_whole_and_not_stored<B: IdempotencyBackend>(b: [B; 3]) {
    let payments = Payments::default();
    let apps = apps(&b, &payments, |l| l.max_response_body(1500));
    let big = || payment("/big", Some("k1"), "acme", "");
    for (n, app) in apps.iter().enumerate() {
        let reply = send(app, big()).await;
        assert_eq!(
            reply.body,
            format!("{}{}", "a".repeat(1024), "b".repeat(1024))
        );
        assert!(reply.headers.get("idempotency-replayed").is_none());
        assert_eq!(payments.runs(), n + 1, "not stored: every try runs");
    }
}

async fn a_lock_lost_while_the_handler_runs_stores_nothing<B: IdempotencyBackend>(b: [B; 3]) {
    let payments = Payments::gated();
    let gate = payments.gate.clone().expect("gated");
    let apps = apps(&b, &payments, |l| l);
    let first = first_inside(&apps[0], &gate).await;
    b[1].force_release(scoped("acme", "k1"))
        .await
        .expect("force release");
    // The handler is dropped where it waits, and the client gets 503.
    first.await.expect("first").problem(503);
    gate.open();
    let retry = pay_with(&apps[1], "k1", "{}").await;
    assert_eq!(
        (retry.status, retry.body.as_str()),
        (201, "charged 2 for {}")
    );
    assert!(retry.headers.get("idempotency-replayed").is_none());
}

async fn a_request_whose_client_went_away_still_completes_and_is_replayed<B: IdempotencyBackend>(
    b: [B; 3],
) {
    let payments = Payments::gated();
    let gate = payments.gate.clone().expect("gated");
    let apps = apps(&b, &payments, |l| l);
    let first = first_inside(&apps[0], &gate).await;
    // The client went away (its timeout, a dropped connection): its request future is
    // dropped mid-handler, after the charge.
    first.abort();
    assert!(first.await.expect_err("aborted").is_cancelled());
    gate.open();
    released(&b[1], "k1").await;
    let retry = pay_with(&apps[1], "k1", "{}").await;
    assert_eq!(retry.body, "charged 1 for {}");
    assert_eq!(retry.headers["idempotency-replayed"], "true");
    assert_eq!(payments.runs(), 1);
}

async fn a_dropped_request_that_stops_with_its_client_leaves_no_record<B: IdempotencyBackend>(
    b: [B; 3],
) {
    let payments = Payments::gated();
    let gate = payments.gate.clone().expect("gated");
    let apps = apps(&b, &payments, IdempotencyLayer::stop_when_client_gone);
    let first = first_inside(&apps[0], &gate).await;
    first.abort();
    assert!(first.await.expect_err("aborted").is_cancelled());
    released(&b[1], "k1").await;
    gate.open();
    let retry = pay_with(&apps[1], "k1", "{}").await;
    assert_eq!(retry.body, "charged 2 for {}");
    assert!(retry.headers.get("idempotency-replayed").is_none());
}

/// Sends a request with tenant acme's `key` whose response is `size` bytes, twice,
/// through a layer on `backend` that keeps responses up to 4 MiB: each time the response
/// comes whole and is not a replay (nothing was stored), and the layer's warning says
/// `says`.
async fn twice_too_large_to_store<B: IdempotencyBackend>(
    backend: B,
    key: &str,
    size: usize,
    says: &str,
) {
    let answer = |body: Bytes| async move {
        let size: usize = String::from_utf8_lossy(&body).parse().expect("a size");
        vec![b'x'; size]
    };
    // Stopped with its client: the request's end runs in its task, where its warning is
    // caught (else in a task of its own).
    let layer = IdempotencyLayer::new(backend)
        .max_response_body(4 << 20)
        .stop_when_client_gone();
    let app: Router = Router::new()
        .route("/big", post(answer))
        .route_layer(layer.scope(tenant));
    for _ in 0..2 {
        let request = payment("/big", Some(key), "acme", size.to_string());
        let (reply, warnings) = support::warnings_of(send(&app, request)).await;
        assert_eq!((reply.status, reply.body.len()), (200, size), "sent whole");
        assert!(
            reply.headers.get("idempotency-replayed").is_none(),
            "not stored"
        );
        assert!(
            warnings.contains(says),
            "the warning says {says}: {warnings}"
        );
    }
}

/// Waits until the lock of tenant acme's `key` is free.
async fn released<B: IdempotencyBackend>(backend: &B, key: &str) {
    let key = scoped("acme", key);
    eventually("the lock is released", || async {
        backend
            .inspect(key.as_str())
            .await
            .expect("inspect")
            .is_free()
    })
    .await;
}

#[tokio::test]
async fn on_rejection_answers_refusals_in_the_apis_own_format() {
    let payments = Payments::default();
    let layer = IdempotencyLayer::new(MemoryBackend::new()).on_rejection(|error| {
        let body = format!("{{\"error\":\"{error}\"}}");
        (error.status(), body).into_response()
    });
    let app = app(layer, &payments);
    assert_eq!(pay_with(&app, "k1", "a").await.status, 201);
    let mismatch = pay_with(&app, "k1", "b").await;
    assert_eq!(mismatch.status, 422);
    assert_eq!(
        mismatch.body,
        "{\"error\":\"the idempotency key was used for a different request\"}"
    );
}

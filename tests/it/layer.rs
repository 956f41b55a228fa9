//! The layer over HTTP: three app instances, contention, reentrancy, release paths.

use crate::support;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use redis::AsyncCommands;
use support::{Gate, RedisServer, http_client, lock_key, post, post_request, queued, serve};
use tokio::io::AsyncWriteExt;
use tower::limit::ConcurrencyLimitLayer;
use tower::{ServiceBuilder, ServiceExt};
use tower_lock::layer::ResponseBody;
use tower_lock::{LockError, LockLayer, PathParam, RedisBackend};

const STOCK: &str = "test:stock";
const SOLD: &str = "test:sold";

/// The shop's state: its Redis, and for the unlocked shop a meeting point of the first two
/// buyers.
#[derive(Clone)]
struct Shop {
    redis: redis::aio::MultiplexedConnection,
    overlap: Option<Arc<Overlap>>,
}

/// Holds the first two buyers between their read and their write until both have read, so
/// that without a lock they certainly overlap, however the machine schedules them.
struct Overlap {
    arrived: AtomicUsize,
    met: tokio::sync::Barrier,
}

/// Reads the stock, yields to other requests, then writes it back decremented: the
/// read-check-write race that a lock must close.
async fn buy(State(Shop { mut redis, overlap }): State<Shop>) -> StatusCode {
    let stock: i64 = redis.get(STOCK).await.unwrap_or(0);
    if stock <= 0 {
        return StatusCode::GONE;
    }
    match overlap {
        Some(overlap) if overlap.arrived.fetch_add(1, Ordering::SeqCst) < 2 => {
            overlap.met.wait().await;
        }
        _ => tokio::time::sleep(Duration::from_millis(2)).await,
    }
    let _: Result<(), _> = redis.set(STOCK, stock - 1).await;
    let _: Result<i64, _> = redis.incr(SOLD, 1).await;
    StatusCode::OK
}

fn shop(shop: Shop, lock: Option<StockLayer>) -> Router {
    let router = Router::new()
        .route("/buy", routing::post(buy))
        .with_state(shop);
    match lock {
        Some(layer) => router.route_layer(layer),
        None => router,
    }
}

type StockLayer = LockLayer<fn(&Request) -> Option<&'static str>>;
type PathLayer = LockLayer<fn(&Request) -> Option<String>>;

fn stock_key(_: &Request) -> Option<&'static str> {
    Some("stock")
}

/// Runs 300 buyers round-robin over three instances and returns (sold, statuses).
async fn flash_sale(server: &RedisServer, locked: bool) -> (i64, Vec<u16>) {
    let mut conn = server.conn().await;
    let _: () = conn.set(STOCK, 100).await.unwrap();
    let _: () = conn.set(SOLD, 0).await.unwrap();
    let mut instances = Vec::new();
    let overlap = (!locked).then(|| {
        Arc::new(Overlap {
            arrived: AtomicUsize::new(0),
            met: tokio::sync::Barrier::new(2),
        })
    });
    for _ in 0..3 {
        let layer = if locked {
            let key_fn: fn(&Request) -> Option<&'static str> = stock_key;
            // A generous command timeout: this test is about exclusion, not about a
            // loaded machine's stalls.
            let backend = RedisBackend::builder(server.url())
                .command_timeout(Duration::from_secs(5))
                .build()
                .await
                .unwrap();
            Some(LockLayer::new(backend, key_fn).wait(Duration::from_secs(60)))
        } else {
            None
        };
        let state = Shop {
            redis: server.conn().await,
            overlap: overlap.clone(),
        };
        instances.push(serve(shop(state, layer)).await);
    }
    let client = http_client();
    let buyers = (0..300).map(|i| {
        let client = client.clone();
        let addr = instances[i % 3];
        tokio::spawn(async move { post(&client, addr, "/buy").await.status })
    });
    let mut statuses = Vec::new();
    for buyer in buyers.collect::<Vec<_>>() {
        statuses.push(buyer.await.unwrap());
    }
    (conn.get(SOLD).await.unwrap(), statuses)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_handler_without_the_layer_oversells() {
    crate::needs!(Redis);
    let server = RedisServer::start();
    let (sold, _) = flash_sale(&server, false).await;
    // The first two buyers both read 100 and both wrote 99: a chain of writes from 100 down
    // to 0 has a buyer per step, and one of the two is not in it.
    assert!(sold > 100, "the unlocked race sold {sold} of 100");
}

/// An app whose `/hold/{key}` handler keeps its lock until told to go on.
struct Holding {
    addr: SocketAddr,
    backend: RedisBackend,
}

async fn holding_app(
    server: &RedisServer,
    configure: impl FnOnce(PathLayer) -> PathLayer,
) -> Holding {
    let backend = server.backend().await;
    let key_fn: fn(&Request) -> Option<String> = path_key;
    let app = Router::new()
        .route(
            "/hold/{key}",
            routing::post(|| async { tokio::time::sleep(Duration::from_secs(3600)).await }),
        )
        .route("/quick/{key}", routing::post(|| async { "done" }))
        .route_layer(configure(LockLayer::new(backend.clone(), key_fn)));
    Holding {
        addr: serve(app).await,
        backend,
    }
}

fn path_key(req: &Request) -> Option<String> {
    req.uri().path().rsplit('/').next().map(str::to_owned)
}

#[tokio::test]
async fn fail_fast_answers_409_while_the_lock_is_held() {
    crate::needs!(Redis);
    let server = RedisServer::start();
    let app = holding_app(&server, |l| l.fail_fast()).await;
    let held = app.backend.lock("k").try_once().await.unwrap();
    let reply = post(&http_client(), app.addr, "/quick/k").await;
    assert_eq!(reply.status, 409);
    assert_eq!(reply.headers["content-type"], "application/problem+json");
    assert!(reply.body.contains("\"status\":409"), "{}", reply.body);
    assert!(reply.headers.contains_key("retry-after"));
    held.release().await.unwrap();
    assert_eq!(post(&http_client(), app.addr, "/quick/k").await.status, 200);
}

#[tokio::test]
async fn waiting_past_the_wait_answers_503_with_retry_after() {
    crate::needs!(Redis);
    let server = RedisServer::start();
    let app = holding_app(&server, |l| l.wait(Duration::from_millis(300))).await;
    let _held = app
        .backend
        .lock("k")
        .lease(Duration::from_secs(20))
        .try_once()
        .await
        .unwrap();
    let reply = post(&http_client(), app.addr, "/quick/k").await;
    assert_eq!(reply.status, 503);
    let retry_after: u64 = reply.headers["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((1..=20).contains(&retry_after), "Retry-After {retry_after}");
    assert!(reply.body.contains("Timed out waiting"), "{}", reply.body);
}

#[tokio::test]
async fn waiting_request_is_served_when_released_within_the_wait() {
    crate::needs!(Redis);
    let server = RedisServer::start();
    let app = holding_app(&server, |l| l.wait(Duration::from_secs(10))).await;
    let held = app.backend.lock("k").try_once().await.unwrap();
    let addr = app.addr;
    let request = tokio::spawn(async move { post(&http_client(), addr, "/quick/k").await });
    queued(&app.backend, 1).await;
    held.release().await.unwrap();
    assert_eq!(request.await.unwrap().status, 200);
}

#[tokio::test]
async fn a_request_waiting_for_its_lock_leaves_an_inner_concurrency_limit_free() {
    crate::needs!(Redis);
    let server = RedisServer::start();
    let backend = server.backend().await;
    let key_fn: fn(&Request) -> Option<String> = path_key;
    // A plain tower stack: axum's `route_layer` puts a `Route` (always ready) between
    // layers, which would hide whose readiness the lock service holds.
    let service = ServiceBuilder::new()
        .layer(LockLayer::new(backend, key_fn).wait(Duration::from_secs(30)))
        .layer(ConcurrencyLimitLayer::new(1))
        .service_fn(|_: Request| async { Ok::<_, Infallible>("done".into_response()) });
    let addr = serve(Router::new().route_service("/quick/{key}", service)).await;
    // Held by another instance, so that the waiter subscribes where the test can see it.
    let held = server.backend().await.lock("a").try_once().await.unwrap();
    let waiting = tokio::spawn(async move { post(&http_client(), addr, "/quick/a").await.status });
    server.wait_for_subscribers("a", 1).await;
    let other = tokio::time::timeout(
        Duration::from_secs(10),
        post(&http_client(), addr, "/quick/b"),
    )
    .await
    .expect("a request for another key is served while one waits for its lock");
    assert_eq!(other.status, 200);
    assert!(!waiting.is_finished(), "the request for a still waits");
    held.release().await.unwrap();
    assert_eq!(waiting.await.unwrap(), 200);
}

#[tokio::test]
async fn a_plain_tower_service_keeps_its_own_body_type() {
    crate::needs!(Redis);
    let server = RedisServer::start();
    let backend = server.backend().await;
    let service = ServiceBuilder::new()
        .layer(LockLayer::new(backend.clone(), |_: &http::Request<()>| Some("k")).fail_fast())
        .service_fn(|_: http::Request<()>| async {
            Ok::<_, Infallible>(http::Response::new(Full::new(Bytes::from_static(b"done"))))
        });
    let read = |response: http::Response<ResponseBody<Full<Bytes>>>| async move {
        let status = response.status();
        (
            status,
            response.into_body().collect().await.unwrap().to_bytes(),
        )
    };
    let served = service
        .clone()
        .oneshot(http::Request::new(()))
        .await
        .unwrap();
    assert_eq!(read(served).await, (StatusCode::OK, Bytes::from("done")));
    let _held = backend.lock("k").try_once().await.unwrap();
    let rejected = service.oneshot(http::Request::new(())).await.unwrap();
    let (status, body) = read(rejected).await;
    assert_eq!(status, StatusCode::CONFLICT);
    assert!(body.starts_with(b"{"), "a problem+json body: {body:?}");
}

#[tokio::test]
async fn nested_layers_on_one_key_reenter_and_leave_no_hash() {
    crate::needs!(Redis);
    let server = RedisServer::start();
    let backend = server.backend().await;
    let (entered_tx, entered_rx) = tokio::sync::oneshot::channel::<()>();
    let (go_tx, go_rx) = tokio::sync::oneshot::channel::<()>();
    let gate = std::sync::Arc::new(tokio::sync::Mutex::new(Some((entered_tx, go_rx))));
    let handler = move || {
        let gate = gate.clone();
        async move {
            if let Some((entered, go)) = gate.lock().await.take() {
                let _ = entered.send(());
                let _ = go.await;
            }
            "nested"
        }
    };
    let key = |_: &Request| Some("k");
    let app = Router::new()
        .route("/nested", routing::post(handler))
        .route_layer(LockLayer::new(backend.clone(), key).fail_fast())
        .route_layer(LockLayer::new(backend.clone(), key).fail_fast());
    let addr = serve(app).await;
    let first = tokio::spawn(async move { post(&http_client(), addr, "/nested").await.status });
    entered_rx.await.unwrap();
    let mut conn = server.conn().await;
    let counts: Vec<i64> = conn.hvals(lock_key("k")).await.unwrap();
    assert!(counts.contains(&2), "the owner entered twice: {counts:?}");
    assert_eq!(post(&http_client(), addr, "/nested").await.status, 409);
    go_tx.send(()).unwrap();
    assert_eq!(first.await.unwrap(), 200);
    assert!(!server.exists(&lock_key("k")).await);
}

async fn panics(State(gate): State<Gate>) -> &'static str {
    gate.pass().await;
    panic!("handler bug")
}

#[tokio::test]
async fn handler_panic_releases_the_lock_and_its_channel() {
    crate::needs!(Redis);
    let server = RedisServer::start();
    let gate = Gate::default();
    // Two instances, so that the waiter on the second one subscribes in Redis.
    let mut instances = Vec::new();
    for _ in 0..2 {
        let backend = server.backend().await;
        let app = Router::new()
            .route("/panic", routing::post(panics))
            .with_state(gate.clone())
            .route_layer(
                LockLayer::new(backend.clone(), |_: &Request| Some("k"))
                    .wait(Duration::from_secs(10)),
            );
        instances.push((serve(app).await, backend));
    }
    let client = http_client();
    let first = tokio::spawn({
        let (client, addr) = (client.clone(), instances[0].0);
        async move { client.request(post_request(addr, "/panic")).await.is_err() }
    });
    gate.wait_inside(1).await;
    let second = tokio::spawn({
        let (client, addr) = (client.clone(), instances[1].0);
        async move { client.request(post_request(addr, "/panic")).await.is_err() }
    });
    server.wait_for_subscribers("k", 1).await;
    gate.open();
    assert!(
        first.await.unwrap(),
        "the panicking request's connection is closed"
    );
    assert!(
        second.await.unwrap(),
        "the waiter got the lock and panicked too"
    );
    server.wait_until_released("k").await;
    server.wait_for_subscribers("k", 0).await;
    assert_eq!(instances[1].1.stats().channels_with_waiters, 0);
}

#[tokio::test]
async fn client_disconnect_releases_the_lock_and_its_channel() {
    crate::needs!(Redis);
    let server = RedisServer::start();
    let holding = holding_app(&server, |l| l.wait(Duration::from_secs(10))).await;
    // The waiter is on a second instance, so that it subscribes in Redis.
    let waiting = holding_app(&server, |l| l.wait(Duration::from_secs(10))).await;
    let mut holder = raw_post(holding.addr, "/hold/k").await;
    server.wait_until_held("k").await;
    let waiter = raw_post(waiting.addr, "/hold/k").await;
    server.wait_for_subscribers("k", 1).await;
    drop(waiter);
    holder.shutdown().await.unwrap();
    drop(holder);
    server.wait_until_released("k").await;
    server.wait_for_subscribers("k", 0).await;
    assert_eq!(holding.backend.stats().watched_locks, 0);
    assert_eq!(waiting.backend.stats().channels_with_waiters, 0);
}

#[tokio::test]
async fn lock_deleted_from_outside_aborts_the_handler_with_503() {
    crate::needs!(Redis);
    let server = RedisServer::start();
    let app = holding_app(&server, |l| l.lease(Duration::from_millis(600))).await;
    let addr = app.addr;
    let request = tokio::spawn(async move { post(&http_client(), addr, "/hold/k").await });
    server.wait_until_held("k").await;
    let _: () = server.conn().await.del(lock_key("k")).await.unwrap();
    let reply = tokio::time::timeout(Duration::from_secs(10), request)
        .await
        .expect("aborted, not left running")
        .unwrap();
    assert_eq!(reply.status, 503);
    assert!(reply.body.contains("Lock lost"), "{}", reply.body);
}

#[tokio::test]
async fn watchdog_keeps_the_lock_through_a_handler_running_three_leases() {
    crate::needs!(Redis);
    // Renewed every third of it: a second of room for a renewal delayed on a loaded machine.
    const LEASE: Duration = Duration::from_millis(1500);
    let server = RedisServer::start();
    let backend = server.backend().await;
    let gate = Gate::default();
    let app = Router::new()
        .route(
            "/slow",
            routing::post(|State(gate): State<Gate>| async move {
                gate.pass().await;
                "slow"
            }),
        )
        .route("/try", routing::post(|| async { "got it" }))
        .with_state(gate.clone())
        .route_layer(
            LockLayer::new(backend, |_: &Request| Some("k"))
                .fail_fast()
                .lease(LEASE),
        );
    let addr = serve(app).await;
    let slow = tokio::spawn(async move { post(&http_client(), addr, "/slow").await.status });
    gate.wait_inside(1).await;
    tokio::time::sleep(3 * LEASE + LEASE / 5).await;
    assert_eq!(
        post(&http_client(), addr, "/try").await.status,
        409,
        "still held after three leases"
    );
    gate.open();
    assert_eq!(slow.await.unwrap(), 200, "finished, not aborted as lost");
    assert_eq!(post(&http_client(), addr, "/try").await.status, 200);
}

#[tokio::test]
async fn empty_and_oversized_keys_answer_400() {
    crate::needs!(Redis);
    let server = RedisServer::start();
    let backend = server.backend().await;
    let app = Router::new()
        .route("/{*key}", routing::post(|| async { "ok" }))
        .route_layer(LockLayer::new(backend, |req: &Request| {
            let key = req.uri().query().unwrap_or_default();
            Some(if key == "big" {
                "k".repeat(100 * 1024)
            } else {
                key.to_owned()
            })
        }));
    let addr = serve(app).await;
    for query in ["/x?", "/x?big"] {
        let reply = post(&http_client(), addr, query).await;
        assert_eq!(reply.status, 400, "{query}");
        assert_eq!(reply.headers["content-type"], "application/problem+json");
    }
    assert_eq!(post(&http_client(), addr, "/x?fine").await.status, 200);
}

#[tokio::test]
async fn unreachable_redis_answers_503_within_the_wait() {
    crate::needs!(Redis);
    let mut server = RedisServer::start();
    let backend = server.backend().await;
    let app = Router::new()
        .route("/x", routing::post(|| async { "ok" }))
        .route_layer(LockLayer::new(backend, |_: &Request| Some("k")).wait(Duration::from_secs(2)));
    let addr = serve(app).await;
    server.kill();
    let reply = tokio::time::timeout(Duration::from_secs(10), post(&http_client(), addr, "/x"))
        .await
        .expect("no hang");
    assert_eq!(reply.status, 503);
    assert!(reply.headers.contains_key("retry-after"));
    assert!(
        reply.body.contains("Lock service unavailable"),
        "{}",
        reply.body
    );
}

#[tokio::test]
async fn rejections_can_be_overridden() {
    crate::needs!(Redis);
    let server = RedisServer::start();
    let app = holding_app(&server, |l| {
        l.fail_fast().on_rejection(|e: LockError| {
            match e {
                LockError::Contended { .. } => (StatusCode::TOO_MANY_REQUESTS, "busy, try later"),
                _ => (StatusCode::INTERNAL_SERVER_ERROR, "other"),
            }
            .into_response()
        })
    })
    .await;
    let _held = app.backend.lock("k").try_once().await.unwrap();
    let reply = post(&http_client(), app.addr, "/quick/k").await;
    assert_eq!(
        (reply.status, reply.body.as_str()),
        (429, "busy, try later")
    );
}

/// Sends a request on a raw connection that the test can drop mid-request.
async fn raw_post(addr: SocketAddr, path: &str) -> tokio::net::TcpStream {
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let request = format!("POST {path} HTTP/1.1\r\nhost: test\r\ncontent-length: 0\r\n\r\n");
    stream.write_all(request.as_bytes()).await.unwrap();
    stream
}

#[tokio::test]
async fn router_layer_lets_unmatched_requests_through_unlocked_to_their_404() {
    crate::needs!(Redis);
    let server = RedisServer::start();
    let backend = server.backend().await;
    let by_path = Router::new()
        .route("/orders/{id}", routing::post(|| async { "ok" }))
        .layer(
            LockLayer::new(backend.clone(), |req: &Request| {
                Some(req.uri().path().to_owned())
            })
            .fail_fast(),
        );
    let by_param = Router::new()
        .route("/carts/{id}", routing::post(|| async { "ok" }))
        .layer(LockLayer::new(backend.clone(), PathParam::new("id")).fail_fast());
    let (by_path, by_param) = (serve(by_path).await, serve(by_param).await);
    let client = http_client();

    let scripts = server.command_calls(&["evalsha", "eval"]).await;
    let keys = server.keys().await;
    for addr in [by_path, by_param] {
        let reply = post(&client, addr, "/nowhere").await;
        assert_eq!((reply.status, reply.body.as_str()), (404, ""));
    }
    assert_eq!(server.command_calls(&["evalsha", "eval"]).await, scripts);
    assert_eq!(server.keys().await, keys);

    // Matched routes are still locked, and so is a matched path with the wrong method
    // (documented: `route_layer` would answer its 405 unlocked).
    let get = || {
        http::Request::get(format!("http://{by_path}/orders/1"))
            .body(Default::default())
            .unwrap()
    };
    let held = backend.lock("/orders/1").try_once().await.unwrap();
    assert_eq!(post(&client, by_path, "/orders/1").await.status, 409);
    assert_eq!(support::send(&client, get()).await.status, 409);
    held.release().await.unwrap();
    assert_eq!(support::send(&client, get()).await.status, 405);
    let held = backend.lock("7").try_once().await.unwrap();
    assert_eq!(post(&client, by_param, "/carts/7").await.status, 409);
    held.release().await.unwrap();
}

#[tokio::test]
async fn rejections_can_start_from_the_default_and_change_one_header() {
    crate::needs!(Redis);
    let server = RedisServer::start();
    let app = holding_app(&server, |l| {
        l.fail_fast().on_rejection(|e: LockError| {
            let mut response = tower_lock::layer::response::default_rejection(&e);
            let status = e.status().as_u16().to_string();
            response
                .headers_mut()
                .insert("x-lock-status", status.parse().unwrap());
            response
        })
    })
    .await;
    let _held = app.backend.lock("k").try_once().await.unwrap();
    let reply = post(&http_client(), app.addr, "/quick/k").await;
    reply.problem(409);
    assert_eq!(reply.headers["x-lock-status"], "409");
    assert!(reply.headers.contains_key("retry-after"));
}

#[tokio::test]
async fn a_service_outside_any_router_is_locked() {
    crate::needs!(Redis);
    use tower::{Layer, ServiceExt};
    let server = RedisServer::start();
    let backend = server.backend().await;
    let service = LockLayer::new(backend.clone(), |req: &Request| {
        Some(req.uri().path().to_owned())
    })
    .fail_fast()
    .layer(tower::service_fn(|_: Request| async {
        Ok::<_, std::convert::Infallible>(axum::response::Response::new(axum::body::Body::empty()))
    }));
    let request = || {
        Request::post("/nowhere")
            .body(axum::body::Body::empty())
            .unwrap()
    };
    let held = backend.lock("/nowhere").try_once().await.unwrap();
    let busy = service.clone().oneshot(request()).await.unwrap();
    assert_eq!(busy.status(), StatusCode::CONFLICT);
    held.release().await.unwrap();
    let free = service.oneshot(request()).await.unwrap();
    assert_eq!(free.status(), StatusCode::OK);
}

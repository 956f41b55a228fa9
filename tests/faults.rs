//! Fault injection and bad input, against real redis-server processes (one per test) and,
//! where a holder must die or freeze, real child processes.
//!
//! Every test asserts outcomes (status codes, Redis state, counters); waits are bounded
//! generously to turn a hang into a failure, never to measure time.

mod support;

use std::io::Write as _;
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use axum::Router;
use axum::extract::Request;
use axum::routing;
use http::StatusCode;
use support::child;
use support::{
    RedisServer, Reply, channel, eventually, http_client, lock_key, post, post_request, serve,
};
use tokio::task::JoinHandle;
use tower_http::timeout::TimeoutLayer;
use tower_lock::response::PROBLEM_JSON;
use tower_lock::{KeyExtractor, LockLayer, RedisBackend};

/// How long a request waits for a held lock in these tests.
const WAIT: Duration = Duration::from_secs(1);
/// Generous bound on anything that should end by a deadline of a few seconds.
const HANG: Duration = Duration::from_secs(20);

/// The key of `/ROUTE/KEY`.
fn path_key(req: &Request) -> Option<String> {
    req.uri().path().splitn(3, '/').nth(2).map(str::to_owned)
}

type PathLayer = LockLayer<RedisBackend, fn(&Request) -> Option<String>>;

/// `/hold/K` holds K until cancelled, `/quick/K` takes K briefly, `/panic/K` panics under K.
fn locked_app<K: KeyExtractor<axum::body::Body>>(layer: LockLayer<RedisBackend, K>) -> Router {
    Router::new()
        .route("/hold/{key}", routing::post(std::future::pending::<()>))
        .route("/quick/{key}", routing::post(|| async { "done" }))
        .route("/panic/{key}", routing::post(panics))
        .route_layer(layer)
}

async fn panics() -> &'static str {
    panic!("handler panics while holding its lock")
}

async fn app(backend: &RedisBackend, configure: fn(PathLayer) -> PathLayer) -> SocketAddr {
    support::init_tracing();
    let layer = LockLayer::new(backend.clone(), path_key as fn(&Request) -> Option<String>);
    serve(locked_app(configure(layer).wait(WAIT))).await
}

fn spawn_post(addr: SocketAddr, path: &str) -> JoinHandle<Reply> {
    let path = path.to_owned();
    tokio::spawn(async move { post(&http_client(), addr, &path).await })
}

/// Awaits every request, failing on a hang, and returns their statuses.
async fn statuses(requests: Vec<JoinHandle<Reply>>) -> Vec<u16> {
    let mut statuses = Vec::new();
    for request in requests {
        let reply = tokio::time::timeout(HANG, request)
            .await
            .expect("the request finished (no hang)")
            .expect("request task");
        // Other statuses come from other layers (a timeout) or hyper itself.
        if [400, 409, 503].contains(&reply.status) {
            assert_problem_json(&reply);
        }
        statuses.push(reply.status);
    }
    statuses
}

fn assert_problem_json(reply: &Reply) {
    assert_eq!(
        reply.headers[http::header::CONTENT_TYPE],
        PROBLEM_JSON,
        "{reply:?}"
    );
    let body: serde_json::Value = serde_json::from_str(&reply.body).expect("JSON body");
    assert_eq!(body["status"], reply.status, "{reply:?}");
    assert!(
        body["title"].is_string() && body["detail"].is_string(),
        "{reply:?}"
    );
}

async fn wait_until_held(server: &RedisServer, key: &str) {
    let lock = lock_key(key);
    eventually("the lock is held", || server.exists(&lock)).await;
}

async fn wait_until_released(server: &RedisServer, key: &str) {
    let lock = lock_key(key);
    eventually("the lock is released", || async {
        !server.exists(&lock).await
    })
    .await;
}

async fn wait_for_subscribers(server: &RedisServer, key: &str, n: i64) {
    let channel = channel(key);
    eventually(&format!("{n} subscriber(s) on {channel}"), || async {
        server.numsub(&channel).await == n
    })
    .await;
}

// ---------------------------------------------------------------------------------------
// Redis faults

#[tokio::test]
async fn redis_killed_mid_request_answers_503_and_recovers_after_restart() {
    let mut server = RedisServer::start();
    let backend = server.backend().await;
    let addr = app(&backend, |layer| layer.lease(Duration::from_secs(2))).await;

    let mut requests = vec![spawn_post(addr, "/hold/a")];
    wait_until_held(&server, "a").await;
    requests.extend((0..3).map(|_| spawn_post(addr, "/quick/a")));
    wait_for_subscribers(&server, "a", 1).await;

    server.kill();
    // The holder is stopped once its lease has certainly run out, the waiters as soon as
    // Redis cannot be reached: every one ends with 503, none hangs.
    assert_eq!(statuses(requests).await, [503; 4]);

    server.restart();
    let client = http_client();
    for key in ["a", "b"] {
        let reply = post(&client, addr, &format!("/quick/{key}")).await;
        assert_eq!(
            reply.status, 200,
            "same app and backend after restart: {reply:?}"
        );
    }
}

#[tokio::test]
async fn redis_paused_past_the_wait_answers_503_then_recovers_after_sigcont() {
    let server = RedisServer::start();
    let backend = server.backend().await;
    let addr = app(&backend, |layer| layer).await;
    let holder = backend.lock("a").try_once().await.expect("uncontended");
    let waiters: Vec<_> = (0..3).map(|_| spawn_post(addr, "/quick/a")).collect();
    wait_for_subscribers(&server, "a", 1).await;

    server.pause();
    let mut requests = waiters;
    requests.push(spawn_post(addr, "/quick/b"));
    let outcome = statuses(requests).await;
    server.resume();
    assert_eq!(outcome, [503; 4]);

    holder
        .release()
        .await
        .expect("the holder still holds after SIGCONT");
    let client = http_client();
    for key in ["a", "b"] {
        let reply = post(&client, addr, &format!("/quick/{key}")).await;
        assert_eq!(reply.status, 200, "after SIGCONT: {reply:?}");
    }
}

#[tokio::test]
async fn subscriber_killed_while_waiting_waiters_are_served_after_the_release() {
    let server = RedisServer::start();
    let backend = server.backend().await;
    // Waits far below the holder's lease: a waiter that is served was woken by the
    // release (or the resubscription), not by the lease running out.
    let addr = app(&backend, |layer| layer.wait(Duration::from_secs(10))).await;
    let holder_backend = server.backend().await;
    for resubscribed_before_release in [false, true] {
        let holder = holder_backend
            .lock("a")
            .lease(Duration::from_secs(30))
            .try_once()
            .await
            .expect("uncontended");
        let waiters: Vec<_> = (0..3).map(|_| spawn_post(addr, "/quick/a")).collect();
        wait_for_subscribers(&server, "a", 1).await;
        assert!(server.kill_subscribers().await >= 1);
        if resubscribed_before_release {
            wait_for_subscribers(&server, "a", 1).await;
        }
        holder.release().await.expect("release");
        assert_eq!(statuses(waiters).await, [200; 3]);
    }
    wait_for_subscribers(&server, "a", 0).await;
}

// ---------------------------------------------------------------------------------------
// Cancellation

#[tokio::test]
async fn handler_panic_releases_the_lock_and_leaves_no_subscription() {
    let server = RedisServer::start();
    let backend = server.backend().await;
    let addr = app(&backend, |layer| layer.wait(Duration::from_secs(10))).await;
    let holder = backend.lock("a").try_once().await.expect("uncontended");
    let panicking = tokio::spawn(async move {
        let client = http_client();
        client
            .request(post_request(addr, "/panic/a"))
            .await
            .map(|r| r.status())
    });
    wait_for_subscribers(&server, "a", 1).await;
    holder.release().await.expect("release");

    let outcome = tokio::time::timeout(HANG, panicking)
        .await
        .expect("no hang")
        .expect("task");
    assert!(
        outcome.is_err(),
        "the panic drops the connection: {outcome:?}"
    );
    wait_until_released(&server, "a").await;
    wait_for_subscribers(&server, "a", 0).await;
    assert_eq!(post(&http_client(), addr, "/quick/a").await.status, 200);
}

/// Sends `POST path` on a raw connection and leaves it open (dropping it disconnects).
fn raw_post(addr: SocketAddr, path: &str) -> TcpStream {
    let mut stream = TcpStream::connect(addr).expect("connect");
    write!(
        stream,
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Length: 0\r\n\r\n"
    )
    .expect("send request");
    stream
}

#[tokio::test]
async fn client_disconnect_releases_the_lock_and_leaves_no_subscription() {
    let server = RedisServer::start();
    let backend = server.backend().await;
    let addr = app(&backend, |layer| layer.wait(Duration::from_secs(30))).await;
    let holding = raw_post(addr, "/hold/a");
    wait_until_held(&server, "a").await;
    let waiting = raw_post(addr, "/hold/a");
    wait_for_subscribers(&server, "a", 1).await;

    drop(waiting);
    wait_for_subscribers(&server, "a", 0).await;
    assert!(
        server.exists(&lock_key("a")).await,
        "the holder is unaffected"
    );
    drop(holding);
    wait_until_released(&server, "a").await;
    assert_eq!(backend.stats().channels_with_waiters, 0);
    assert_eq!(backend.stats().watched_locks, 0);
}

#[tokio::test]
async fn outer_timeout_layer_releases_the_lock_and_leaves_no_subscription() {
    let server = RedisServer::start();
    let backend = server.backend().await;
    let layer = LockLayer::new(backend.clone(), path_key).wait(Duration::from_secs(30));
    let app = locked_app(layer).layer(TimeoutLayer::with_status_code(
        StatusCode::GATEWAY_TIMEOUT,
        Duration::from_secs(2),
    ));
    let addr = serve(app).await;
    let holding = spawn_post(addr, "/hold/a");
    wait_until_held(&server, "a").await;
    let waiting = spawn_post(addr, "/hold/a");
    wait_for_subscribers(&server, "a", 1).await;

    // The holder's handler and the waiter's acquisition are both cut off by the timeout.
    assert_eq!(statuses(vec![holding, waiting]).await, [504, 504]);
    wait_until_released(&server, "a").await;
    wait_for_subscribers(&server, "a", 0).await;
    assert_eq!(backend.stats().channels_with_waiters, 0);
}

#[tokio::test]
#[ignore = "entry point of the child processes that the fault tests spawn"]
async fn child_process() {
    let _ = child::role();
}

//! Fault injection and bad input, against real redis-server processes (one per test) and,
//! where a holder must die or freeze, real child processes.
//!
//! Every test asserts outcomes (status codes, Redis state, counters); waits are bounded
//! generously to turn a hang into a failure, never to measure time.

use crate::support;

use std::io::{Read as _, Write as _};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::Extension;
use axum::Router;
use axum::extract::Request;
use axum::routing;
use http::StatusCode;
use redis::AsyncCommands;
use support::child::{self, ChildProcess};
use support::{
    RedisServer, Reply, eventually, http_client, lock_key, post, post_request, queued, serve,
    try_send,
};
use tokio::io::AsyncWriteExt as _;
use tokio::task::JoinHandle;
use tower_http::timeout::TimeoutLayer;
use tower_lock::layer::response::PROBLEM_JSON;
use tower_lock::redis::{FencedStore, FencedWrite};
use tower_lock::{HeldLock, KeyError, KeyExtractor, LockError, LockLayer, RedisBackend};

/// How long a request waits for a held lock in these tests.
const WAIT: Duration = Duration::from_secs(1);
/// The wait of requests that must be served while the subscriber reconnects after a
/// fault (its backoff is capped at 2 s).
const RECOVERY_WAIT: Duration = Duration::from_secs(3);
/// Generous bound on anything that should end by a deadline of a few seconds.
const HANG: Duration = Duration::from_secs(20);

/// The key of `/ROUTE/KEY`.
fn path_key(req: &Request) -> Option<String> {
    req.uri().path().splitn(3, '/').nth(2).map(str::to_owned)
}

type PathLayer = LockLayer<fn(&Request) -> Option<String>>;

/// `/hold/K` holds K until cancelled, `/quick/K` takes K briefly, `/panic/K` panics under
/// K, `/token/K` answers with its fencing token.
fn locked_app<K: KeyExtractor<axum::body::Body>>(layer: LockLayer<K>) -> Router {
    Router::new()
        .route("/hold/{key}", routing::post(std::future::pending::<()>))
        .route("/quick/{key}", routing::post(|| async { "done" }))
        .route("/panic/{key}", routing::post(panics))
        .route("/token/{key}", routing::post(token))
        .route_layer(layer)
}

async fn panics() -> &'static str {
    panic!("handler panics while holding its lock")
}

async fn token(Extension(lock): Extension<HeldLock>) -> String {
    lock.fencing_token().to_string()
}

/// A fresh server, a backend on it, and the routes served behind a layer on that backend
/// (waiting 1 s unless `configure` says otherwise).
async fn start_app(
    configure: fn(PathLayer) -> PathLayer,
) -> (RedisServer, RedisBackend, SocketAddr) {
    support::init_tracing();
    let server = RedisServer::start();
    let backend = server.backend().await;
    let layer = LockLayer::new(backend.clone(), path_key as fn(&Request) -> Option<String>);
    let addr = serve(locked_app(configure(layer.wait(WAIT)))).await;
    (server, backend, addr)
}

fn spawn_post(addr: SocketAddr, path: &str) -> JoinHandle<Reply> {
    let path = path.to_owned();
    tokio::spawn(async move { post(&http_client(), addr, &path).await })
}

/// Awaits a spawned task, failing on a hang or a panic.
async fn finish<T>(task: JoinHandle<T>) -> T {
    tokio::time::timeout(HANG, task)
        .await
        .expect("finished (no hang)")
        .expect("the task did not panic")
}

/// Awaits every request, failing on a hang, and returns their statuses.
async fn statuses(requests: Vec<JoinHandle<Reply>>) -> Vec<u16> {
    let mut statuses = Vec::new();
    for request in requests {
        let reply = finish(request).await;
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

// ---------------------------------------------------------------------------------------
// Redis faults

#[tokio::test]
async fn redis_killed_mid_request_answers_503_and_recovers_after_restart() {
    crate::needs!(Redis);
    let (mut server, backend, addr) =
        start_app(|layer| layer.wait(RECOVERY_WAIT).lease(Duration::from_secs(2))).await;

    let holder = spawn_post(addr, "/hold/a");
    server.wait_until_held("a").await;
    let waiters: Vec<_> = (0..3).map(|_| spawn_post(addr, "/quick/a")).collect();
    queued(&backend, 3).await;

    server.kill();
    // The holder is answered once its lease has certainly run out. The waiters queue
    // in-process behind it and do not talk to Redis: each is answered when its turn
    // comes and it finds Redis unreachable, or when its wait runs out first. Every one
    // ends with 503, none hangs.
    for waiter in waiters {
        let (status, problem) = rejection(&finish(waiter).await);
        assert_eq!(status, 503);
        assert!(
            ["Backend", "TimedOut"].contains(&problem.as_str()),
            "{problem}"
        );
    }
    assert_eq!(rejection(&finish(holder).await), (503, "Lost".to_owned()));

    server.restart();
    assert_recovered(&server, addr).await;
}

#[tokio::test]
async fn every_pooled_connection_is_replaced_after_a_redis_restart() {
    crate::needs!(Redis);
    let mut server = RedisServer::start();
    let backend = RedisBackend::builder(server.url())
        .pool_size(4)
        .command_timeout(Duration::from_millis(500))
        .build()
        .await
        .expect("connects");
    // Enough concurrent commands that the pool opens all its connections, released and
    // awaited, so that nothing is in flight when Redis dies.
    let acquisitions: Vec<_> = (0..64)
        .map(|i| {
            let backend = backend.clone();
            tokio::spawn(async move { backend.lock(format!("k{i}")).try_once().await })
        })
        .collect();
    for acquisition in acquisitions {
        let guard = finish(acquisition).await.expect("uncontended");
        guard.release().await.expect("release");
    }
    let connections_made = backend.stats().subscriber_connections_made;
    server.kill();
    server.restart();
    // A request racing the restart may fail; once the backend has noticed it (its
    // subscriber reconnected), none may fail on a stale pooled connection.
    eventually("the subscriber reconnected", || async {
        backend.stats().subscriber_connections_made > connections_made
    })
    .await;
    // One at a time, so each gets whichever pooled connection is next.
    for i in 0..8 {
        let result = backend
            .lock(format!("after-{i}"))
            .try_once()
            .await
            .map(drop);
        assert!(result.is_ok(), "request {i} after the restart: {result:?}");
    }
}

async fn fencing_token(addr: SocketAddr, key: &str) -> u64 {
    let reply = post(&http_client(), addr, &format!("/token/{key}")).await;
    assert_eq!(reply.status, 200, "{reply:?}");
    reply.body.parse().expect("a token")
}

#[tokio::test]
async fn redis_restarted_under_a_holder_aborts_it_and_tokens_keep_increasing() {
    crate::needs!(Redis);
    let (mut server, _, addr) = start_app(|layer| layer.lease(Duration::from_secs(3))).await;
    let before = fencing_token(addr, "a").await;
    let holder = spawn_post(addr, "/hold/a");
    server.wait_until_held("a").await;

    // Without persistence the restarted server has lost the lock and its fence counter.
    server.restart();
    let reply = finish(holder).await;
    assert_eq!(
        rejection(&reply),
        (503, "Lost".to_owned()),
        "renewal found the lock gone"
    );
    assert!(
        fencing_token(addr, "a").await > before,
        "tokens survive the lost counter"
    );
}

#[tokio::test]
async fn lock_key_overwritten_while_held_aborts_the_holder_and_keeps_the_overwrite() {
    crate::needs!(Redis);
    let (server, backend, addr) = start_app(|layer| layer.lease(Duration::from_secs(1))).await;
    let holder = spawn_post(addr, "/hold/a");
    server.wait_until_held("a").await;

    let mut conn = server.conn().await;
    let _: () = conn.set(lock_key("a"), "someone else's").await.unwrap();
    let reply = finish(holder).await;
    assert_eq!(rejection(&reply), (503, "Lost".to_owned()));
    let reply = post(&http_client(), addr, "/quick/a").await;
    assert_eq!(rejection(&reply), (503, "NotALock".to_owned()));
    let value: String = conn.get(lock_key("a")).await.unwrap();
    assert_eq!(
        value, "someone else's",
        "neither release nor acquire touched it"
    );
    assert_eq!(backend.stats().watched_locks, 0);

    // Without HTTP: releasing a lock whose key was overwritten reports it lost.
    let guard = backend.lock("b").try_once().await.expect("uncontended");
    let _: () = conn.set(lock_key("b"), "someone else's").await.unwrap();
    let released = guard.release().await;
    assert!(
        matches!(released, Err(LockError::Lost { .. })),
        "{released:?}"
    );
}

#[tokio::test]
async fn redis_paused_past_the_wait_answers_503_then_recovers_after_sigcont() {
    crate::needs!(Redis);
    let (server, backend, addr) = start_app(|layer| layer.wait(RECOVERY_WAIT)).await;
    let holder = backend.lock("a").try_once().await.expect("uncontended");
    let waiters: Vec<_> = (0..3).map(|_| spawn_post(addr, "/quick/a")).collect();
    queued(&backend, 3).await;

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
    assert_eq!(post(&http_client(), addr, "/quick/a").await.status, 200);
    assert_recovered(&server, addr).await;
}

#[tokio::test]
async fn redis_paused_past_the_lease_stops_the_holder_with_503_then_recovers() {
    crate::needs!(Redis);
    let (server, _, addr) =
        start_app(|layer| layer.wait(RECOVERY_WAIT).lease(Duration::from_secs(1))).await;
    let holder = spawn_post(addr, "/hold/a");
    server.wait_until_held("a").await;

    server.pause();
    // Renewals time out; once the lease has certainly run out the handler is stopped.
    let reply = finish(holder).await;
    server.resume();
    assert_eq!(rejection(&reply), (503, "Lost".to_owned()));
    // Redis expired the lease on its own clock meanwhile.
    server.wait_until_released("a").await;
    assert_recovered(&server, addr).await;
}

#[tokio::test]
async fn release_that_cannot_reach_a_paused_redis_completes_after_sigcont() {
    crate::needs!(Redis);
    support::init_tracing();
    let server = RedisServer::start();
    let backend = server.backend().await;
    let gate = Arc::new(tokio::sync::Notify::new());
    let app = Router::new()
        .route(
            "/gate/{key}",
            routing::post(
                |Extension(gate): Extension<Arc<tokio::sync::Notify>>| async move {
                    gate.notified().await;
                    "done"
                },
            ),
        )
        .route_layer(LockLayer::new(backend.clone(), path_key))
        .layer(Extension(gate.clone()));
    let addr = serve(app).await;
    let request = spawn_post(addr, "/gate/a");
    server.wait_until_held("a").await;

    // Freeze Redis until the backend has noticed (its subscriber's ping timed out), so the
    // release cannot even be sent before the handler's answer is due.
    server.pause();
    eventually("the backend noticed the frozen server", || async {
        !backend.stats().subscriber_connected
    })
    .await;
    gate.notify_one();
    let reply = finish(request).await;
    server.resume();
    assert_eq!(
        reply.status, 200,
        "the work was done under the lock: {reply:?}"
    );
    // The default lease (30 s) is far beyond this wait: the release itself freed it.
    server.wait_until_released("a").await;
}

/// Takes `key` with a lease (30 s) far beyond any wait in these tests, so that a waiter
/// that is served was woken, not let in by the lease running out.
async fn hold_long(backend: &RedisBackend, key: &str) -> tower_lock::LockGuard {
    backend
        .lock(key)
        .lease(Duration::from_secs(30))
        .try_once()
        .await
        .expect("uncontended")
}

/// Checks that the app serves requests again, uncontended and contended. The contended
/// holder's lease (30 s) is far beyond the wait, so only a release message (or the
/// resubscription after a reconnect) can serve the waiter.
async fn assert_recovered(server: &RedisServer, addr: SocketAddr) {
    let reply = post(&http_client(), addr, "/quick/fresh").await;
    assert_eq!(reply.status, 200, "uncontended after the fault: {reply:?}");
    let guard = hold_long(&server.backend().await, "contended").await;
    let waiter = spawn_post(addr, "/quick/contended");
    server.wait_for_subscribers("contended", 1).await;
    guard.release().await.expect("release");
    assert_eq!(
        statuses(vec![waiter]).await,
        [200],
        "contended after the fault"
    );
}

#[tokio::test]
async fn subscriber_killed_while_waiting_waiters_are_served_after_the_release() {
    crate::needs!(Redis);
    // Waits far below the holder's lease: a waiter that is served was woken by the
    // release (or the resubscription), not by the lease running out.
    let (server, _, addr) = start_app(|layer| layer.wait(Duration::from_secs(10))).await;
    let holder_backend = server.backend().await;
    // Several keys, so that one connection carries several channels to resubscribe.
    let keys = ["a", "b", "c", "d", "e"];
    for resubscribed_before_release in [false, true] {
        let mut holders = Vec::new();
        let mut waiters = Vec::new();
        for key in keys {
            holders.push(hold_long(&holder_backend, key).await);
            waiters.extend((0..3).map(|_| spawn_post(addr, &format!("/quick/{key}"))));
        }
        for key in keys {
            server.wait_for_subscribers(key, 1).await;
        }
        assert!(server.kill_subscribers().await >= 1);
        if resubscribed_before_release {
            for key in keys {
                server.wait_for_subscribers(key, 1).await;
            }
        }
        for holder in holders {
            holder.release().await.expect("release");
        }
        assert_eq!(statuses(waiters).await, [200; 15]);
    }
    for key in keys {
        server.wait_for_subscribers(key, 0).await;
    }
}

// ---------------------------------------------------------------------------------------
// Cancellation

#[tokio::test]
async fn handler_panic_releases_the_lock_and_leaves_no_subscription() {
    crate::needs!(Redis);
    let (server, backend, addr) = start_app(|layer| layer.wait(Duration::from_secs(10))).await;
    let holder = backend.lock("a").try_once().await.expect("uncontended");
    let panicking = tokio::spawn(async move {
        let client = http_client();
        client
            .request(post_request(addr, "/panic/a"))
            .await
            .map(|r| r.status())
    });
    queued(&backend, 1).await;
    holder.release().await.expect("release");

    let outcome = finish(panicking).await;
    assert!(
        outcome.is_err(),
        "the panic drops the connection: {outcome:?}"
    );
    server.wait_until_released("a").await;
    server.wait_for_subscribers("a", 0).await;
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
    crate::needs!(Redis);
    let (server, backend, addr) = start_app(|layer| layer.wait(Duration::from_secs(30))).await;
    let holding = raw_post(addr, "/hold/a");
    server.wait_until_held("a").await;
    let waiting = raw_post(addr, "/hold/a");
    queued(&backend, 1).await;

    drop(waiting);
    queued(&backend, 0).await;
    assert!(
        server.exists(&lock_key("a")).await,
        "the holder is unaffected"
    );
    drop(holding);
    server.wait_until_released("a").await;
    assert_eq!(backend.stats().channels_with_waiters, 0);
    assert_eq!(backend.stats().watched_locks, 0);
}

#[tokio::test]
async fn acquisition_cancelled_while_its_script_is_in_flight_leaves_no_lock() {
    crate::needs!(Redis);
    let server = RedisServer::start();
    let backend = server.backend().await;
    // Connect before the pause.
    drop(backend.lock("warm-up").try_once().await.expect("connects"));
    server.pause();
    let acquiring = {
        let backend = backend.clone();
        tokio::spawn(async move { backend.lock("a").wait(HANG).await.map(drop) })
    };
    // Let the acquire script reach the (frozen) server, then cancel the acquisition:
    // the script runs once Redis continues, for an owner nobody holds a guard for. (On a
    // machine too slow to send it within the pause, nothing is in flight and the test
    // passes without proving anything; it cannot fail spuriously.)
    tokio::time::sleep(Duration::from_millis(200)).await;
    acquiring.abort();
    server.resume();
    server.wait_until_released("a").await;
    assert!(backend.lock("a").try_once().await.is_ok());
}

/// Polls `acquiring` (without a waker) until Redis has run its script for `key`, lets the
/// reply reach this process, then drops the acquisition without reading the reply: a
/// client gone, or an outer timeout firing, just after Redis answered.
async fn cancel_after_the_reply<F: Future>(server: &RedisServer, key: &str, acquiring: F) {
    let mut acquiring = std::pin::pin!(acquiring);
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    let lock = lock_key(key);
    eventually("the acquire script ran", || {
        let ready = acquiring.as_mut().poll(&mut cx).is_ready();
        assert!(
            !ready,
            "the acquisition was meant to be cancelled, not finished"
        );
        server.exists(&lock)
    })
    .await;
    tokio::time::sleep(Duration::from_millis(200)).await;
}

#[tokio::test]
async fn acquisition_cancelled_just_after_its_reply_arrived_leaves_no_lock() {
    crate::needs!(Redis);
    let server = RedisServer::start();
    let backend = server.backend().await;
    drop(backend.lock("warm-up").try_once().await.expect("connects"));
    // A 60 s lease: a leaked hold would outlive every wait below.
    let acquiring = backend.lock("a").lease(Duration::from_secs(60)).try_once();
    cancel_after_the_reply(&server, "a", acquiring).await;
    server.wait_until_released("a").await;
    assert_eq!(backend.stats().watched_locks, 0);
}

#[tokio::test]
async fn reentry_cancelled_just_after_its_reply_arrived_leaves_only_the_outer_hold() {
    crate::needs!(Redis);
    let server = RedisServer::start();
    let backend = server.backend().await;
    let outer = backend
        .lock("a")
        .lease(Duration::from_secs(60))
        .try_once()
        .await
        .expect("uncontended");
    let owner = outer.held().owner().as_str().to_owned();
    let lock = lock_key("a");
    let reentering = backend.lock("a").reentrant(outer.held()).try_once();
    // The outer hold already makes the key exist: wait for the re-entry's count instead.
    let mut reentering = Box::pin(reentering);
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    eventually("the re-entry's script ran", || {
        assert!(reentering.as_mut().poll(&mut cx).is_pending());
        let count = server.hold_count(&lock, &owner);
        async move { count.await == Some(2) }
    })
    .await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    drop(reentering);
    eventually("the cancelled re-entry was given back", || async {
        server.hold_count(&lock, &owner).await == Some(1)
    })
    .await;
    outer.release().await.expect("the outer hold is intact");
    assert!(!server.exists(&lock).await, "nothing is left held");
}

#[tokio::test]
async fn outer_timeout_layer_releases_the_lock_and_leaves_no_subscription() {
    crate::needs!(Redis);
    let server = RedisServer::start();
    let backend = server.backend().await;
    let layer = LockLayer::new(backend.clone(), path_key).wait(Duration::from_secs(30));
    let app = locked_app(layer).layer(TimeoutLayer::with_status_code(
        StatusCode::GATEWAY_TIMEOUT,
        Duration::from_secs(2),
    ));
    let addr = serve(app).await;
    let holding = spawn_post(addr, "/hold/a");
    server.wait_until_held("a").await;
    let waiting = spawn_post(addr, "/hold/a");
    queued(&backend, 1).await;

    // The holder's handler and the waiter's acquisition are both cut off by the timeout.
    assert_eq!(statuses(vec![holding, waiting]).await, [504, 504]);
    server.wait_until_released("a").await;
    server.wait_for_subscribers("a", 0).await;
    assert_eq!(backend.stats().channels_with_waiters, 0);
}

// ---------------------------------------------------------------------------------------
// Bad input

const KEY_HEADER: &str = "x-lock-key";

/// The key is the `x-lock-key` header. Written as an extractor rather than a closure: a
/// closure can only answer `None`, which would let a request with a non-UTF-8 key through
/// unlocked instead of rejecting it.
#[derive(Clone)]
struct HeaderKey;

impl KeyExtractor<axum::body::Body> for HeaderKey {
    fn extract(&self, req: &Request) -> Result<Option<String>, KeyError> {
        let value = req.headers().get(KEY_HEADER).ok_or(KeyError::Missing {
            source: format!("header {KEY_HEADER:?}"),
        })?;
        // Any UTF-8 is passed on: rejecting control characters is the backend's job.
        let key = std::str::from_utf8(value.as_bytes()).map_err(|_| KeyError::Malformed {
            reason: format!("the {KEY_HEADER} header is not UTF-8"),
        })?;
        Ok(Some(key.to_owned()))
    }
}

/// POSTs `/quick/x` with the key header set to `key` (no header for `None`).
async fn post_key(addr: SocketAddr, key: Option<&[u8]>) -> Result<Reply, axum::BoxError> {
    let mut request = post_request(addr, "/quick/x");
    if let Some(key) = key {
        let value = http::HeaderValue::from_bytes(key).expect("a valid header value");
        request.headers_mut().insert(KEY_HEADER, value);
    }
    try_send(&http_client(), request).await
}

/// The status and problem type (the `LockError` variant) of a rejection.
fn rejection(reply: &Reply) -> (u16, String) {
    assert_problem_json(reply);
    let body: serde_json::Value = serde_json::from_str(&reply.body).expect("JSON body");
    let kind = body["type"].as_str().expect("a problem type");
    (
        reply.status,
        kind.rsplit('.').next().unwrap_or(kind).to_owned(),
    )
}

#[tokio::test]
async fn bad_keys_get_problem_json_and_touch_no_other_key() {
    crate::needs!(Redis);
    let server = RedisServer::start();
    let backend = server.backend().await;
    support::init_tracing();
    let addr = serve(locked_app(
        LockLayer::new(backend.clone(), HeaderKey).wait(WAIT),
    ))
    .await;
    let mut conn = server.conn().await;
    // Bystanders: a plain key, a held lock, and a lock key someone overwrote with a string.
    let _: () = conn.set("bystander", "untouched").await.unwrap();
    let _held = backend.lock("other").try_once().await.expect("uncontended");
    let _: () = conn.set(lock_key("string"), "not a lock").await.unwrap();
    let before = server.dump().await;

    let cases: [(&str, Option<&[u8]>, u16, &str); 6] = [
        ("control character", Some(b"a\tb"), 400, "InvalidKey"),
        ("invalid UTF-8", Some(b"caf\xc3\x28\xff"), 400, "InvalidKey"),
        ("empty", Some(b""), 400, "InvalidKey"),
        ("missing", None, 400, "InvalidKey"),
        (
            "over the length limit",
            Some(&[b'k'; 2048]),
            400,
            "InvalidKey",
        ),
        ("WRONGTYPE lock key", Some(b"string"), 503, "NotALock"),
    ];
    for (case, key, status, kind) in cases {
        let reply = post_key(addr, key).await.expect("a reply");
        assert_eq!(rejection(&reply), (status, kind.to_owned()), "{case}");
    }
    // hyper refuses a 1 MiB header with 431 before the key extractor runs. (If it closes
    // the connection while the client is still sending, the client sees an error instead;
    // either way nothing reaches Redis, which the dump below checks.)
    let huge = vec![b'k'; 1024 * 1024];
    if let Ok(reply) = post_key(addr, Some(&huge)).await {
        assert_eq!(reply.status, 431, "{reply:?}");
    }
    for key in ["a\nb", "\0", "\u{7f}"] {
        let result = backend.lock(key).try_once().await;
        assert!(
            matches!(
                result,
                Err(LockError::InvalidKey(KeyError::ControlCharacter))
            ),
            "{key:?}: {result:?}"
        );
    }

    assert_eq!(
        server.dump().await,
        before,
        "no key was created, changed or removed"
    );
    let after: String = conn.get(lock_key("string")).await.unwrap();
    assert_eq!(after, "not a lock");
    // The service still works, with any UTF-8 key.
    let reply = post_key(addr, Some("café".as_bytes()))
        .await
        .expect("a reply");
    assert_eq!(reply.status, 200, "{reply:?}");
}

#[tokio::test]
async fn braces_in_keys_stay_in_the_namespace_and_the_slot_of_their_channel() {
    crate::needs!(Redis);
    let server = RedisServer::start();
    // CLUSTER KEYSLOT needs cluster mode; this node only computes slots.
    let slots = RedisServer::start_with(&["--cluster-enabled", "yes"]);
    let mut slots_conn = slots.conn().await;
    let holder = server.backend().await;
    let waiter = server.backend().await;
    let store = FencedStore::new(holder.clone());
    let mut lock_names = Vec::new();
    for key in ["a}b{c", "{x}", "}{", "{", "%7B", "ns:{evil}"] {
        let guard = holder.lock(key).try_once().await.expect("uncontended");
        assert_eq!(
            store
                .write(key, guard.fencing_token(), "v")
                .await
                .expect("fenced write"),
            FencedWrite::Written
        );
        let waiting = {
            let waiter = waiter.clone();
            let key = key.to_owned();
            tokio::spawn(async move { waiter.lock(key).wait(HANG).await.map(drop) })
        };
        eventually("the waiter subscribed", || async {
            server.channels().await.len() == 1
        })
        .await;
        let mut names = server.keys().await;
        names.retain(|n| {
            !lock_names
                .iter()
                .any(|l: &String| n.starts_with(l.as_str()))
        });
        names.extend(server.channels().await);
        // The waiter is in the key's line too (two sorted sets).
        assert_eq!(
            names.len(),
            6,
            "lock, fence, fenced value, line, its times, channel: {names:?}"
        );
        let mut slot_of_names = Vec::new();
        for name in &names {
            assert!(
                name.starts_with("tower-lock:{"),
                "{name} left the namespace"
            );
            let slot: i64 = redis::cmd("CLUSTER")
                .arg("KEYSLOT")
                .arg(name)
                .query_async(&mut slots_conn)
                .await
                .expect("CLUSTER KEYSLOT");
            slot_of_names.push(slot);
        }
        assert!(
            slot_of_names.iter().all(|s| *s == slot_of_names[0]),
            "{key:?}: {names:?} hash to {slot_of_names:?}"
        );
        guard.release().await.expect("release");
        finish(waiting).await.expect("the waiter gets the lock");
        server.wait_until_gone(&names[0]).await;
        lock_names.push(names[0].clone());
    }
    let distinct: std::collections::HashSet<_> = lock_names.iter().collect();
    assert_eq!(
        distinct.len(),
        lock_names.len(),
        "distinct keys never share a lock"
    );
}

// ---------------------------------------------------------------------------------------
// Holder processes that die or freeze, and a lost-update workload under a nemesis

/// Settings passed to child processes.
const URL: &str = "TOWER_LOCK_TEST_REDIS_URL";
const OPS: &str = "TOWER_LOCK_TEST_OPS";
const TASKS: &str = "TOWER_LOCK_TEST_TASKS";
/// The key every child process locks.
const SHARED_KEY: &str = "shared";
/// The lease of a child holder: short, so the tests that outlive it stay short.
const CHILD_LEASE: Duration = Duration::from_secs(2);

#[tokio::test]
#[ignore = "entry point of the child processes that the fault tests spawn"]
async fn child_process() {
    match child::role().as_deref() {
        None => {}
        Some("holder") => hold_until_killed().await,
        Some("fenced-holder") => hold_then_write_after_pause().await,
        Some("queued-holder") => hold_with_a_local_queue().await,
        Some("worker") => increment_counters().await,
        Some(other) => panic!("unknown child role {other}"),
    }
}

fn spawn_child(role: &str, server: &RedisServer) -> ChildProcess {
    ChildProcess::spawn("faults::child_process", role, &[(URL, server.url())])
}

/// Parses a `held TOKEN` report.
async fn held_token(child: &mut ChildProcess) -> u64 {
    let report = child
        .next_report()
        .await
        .expect("the child reports its lock");
    report
        .strip_prefix("held ")
        .and_then(|t| t.parse().ok())
        .unwrap_or_else(|| panic!("unexpected report {report:?}"))
}

async fn hold_until_killed() {
    let backend = support::backend(&child::setting(URL)).await;
    let guard = backend
        .lock(SHARED_KEY)
        .lease(CHILD_LEASE)
        .try_once()
        .await
        .expect("uncontended");
    child::report(&format!("held {}", guard.fencing_token()));
    std::future::pending::<()>().await;
}

#[tokio::test]
async fn killed_holder_process_loses_its_lock_within_the_lease() {
    crate::needs!(Redis);
    let server = RedisServer::start();
    // Ready before the holder starts, so the check below runs well inside its lease.
    let backend = server.backend().await;
    let mut holder = spawn_child("holder", &server);
    let killed_token = held_token(&mut holder).await;
    holder.kill().await;

    let still_held = backend.lock(SHARED_KEY).try_once().await;
    assert!(
        matches!(still_held, Err(LockError::Contended { .. })),
        "nobody released the dead holder's lock: {still_held:?}"
    );
    let guard = backend
        .lock(SHARED_KEY)
        .wait(CHILD_LEASE + Duration::from_secs(3))
        .await
        .expect("the lease frees the dead holder's lock");
    assert!(guard.fencing_token() > killed_token);
}

/// Holds with watchdog renewal until the lock is lost (the test pauses this process past
/// its lease), then tries the write it was about to make.
async fn hold_then_write_after_pause() {
    let backend = support::backend(&child::setting(URL)).await;
    let store = FencedStore::new(backend.clone());
    let guard = backend
        .lock(SHARED_KEY)
        .lease(CHILD_LEASE / 2)
        .try_once()
        .await
        .expect("uncontended");
    child::report(&format!("held {}", guard.fencing_token()));
    tokio::time::timeout(HANG, guard.lost())
        .await
        .expect("lost() fires after the pause");
    child::report("lost");
    match store
        .write(SHARED_KEY, guard.fencing_token(), "from the paused holder")
        .await
    {
        Ok(FencedWrite::Stale { stored_token }) => child::report(&format!("stale {stored_token}")),
        other => child::report(&format!("unexpected {other:?}")),
    }
    let release = guard.release().await;
    child::report(&format!(
        "release lost: {}",
        matches!(release, Err(LockError::Lost { .. }))
    ));
}

#[tokio::test]
async fn paused_holder_process_sees_lost_and_its_fenced_write_is_rejected() {
    crate::needs!(Redis);
    let server = RedisServer::start();
    let mut holder = spawn_child("fenced-holder", &server);
    let paused_token = held_token(&mut holder).await;
    holder.pause();

    let backend = server.backend().await;
    let store = FencedStore::new(backend.clone());
    let guard = backend
        .lock(SHARED_KEY)
        .wait(HANG)
        .await
        .expect("taken over once the paused holder's lease ran out");
    let token = guard.fencing_token();
    assert!(token > paused_token);
    assert_eq!(
        store
            .write(SHARED_KEY, token, "from the new holder")
            .await
            .expect("write"),
        FencedWrite::Written
    );

    holder.resume();
    assert_eq!(holder.next_report().await.as_deref(), Some("lost"));
    assert_eq!(holder.next_report().await, Some(format!("stale {token}")));
    assert_eq!(
        holder.next_report().await.as_deref(),
        Some("release lost: true")
    );
    holder.assert_success().await;
    let stored = store
        .read(SHARED_KEY)
        .await
        .expect("read")
        .expect("a value");
    assert_eq!(
        (stored.token, stored.value.as_str()),
        (token, "from the new holder")
    );
    assert!(!guard.is_lost());
    guard.release().await.expect("the new holder is untouched");
}

/// The lease of the holder with a local queue, and of the tasks queued behind it (the
/// same, or the hold could not pass to them in memory): short, so the pause past it is
/// short.
const QUEUE_LEASE: Duration = Duration::from_secs(1);
/// Tasks of the holder's process queued behind it for the key.
const QUEUED: usize = 6;
/// Where the child's holder waits to be woken (the parent's listener), and what it does
/// then: `write` (its fenced write, then its release) or `release` (its release at once).
const GO: &str = "TOWER_LOCK_TEST_GO";
const WAKE: &str = "TOWER_LOCK_TEST_WAKE";

/// Holds the key with [`QUEUED`] tasks of the same backend queued behind it, each of which
/// makes a fenced write when it gets the key. The holder reports `held TOKEN` and waits
/// for a byte from the parent (sent once the parent took the key over) in a blocking read
/// on the runtime's only thread (a `#[tokio::test]` runs on one): from then on nothing of
/// this process runs, as if it were
/// stopped already, and once the byte is in the holder goes on before the watchdog, which
/// would find the lease run out, gets a turn. (Waiting in the runtime instead, the watchdog
/// runs first: after SIGCONT `epoll_wait` fails with EINTR, so the runtime's first turn sees
/// only its expired timers.)
async fn hold_with_a_local_queue() {
    let release_at_once = match child::setting(WAKE).as_str() {
        "write" => false,
        "release" => true,
        other => panic!("unknown wake action {other}"),
    };
    // A run of handoffs in memory is bounded by its count only: every queued task would get
    // the key in memory if that were allowed.
    // A lease well above the nemesis' pauses (see `increment`), the grant's too: a hold
    // that a release granted runs on it until its first renewal.
    let backend = support::builder(&child::setting(URL))
        .max_local_handoff_time(Duration::from_secs(60))
        .grant_lease(Duration::from_secs(10))
        .build()
        .await
        .expect("backend connects to the test server");
    let store = FencedStore::new(backend.clone());
    let mut go = TcpStream::connect(child::setting(GO)).expect("connect to the parent");
    go.set_read_timeout(Some(Duration::from_secs(60)))
        .expect("read timeout");
    // The parent holds the key: the holder waits for it in Redis, the other tasks queue
    // behind it here, so Redis reserves a block of tokens when it grants the holder the key.
    let holder = tokio::spawn({
        let backend = backend.clone();
        async move { backend.lock(SHARED_KEY).lease(QUEUE_LEASE).wait(HANG).await }
    });
    eventually("the holder contends for the key", || async {
        backend.stats().local_queues == 1
    })
    .await;
    let queued: Vec<JoinHandle<()>> = (1..=QUEUED)
        .map(|task| tokio::spawn(write_when_handed_the_key(backend.clone(), task)))
        .collect();
    support::queued(&backend, QUEUED).await;
    child::report("queued");

    let guard = finish(holder)
        .await
        .expect("the holder gets the key once the parent releases it");
    let token = guard.fencing_token();
    if release_at_once {
        // Its work done before the pause, which catches it before its release.
        let written = store.write(SHARED_KEY, token, "from the holder").await;
        assert!(matches!(written, Ok(FencedWrite::Written)), "{written:?}");
    }
    child::report(&format!("held {token}"));
    go.read_exact(&mut [0; 1])
        .expect("woken by the parent within 60 s");
    if !release_at_once {
        match store
            .write(SHARED_KEY, token, "from the paused holder")
            .await
        {
            Ok(FencedWrite::Stale { stored_token }) => {
                child::report(&format!("holder write stale {stored_token}"));
            }
            other => child::report(&format!("holder write unexpected {other:?}")),
        }
    }
    match guard.release().await {
        Err(LockError::Lost { .. }) => child::report("holder release lost"),
        other => child::report(&format!("holder release unexpected {other:?}")),
    }
    for task in queued {
        finish(task).await;
    }
}

/// A queued task: waits for the key, makes a fenced write with its token, reports
/// `queued TASK TOKEN written|stale LOST`, and releases.
async fn write_when_handed_the_key(backend: RedisBackend, task: usize) {
    let store = FencedStore::new(backend.clone());
    let guard = match backend
        .lock(SHARED_KEY)
        .lease(QUEUE_LEASE)
        .wait(Duration::from_secs(30))
        .await
    {
        Ok(guard) => guard,
        Err(e) => return child::report(&format!("queued {task} failed: {e}")),
    };
    let token = guard.fencing_token();
    let outcome = match store
        .write(SHARED_KEY, token, &format!("queued {task}"))
        .await
    {
        Ok(FencedWrite::Written) => "written",
        Ok(FencedWrite::Stale { .. }) => "stale",
        Err(e) => return child::report(&format!("queued {task} failed: {e}")),
    };
    child::report(&format!(
        "queued {task} {token} {outcome} {}",
        guard.is_lost()
    ));
    let _ = guard.release().await;
}

/// A queued task's report.
#[derive(Debug, Clone, Copy)]
struct QueuedHold {
    task: usize,
    token: u64,
    written: bool,
    lost: bool,
}

impl QueuedHold {
    fn decode(report: &str) -> QueuedHold {
        let parsed = (|| {
            let mut parts = report.strip_prefix("queued ")?.split(' ');
            let task = parts.next()?.parse().ok()?;
            let token = parts.next()?.parse().ok()?;
            let written = match parts.next()? {
                "written" => true,
                "stale" => false,
                _ => return None,
            };
            let lost = parts.next()?.parse().ok()?;
            Some(QueuedHold {
                task,
                token,
                written,
                lost,
            })
        })();
        parsed.unwrap_or_else(|| panic!("unexpected report {report:?}"))
    }
}

/// The child (role `queued-holder`) holds the key with [`QUEUED`] tasks queued behind it
/// and a block of tokens reserved for handing it to them in memory; it is stopped past its
/// lease, the parent takes the key over and writes with its newer token, and the child's
/// holder is woken to do `wake` (see [`hold_with_a_local_queue`]) while the parent still
/// holds the key. Nothing of the child may run under the stale hold: the holder's release
/// goes to Redis (and finds the key lost), and each queued task gets the key from Redis
/// after the parent, with a newer token.
async fn paused_holder_with_a_local_queue(wake: &str) {
    let server = RedisServer::start();
    let backend = server.backend().await;
    let store = FencedStore::new(backend.clone());
    let first = backend
        .lock(SHARED_KEY)
        .try_once()
        .await
        .expect("uncontended");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let go_addr = listener.local_addr().expect("local addr").to_string();
    let mut child = ChildProcess::spawn(
        "faults::child_process",
        "queued-holder",
        &[(URL, server.url()), (GO, go_addr), (WAKE, wake.to_owned())],
    );
    let (mut go, _) = tokio::time::timeout(HANG, listener.accept())
        .await
        .expect("the child connects")
        .expect("accept");
    assert_eq!(child.next_report().await.as_deref(), Some("queued"));
    first.release().await.expect("release");
    let paused_token = held_token(&mut child).await;
    // Redis reserved the tokens above the holder's for its queue: the holder could hand
    // them out in memory.
    let fence_key = format!("{}:fence", lock_key(SHARED_KEY));
    let mut conn = server.conn().await;
    let fence: u64 = conn.get(&fence_key).await.expect("GET the fencing counter");
    assert_eq!(
        fence,
        paused_token + u64::from(tower_lock::lock::DEFAULT_MAX_LOCAL_HANDOFFS)
    );
    child.pause();

    let guard = backend
        .lock(SHARED_KEY)
        .wait(HANG)
        .await
        .expect("taken over once the paused holder's lease ran out");
    let token = guard.fencing_token();
    assert!(
        token > fence,
        "the parent's token {token} is above the block"
    );
    assert_eq!(
        store
            .write(SHARED_KEY, token, "from the parent")
            .await
            .expect("write"),
        FencedWrite::Written
    );
    go.write_all(b"g").await.expect("wake the child's holder");
    child.resume();

    // Held until the child's holder has done what it does on waking: no queued task may
    // get the key meanwhile.
    let mut holder_reports = Vec::new();
    let mut while_held = Vec::new();
    while !holder_reports
        .iter()
        .any(|r: &String| r.starts_with("holder release"))
    {
        let report = child
            .next_report()
            .await
            .expect("the child's holder reports");
        if report.starts_with("holder ") {
            holder_reports.push(report);
        } else {
            while_held.push(report);
        }
    }
    assert!(!guard.is_lost());
    guard
        .release()
        .await
        .expect("the parent's hold is untouched");
    let after = child.remaining_reports().await;
    child.assert_success().await;

    let reports: Vec<&String> = while_held.iter().chain(&after).collect();
    let queued: Vec<QueuedHold> = reports.iter().map(|r| QueuedHold::decode(r)).collect();
    // Fencing: no write with an older token than the parent's got in.
    let refused_below = queued.iter().all(|q| q.token > token || !q.written);
    assert!(
        refused_below,
        "a write below the parent's token was accepted: {queued:?}"
    );
    // Exclusion: no queued task ran under the paused hold.
    let under_the_paused_hold: Vec<_> = queued.iter().filter(|q| q.token <= token).collect();
    assert!(
        under_the_paused_hold.is_empty(),
        "queued tasks held the key under the paused hold (the parent's token is {token}): \
         {under_the_paused_hold:?}; holder: {holder_reports:?}"
    );
    assert!(
        while_held.is_empty(),
        "queued tasks held the key while the parent did: {while_held:?}"
    );
    let mut expected = match wake {
        "write" => vec![format!("holder write stale {token}")],
        _ => Vec::new(),
    };
    expected.push("holder release lost".to_owned());
    assert_eq!(holder_reports, expected);

    // Every queued task got the key once, after the parent, and its write was accepted.
    let mut tasks: Vec<usize> = queued.iter().map(|q| q.task).collect();
    tasks.sort_unstable();
    assert_eq!(tasks, (1..=QUEUED).collect::<Vec<_>>(), "{queued:?}");
    assert!(queued.iter().all(|q| q.written && !q.lost), "{queued:?}");
    let last = queued.iter().max_by_key(|q| q.token).expect("queued tasks");
    let stored = store
        .read(SHARED_KEY)
        .await
        .expect("read")
        .expect("a value");
    assert_eq!(
        (stored.token, stored.value),
        (last.token, format!("queued {}", last.task))
    );
    // A later holder anywhere gets a newer token than every one issued.
    let fence: u64 = conn.get(&fence_key).await.expect("GET the fencing counter");
    assert!(
        fence >= last.token,
        "counter {fence}, last token {}",
        last.token
    );
    server.wait_until_released(SHARED_KEY).await;
}

#[tokio::test]
async fn holder_paused_past_its_lease_with_a_local_queue_writes_stale_and_hands_nothing_over() {
    crate::needs!(Redis);
    paused_holder_with_a_local_queue("write").await;
}

#[tokio::test]
async fn holder_paused_past_its_lease_releasing_on_waking_hands_nothing_over_in_memory() {
    crate::needs!(Redis);
    paused_holder_with_a_local_queue("release").await;
}

#[tokio::test]
async fn fenced_store_accepts_only_newer_tokens() {
    crate::needs!(Redis);
    let server = RedisServer::start();
    let store = FencedStore::new(server.backend().await);
    assert_eq!(store.read("k").await.expect("read"), None);
    assert_eq!(
        store.write("k", 10, "ten").await.expect("write"),
        FencedWrite::Written
    );
    for (token, value) in [(10, "again"), (9, "older")] {
        assert_eq!(
            store.write("k", token, value).await.expect("write"),
            FencedWrite::Stale { stored_token: 10 }
        );
    }
    assert_eq!(
        store.write("k", 11, "eleven").await.expect("write"),
        FencedWrite::Written
    );
    let stored = store.read("k").await.expect("read").expect("a value");
    assert_eq!((stored.token, stored.value.as_str()), (11, "eleven"));
    assert!(matches!(
        store.write("", 12, "x").await,
        Err(LockError::InvalidKey(KeyError::Empty))
    ));
}

/// One guarded read-modify-write as a worker saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Hold {
    key: &'static str,
    token: u64,
    /// Wall-clock microseconds (shared by all processes on this machine) after the lock
    /// was granted and before its release was sent: inside the real hold.
    start: u64,
    end: u64,
    outcome: Outcome,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    /// The increment was acknowledged.
    Written,
    /// The store refused it: a newer holder had written.
    Stale,
    /// No reply to the write: it may or may not have happened.
    Unknown,
    /// Nothing was written (the read failed).
    Skipped,
}

impl Hold {
    fn encode(&self) -> String {
        let (key, token, start, end) = (self.key, self.token, self.start, self.end);
        format!("op {key} {token} {start} {end} {:?}", self.outcome)
    }

    fn decode(line: &str) -> Option<Hold> {
        let mut parts = line.strip_prefix("op ")?.split(' ');
        let key = parts.next()?;
        let key = *COUNTERS.iter().find(|k| **k == key)?;
        let mut number = || parts.next()?.parse::<u64>().ok();
        let (token, start, end) = (number()?, number()?, number()?);
        let outcome = match parts.next()? {
            "Written" => Outcome::Written,
            "Stale" => Outcome::Stale,
            "Unknown" => Outcome::Unknown,
            "Skipped" => Outcome::Skipped,
            _ => return None,
        };
        Some(Hold {
            key,
            token,
            start,
            end,
            outcome,
        })
    }
}

fn now_micros() -> u64 {
    let since_epoch = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock after 1970");
    u64::try_from(since_epoch.as_micros()).expect("fits")
}

/// The fenced counters of the lost-update workload; each increment picks one at random.
const COUNTERS: [&str; 2] = ["counter-a", "counter-b"];

/// Runs TASKS tasks on one backend, each making OPS guarded increments of the fenced
/// counters and reporting each hold. Tasks of the process that want the same counter
/// queue for it here and may get it from one another in memory: runs of handoffs are
/// bounded by their count only, since the default time bound (20 ms) could end every run
/// before its first handoff on a loaded machine.
async fn increment_counters() {
    // A lease well above the nemesis' pauses (see `increment`), the grant's too: a hold
    // that a release granted runs on it until its first renewal.
    let backend = support::builder(&child::setting(URL))
        .max_local_handoff_time(Duration::from_secs(60))
        .grant_lease(Duration::from_secs(10))
        .build()
        .await
        .expect("backend connects to the test server");
    let store = FencedStore::new(backend.clone());
    let ops: usize = child::setting(OPS).parse().expect("OPS is a number");
    let tasks: usize = child::setting(TASKS).parse().expect("TASKS is a number");
    let tasks: Vec<JoinHandle<()>> = (0..tasks)
        .map(|_| tokio::spawn(increment(backend.clone(), store.clone(), ops)))
        .collect();
    for task in tasks {
        task.await.expect("a task of the worker did not panic");
    }
}

async fn increment(backend: RedisBackend, store: FencedStore, ops: usize) {
    for _ in 0..ops {
        let key = COUNTERS[fastrand::usize(..COUNTERS.len())];
        // A lease well above the nemesis' pauses: the workload checks exclusion, and a
        // lease lost to a stalled machine would only show fencing at work.
        let Ok(guard) = backend
            .lock(key)
            .lease(Duration::from_secs(10))
            .wait(Duration::from_secs(5))
            .await
        else {
            child::report("acquire failed");
            continue;
        };
        let start = now_micros();
        let outcome = match store.read(key).await {
            Ok(current) => {
                let value: u64 = current.map_or(0, |c| c.value.parse().expect("a number"));
                tokio::time::sleep(Duration::from_millis(fastrand::u64(0..=2))).await;
                let next = (value + 1).to_string();
                match store.write(key, guard.fencing_token(), &next).await {
                    Ok(FencedWrite::Written) => Outcome::Written,
                    Ok(FencedWrite::Stale { .. }) => Outcome::Stale,
                    Err(_) => Outcome::Unknown,
                }
            }
            Err(_) => Outcome::Skipped,
        };
        let hold = Hold {
            key,
            token: guard.fencing_token(),
            start,
            end: now_micros(),
            outcome,
        };
        // A failed release is the nemesis' doing; the lease frees the lock then.
        let _ = guard.release().await;
        child::report(&hold.encode());
    }
}

/// What a run of the lost-update workload did.
struct Workload {
    holds: Vec<Hold>,
    /// HSET calls Redis ran (scripts' own included) from the start until every worker
    /// was done.
    hsets: u64,
}

/// Runs `workers` processes of `tasks` tasks each, every task making `ops` guarded
/// increments, under a nemesis; asserts that no update was lost and no holds overlapped.
async fn lost_update_workload(workers: usize, tasks: usize, ops: usize) -> Workload {
    let server = RedisServer::start();
    let workers: Vec<JoinHandle<Vec<String>>> = (0..workers)
        .map(|_| {
            let mut worker = ChildProcess::spawn(
                "faults::child_process",
                "worker",
                &[
                    (URL, server.url()),
                    (OPS, ops.to_string()),
                    (TASKS, tasks.to_string()),
                ],
            );
            tokio::spawn(async move {
                let reports = worker.remaining_reports().await;
                worker.assert_success().await;
                reports
            })
        })
        .collect();

    // The nemesis: at random, drop every subscriber connection or freeze Redis briefly
    // (at times past the command timeout, always well below the lease), until the workers are done.
    let (mut subscriber_kills, mut pauses) = (0, 0);
    while subscriber_kills == 0 || pauses == 0 || !workers.iter().all(|w| w.is_finished()) {
        tokio::time::sleep(Duration::from_millis(fastrand::u64(50..300))).await;
        if subscriber_kills <= pauses {
            server.kill_subscribers().await;
            subscriber_kills += 1;
        } else {
            server.pause();
            tokio::time::sleep(Duration::from_millis(fastrand::u64(50..800))).await;
            server.resume();
            pauses += 1;
        }
    }

    let mut holds = Vec::new();
    let mut failed_acquisitions = 0;
    for worker in workers {
        let reports = finish(worker).await;
        assert_eq!(reports.len(), tasks * ops, "one report per operation");
        for report in reports {
            match Hold::decode(&report) {
                Some(hold) => holds.push(hold),
                None if report == "acquire failed" => failed_acquisitions += 1,
                None => panic!("unexpected report {report:?}"),
            }
        }
    }
    let scripts = server.command_calls(&["evalsha", "eval"]).await;
    let hsets = server.command_calls(&["hset"]).await;
    let count = |outcome| holds.iter().filter(|h| h.outcome == outcome).count();
    eprintln!(
        "{} holds: {} written, {} unknown, {} stale, {} skipped; \
         {failed_acquisitions} failed acquisitions; {scripts} scripts, {hsets} HSETs; \
         {subscriber_kills} subscriber kills, {pauses} pauses",
        holds.len(),
        count(Outcome::Written),
        count(Outcome::Unknown),
        count(Outcome::Stale),
        count(Outcome::Skipped),
    );
    assert_eq!(
        count(Outcome::Stale),
        0,
        "no holder wrote after being overtaken"
    );
    assert!(count(Outcome::Written) > 0);

    let store = FencedStore::new(server.backend().await);
    for key in COUNTERS {
        let mut holds: Vec<Hold> = holds.iter().filter(|h| h.key == key).copied().collect();
        let count = |outcome| holds.iter().filter(|h| h.outcome == outcome).count() as u64;
        let (written, unknown) = (count(Outcome::Written), count(Outcome::Unknown));
        let counter: u64 = store
            .read(key)
            .await
            .expect("read")
            .map_or(0, |c| c.value.parse().expect("a number"));
        // No update was lost: every acknowledged increment is in the counter, and nothing
        // else is but increments whose reply the nemesis swallowed.
        assert!(
            written <= counter && counter <= written + unknown,
            "{key}: counter {counter}, {written} acknowledged and {unknown} unknown increments"
        );
        // Mutual exclusion: ordered by token, each hold ends before the next one starts.
        holds.sort_by_key(|h| h.token);
        for pair in holds.windows(2) {
            assert!(pair[0].token < pair[1].token, "tokens are unique: {pair:?}");
            assert!(pair[0].end <= pair[1].start, "holds overlap: {pair:?}");
        }
    }
    Workload { holds, hsets }
}

#[tokio::test]
async fn lost_update_workload_under_a_nemesis_loses_nothing_and_never_overlaps() {
    crate::needs!(Redis);
    lost_update_workload(3, 1, 200).await;
}

/// Four processes of four tasks each on two counters: a process's tasks queue for a
/// counter and take turns under one hold in Redis.
#[tokio::test]
async fn lost_update_workload_with_handoffs_in_memory_loses_nothing_and_never_overlaps() {
    crate::needs!(Redis);
    let Workload { holds, hsets } = lost_update_workload(4, 4, 50).await;
    // Redis writes a lock's hash (HSET, counted inside scripts too) when it grants a hold
    // through Redis (acquire.lua, or release.lua handing it over) and when a fenced write
    // is accepted (fence.lua), nowhere else on this path: the HSETs that are not
    // acknowledged writes bound the holds granted through Redis. Fewer of those than holds
    // means the others passed in memory.
    let written = holds
        .iter()
        .filter(|h| h.outcome == Outcome::Written)
        .count() as u64;
    let through_redis = hsets - written;
    assert!(
        through_redis < holds.len() as u64,
        "at most {through_redis} of {} holds were granted through Redis: none passed in memory",
        holds.len()
    );
}

/// An attempt whose reply comes when the hold it took has (nearly) run out its lease (the
/// process was paused, or the network held the reply) must not start the holder at the
/// edge of its deadline: the key may have been freed and taken meanwhile (seen on etcd:
/// a reply read by a process thawed after its lease lapsed, while another instance held
/// the key). The hold is given back and the attempt reports the key held.
#[tokio::test]
async fn a_reply_that_comes_after_the_holds_lease_ran_out_is_not_used() {
    crate::needs!(Redis);
    const LEASE: Duration = Duration::from_millis(500);
    let server = RedisServer::start();
    let proxy = support::proxy::FaultProxy::start(
        SocketAddr::from(([127, 0, 0, 1], 0)),
        SocketAddr::from(([127, 0, 0, 1], server.port())),
    )
    .await;
    // No ping of its subscriber's: what the proxy holds is the attempt.
    let backend = support::builder(&format!("redis://{}", proxy.addr()))
        .command_timeout(Duration::from_secs(30))
        .subscriber_ping_interval(Duration::from_secs(3600))
        .build()
        .await
        .expect("backend through the proxy");
    proxy.stall();
    let held_back = proxy.held_requests();
    let attempt = tokio::spawn({
        let backend = backend.clone();
        async move { backend.lock("late").lease(LEASE).try_once().await }
    });
    eventually("the attempt waits in the proxy", || async {
        proxy.held_requests() > held_back
    })
    .await;
    // At least the hold's whole lease passes before its reply can come.
    tokio::time::sleep(LEASE).await;
    proxy.resume();
    let answer = finish(attempt).await;
    assert!(
        matches!(answer, Err(LockError::Contended { .. })),
        "the late reply's hold was used: {answer:?}"
    );
    eventually("the late reply's hold was given back", || async {
        !server.exists(&lock_key("late")).await
    })
    .await;
}

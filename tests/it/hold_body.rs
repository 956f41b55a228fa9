//! `LockLayer::hold_until_body_end`: the lock outlives the handler until the body is sent.

use crate::support;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::response::IntoResponse;
use axum::routing::post;
use http::header::CONTENT_LENGTH;
use http_body_util::{BodyExt, Full};
use redis::AsyncCommands;
use support::{HttpClient, RedisServer, eventually, http_client, request, serve};
use tokio::sync::mpsc;
use tower_lock::{LockLayer, RedisBackend};

const LOCK: &str = "tower-lock:{report}";

/// The receiving end of the body the next `/download` streams.
type Feed = Arc<Mutex<Option<mpsc::Receiver<&'static str>>>>;

/// Streams whatever the test sends, until the test drops its sender.
async fn download(State(feed): State<Feed>) -> Body {
    let chunks = feed.lock().unwrap().take().expect("one download per test");
    Body::from_stream(futures_util::stream::unfold(
        chunks,
        |mut chunks| async move {
            let chunk = chunks.recv().await?;
            Some((Ok::<_, Infallible>(chunk), chunks))
        },
    ))
}

/// `/download`'s stream with the `content-length` of "first" + "second", set by the handler.
async fn sized_download(feed: State<Feed>) -> impl IntoResponse {
    ([(CONTENT_LENGTH, "11")], download(feed).await)
}

/// Answers `response` once the test sends a chunk.
async fn answer_when_fed(
    State(feed): State<Feed>,
    response: impl IntoResponse,
) -> impl IntoResponse {
    let mut go = feed.lock().unwrap().take().expect("one request per test");
    go.recv().await;
    response
}

/// The body of a `/download` response, read by the test chunk by chunk.
type Download = http_body_util::combinators::BoxBody<bytes::Bytes, axum::BoxError>;

type KeyFn = fn(&Request) -> Option<&'static str>;
type Layer = LockLayer<KeyFn>;

fn report(_: &Request) -> Option<&'static str> {
    Some("report")
}

struct Streaming {
    server: RedisServer,
    client: HttpClient,
    addr: SocketAddr,
    /// Feeds the download's body; `None` ends it.
    chunks: Option<mpsc::Sender<&'static str>>,
}

impl Streaming {
    /// `/download` streams under the `report` lock, fail-fast and as `configure` sets it;
    /// `/sized` streams it with a `content-length` of 11; `/fixed` answers "hello" with a
    /// `content-length` of 5 and `/no-content` a 204, once the test sends a chunk; `/touch` takes the same lock and answers at once.
    async fn start(configure: impl FnOnce(Layer) -> Layer) -> Self {
        let server = RedisServer::start();
        // Commands may wait out the write pauses of the content-length tests.
        let backend = RedisBackend::builder(server.url())
            .command_timeout(Duration::from_secs(5))
            .build()
            .await
            .unwrap();
        let (chunks, feed) = mpsc::channel(4);
        let layer = configure(LockLayer::new(backend, report as KeyFn).fail_fast());
        let app = Router::new()
            .route("/download", post(download))
            .route("/sized", post(sized_download))
            .route(
                "/fixed",
                post(|feed| answer_when_fed(feed, ([(CONTENT_LENGTH, "5")], "hello"))),
            )
            .route(
                "/no-content",
                post(|feed| answer_when_fed(feed, http::StatusCode::NO_CONTENT)),
            )
            .route("/touch", post(|| async { "touched" }))
            .route_layer(layer)
            .with_state(Arc::new(Mutex::new(Some(feed))));
        let addr = serve(app).await;
        Streaming {
            server,
            client: http_client(),
            addr,
            chunks: Some(chunks),
        }
    }

    /// Has the download's body stream `chunk`; false once the body is gone.
    async fn send(&self, chunk: &'static str) -> bool {
        match &self.chunks {
            Some(chunks) => chunks.send(chunk).await.is_ok(),
            None => false,
        }
    }

    /// Starts `/download` and reads its first chunk; returns the headers and the rest.
    async fn download(&self) -> (http::HeaderMap, Download) {
        self.download_from("/download").await
    }

    /// Starts the streamed `path` and reads its first chunk; returns the headers and the rest.
    async fn download_from(&self, path: &str) -> (http::HeaderMap, Download) {
        assert!(self.send("first").await);
        let request = request(self.addr, path).body(Full::default()).unwrap();
        let response = self.client.request(request).await.expect("response");
        assert_eq!(response.status(), 200);
        let (parts, body) = response.into_parts();
        let mut body = body.map_err(axum::BoxError::from).boxed();
        let first = body.frame().await.expect("a frame").unwrap();
        assert_eq!(first.into_data().unwrap(), "first");
        (parts.headers, body)
    }

    async fn touch(&self) -> u16 {
        support::post(&self.client, self.addr, "/touch")
            .await
            .status
    }

    async fn locked(&self) -> bool {
        self.server.conn().await.exists(LOCK).await.unwrap()
    }
}

#[tokio::test]
async fn streamed_body_holds_the_lock_until_fully_read() {
    crate::needs!(Redis);
    let mut app = Streaming::start(Layer::hold_until_body_end).await;
    let (headers, body) = app.download().await;
    assert!(headers.get(http::header::CONTENT_LENGTH).is_none());

    assert_eq!(app.touch().await, 409, "the body is still being sent");
    assert!(app.locked().await);

    assert!(app.send("second").await);
    app.chunks = None;
    let rest = body.collect().await.expect("the rest").to_bytes();
    assert_eq!(rest, "second");
    // Deterministic: the end of the body is sent after the release.
    assert!(
        !app.locked().await,
        "released before the end reached the client"
    );
    assert_eq!(app.touch().await, 200);
}

/// Pauses Redis writes for a while (reads still run), so that a release which does not
/// gate the end of the body is still pending when the client looks: without the pause a
/// background release usually beats the client to Redis and hides the bug.
async fn pause_writes(conn: &mut redis::aio::MultiplexedConnection) {
    let _: () = redis::cmd("CLIENT")
        .arg(&["PAUSE", "1500", "WRITE"])
        .query_async(conn)
        .await
        .unwrap();
}

/// Reads the whole of `body`, then tells whether the lock is still held at once.
async fn held_after_reading(
    conn: &mut redis::aio::MultiplexedConnection,
    body: impl http_body::Body<Error: std::fmt::Debug>,
) -> bool {
    body.collect().await.expect("the whole body");
    conn.exists(LOCK).await.unwrap()
}

/// Requests `path` (an `answer_when_fed` route) and tells whether the lock is still held
/// at once after the client has read the whole response, whose `content-length` must be
/// `length`.
async fn held_after_answer(path: &str, length: Option<&str>) -> bool {
    let app = Streaming::start(Layer::hold_until_body_end).await;
    let request = request(app.addr, path).body(Full::default()).unwrap();
    let response = tokio::spawn(app.client.request(request));
    app.server.wait_until_held("report").await;
    let mut conn = app.server.conn().await;
    pause_writes(&mut conn).await;
    assert!(app.send("answer").await, "the handler answers");
    let response = response.await.unwrap().expect("response");
    let declared = response.headers().get(CONTENT_LENGTH);
    assert_eq!(declared.map(|v| v.to_str().unwrap()), length);
    held_after_reading(&mut conn, response.into_body()).await
}

#[tokio::test]
async fn fixed_body_with_content_length_is_released_before_the_client_has_read_it() {
    crate::needs!(Redis);
    assert!(
        !held_after_answer("/fixed", Some("5")).await,
        "the client read the whole body while the lock was held"
    );
}

#[tokio::test]
async fn bodyless_response_is_released_before_the_client_has_it() {
    crate::needs!(Redis);
    // hyper never polls the body of a 204 (nor of any response to HEAD).
    assert!(
        !held_after_answer("/no-content", None).await,
        "the client had the whole response while the lock was held"
    );
}

#[tokio::test]
async fn streamed_body_with_content_length_is_released_before_the_client_has_read_it() {
    crate::needs!(Redis);
    let app = Streaming::start(Layer::hold_until_body_end).await;
    let (headers, body) = app.download_from("/sized").await;
    assert_eq!(headers[CONTENT_LENGTH], "11");
    assert_eq!(app.touch().await, 409, "the body is still being sent");
    let mut conn = app.server.conn().await;
    pause_writes(&mut conn).await;
    // The sender stays open: the content-length alone says where the body ends.
    assert!(app.send("second").await);
    assert!(
        !held_after_reading(&mut conn, body).await,
        "the client read the whole body while the lock was held"
    );
}

#[tokio::test]
async fn dropped_streamed_body_releases_the_lock() {
    crate::needs!(Redis);
    let app = Streaming::start(Layer::hold_until_body_end).await;
    let (_, body) = app.download().await;
    assert_eq!(app.touch().await, 409);
    drop(body);
    // The server notices the client is gone when it next writes.
    eventually("the abandoned body's lock is released", || async {
        app.send("more").await;
        !app.locked().await
    })
    .await;
    assert_eq!(app.touch().await, 200);
}

#[tokio::test]
async fn without_hold_the_lock_is_released_when_the_handler_returns() {
    crate::needs!(Redis);
    let app = Streaming::start(|layer| layer).await;
    let (_, _body) = app.download().await;
    assert!(!app.locked().await);
    assert_eq!(app.touch().await, 200, "the body streams unlocked");
}

#[tokio::test]
async fn lost_lock_aborts_the_streamed_body() {
    crate::needs!(Redis);
    let app = Streaming::start(|layer| {
        layer
            .hold_until_body_end()
            .lease(Duration::from_millis(600))
    })
    .await;
    let (_, body) = app.download().await;
    let _: () = app.server.conn().await.del(LOCK).await.unwrap();
    // The watchdog's next renewal finds the lock gone; the body ends with an error then.
    let result = tokio::time::timeout(Duration::from_secs(10), body.collect())
        .await
        .expect("the body ends");
    assert!(result.is_err(), "the response is aborted, not completed");
}

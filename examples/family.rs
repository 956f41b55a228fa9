//! The read/write lock and the semaphore on one app: `GET /docs/{id}` reads under shared
//! holds, `PUT /docs/{id}` writes under the exclusive one, and `POST /exports` lets at
//! most 3 requests per tenant run at once (fail-fast: the others get 429).
//!
//! It sends the app concurrent requests in-process and prints what each got: a write that
//! waits for the read before it and goes before the reads after it, which then run side
//! by side; five exports of which three run.
//!
//! ```text
//! cargo run --example family                                    # MemoryBackend
//! REDIS_URL=redis://127.0.0.1:6379 cargo run --example family   # Redis
//! ```

use std::process::ExitCode;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::Request;
use axum::routing::{get, post};
use axum::{Router, http::Method};
use futures_util::future::join_all;
use tower::ServiceExt;
use tower_lock::{
    Header, HeldLock, LockBackend, LockLayer, MemoryBackend, PathParam, RedisBackend,
};

/// Long enough that the concurrent requests below overlap.
const WORK: Duration = Duration::from_millis(200);

async fn read(lock: HeldLock) -> String {
    tokio::time::sleep(WORK).await;
    format!(
        "read under a shared hold, last write's token {}",
        lock.fencing_token()
    )
}

async fn write(lock: HeldLock) -> String {
    tokio::time::sleep(WORK).await;
    format!("written under token {}", lock.fencing_token())
}

async fn export() -> &'static str {
    tokio::time::sleep(WORK).await;
    "exported"
}

/// The app, generic over where its locks live.
fn app<B: LockBackend>(backend: B) -> Router {
    let docs = Router::new()
        .route("/docs/{id}", get(read).put(write))
        .route_layer(
            LockLayer::new(backend.clone(), PathParam::new("id").prefix("doc"))
                .read_write()
                .wait(Duration::from_secs(2)),
        );
    let exports = Router::new().route("/exports", post(export)).route_layer(
        LockLayer::new(backend, Header::new("x-tenant").prefix("exports"))
            .permits(3)
            .fail_fast(),
    );
    docs.merge(exports)
}

/// Sends `method path` to `app` and describes the reply, with when it came.
async fn send(app: &Router, started: Instant, method: Method, path: &str) -> String {
    let request = Request::builder()
        .method(method.clone())
        .uri(path)
        .header("x-tenant", "acme")
        .body(Body::empty())
        .expect("a valid request");
    let response = match app.clone().oneshot(request).await {
        Ok(response) => response,
        Err(never) => match never {},
    };
    let status = response.status();
    let body = axum::body::to_bytes(response.into_body(), 64 * 1024)
        .await
        .map(|b| String::from_utf8_lossy(&b).into_owned())
        .unwrap_or_else(|e| format!("(body failed: {e})"));
    let at = started.elapsed().as_millis();
    format!("{method} {path} -> {status} after {at} ms: {body}")
}

async fn run<B: LockBackend>(backend: B) {
    let app = app(backend);
    let started = Instant::now();
    // A read, a write and two reads of one document, sent in that order: the write waits
    // for the first read, and the two reads sent after it wait for the write (a waiting
    // writer is not starved), then run side by side.
    let calls = [Method::GET, Method::PUT, Method::GET, Method::GET].map(|method| {
        let app = app.clone();
        async move { send(&app, started, method, "/docs/7").await }
    });
    for line in join_all(calls).await {
        println!("{line}");
    }
    let started = Instant::now();
    let calls = (0..5).map(|_| {
        let app = app.clone();
        async move { send(&app, started, Method::POST, "/exports").await }
    });
    for line in join_all(calls).await {
        println!("{line}");
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    match std::env::var("REDIS_URL") {
        Ok(url) => match RedisBackend::connect(&url).await {
            Ok(backend) => run(backend).await,
            Err(e) => {
                eprintln!("cannot use {url}: {e}");
                return ExitCode::FAILURE;
            }
        },
        Err(_) => run(MemoryBackend::new()).await,
    }
    ExitCode::SUCCESS
}

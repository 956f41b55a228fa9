//! Testing an axum app that uses `LockLayer` without Redis: the same layer on a
//! `MemoryBackend`, driven in-process with `tower::ServiceExt::oneshot`.
//!
//! ```text
//! cargo run --example testing_with_memory
//! ```
//!
//! In a real project the app is built by one function that takes the backend, the binary
//! passes a `RedisBackend` and the tests pass a `MemoryBackend`.

use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::{Path, Request};
use axum::http::StatusCode;
use axum::routing::post;
use tower::ServiceExt;
use tower_lock::{LockBackend, LockLayer, MemoryBackend};

/// The app under test, generic over where its locks live.
fn app<B: LockBackend>(backend: B) -> Router {
    Router::new()
        .route("/orders/{id}/pay", post(pay))
        .route_layer(LockLayer::new(backend, order_key).fail_fast())
}

fn order_key(req: &Request) -> Option<String> {
    let id = req
        .uri()
        .path()
        .strip_prefix("/orders/")?
        .split('/')
        .next()?;
    Some(format!("order:{id}"))
}

async fn pay(Path(id): Path<u64>) -> String {
    // Long enough for the second request below to find the order locked.
    tokio::time::sleep(Duration::from_millis(200)).await;
    format!("paid order {id}")
}

async fn status(app: &Router, path: &str) -> StatusCode {
    let request = Request::post(path)
        .body(Body::empty())
        .expect("valid request");
    match app.clone().oneshot(request).await {
        Ok(response) => response.status(),
        Err(never) => match never {},
    }
}

#[tokio::main]
async fn main() {
    let backend = MemoryBackend::new();
    let app = app(backend.clone());

    // Two payments of one order at once: one is served, the other answered 409.
    let first = tokio::spawn({
        let app = app.clone();
        async move { status(&app, "/orders/7/pay").await }
    });
    // Let the first request take the lock.
    tokio::time::sleep(Duration::from_millis(50)).await;
    let second = status(&app, "/orders/7/pay").await;
    let first = first.await.expect("the first request does not panic");
    println!("first payment of order 7:  {first}");
    println!("second payment of order 7: {second}");
    println!(
        "a payment of order 8:      {}",
        status(&app, "/orders/8/pay").await
    );
    assert_eq!((first, second), (StatusCode::OK, StatusCode::CONFLICT));
    assert_eq!(backend.held(), 0, "every lock was released");
}

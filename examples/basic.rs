//! The smallest useful setup: one route locked per order id, exercised against itself.
//!
//! `REDIS_URL=redis://127.0.0.1:6379 cargo run --example basic`, against a Redis you run
//! (a throwaway one: `redis-server --port 6390 --save ""` and `REDIS_URL=redis://127.0.0.1:6390`).
//!
//! Two payments for the same order arrive at once: the second waits for the first to
//! finish instead of running beside it, a payment for another order runs in parallel, and
//! a fail-fast route answers 409 while the order is busy.

use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::{Path, Request};
use axum::routing::post;
use tower::ServiceExt;
use tower_lock::{HeldLock, LockLayer, RedisBackend};

async fn pay(Path(id): Path<String>, lock: HeldLock) -> String {
    // Pretend to call a payment provider while holding the order's lock.
    tokio::time::sleep(Duration::from_millis(200)).await;
    format!(
        "order {id} paid under fencing token {}",
        lock.fencing_token()
    )
}

fn order_id(req: &Request) -> Option<String> {
    let rest = req.uri().path().strip_prefix("/orders/")?;
    rest.split('/').next().map(|id| format!("order:{id}"))
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("REDIS_URL")
        .map_err(|_| "set REDIS_URL, e.g. REDIS_URL=redis://127.0.0.1:6379")?;
    let backend = RedisBackend::builder(&url)
        .namespace("tower-lock-basic")
        .build()
        .await?;

    let app = Router::new()
        .route("/orders/{id}/pay", post(pay))
        .route_layer(LockLayer::new(backend.clone(), order_id).wait(Duration::from_secs(2)));
    let busy_check = Router::new()
        .route("/orders/{id}/pay", post(pay))
        .route_layer(LockLayer::new(backend.clone(), order_id).fail_fast());

    let call = |router: Router, path: &'static str| async move {
        let started = Instant::now();
        let request = Request::post(path).body(axum::body::Body::empty())?;
        let response = router.oneshot(request).await?;
        let status = response.status();
        let body = axum::body::to_bytes(response.into_body(), 64 * 1024).await?;
        println!(
            "{path:<18} {status} after {:>4} ms  {}",
            started.elapsed().as_millis(),
            String::from_utf8_lossy(&body)
        );
        Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
    };

    println!("two payments for order 1 and one for order 2, all at once:");
    let (a, b, c, d) = tokio::join!(
        call(app.clone(), "/orders/1/pay"),
        call(app.clone(), "/orders/1/pay"),
        call(app.clone(), "/orders/2/pay"),
        async {
            // Arrives while order 1 is being paid, on a route that does not wait.
            tokio::time::sleep(Duration::from_millis(50)).await;
            call(busy_check.clone(), "/orders/1/pay").await
        },
    );
    for result in [a, b, c, d] {
        result.map_err(|e| e.to_string())?;
    }
    Ok(())
}

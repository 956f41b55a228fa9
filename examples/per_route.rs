//! Three routes, keyed three ways, each with its own prefix.
//!
//! - `POST /orders/{id}/pay`: the `id` path parameter, as `order:{id}`; waits for the lock.
//! - `POST /payments`: the `Idempotency-Key` header, as `payment:{key}`; fail-fast, so a
//!   retry that arrives while the first attempt runs gets 409.
//! - `POST /checkout?cart=7`: the `cart` query parameter, as `cart:{cart}`; fail-fast.
//!
//! It serves the routes on a free port, sends itself a few requests, prints what each got
//! and exits.
//!
//! ```text
//! REDIS_URL=redis://127.0.0.1:6379 cargo run --example per_route
//! ```

use std::process::ExitCode;
use std::time::Duration;

use axum::routing::post;
use axum::{Router, http::StatusCode};
use futures_util::future::join;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use tower_lock::{Header, HeldLock, LockLayer, PathParam, QueryParam, RedisBackend};

type Error = Box<dyn std::error::Error + Send + Sync>;

/// Long enough that the concurrent requests below overlap.
const WORK: Duration = Duration::from_millis(300);

async fn work(lock: HeldLock) -> String {
    tokio::time::sleep(WORK).await;
    format!(
        "locked {} (fencing token {})",
        lock.key(),
        lock.fencing_token()
    )
}

fn app(backend: RedisBackend) -> Router {
    let orders = Router::new()
        .route("/orders/{id}/pay", post(work))
        .route_layer(LockLayer::new(
            backend.clone(),
            PathParam::new("id").prefix("order"),
        ));
    let payments = Router::new().route("/payments", post(work)).route_layer(
        LockLayer::new(
            backend.clone(),
            Header::new("Idempotency-Key").prefix("payment"),
        )
        .fail_fast(),
    );
    let checkout = Router::new()
        .route("/checkout", post(work))
        .route_layer(LockLayer::new(backend, QueryParam::new("cart").prefix("cart")).fail_fast());
    orders.merge(payments).merge(checkout)
}

struct Caller {
    client: Client<HttpConnector, Full<bytes::Bytes>>,
    base: String,
}

impl Caller {
    /// POSTs `path`, with an `Idempotency-Key` if given, and prints what came back.
    async fn post(&self, path: &str, idempotency_key: Option<&str>) -> Result<StatusCode, Error> {
        let mut request = http::Request::post(format!("{}{path}", self.base));
        if let Some(key) = idempotency_key {
            request = request.header("idempotency-key", key);
        }
        let response = self.client.request(request.body(Full::default())?).await?;
        let status = response.status();
        let body = response.into_body().collect().await?.to_bytes();
        let header = idempotency_key.map_or(String::new(), |k| format!(" (Idempotency-Key: {k})"));
        let body = String::from_utf8_lossy(&body);
        // Problem bodies are JSON: show their `detail` only.
        let shown = serde_json::from_str::<serde_json::Value>(&body)
            .ok()
            .and_then(|problem| problem["detail"].as_str().map(str::to_owned))
            .unwrap_or_else(|| body.into_owned());
        println!("POST {path}{header} -> {status}: {shown}");
        Ok(status)
    }

    /// Sends two requests at once.
    async fn together(
        &self,
        (a, a_key): (&str, Option<&str>),
        (b, b_key): (&str, Option<&str>),
    ) -> Result<(), Error> {
        let (a, b) = join(self.post(a, a_key), self.post(b, b_key)).await;
        a?;
        b?;
        Ok(())
    }
}

async fn run(url: &str) -> Result<(), Error> {
    let namespace = format!(
        "tower-lock-demo-per-route-{}",
        &uuid::Uuid::new_v4().simple().to_string()[..8]
    );
    let backend = RedisBackend::builder(url)
        .namespace(namespace)
        // Locks delete themselves on release; this lets the fencing counters go soon too.
        .fence_ttl(Duration::from_secs(60))
        .build()
        .await?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let caller = Caller {
        client: Client::builder(TokioExecutor::new()).build_http(),
        base: format!("http://{}", listener.local_addr()?),
    };
    tokio::spawn(async move { axum::serve(listener, app(backend)).await });

    println!("# Path parameter, waiting: the second payment of order 42 waits for the first.");
    let order_42 = ("/orders/42/pay", None);
    caller.together(order_42, order_42).await?;
    println!("\n# Same route, another order: no contention.");
    caller.together(order_42, ("/orders/43/pay", None)).await?;
    println!("\n# Header, fail-fast: a retry with the same Idempotency-Key while the first runs.");
    let payment = ("/payments", Some("7f3c"));
    caller.together(payment, payment).await?;
    caller.post("/payments", None).await?;
    println!("\n# Query parameter, fail-fast: two checkouts of cart 7 at once, then no cart.");
    let cart_7 = ("/checkout?cart=7", None);
    caller.together(cart_7, cart_7).await?;
    caller.post("/checkout", None).await?;
    Ok(())
}

#[tokio::main]
async fn main() -> ExitCode {
    let Ok(url) = std::env::var("REDIS_URL") else {
        eprintln!("set REDIS_URL, e.g. REDIS_URL=redis://127.0.0.1:6379");
        return ExitCode::from(2);
    };
    match run(&url).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("per_route: {e}");
            ExitCode::FAILURE
        }
    }
}

//! A retried payment, charged once: three instances of a payments service behind
//! `IdempotencyLayer`, a client whose first reply is lost, and its retries.
//!
//! `cargo run --example payments`
//!
//! - `REDIS_URL` set: that Redis, under a namespace of this run's own;
//! - otherwise, with `redis-server` on `PATH`: a throwaway `redis-server` on a free
//!   loopback port, stopped when the example ends;
//! - otherwise: one in-process `MemoryBackend` shared by the three instances.
//!
//! The client sends a payment to instance 1 and gives up after 100 ms, while the card
//! network takes 300 ms: the charge happens, the reply is lost. It retries at once on
//! instance 2 (409: still in flight), then after `Retry-After` on instance 3, which
//! replays the first response: one charge. The same client against the same handler
//! without the layer is charged on every try: three times.

#[path = "flash_sale/throwaway.rs"]
mod throwaway;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::post;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use tower_lock::{IdempotencyLayer, MemoryBackend, RedisBackend};

use crate::throwaway::ThrowawayRedis;

type Error = Box<dyn std::error::Error + Send + Sync>;
type HttpClient = Client<HttpConnector, Full<bytes::Bytes>>;

/// The card network's ledger: every charge made, by any instance.
#[derive(Clone, Default)]
struct Ledger(Arc<Mutex<Vec<String>>>);

impl Ledger {
    fn charges(&self) -> usize {
        self.0.lock().map_or(0, |l| l.len())
    }
}

/// Charges the card, then waits for the slow card network's confirmation.
async fn charge(State(ledger): State<Ledger>, body: bytes::Bytes) -> (StatusCode, String) {
    let id = {
        let Ok(mut ledger) = ledger.0.lock() else {
            return (StatusCode::INTERNAL_SERVER_ERROR, "ledger poisoned".into());
        };
        ledger.push(String::from_utf8_lossy(&body).into_owned());
        format!("ch_{}", ledger.len())
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    (StatusCode::CREATED, format!("{{\"charge\":\"{id}\"}}"))
}

/// Where the instances keep their locks and records.
enum Store {
    Redis(String),
    Memory(MemoryBackend),
}

/// An instance of the service: `/payments` under the layer, `/unsafe/payments` without.
async fn instance(store: &Store, namespace: &str, ledger: &Ledger) -> Result<SocketAddr, Error> {
    let layer = match store {
        Store::Redis(url) => IdempotencyLayer::new(
            RedisBackend::builder(url)
                .namespace(namespace)
                .build()
                .await?,
        ),
        Store::Memory(backend) => IdempotencyLayer::new(backend.clone()),
    };
    let app = Router::new()
        .route("/payments", post(charge))
        .route_layer(layer)
        .route("/unsafe/payments", post(charge))
        .with_state(ledger.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move { axum::serve(listener, app).await });
    Ok(addr)
}

/// Sends the payment to `addr`, giving up after `patience`; prints what came back.
async fn pay(client: &HttpClient, addr: SocketAddr, path: &str, patience: Duration) -> u64 {
    let request = http::Request::post(format!("http://{addr}{path}"))
        .header("idempotency-key", "order-42-attempt")
        .body(Full::from(r#"{"order":42,"amount":1000}"#))
        .expect("a valid request");
    let reply = tokio::time::timeout(patience, async {
        let response = client.request(request).await?;
        let (parts, body) = response.into_parts();
        let body = body.collect().await?.to_bytes();
        Ok::<_, Error>((parts, body))
    })
    .await;
    match reply {
        Err(_) => {
            println!("  {addr}{path}: no reply within {patience:?} (lost)");
            0
        }
        Ok(Err(e)) => {
            println!("  {addr}{path}: failed: {e}");
            0
        }
        Ok(Ok((parts, body))) => {
            let header = |name: &str| {
                parts
                    .headers
                    .get(name)
                    .and_then(|v| v.to_str().ok())
                    .map(str::to_owned)
            };
            let replayed = header("idempotency-replayed").map_or("", |_| " (replayed)");
            let body = String::from_utf8_lossy(&body);
            let detail = match serde_json::from_str::<serde_json::Value>(&body) {
                Ok(problem) if problem.get("title").is_some() => problem["title"].to_string(),
                _ => body.into_owned(),
            };
            println!("  {addr}{path}: {}{replayed} {detail}", parts.status);
            header("retry-after")
                .and_then(|s| s.parse().ok())
                .unwrap_or(0)
        }
    }
}

/// The client: the first reply lost, a retry at once, one more after `Retry-After`.
async fn client_run(client: &HttpClient, instances: &[SocketAddr; 3], path: &str) {
    pay(client, instances[0], path, Duration::from_millis(100)).await;
    let retry_after = pay(client, instances[1], path, Duration::from_secs(5)).await;
    tokio::time::sleep(Duration::from_secs(retry_after.max(1))).await;
    pay(client, instances[2], path, Duration::from_secs(5)).await;
}

#[tokio::main]
async fn main() -> Result<(), Error> {
    // Lives until the end of `main`: the server is killed on every way out.
    let mut throwaway = None;
    let store = if let Some(url) = std::env::var("REDIS_URL").ok().filter(|u| !u.is_empty()) {
        println!("Redis from REDIS_URL");
        Store::Redis(url)
    } else if let Some(server) = ThrowawayRedis::start().await? {
        println!(
            "throwaway redis-server {} on {} (REDIS_URL is unset)",
            server.version(),
            server.url()
        );
        let url = server.url().to_owned();
        throwaway = Some(server);
        Store::Redis(url)
    } else {
        println!("no redis-server on PATH and REDIS_URL unset: one in-process MemoryBackend");
        Store::Memory(MemoryBackend::new())
    };
    let namespace = format!("tower-lock-payments-{}", uuid::Uuid::new_v4().simple());
    let client: HttpClient = Client::builder(TokioExecutor::new()).build_http();

    for (path, title) in [
        ("/unsafe/payments", "without IdempotencyLayer"),
        ("/payments", "with IdempotencyLayer"),
    ] {
        let ledger = Ledger::default();
        let mut instances = Vec::new();
        for _ in 0..3 {
            instances.push(instance(&store, &namespace, &ledger).await?);
        }
        let instances: [SocketAddr; 3] = instances.try_into().map_err(|_| "three instances")?;
        println!("\n{title}:");
        client_run(&client, &instances, path).await;
        // Let the lost first request finish its confirmation.
        tokio::time::sleep(Duration::from_millis(500)).await;
        println!("  the card was charged {} time(s)", ledger.charges());
    }
    drop(throwaway);
    Ok(())
}

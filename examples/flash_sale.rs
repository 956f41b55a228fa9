//! The flash-sale oversell, and the one-line fix, in one table.
//!
//! A stock of 50 lives in Redis. Three app instances (each with its own [`RedisBackend`]
//! and port, as three pods would have) sell from it, and a few hundred buyers hit them
//! round-robin, all at once. The buy handler reads the stock, awaits (the payment call),
//! then writes stock - 1: without a lock, buyers on different instances read the same
//! stock and sell the same item twice.
//!
//! - `/unsafe/buy`: the handler alone. Oversells.
//! - `/buy`: the same handler under `LockLayer` (waits for the lock).
//! - `/try-buy`: under `LockLayer::fail_fast()` (409 while someone else is buying).
//!
//! Sold out is 410 Gone. Exits non-zero if a locked route oversells.
//!
//! ```text
//! REDIS_URL=redis://127.0.0.1:6379 cargo run --release --example flash_sale
//! ```
//!
//! Every key it writes lives under a namespace unique to the run, and is deleted at the end.

use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::routing::post;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use redis::AsyncCommands;
use redis::aio::MultiplexedConnection;
use tokio::task::JoinSet;
use tower_lock::{LockLayer, RedisBackend};

const STOCK: i64 = 50;
const BUYERS: usize = 300;
const INSTANCES: usize = 3;
const ROUTES: [&str; 3] = ["/unsafe/buy", "/buy", "/try-buy"];
/// The lock key every buy takes: there is one item on sale.
const ITEM: &str = "item";

type Error = Box<dyn std::error::Error + Send + Sync>;
type HttpClient = Client<HttpConnector, Full<bytes::Bytes>>;

/// The Redis names of this run's shop.
#[derive(Clone)]
struct Shop {
    redis: MultiplexedConnection,
    stock: Arc<str>,
    sold: Arc<str>,
}

impl Shop {
    fn new(redis: MultiplexedConnection, namespace: &str) -> Self {
        Shop {
            redis,
            stock: format!("{namespace}:stock").into(),
            sold: format!("{namespace}:sold").into(),
        }
    }

    async fn restock(&self) -> Result<(), Error> {
        let mut conn = self.redis.clone();
        let _: () = conn.set(&*self.stock, STOCK).await?;
        let _: () = conn.del(&*self.sold).await?;
        Ok(())
    }

    async fn sold(&self) -> Result<i64, Error> {
        let sold: Option<i64> = self.redis.clone().get(&*self.sold).await?;
        Ok(sold.unwrap_or(0))
    }
}

/// Check-then-act across an await: correct in one process with one request at a time,
/// wrong as soon as two requests interleave.
async fn buy(State(shop): State<Shop>) -> StatusCode {
    match sell_one(&shop).await {
        Ok(status) => status,
        Err(_) => StatusCode::INTERNAL_SERVER_ERROR,
    }
}

async fn sell_one(shop: &Shop) -> Result<StatusCode, redis::RedisError> {
    let mut conn = shop.redis.clone();
    let stock: i64 = conn.get(&*shop.stock).await?;
    if stock <= 0 {
        return Ok(StatusCode::GONE);
    }
    // The payment call: every buyer that reads the stock before this one writes it back
    // sells the same item again.
    tokio::time::sleep(Duration::from_millis(5)).await;
    let _: () = conn.set(&*shop.stock, stock - 1).await?;
    let _: () = conn.incr(&*shop.sold, 1).await?;
    Ok(StatusCode::OK)
}

fn app(backend: RedisBackend, shop: Shop) -> Router {
    let item = |_: &Request| Some(ITEM);
    let waiting = Router::new()
        .route("/buy", post(buy))
        .route_layer(LockLayer::new(backend.clone(), item).wait(Duration::from_secs(10)));
    let fail_fast = Router::new()
        .route("/try-buy", post(buy))
        .route_layer(LockLayer::new(backend, item).fail_fast());
    Router::new()
        .route("/unsafe/buy", post(buy))
        .merge(waiting)
        .merge(fail_fast)
        .with_state(shop)
}

/// Starts one instance: its own lock backend, Redis connection and port.
async fn start_instance(url: &str, namespace: &str) -> Result<SocketAddr, Error> {
    let backend = RedisBackend::builder(url)
        .namespace(namespace)
        .build()
        .await?;
    let redis = redis::Client::open(url)?
        .get_multiplexed_async_connection()
        .await?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let app = app(backend, Shop::new(redis, namespace));
    tokio::spawn(async move { axum::serve(listener, app).await });
    Ok(addr)
}

/// One buyer's outcome: the status (0 if the request itself failed) and its latency.
type Outcome = (u16, Duration);

async fn one_buyer(client: HttpClient, addr: SocketAddr, route: &'static str) -> Outcome {
    let started = Instant::now();
    let request = http::Request::post(format!("http://{addr}{route}")).body(Full::default());
    let status = match request {
        Ok(request) => match client.request(request).await {
            Ok(response) => {
                let status = response.status().as_u16();
                // Read the body so the connection goes back to the pool.
                let _ = response.into_body().collect().await;
                status
            }
            Err(_) => 0,
        },
        Err(_) => 0,
    };
    (status, started.elapsed())
}

struct Row {
    route: &'static str,
    outcomes: Vec<Outcome>,
    sold: i64,
    elapsed: Duration,
}

impl Row {
    fn count(&self, status: u16) -> usize {
        self.outcomes.iter().filter(|(s, _)| *s == status).count()
    }

    fn oversold(&self) -> i64 {
        (self.sold - STOCK).max(0)
    }

    fn others(&self) -> usize {
        self.outcomes.len()
            - [200, 409, 503, 410]
                .map(|s| self.count(s))
                .iter()
                .sum::<usize>()
    }

    /// The latency below which `pct` percent of requests finished, in milliseconds.
    fn latency_ms(&self, pct: usize) -> f64 {
        let mut latencies: Vec<Duration> = self.outcomes.iter().map(|(_, d)| *d).collect();
        latencies.sort();
        let i = (latencies.len() * pct / 100).min(latencies.len().saturating_sub(1));
        latencies.get(i).map_or(0.0, |d| d.as_secs_f64() * 1e3)
    }

    fn print(&self) {
        println!(
            "| `{}` | {} | {} | {} | {} | {} | {} | {} | {:.1} | {:.1} | {:.0} |",
            self.route,
            self.outcomes.len(),
            self.sold,
            self.oversold(),
            self.count(200),
            self.count(409),
            self.count(503),
            self.count(410),
            self.latency_ms(50),
            self.latency_ms(99),
            self.outcomes.len() as f64 / self.elapsed.as_secs_f64(),
        );
    }
}

/// Restocks, fires every buyer at once round-robin over the instances, and counts.
async fn run_route(
    shop: &Shop,
    client: &HttpClient,
    instances: &[SocketAddr],
    route: &'static str,
) -> Result<Row, Error> {
    shop.restock().await?;
    let started = Instant::now();
    let mut buyers = JoinSet::new();
    for addr in instances.iter().cycle().take(BUYERS) {
        buyers.spawn(one_buyer(client.clone(), *addr, route));
    }
    let outcomes = buyers.join_all().await;
    let elapsed = started.elapsed();
    Ok(Row {
        route,
        outcomes,
        sold: shop.sold().await?,
        elapsed,
    })
}

/// Deletes every key of this run (stock, counters, locks, fencing counters).
async fn clean_up(conn: &mut MultiplexedConnection, namespace: &str) -> Result<(), Error> {
    let mut keys = Vec::new();
    let mut iter = conn
        .scan_match::<_, String>(format!("{namespace}:*"))
        .await?;
    while let Some(key) = futures_util::StreamExt::next(&mut iter).await {
        keys.push(key?);
    }
    drop(iter);
    if !keys.is_empty() {
        let _: () = conn.del(keys).await?;
    }
    Ok(())
}

async fn run(url: &str) -> Result<Vec<Row>, Error> {
    let namespace = format!(
        "tower-lock-demo-flash-sale-{}",
        &uuid::Uuid::new_v4().simple().to_string()[..8]
    );
    let mut conn = redis::Client::open(url)?
        .get_multiplexed_async_connection()
        .await?;
    let shop = Shop::new(conn.clone(), &namespace);
    let mut instances = Vec::new();
    for _ in 0..INSTANCES {
        instances.push(start_instance(url, &namespace).await?);
    }
    let client: HttpClient = Client::builder(TokioExecutor::new()).build_http();
    let mut rows = Vec::new();
    let mut result = Ok(());
    for route in ROUTES {
        match run_route(&shop, &client, &instances, route).await {
            Ok(row) => rows.push(row),
            Err(e) => {
                result = Err(e);
                break;
            }
        }
    }
    clean_up(&mut conn, &namespace).await?;
    result.map(|()| rows)
}

#[tokio::main]
async fn main() -> ExitCode {
    let Ok(url) = std::env::var("REDIS_URL") else {
        eprintln!("set REDIS_URL, e.g. REDIS_URL=redis://127.0.0.1:6379 (or run `just demo`)");
        return ExitCode::from(2);
    };
    let rows = match run(&url).await {
        Ok(rows) => rows,
        Err(e) => {
            eprintln!("flash_sale: {e}");
            return ExitCode::FAILURE;
        }
    };
    println!(
        "Stock {STOCK}, {BUYERS} concurrent buyers, round-robin over {INSTANCES} instances sharing one Redis.\n"
    );
    println!(
        "| route | requests | sold | oversold | 200 | 409 | 503 | 410 | p50 ms | p99 ms | requests/s |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    rows.iter().for_each(Row::print);
    println!();
    let others: usize = rows.iter().map(Row::others).sum();
    if others > 0 {
        println!("({others} requests ended with another status or a transport error.)");
    }
    let locked_oversold: i64 = rows.iter().skip(1).map(Row::oversold).sum();
    if let [unsafe_row, wait_row, fail_fast_row] = rows.as_slice() {
        println!(
            "Without a lock the three instances sold {} items that did not exist. Under LockLayer \
             nothing was oversold: `/buy` queued buyers and sold exactly the stock ({}), then said 410; \
             `/try-buy` sold {} and answered 409 to the {} buyers who came while someone was buying.",
            unsafe_row.oversold(),
            wait_row.sold,
            fail_fast_row.sold,
            fail_fast_row.count(409),
        );
    }
    if locked_oversold > 0 {
        eprintln!("FAIL: a locked route oversold");
        return ExitCode::FAILURE;
    }
    ExitCode::SUCCESS
}

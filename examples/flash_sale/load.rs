//! The buyers: all at once, round-robin over the instances; and the table row of a route.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use tokio::task::JoinSet;

use crate::shop::Store;

pub type HttpClient = Client<HttpConnector, Full<bytes::Bytes>>;

pub fn http_client() -> HttpClient {
    Client::builder(TokioExecutor::new()).build_http()
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

/// Restocks, fires `buyers` buyers at once round-robin over the instances, and counts.
pub async fn run_route(
    store: &Store,
    client: &HttpClient,
    instances: &[SocketAddr],
    route: &'static str,
    (stock, buyers): (i64, usize),
) -> redis::RedisResult<Row> {
    store.restock(stock).await?;
    let started = Instant::now();
    let mut set = JoinSet::new();
    for addr in instances.iter().cycle().take(buyers) {
        set.spawn(one_buyer(client.clone(), *addr, route));
    }
    let outcomes = set.join_all().await;
    let elapsed = started.elapsed();
    Ok(Row {
        route,
        stock,
        outcomes,
        sold: store.sold().await?,
        elapsed,
    })
}

/// What one route did.
pub struct Row {
    pub route: &'static str,
    stock: i64,
    outcomes: Vec<Outcome>,
    pub sold: i64,
    elapsed: Duration,
}

impl Row {
    pub fn count(&self, status: u16) -> usize {
        self.outcomes.iter().filter(|(s, _)| *s == status).count()
    }

    pub fn oversold(&self) -> i64 {
        (self.sold - self.stock).max(0)
    }

    /// Requests that ended with none of the table's statuses (or no response at all).
    pub fn others(&self) -> usize {
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

    pub const HEADER: &str = "| route | requests | sold | oversold | 200 | 409 | 503 | 410 | p50 ms | p99 ms | requests/s |\n\
                              |---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|";

    pub fn print(&self) {
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

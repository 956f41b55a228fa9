//! The instances' metrics (the crate's `metrics` feature) through a Prometheus exporter:
//! one recorder for the process, served on `/metrics` by every instance, and read back over
//! HTTP after the run. In production each instance is its own process with its own
//! recorder, and the scraper adds the `instance` label.

use std::net::SocketAddr;

use axum::Router;
use axum::routing::get;
use http_body_util::{BodyExt, Full};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};

use crate::Error;
use crate::load::HttpClient;

/// Installs the process's recorder. Wait and hold times are rendered as summaries with
/// their median and p99 (a real deployment sets buckets instead: see the README).
pub fn install() -> Result<PrometheusHandle, Error> {
    Ok(PrometheusBuilder::new()
        .set_quantiles(&[0.5, 0.99])?
        .install_recorder()?)
}

/// `GET /metrics`: the recorder's text exposition.
pub fn route(handle: PrometheusHandle) -> Router {
    Router::new().route("/metrics", get(move || async move { handle.render() }))
}

/// Scrapes `/metrics` of the instance at `addr`.
pub async fn fetch(client: &HttpClient, addr: SocketAddr) -> Result<String, Error> {
    let request = http::Request::get(format!("http://{addr}/metrics")).body(Full::default())?;
    let response = client.request(request).await?;
    if !response.status().is_success() {
        return Err(format!("GET /metrics answered {}", response.status()).into());
    }
    let body = response.into_body().collect().await?.to_bytes();
    Ok(String::from_utf8_lossy(&body).into_owned())
}

/// The samples of the crate's metrics for the locked routes, without the comment lines.
pub fn locked_routes(exposition: &str) -> Vec<&str> {
    exposition
        .lines()
        .filter(|line| line.starts_with("tower_lock_"))
        .filter(|line| line.contains("route=\"buy\"") || line.contains("route=\"try-buy\""))
        .collect()
}

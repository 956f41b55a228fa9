//! The instances' metrics (the crate's `metrics` feature) through a Prometheus exporter:
//! one recorder for the process, served on `/metrics` by every instance, and read back over
//! HTTP after the run. In production each instance is its own process with its own
//! recorder, and the scraper adds the `instance` label.

use std::net::SocketAddr;

use axum::Router;
use axum::routing::get;
use http_body_util::{BodyExt, Full};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

use crate::Error;
use crate::load::HttpClient;

/// Installs the process's recorder. The crate's wait and hold times become histograms (as
/// in a real deployment), with buckets fine enough for the summary's p50 and p99: 1, 1.5,
/// 2, 3, 5 and 7 per decade from 10 us to 10 s.
///
/// Not the exporter's summaries: metrics-exporter-prometheus 0.17 keeps, of the samples a
/// first scrape drains, only the newest block (64), so after a burst its quantiles describe
/// the last few requests alone.
pub fn install() -> Result<PrometheusHandle, Error> {
    let buckets: Vec<f64> = (-5..=0)
        .flat_map(|exp| [1.0, 1.5, 2.0, 3.0, 5.0, 7.0].map(|m| m * 10f64.powi(exp)))
        .chain([10.0])
        .collect();
    Ok(PrometheusBuilder::new()
        .set_buckets_for_metric(Matcher::Prefix("tower_lock_".into()), &buckets)?
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

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

/// The bucket bounds of a decade: each a quarter above the one before, so that a bucket
/// tells a time within 25%.
const R10: [f64; 10] = [1.0, 1.25, 1.6, 2.0, 2.5, 3.2, 4.0, 5.0, 6.3, 8.0];

/// Installs the process's recorder. The crate's wait and hold times become histograms (as
/// in a real deployment), with [`R10`] buckets from 10 us to 10 s for the summary.
///
/// Not the exporter's summaries: metrics-exporter-prometheus 0.17 keeps, of the samples a
/// first scrape drains, only the newest block (64), so after a burst its quantiles describe
/// the last few requests alone.
pub fn install() -> Result<PrometheusHandle, Error> {
    // Divided, not multiplied by 1e-5..: the bounds then print as written (0.00063).
    let buckets: Vec<f64> = (0..=5)
        .rev()
        .flat_map(|exp| R10.map(|m| m / 10f64.powi(exp)))
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

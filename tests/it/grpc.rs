//! The layer on a tonic server: every rejection arrives at a real tonic client as its
//! gRPC status, with the retry delay where there is one, and a request that gets its lock
//! is served and releases it.

use crate::support;

use std::net::SocketAddr;
use std::time::Duration;

use tokio::net::TcpListener;
use tonic::transport::server::TcpIncoming;
use tonic::transport::{Channel, Server};
use tonic::{Code, Status};
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::{HealthCheckRequest, HealthCheckResponse};
use tonic_types::StatusExt;
use tower_lock::{LockLayer, MemoryBackend, RedisBackend};

/// The metadata a call names its lock key in.
const KEY: &str = "x-lock-key";

type GrpcRequest = http::Request<tonic::body::Body>;

/// Reads the lock key from the call's metadata (a missing one locks nothing).
fn key(req: &GrpcRequest) -> Option<String> {
    let key = req.headers().get(KEY)?.to_str().ok()?;
    Some(key.to_owned())
}

/// A tonic server of the health service behind `layer`, on a free loopback port; the
/// server stops with the test's runtime.
async fn serve<P>(layer: LockLayer<fn(&GrpcRequest) -> Option<String>, P>) -> HealthClient<Channel>
where
    P: tower_lock::lock::policy::HoldPolicy<tonic::body::Body> + Clone + Send + Sync + 'static,
{
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr: SocketAddr = listener.local_addr().expect("local addr");
    let (reporter, health) = tonic_health::server::health_reporter();
    reporter
        .set_service_status("", tonic_health::ServingStatus::Serving)
        .await;
    tokio::spawn(
        Server::builder()
            .layer(layer)
            .add_service(health)
            .serve_with_incoming(TcpIncoming::from(listener)),
    );
    let channel = Channel::from_shared(format!("http://{addr}"))
        .expect("endpoint")
        .connect()
        .await
        .expect("connect to the tonic server");
    HealthClient::new(channel)
}

/// One health check under lock `key`.
async fn check(
    client: &mut HealthClient<Channel>,
    key: &str,
) -> Result<HealthCheckResponse, Status> {
    let mut request = tonic::Request::new(HealthCheckRequest {
        service: String::new(),
    });
    request
        .metadata_mut()
        .insert(KEY, key.parse().expect("ascii key"));
    client.check(request).await.map(tonic::Response::into_inner)
}

fn layer(backend: &MemoryBackend) -> LockLayer<fn(&GrpcRequest) -> Option<String>> {
    LockLayer::new(backend.clone(), key as fn(&GrpcRequest) -> Option<String>).grpc()
}

/// The delay a status carries, read both ways a gRPC client reads it; they agree.
fn retry_delay(status: &Status) -> Option<Duration> {
    let details = status.get_details_retry_info().and_then(|r| r.retry_delay);
    let pushback = status
        .metadata()
        .get("grpc-retry-pushback-ms")
        .map(|ms| Duration::from_millis(ms.to_str().expect("ascii").parse().expect("millis")));
    assert_eq!(
        details, pushback,
        "RetryInfo and pushback disagree: {status:?}"
    );
    details
}

#[tokio::test]
async fn a_free_key_is_served_and_released() {
    let backend = MemoryBackend::new();
    let mut client = serve(layer(&backend)).await;
    let served = check(&mut client, "order:1").await.expect("served");
    assert_eq!(served.status(), ServingStatus::Serving);
    let info = backend.inspect("order:1").await.expect("inspect");
    assert!(info.is_free(), "the call's lock was not released: {info:?}");
    assert!(
        info.fencing_token.is_some(),
        "the call took no lock: {info:?}"
    );
}

#[tokio::test]
async fn a_held_key_is_aborted_on_a_fail_fast_route() {
    let backend = MemoryBackend::new();
    let mut client = serve(layer(&backend).fail_fast()).await;
    let _held = backend
        .lock("order:2")
        .try_once()
        .await
        .expect("take the key");
    let status = check(&mut client, "order:2").await.expect_err("contended");
    assert_eq!(status.code(), Code::Aborted, "{status:?}");
    assert!(
        status.message().starts_with("Resource is locked"),
        "{status:?}"
    );
    assert!(retry_delay(&status).is_some(), "no retry delay: {status:?}");
}

#[tokio::test]
async fn a_wait_that_runs_out_is_unavailable() {
    let backend = MemoryBackend::new();
    let mut client = serve(layer(&backend).wait(Duration::from_millis(20))).await;
    let _held = backend
        .lock("order:3")
        .try_once()
        .await
        .expect("take the key");
    let status = check(&mut client, "order:3").await.expect_err("timed out");
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    assert!(retry_delay(&status).is_some(), "no retry delay: {status:?}");
}

#[tokio::test]
async fn taken_permits_are_resource_exhausted() {
    let backend = MemoryBackend::new();
    let mut client = serve(layer(&backend).permits(1).fail_fast()).await;
    let _permit = backend
        .lock("order:4")
        .permits(1)
        .try_once()
        .await
        .expect("take the permit");
    let status = check(&mut client, "order:4").await.expect_err("no permit");
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert!(retry_delay(&status).is_some(), "no retry delay: {status:?}");
}

#[tokio::test]
async fn a_bad_key_is_an_invalid_argument_without_a_delay() {
    let backend = MemoryBackend::new();
    let mut client = serve(layer(&backend)).await;
    let status = check(&mut client, "").await.expect_err("empty key");
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    assert_eq!(retry_delay(&status), None, "{status:?}");
}

#[tokio::test]
async fn a_store_down_is_unavailable() {
    let mut server = support::RedisServer::start();
    let backend = RedisBackend::connect(&server.url()).await.expect("connect");
    let layer = LockLayer::new(backend, key as fn(&GrpcRequest) -> Option<String>)
        .wait(Duration::from_millis(200))
        .grpc();
    let mut client = serve(layer).await;
    check(&mut client, "order:5")
        .await
        .expect("served while Redis runs");
    server.kill();
    let status = check(&mut client, "order:5")
        .await
        .expect_err("Redis is down");
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    assert!(
        status.message().starts_with("Lock service unavailable"),
        "{status:?}"
    );
    assert!(retry_delay(&status).is_some(), "no retry delay: {status:?}");
}

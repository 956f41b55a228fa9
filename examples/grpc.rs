//! The layer on a tonic server: a gRPC client sees rejections as gRPC statuses.
//!
//! `cargo run --example grpc` (no server needed: the locks are in memory; with
//! `RedisBackend::connect(url)` in place of `MemoryBackend::new()` they are shared by
//! every instance). Needs the `grpc` feature, which the crate's own examples have.
//!
//! The service is tonic-health's (its code is generated ahead, so nothing here needs
//! `protoc`); a real service is locked the same way. Each call names the order it works on
//! in its `x-order-id` metadata: a call for a busy order is answered `ABORTED` with the
//! time to wait before trying again, a call for a free one is served.

use std::time::Duration;

use tokio::net::TcpListener;
use tonic::transport::server::TcpIncoming;
use tonic::transport::{Channel, Server};
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_client::HealthClient;
use tonic_types::StatusExt;
use tower_lock::{LockLayer, MemoryBackend};

/// One lock per order, named by the call's metadata; a call without it is not locked.
fn order(req: &http::Request<tonic::body::Body>) -> Option<String> {
    let id = req.headers().get("x-order-id")?.to_str().ok()?;
    Some(format!("order:{id}"))
}

async fn check(
    client: &mut HealthClient<Channel>,
    order: &str,
) -> Result<(), Box<dyn std::error::Error>> {
    let mut request = tonic::Request::new(HealthCheckRequest::default());
    request.metadata_mut().insert("x-order-id", order.parse()?);
    match client.check(request).await {
        Ok(response) => println!(
            "order {order}: served ({:?})",
            response.into_inner().status()
        ),
        Err(status) => {
            let retry = status.get_details_retry_info().and_then(|r| r.retry_delay);
            println!(
                "order {order}: {:?} \"{}\", retry after {retry:?}",
                status.code(),
                status.message()
            );
        }
    }
    Ok(())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let backend = MemoryBackend::new();

    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let (reporter, health) = tonic_health::server::health_reporter();
    reporter
        .set_service_status("", tonic_health::ServingStatus::Serving)
        .await;
    let layer = LockLayer::new(backend.clone(), order)
        .fail_fast()
        .retry_after(Duration::from_millis(250))
        .grpc();
    tokio::spawn(
        Server::builder()
            .layer(layer)
            .add_service(health)
            .serve_with_incoming(TcpIncoming::from(listener)),
    );

    let channel = Channel::from_shared(format!("http://{addr}"))?
        .connect()
        .await?;
    let mut client = HealthClient::new(channel);

    // Another request (here: a job of this process) works on order 1.
    let job = backend.lock("order:1").try_once().await?;
    check(&mut client, "1").await?;
    check(&mut client, "2").await?;
    job.release().await?;
    check(&mut client, "1").await?;
    Ok(())
}

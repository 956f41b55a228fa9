//! A killed node is given up: redis-rs reconnects a lost node's connection, and logs a
//! WARN at each failed attempt, for as long as the node is in that connection's slot map,
//! and a connection that routes nothing to the node never refreshes the map. Each
//! backend's subscriber (which only pings the primaries it knows) retried a killed primary
//! once a second without end, about 200 WARN lines in 3.5 minutes per instance.

use std::num::NonZeroUsize;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

/// How many times the test's own cluster connections try a lost node, as the backends' do.
pub const RECONNECT_ATTEMPTS: NonZeroUsize = NonZeroUsize::MIN.saturating_add(4);

/// The backends that lost the primary on `killed` (those of the failover scenario, and of
/// earlier scenarios still serving) no longer try to reach it: whatever opens a connection
/// on its port is counted, and nothing does.
pub async fn the_backends_stop_reconnecting_to_a_killed_node(killed: u16) {
    // redis-rs spaces a node's reconnect attempts 50 ms, 100 ms, ... apart, doubling up to
    // 1 s: five attempts end within a second of the loss. Two more seconds of margin.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", killed))
        .await
        .expect("the killed node's port is free");
    let accepted = Arc::new(AtomicUsize::new(0));
    let counting = tokio::spawn({
        let accepted = accepted.clone();
        async move {
            while let Ok((connection, _)) = listener.accept().await {
                accepted.fetch_add(1, Ordering::SeqCst);
                drop(connection);
            }
        }
    });
    // Three times the longest spacing of redis-rs' endless retries: each backend that still
    // retried would be counted about three times.
    tokio::time::sleep(Duration::from_secs(3)).await;
    counting.abort();
    assert_eq!(
        accepted.load(Ordering::SeqCst),
        0,
        "connections opened to the killed node's port after the backends should have given up"
    );
}

//! Shared holds and semaphore permits on a Redis Cluster: their hashes, waiting writers and
//! channels live on the shard of their key (one hash tag), waiters are woken by SPUBLISH on
//! that shard, and the watchdog renews every holder's own lease there.

use std::time::Duration;

use tower_lock::LockError;

use crate::support::cluster::{Cluster, key_on};

/// Runs every scenario of this file.
pub async fn shared_holds_and_permits_live_on_their_shard(cluster: &Cluster) {
    readers_and_a_waiting_writer_on_every_shard(cluster).await;
    permits_are_renewed_and_handed_on_within_their_shard(cluster).await;
}

/// On a key of every shard, after a writer: two backends hold it shared (with that
/// writer's token), a writer of a third waits (and
/// registers as waiting on that shard, so a new reader queues behind it), and gets the
/// lock when both readers have left, under a token above theirs.
async fn readers_and_a_waiting_writer_on_every_shard(cluster: &Cluster) {
    let (a, b, writer) = (
        cluster.backend().await,
        cluster.backend().await,
        cluster.backend().await,
    );
    for port in cluster.primaries() {
        let key = key_on(cluster, port, "rw:");
        let hash = format!("tower-lock:{{{key}}}");
        let earlier = writer.lock(key.clone()).try_once().await.expect("free");
        let written = earlier.fencing_token();
        earlier.release().await.expect("release");
        let first = a
            .lock(key.clone())
            .shared()
            .try_once()
            .await
            .expect("shared");
        let second = b
            .lock(key.clone())
            .shared()
            .try_once()
            .await
            .expect("shared");
        assert_eq!(
            first.fencing_token(),
            written,
            "readers see the last writer's token"
        );
        assert_eq!(second.fencing_token(), written);
        assert!(cluster.exists_on(port, &hash), "{key}'s hash on {port}");
        let waiting = {
            let (writer, key) = (writer.clone(), key.clone());
            tokio::spawn(async move { writer.lock(key).wait(Duration::from_secs(20)).await })
        };
        let writers = format!("{hash}:writers");
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while !cluster.exists_on(port, &writers) {
            assert!(
                tokio::time::Instant::now() < deadline,
                "writer never queued on {port}"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let late = b.lock(key.clone()).shared().try_once().await;
        assert!(matches!(late, Err(LockError::Contended { .. })), "{late:?}");
        first.release().await.expect("release");
        assert!(!waiting.is_finished(), "one reader still holds {key}");
        second.release().await.expect("release");
        let held = waiting
            .await
            .expect("task")
            .expect("the writer gets the lock");
        assert!(!held.held().is_shared());
        assert!(held.fencing_token() > written, "{held:?}");
        held.release().await.expect("release");
        assert!(!cluster.exists_on(port, &hash) && !cluster.exists_on(port, &writers));
    }
}

/// Two permits of a key on every shard held through three leases (renewed per holder),
/// a third acquisition waits and is woken by the release on that shard; nothing is left.
/// The shards run at once.
async fn permits_are_renewed_and_handed_on_within_their_shard(cluster: &Cluster) {
    let (a, b) = (cluster.backend().await, cluster.backend().await);
    // Renewed every third of it: a second of room for a renewal delayed on a loaded machine.
    let lease = Duration::from_millis(1500);
    let shards = cluster.primaries().into_iter().map(|port| {
        let (a, b) = (&a, &b);
        async move {
            let key = key_on(cluster, port, "permits:");
            let hash = format!("tower-lock:{{{key}}}:permits");
            let one = a.lock(key.clone()).permits(2).lease(lease).try_once().await;
            let two = b.lock(key.clone()).permits(2).lease(lease).try_once().await;
            let (one, two) = (one.expect("first permit"), two.expect("second permit"));
            assert!(
                cluster.exists_on(port, &hash),
                "{key}'s semaphore on {port}"
            );
            tokio::time::sleep(lease * 3).await;
            assert!(
                !one.is_lost() && !two.is_lost(),
                "renewed past three leases"
            );
            let full = a.lock(key.clone()).permits(2).try_once().await;
            assert!(
                matches!(full, Err(LockError::PermitsTaken { permits: 2, .. })),
                "{full:?}"
            );
            let waiting = {
                let (a, key) = (a.clone(), key.clone());
                tokio::spawn(
                    async move { a.lock(key).permits(2).wait(Duration::from_secs(20)).await },
                )
            };
            tokio::time::sleep(Duration::from_millis(100)).await;
            assert!(!waiting.is_finished(), "both permits still held");
            let freed = one.fencing_token();
            one.release().await.expect("release");
            let third = waiting.await.expect("task").expect("a permit was freed");
            assert!(third.fencing_token() > freed.max(two.fencing_token()));
            third.release().await.expect("release");
            two.release().await.expect("release");
            assert!(
                !cluster.exists_on(port, &hash),
                "{key}'s semaphore left on {port}"
            );
        }
    });
    futures_util::future::join_all(shards).await;
}

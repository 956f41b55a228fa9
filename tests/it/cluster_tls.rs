//! Redis Cluster over TLS: `rediss://` seeds reach every node the cluster names (its
//! `CLUSTER SLOTS` gives bare addresses) with the builder's root certificate and client
//! certificate; waiters are woken by sharded pub/sub over TLS, and the backend follows a
//! primary's failover, which the replica wins over the TLS cluster bus.
//!
//! One TLS cluster (three primaries with a replica each) serves this binary, driven in
//! order by one test, the failover last; killed when it ends.

use crate::support;

use std::time::Duration;

use support::tls_cluster::TlsCluster;
use support::{assert_says, chain, lock_key, timed_build};
use tokio::time::Instant;
use tower_lock::{BuildError, RedisBackend, RedisBackendBuilder};

/// Generous for a loaded machine: a build opens a TLS connection to every node (six
/// handshakes) and checks each, every step within these.
const TIMEOUT: Duration = Duration::from_secs(3);

fn builder(cluster: &TlsCluster) -> RedisBackendBuilder {
    let certs = &cluster.certs;
    RedisBackend::cluster(cluster.urls())
        .tls_root_cert(certs.pem("ca.crt"))
        .tls_client_cert(certs.pem("client.crt"), certs.pem("client.key"))
        .command_timeout(TIMEOUT)
        .connect_timeout(TIMEOUT)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tls_cluster_serves_locks_wakes_waiters_and_follows_a_failover() {
    crate::needs!(Redis);
    support::init_tracing();
    let mut cluster = TlsCluster::start();
    a_node_that_wants_a_client_certificate_is_named_at_build(&cluster).await;
    let backends = (
        timed_build("TLS cluster", builder(&cluster)).await,
        timed_build("TLS cluster, another instance", builder(&cluster)).await,
    );
    let backends = (
        backends.0.expect("backend over TLS"),
        backends.1.expect("another instance"),
    );
    locks_land_on_every_shard_over_tls(&cluster, &backends.0).await;
    a_waiter_is_woken_over_tls(&cluster, &backends).await;
    a_killed_primary_is_followed_to_its_promoted_replica(&mut cluster, &backends.0).await;
}

/// Without the client certificate, the first node reached refuses the handshake: the build
/// fails with a TLS error naming the node and the missing certificate.
async fn a_node_that_wants_a_client_certificate_is_named_at_build(cluster: &TlsCluster) {
    let error = RedisBackend::cluster(cluster.urls())
        .tls_root_cert(cluster.certs.pem("ca.crt"))
        .connect_timeout(TIMEOUT)
        .build()
        .await
        .expect_err("the nodes demand a client certificate");
    let text = chain(&error);
    println!("TLS cluster without a client certificate: {text}");
    assert!(matches!(error, BuildError::Tls { .. }), "{text}");
    assert_says(&error, &["client certificate"]);
}

/// Keys spread over the shards: each lock hash is on exactly one node, a primary, every
/// primary gets some, and the release leaves none behind.
async fn locks_land_on_every_shard_over_tls(cluster: &TlsCluster, backend: &RedisBackend) {
    let primaries = cluster.primaries();
    assert_eq!(primaries.len(), 3, "three primaries");
    let mut guards = Vec::new();
    let mut used = Vec::new();
    for i in 0..30 {
        let key = format!("spread:{i}");
        let guard = backend.lock(key.clone()).try_once().await;
        guards.push(guard.expect("uncontended"));
        let holders = cluster.holders_of(&lock_key(&key));
        assert_eq!(holders.len(), 1, "{key} is on one node: {holders:?}");
        assert!(primaries.contains(&holders[0]), "{key} on a primary");
        used.push(holders[0]);
    }
    used.sort_unstable();
    used.dedup();
    assert_eq!(used, primaries, "every shard holds some of the locks");
    for guard in guards {
        guard.release().await.expect("release");
    }
    for i in 0..30 {
        let key = lock_key(&format!("spread:{i}"));
        assert!(cluster.holders_of(&key).is_empty(), "{key} released");
    }
}

/// A waiter of another instance subscribes on the key's shard (SSUBSCRIBE over TLS) and
/// the release there wakes it.
async fn a_waiter_is_woken_over_tls(cluster: &TlsCluster, (a, b): &(RedisBackend, RedisBackend)) {
    let held = a.lock("wait").try_once().await.expect("lock");
    let owner = cluster.holders_of(&lock_key("wait"))[0];
    let waiting = {
        let b = b.clone();
        tokio::spawn(async move { b.lock("wait").wait(Duration::from_secs(30)).await })
    };
    let channel = format!("{}:released", lock_key("wait"));
    support::eventually("the waiter subscribed on the key's shard", || async {
        cluster
            .cli(owner, &["PUBSUB", "SHARDNUMSUB", &channel])
            .lines()
            .last()
            == Some("1")
    })
    .await;
    let released = Instant::now();
    held.release().await.expect("release");
    let guard = waiting
        .await
        .expect("task")
        .expect("the waiter gets the lock");
    println!(
        "TLS cluster: the waiter was served {:?} after the release",
        released.elapsed()
    );
    guard.release().await.expect("release");
}

/// The primary of a held key is killed; its replica is promoted over the TLS bus, and the
/// backend takes the key on it (the holder's hold was lost with the primary's data or
/// not: either way a new acquisition succeeds once the shard is back).
async fn a_killed_primary_is_followed_to_its_promoted_replica(
    cluster: &mut TlsCluster,
    backend: &RedisBackend,
) {
    let key = "failover";
    let guard = backend.lock(key).try_once().await.expect("lock");
    let primary = cluster.holders_of(&lock_key(key))[0];
    let replica = cluster.replica_of(primary);
    support::eventually("the replica has every write of its primary", || async {
        cluster.replica_caught_up(primary)
    })
    .await;
    let token = guard.fencing_token();
    let killed = Instant::now();
    cluster.kill(primary);
    drop(guard);
    cluster.wait_until_promoted(replica);
    cluster.wait_until_ok();
    assert!(cluster.primaries().contains(&replica), "the replica won");
    let give_up = Instant::now() + Duration::from_secs(30);
    let again = loop {
        match backend.lock(key).wait(Duration::from_secs(5)).await {
            Ok(guard) => break guard,
            Err(e) if e.is_transient() && Instant::now() < give_up => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("the key is served again on the promoted replica: {e}"),
        }
    };
    println!(
        "TLS cluster failover: primary killed -> key served again {:?}",
        killed.elapsed()
    );
    assert!(again.fencing_token() > token, "tokens go on increasing");
    assert_eq!(cluster.holders_of(&lock_key(key)), [replica]);
    again.release().await.expect("release");
}

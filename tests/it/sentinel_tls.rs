//! Redis Sentinel over TLS: `rediss://` sentinel URLs reach the sentinels and the master
//! they name over TLS, verified against the builder's root certificate, and the backend
//! follows a switchover announced on that TLS connection.
//!
//! One TLS deployment (master, replica, one sentinel) serves every scenario of this binary,
//! driven in order by one test, and is killed when it ends.

use crate::support;

use std::time::Duration;

use support::chain;
use support::tls_sentinel::{TLS_MASTER_NAME, TlsSentinelSet};
use tower_lock::{BuildError, RedisBackend};

fn lock_key(key: &str) -> String {
    support::lock_key(key)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sentinel_over_tls_serves_locks_and_follows_a_switchover() {
    crate::needs!(Redis);
    support::init_tracing();
    let mut set = TlsSentinelSet::start();
    let backend = RedisBackend::sentinel([set.sentinel_url()], TLS_MASTER_NAME)
        .tls_root_cert(set.certs.pem("ca.crt"))
        .command_timeout(Duration::from_millis(500))
        .build()
        .await
        .expect("backend through TLS sentinels");
    let master = set.master_port();
    let guard = backend.lock("tls").try_once().await.expect("lock taken");
    let exists = set.cli(master, &["EXISTS", &lock_key("tls")]);
    assert_eq!(exists.as_deref(), Some("1"), "held on the TLS master");
    guard.release().await.expect("released");
    assert_eq!(
        set.cli(master, &["EXISTS", &lock_key("tls")]).as_deref(),
        Some("0")
    );

    // A switchover, announced on the TLS connection to the sentinel: the subscriber moves
    // and locks land on the new master.
    support::eventually("the subscriber is connected", || async {
        backend.stats().subscriber_connected
    })
    .await;
    let subscribed = backend.stats().subscriber_connections_made;
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while set
        .sentinel_cli(&["SENTINEL", "FAILOVER", TLS_MASTER_NAME])
        .is_none_or(|reply| reply != "OK")
    {
        assert!(std::time::Instant::now() < deadline, "SENTINEL FAILOVER");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    support::eventually("the sentinel names the replica", || async {
        set.master_port() != master
    })
    .await;
    support::eventually("the subscriber moves to the new master", || async {
        backend.stats().subscriber_connections_made > subscribed
    })
    .await;
    let new_master = set.master_port();
    assert_ne!(new_master, master, "the replica was promoted");
    let guard = backend.lock("tls").try_once().await.expect("lock taken");
    assert_eq!(
        set.cli(new_master, &["EXISTS", &lock_key("tls")])
            .as_deref(),
        Some("1"),
        "held on the new TLS master"
    );
    guard.release().await.expect("released");

    // A crash: the new master killed once the old one replicates from it (made a replica
    // by hand, as the sentinel would at its next round); the sentinel promotes it back.
    let port = new_master.to_string();
    let replicaof = set.cli(master, &["REPLICAOF", "127.0.0.1", &port]);
    assert_eq!(replicaof.as_deref(), Some("OK"), "REPLICAOF");
    support::eventually("the old master replicates from the new one", || async {
        set.cli(new_master, &["INFO", "replication"])
            .is_some_and(|info| info.contains("connected_slaves:1") && info.contains("online"))
    })
    .await;
    let guard = backend.lock("crash").try_once().await.expect("lock taken");
    let token = guard.fencing_token();
    support::eventually("the replica has every write", || async {
        set.replica_caught_up(new_master)
    })
    .await;
    let subscribed = backend.stats().subscriber_connections_made;
    let killed = std::time::Instant::now();
    set.kill(new_master);
    drop(guard);
    let promoted = tokio::time::timeout(Duration::from_secs(30), async {
        while set.master_port() != master {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    promoted.expect("the sentinel promotes the old master back");
    support::eventually("the subscriber follows the promotion", || async {
        backend.stats().subscriber_connections_made > subscribed
    })
    .await;
    let again = backend.lock("crash").wait(Duration::from_secs(30)).await;
    let again = again.expect("the key is served again on the promoted node");
    println!(
        "TLS sentinel: master killed -> key served again {:?}",
        killed.elapsed()
    );
    assert!(again.fencing_token() > token, "tokens go on increasing");
    assert_eq!(
        set.cli(master, &["EXISTS", &lock_key("crash")]).as_deref(),
        Some("1"),
        "held on the promoted node"
    );
    again.release().await.expect("released");

    // Without the root certificate the sentinel's certificate does not verify.
    let refused = RedisBackend::sentinel([set.sentinel_url()], TLS_MASTER_NAME)
        .build()
        .await
        .expect_err("an untrusted sentinel certificate");
    println!("untrusted sentinel certificate: {}", chain(&refused));
    assert!(
        chain(&refused).to_lowercase().contains("certificate"),
        "{refused:?}"
    );
}

#[tokio::test]
async fn mixed_sentinel_schemes_are_refused() {
    let error = RedisBackend::sentinel(
        ["rediss://127.0.0.1:1", "redis://127.0.0.1:2"],
        TLS_MASTER_NAME,
    )
    .build()
    .await
    .expect_err("TLS on some sentinels only");
    assert!(matches!(error, BuildError::Tls { .. }), "{error:?}");
    let error = RedisBackend::sentinel(["redis://127.0.0.1:1"], TLS_MASTER_NAME)
        .tls_root_cert(b"not used".to_vec())
        .build()
        .await
        .expect_err("certificates for plaintext sentinels");
    assert!(matches!(error, BuildError::Tls { .. }), "{error:?}");
}

//! Sentinels that have not heard of the last promotion: the backend follows a majority of
//! them or the promotion it heard announced, and uses no server that says it is a replica.

use std::time::Duration;

use http::StatusCode;
use support::sentinel::SentinelSet;
use tower_lock::{LockError, RedisBackend};

use super::{MASTER_PASSWORD, backend_with, support};

/// How many acquisitions may fail on connections opened before a change (one pooled
/// connection, and a retry) before one opens a new connection.
const ATTEMPTS: usize = 3;

/// A partition leaves one sentinel with the old master, which still answers as one; the
/// two others promoted the replica. That sentinel comes first in the backend's list (the
/// one redis-rs' lookup asked first and believed): locks still land on the new master
/// only. With one of the two others stopped, no master has a majority: acquisitions fail
/// with a 503 naming the disagreement, and none lands on the old master.
pub(crate) async fn a_stale_sentinel_is_outvoted(set: &SentinelSet) {
    let (old, new) = set.split_off_sentinel(2).await;
    let mut urls = set.sentinel_urls();
    urls.rotate_right(1);
    let backend = RedisBackend::sentinel(urls, support::sentinel::MASTER_NAME)
        .command_timeout(Duration::from_millis(500))
        .connect_timeout(Duration::from_millis(500))
        .master_password(MASTER_PASSWORD)
        .pool_size(1)
        .build()
        .await
        .expect("backend through sentinels, the stale one first");
    for _ in 0..3 {
        let guard = backend.lock("stale").try_once().await.expect("lock");
        let held = held_on(set, "stale").await;
        assert_eq!(held, vec![new], "held on the new master only (old {old})");
        guard.release().await.expect("release");
    }

    // Sentinel 1 (of the two up to date) answers nothing; its answer waits for the timeout.
    set.pause_sentinel(1);
    // The backend's connections to the new master end, so the next ones ask again.
    kill_clients_of(set, new, "default").await;
    let refused = refused_within_attempts(&backend, "split", "majority").await;
    set.resume_sentinel(1);
    let text = support::chain(&refused);
    assert_eq!(refused.status(), StatusCode::SERVICE_UNAVAILABLE, "{text}");
    assert!(held_on(set, "split").await.is_empty(), "taken nowhere");
    println!("sentinels without a majority: {text}");
    drop(backend);
    set.reconnect_sentinels(old).await;
}

/// The reverse partition: the one sentinel the backend listens to promotes the replica
/// alone (a forced failover) and announces it; the two others never hear of it and name
/// the old master, which still answers as one. The backend goes where the announcement
/// says, against the majority.
pub(crate) async fn an_announced_master_is_trusted_over_stale_sentinels(set: &SentinelSet) {
    // The listener subscribes on the first sentinel, which will announce the promotion;
    // the backends of the scenarios before are gone, and theirs with them.
    let first = redis::Client::open(set.sentinel_urls()[0].as_str())
        .expect("url")
        .get_multiplexed_async_connection()
        .await
        .expect("sentinel");
    let listeners = || async {
        let clients: String = redis::cmd("CLIENT")
            .arg("LIST")
            .query_async(&mut first.clone())
            .await
            .expect("CLIENT LIST");
        clients.lines().filter(|c| c.contains(" sub=1 ")).count()
    };
    support::eventually("no backend listens to the first sentinel", || async {
        listeners().await == 0
    })
    .await;
    let backend = backend_with(set, |b| b.pool_size(1)).await;
    let guard = backend.lock("pinned").try_once().await.expect("lock");
    guard.release().await.expect("release");
    support::eventually("the backend listens to the first sentinel", || async {
        listeners().await == 1
    })
    .await;
    let subscribed = backend.stats().subscriber_connections_made;
    let (old, new) = set.fail_over_alone(0).await;
    support::eventually("the subscriber moves to the announced master", || async {
        backend.stats().subscriber_connections_made > subscribed
    })
    .await;
    for _ in 0..3 {
        let guard = backend.lock("pinned").try_once().await.expect("lock");
        let held = held_on(set, "pinned").await;
        assert_eq!(held, vec![new], "held on the announced master (old {old})");
        guard.release().await.expect("release");
    }
    drop(backend);
    set.reconnect_sentinels(old).await;
}

/// The master the sentinels name is made a replica by hand, and the sentinels told to
/// take their time noticing: every sentinel still names it, and it answers, but as a
/// replica. The backend refuses it with an error that says so (a 503).
pub(crate) async fn a_master_reporting_a_replica_is_refused(set: &SentinelSet) {
    let backend = backend_with(set, |b| b.pool_size(1)).await;
    let guard = backend.lock("demoted").try_once().await.expect("lock");
    guard.release().await.expect("release");
    // Down after 10 min: the sentinels flag a master that reports a replica 20 s after that.
    set.set_down_after(Duration::from_secs(600)).await;
    let master = set.master_port().await;
    let mut conn = set.data_conn(set.server(master)).await;
    let nowhere = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("free port")
        .port();
    let _: () = redis::cmd("REPLICAOF")
        .arg("127.0.0.1")
        .arg(nowhere)
        .query_async(&mut conn)
        .await
        .expect("REPLICAOF");
    let refused = refused_within_attempts(&backend, "demoted", "role:slave").await;
    assert_eq!(
        set.master_port().await,
        master,
        "the sentinels still name it"
    );
    let _: () = redis::cmd("REPLICAOF")
        .arg("NO")
        .arg("ONE")
        .query_async(&mut conn)
        .await
        .expect("REPLICAOF NO ONE");
    set.set_down_after(Duration::from_secs(1)).await;
    let text = support::chain(&refused);
    assert_eq!(refused.status(), StatusCode::SERVICE_UNAVAILABLE, "{text}");
    println!("a named master that reports a replica: {text}");
    set.wait_until_ready().await;
}

/// Tries to take `key` until an acquisition fails with an error whose chain says `says`,
/// within [`ATTEMPTS`]; every one of them must fail.
async fn refused_within_attempts(
    backend: &tower_lock::RedisBackend,
    key: &str,
    says: &str,
) -> LockError {
    let mut seen = Vec::new();
    for _ in 0..ATTEMPTS {
        let error = backend
            .lock(key)
            .try_once()
            .await
            .expect_err("no master to take it on");
        let text = support::chain(&error);
        if text.contains(says) {
            return error;
        }
        seen.push(text);
    }
    panic!("no error within {ATTEMPTS} attempts says `{says}`: {seen:#?}")
}

/// The ports of the data nodes that hold `key`'s lock.
async fn held_on(set: &SentinelSet, key: &str) -> Vec<u16> {
    let mut held = Vec::new();
    for server in set.servers() {
        let exists: bool = redis::cmd("EXISTS")
            .arg(support::lock_key(key))
            .query_async(&mut set.data_conn(server).await)
            .await
            .expect("EXISTS");
        if exists {
            held.push(server.port());
        }
    }
    held
}

/// Cuts the connections of `user` on the data node on `port`.
async fn kill_clients_of(set: &SentinelSet, port: u16, user: &str) {
    let _: i64 = redis::cmd("CLIENT")
        .arg("KILL")
        .arg("USER")
        .arg(user)
        .query_async(&mut set.data_conn(set.server(port)).await)
        .await
        .expect("CLIENT KILL USER");
}

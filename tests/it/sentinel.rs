//! Redis Sentinel: a backend built through the sentinels takes and releases locks, and
//! follows a failover (the master SIGKILLed, the replica promoted) without a restart.
//!
//! One deployment (master, replica, three sentinels) serves every scenario of this binary,
//! driven in order by one test, and is killed when it ends. Sentinels that have not heard
//! of a promotion are in `sentinel/stale.rs`.

#[path = "sentinel/stale.rs"]
mod stale;
use crate::support;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::{Request, State};
use axum::routing;
use axum::{Extension, Router};
use futures_util::StreamExt;
use http::StatusCode;
use support::sentinel::{MASTER_NAME, SentinelSet};
use support::{HttpClient, RedisServer, eventually, http_client, post, serve};
use tower_lock::{BuildError, HeldLock, LockError, LockLayer, RedisBackend};

/// Generous bound on the failover (kill to first served request); measured figures are
/// printed, not asserted.
const FAILOVER_BOUND: Duration = Duration::from_secs(30);

/// The data nodes' password once [`data_nodes_require_a_password`] set it; the sentinels
/// keep none.
const MASTER_PASSWORD: &str = "data-node-secret";

/// A builder on the set with short timeouts, so requests fail fast while there is no
/// master.
fn sentinel_builder(set: &SentinelSet) -> tower_lock::RedisBackendBuilder {
    RedisBackend::sentinel(set.sentinel_urls(), MASTER_NAME)
        .command_timeout(Duration::from_millis(500))
        .connect_timeout(Duration::from_millis(500))
}

/// [`sentinel_builder`] with the data nodes' password.
fn data_builder(set: &SentinelSet) -> tower_lock::RedisBackendBuilder {
    sentinel_builder(set).master_password(MASTER_PASSWORD)
}

/// A backend through the sentinels, logged in to the data nodes.
async fn backend(set: &SentinelSet) -> RedisBackend {
    backend_with(set, |builder| builder).await
}

/// [`backend`] with `more` settings.
async fn backend_with(
    set: &SentinelSet,
    more: impl FnOnce(tower_lock::RedisBackendBuilder) -> tower_lock::RedisBackendBuilder,
) -> RedisBackend {
    more(data_builder(set))
        .build()
        .await
        .expect("backend through sentinels")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sentinel_deployment_serves_locks_and_survives_a_failover() {
    crate::needs!(Redis);
    support::init_tracing();
    let mut set = SentinelSet::start().await;
    locks_are_taken_and_released_on_the_master(&set).await;
    an_unknown_master_name_fails_the_build(&set).await;
    data_nodes_require_a_password(&mut set).await;
    an_evicting_replica_is_refused_unless_allowed(&set).await;
    a_replica_flagged_down_is_not_checked(&set).await;
    a_planned_switchover_moves_the_backend(&set).await;
    a_switchover_leaves_newer_holds_alone(&set).await;
    a_switchover_releases_the_shared_holds_and_permits_it_lost(&set).await;
    a_master_cut_off_from_the_sentinels_is_left_at_their_announcement(&set).await;
    stale::a_stale_sentinel_is_outvoted(&set).await;
    stale::an_announced_master_is_trusted_over_stale_sentinels(&set).await;
    stale::a_master_reporting_a_replica_is_refused(&set).await;
    three_instances_sell_exactly_the_stock_across_a_failover(&mut set).await;
}

async fn locks_are_taken_and_released_on_the_master(set: &SentinelSet) {
    let backend = sentinel_builder(set)
        .build()
        .await
        .expect("backend through sentinels");
    let guard = backend.lock("basic").try_once().await.expect("lock taken");
    let master = set.server(set.master_port().await);
    assert!(master.exists(&support::lock_key("basic")).await);
    let contended = backend.lock("basic").try_once().await;
    assert!(
        contended.is_err(),
        "a second owner is refused: {contended:?}"
    );
    guard.release().await.expect("released");
    assert!(!master.exists(&support::lock_key("basic")).await);
}

async fn an_unknown_master_name_fails_the_build(set: &SentinelSet) {
    let error = RedisBackend::sentinel(set.sentinel_urls(), "no-such-master")
        .build()
        .await
        .expect_err("no sentinel knows the name");
    assert!(
        matches!(&error, BuildError::Sentinel { master_name, .. } if master_name == "no-such-master"),
        "{error:?}"
    );
    let message = support::chain(&error);
    assert!(message.contains("`no-such-master`"), "{message}");
    println!("unknown master name: {message}");
}

/// From here on the data nodes require a password and the sentinels none (the common
/// setup): the sentinel URLs carry no password, the builder gives the master's.
async fn data_nodes_require_a_password(set: &mut SentinelSet) {
    set.require_password(MASTER_PASSWORD).await;
    let refused = sentinel_builder(set)
        .build()
        .await
        .expect_err("the master refuses a client without its password");
    assert!(
        matches!(refused, BuildError::Sentinel { .. }),
        "{refused:?}"
    );
    println!("master without its password: {}", support::chain(&refused));
    let backend = data_builder(set)
        .build()
        .await
        .expect("the master's password from the builder");
    let guard = backend.lock("auth").try_once().await.expect("lock taken");
    guard.release().await.expect("released");
}

/// The replica may evict keys: the sentinels would promote it into a master that evicts
/// held locks. The build refuses it, naming the replica (reached with the master's
/// password), unless allowed; with its policy set back, the build passes.
async fn an_evicting_replica_is_refused_unless_allowed(set: &SentinelSet) {
    let replica = replica_of(set).await;
    set_policy(set, replica, "allkeys-lru").await;
    let builder = || data_builder(set);
    let error = builder().build().await.expect_err("refused");
    let text = support::chain(&error);
    let at = format!("127.0.0.1:{}", replica.port());
    assert!(
        matches!(&error, BuildError::Eviction { policy, addr }
            if policy == "allkeys-lru" && *addr == at),
        "{text}"
    );
    println!("evicting replica: {text}");
    builder()
        .allow_eviction()
        .build()
        .await
        .expect("allowed knowingly");
    set_policy(set, replica, "noeviction").await;
    builder().build().await.expect("every node keeps its keys");
}

/// A replica the sentinels flag down (stopped) is left out of the check, as they would not
/// promote it: an evicting policy there does not fail the build, nor does it wait for the
/// replica's answer.
async fn a_replica_flagged_down_is_not_checked(set: &SentinelSet) {
    let replica = replica_of(set).await;
    set_policy(set, replica, "allkeys-lru").await;
    replica.pause();
    eventually("every sentinel flags the stopped replica down", || async {
        let flags = set.replica_flags(replica.port()).await;
        flags.len() == 3 && flags.iter().all(|f| f.contains("s_down"))
    })
    .await;
    let built = data_builder(set).build().await;
    replica.resume();
    built.expect("a replica flagged down is not asked");
    set_policy(set, replica, "noeviction").await;
    set.wait_until_ready().await;
}

/// The data node that is not the master now.
async fn replica_of(set: &SentinelSet) -> &RedisServer {
    let master = set.master_port().await;
    set.servers()
        .iter()
        .find(|s| s.port() != master)
        .expect("a replica")
}

/// `CONFIG SET maxmemory-policy` on `server`.
async fn set_policy(set: &SentinelSet, server: &RedisServer, policy: &str) {
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("maxmemory-policy")
        .arg(policy)
        .query_async(&mut set.data_conn(server).await)
        .await
        .expect("CONFIG SET maxmemory-policy");
}

/// The lease of the locks taken across the planned switchover: long, so that a key left
/// held by a release the switch lost would clearly wait for it.
const SWITCHOVER_LEASE: Duration = Duration::from_secs(30);

/// How soon after the announcement the key must be served again: well under the lease.
const FREE_AGAIN_BOUND: Duration = Duration::from_secs(10);

/// `SENTINEL FAILOVER` while three tasks take turns on a key: the old master stays up, and
/// the backend moves to the new one as soon as the sentinels announce it.
///
/// Writes that reach the old master between the replica's promotion and that announcement
/// are lost: typically the release of a lock taken just before the promotion. The backend
/// sends its recent releases again to the new master when it hears the announcement, so
/// the key is free again at once instead of a lease (30 s) later.
async fn a_planned_switchover_moves_the_backend(set: &SentinelSet) {
    let backend = backend(set).await;
    let old_master = set.master_port().await;
    // Every acquisition's start and end, and whether it got the lock.
    let outcomes: Arc<Mutex<Vec<(Instant, Instant, bool)>>> = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    let tasks: Vec<_> = (0..3)
        .map(|_| {
            let (backend, outcomes, stop) = (backend.clone(), outcomes.clone(), stop.clone());
            tokio::spawn(async move {
                while !stop.load(Ordering::Relaxed) {
                    let lock = backend.lock("switch").lease(SWITCHOVER_LEASE);
                    let started = Instant::now();
                    let taken = lock.wait(Duration::from_secs(2)).await;
                    outcomes.lock().expect("outcomes").push((
                        started,
                        Instant::now(),
                        taken.is_ok(),
                    ));
                    match taken {
                        Ok(guard) => drop(guard.release().await),
                        Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
                    }
                }
            })
        })
        .collect();
    // Acquisitions that started after `since` and got the lock.
    let served_since = |since: Instant| {
        let outcomes = outcomes.lock().expect("outcomes");
        outcomes
            .iter()
            .filter(|(started, _, ok)| *ok && *started > since)
            .map(|(_, ended, _)| *ended)
            .collect::<Vec<_>>()
    };
    let started = Instant::now();
    eventually("locks are served before the switchover", || async {
        served_since(started).len() >= 50
    })
    .await;
    let subscribed = backend.stats().subscriber_connections_made;
    let switched = switch_master_watch(set).await;
    let asked = Instant::now();
    set.switchover().await;
    let promoted = switched
        .await
        .expect("switch watch")
        .expect("the sentinels announce the switch");
    // The backend heard it too once its subscriber moved: acquisitions started from then on
    // go to the new master.
    eventually("the subscriber moves to the new master", || async {
        backend.stats().subscriber_connections_made > subscribed
    })
    .await;
    let moved = Instant::now();
    let free_again = tokio::time::timeout(FREE_AGAIN_BOUND, async {
        loop {
            if let Some(first) = served_since(moved).into_iter().min() {
                return first;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    let Ok(free_again) = free_again else {
        let mut held = Vec::new();
        for server in set.servers() {
            let mut conn = set.data_conn(server).await;
            let hash: Vec<String> = redis::cmd("HGETALL")
                .arg(support::lock_key("switch"))
                .query_async(&mut conn)
                .await
                .expect("HGETALL");
            held.push((server.port(), hash));
        }
        panic!(
            "the key is served again within {FREE_AGAIN_BOUND:?} of the announcement, \
             not a lease ({SWITCHOVER_LEASE:?}) later; master {}, the lock on each server: \
             {held:?}",
            set.master_port().await
        )
    };
    tokio::time::timeout(Duration::from_secs(20), async {
        while served_since(free_again).len() < 50 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("locks are served after the switch");
    stop.store(true, Ordering::Relaxed);
    for task in tasks {
        task.await.expect("task");
    }
    let outcomes = outcomes.lock().expect("outcomes").clone();
    let failed: Vec<Instant> = outcomes
        .iter()
        .filter(|(_, _, ok)| !ok)
        .map(|(_, at, _)| *at)
        .collect();
    println!(
        "sentinel switchover: SENTINEL FAILOVER -> +switch-master {:?}; +switch-master -> \
         backend moved {:?}, -> key served again {:?}; {} acquisitions failed (2 s waits), \
         the last {:?} after the switch (lease {:?})",
        promoted - asked,
        moved.saturating_duration_since(promoted),
        free_again.saturating_duration_since(promoted),
        failed.len(),
        failed
            .last()
            .map(|at| at.saturating_duration_since(promoted)),
        SWITCHOVER_LEASE,
    );
    let new_master = set.master_port().await;
    assert_ne!(new_master, old_master, "the replica was promoted");
    // Locks now land on the new master.
    let guard = backend.lock("switch").try_once().await.expect("lock");
    let mut conn = set.data_conn(set.server(new_master)).await;
    let held: bool = redis::cmd("EXISTS")
        .arg(support::lock_key("switch"))
        .query_async(&mut conn)
        .await
        .expect("EXISTS");
    assert!(held, "the lock is on the new master");
    guard.release().await.expect("release");
    // The old master becomes the replica the next failover promotes.
    set.demote(old_master).await;
    set.wait_until_ready().await;
}

/// After a switchover the backend releases, on the new master, holds it had already
/// released (see the previous scenario); holds taken after those releases, by another
/// instance or by the same owner again (a newer token), stay held and are not lost.
async fn a_switchover_leaves_newer_holds_alone(set: &SentinelSet) {
    let (ours, theirs) = (data_builder(set), data_builder(set));
    let ours = ours.build().await.expect("backend through sentinels");
    let theirs = theirs.build().await.expect("another instance");
    // Released by us, then taken by another instance.
    let released = ours.lock("newer-other").try_once().await.expect("lock");
    released.release().await.expect("release");
    let other = theirs.lock("newer-other").try_once().await.expect("lock");
    // Released by one of our owners, then taken again by the same owner (a new token).
    let outer = ours.lock("newer-outer").try_once().await.expect("lock");
    let first = ours
        .lock("newer-same")
        .reentrant(outer.held())
        .try_once()
        .await;
    let first = first.expect("lock");
    let first_token = first.fencing_token();
    first.release().await.expect("release");
    let again = ours
        .lock("newer-same")
        .reentrant(outer.held())
        .try_once()
        .await;
    let again = again.expect("lock again");
    assert!(again.fencing_token() > first_token, "a new acquisition");
    let old_master = set.master_port().await;
    // On the replica before the switch, so the switch itself loses none of them.
    let replica = set
        .servers()
        .iter()
        .find(|s| s.port() != old_master)
        .expect("the replica");
    let on_replica = set.data_conn(replica).await;
    eventually("the replica has the locks", || async {
        let held: i64 = redis::cmd("EXISTS")
            .arg(support::lock_key("newer-other"))
            .arg(support::lock_key("newer-same"))
            .arg(support::lock_key("newer-outer"))
            .query_async(&mut on_replica.clone())
            .await
            .expect("EXISTS");
        held == 3
    })
    .await;
    switch_over_and_follow(set, &ours).await;
    // The check of released keys runs at the announcement and takes milliseconds.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let new_master = set.master_port().await;
    assert_ne!(new_master, old_master, "the replica was promoted");
    let mut conn = set.data_conn(set.server(new_master)).await;
    for key in ["newer-other", "newer-same", "newer-outer"] {
        let held: bool = redis::cmd("EXISTS")
            .arg(support::lock_key(key))
            .query_async(&mut conn)
            .await
            .expect("EXISTS");
        assert!(held, "{key} is still held on the new master");
    }
    assert!(!other.is_lost() && !again.is_lost() && !outer.is_lost());
    for guard in [other, again, outer] {
        guard.release().await.expect("released by its holder");
    }
    set.demote(old_master).await;
    set.wait_until_ready().await;
}

/// A planned switchover, once `backend` has heard of it (its subscriber moved).
async fn switch_over_and_follow(set: &SentinelSet, backend: &RedisBackend) {
    let subscribed = backend.stats().subscriber_connections_made;
    let switched = switch_master_watch(set).await;
    set.switchover().await;
    switched
        .await
        .expect("switch watch")
        .expect("the sentinels announce the switch");
    eventually("the subscriber moves to the new master", || async {
        backend.stats().subscriber_connections_made > subscribed
    })
    .await;
}

/// Shared holds and permits whose releases a failover lost (the promoted replica still has
/// them) are released on the new master when the backend hears of the promotion, as
/// exclusive holds are (see `a_planned_switchover_moves_the_backend`), instead of keeping
/// their permits and readers a lease (here a minute) longer. The loss is made by hand: each
/// hash, read from the master before the release, is written back on the replica (made
/// writable for it) after the release reached it, so that the promotion brings it back.
async fn a_switchover_releases_the_shared_holds_and_permits_it_lost(set: &SentinelSet) {
    const LEASE: Duration = Duration::from_secs(60);
    let backend = backend(set).await;
    let old_master = set.master_port().await;
    let replica = set
        .servers()
        .iter()
        .find(|s| s.port() != old_master)
        .expect("the replica");
    let reader = backend.lock("lost-read").shared().lease(LEASE).try_once();
    let reader = reader.await.expect("shared hold");
    let permit = backend
        .lock("lost-permit")
        .permits(2)
        .lease(LEASE)
        .try_once();
    let permit = permit.await.expect("permit");
    let keys = [
        support::lock_key("lost-read"),
        format!("{}:permits", support::lock_key("lost-permit")),
    ];
    let mut master = set.data_conn(set.server(old_master)).await;
    let mut held = Vec::new();
    for key in &keys {
        let hash: Vec<String> = redis::cmd("HGETALL")
            .arg(key)
            .query_async(&mut master)
            .await
            .expect("HGETALL");
        assert!(!hash.is_empty(), "{key} is held on the master");
        held.push(hash);
    }
    reader.release().await.expect("release");
    permit.release().await.expect("release");
    let mut on_replica = set.data_conn(replica).await;
    eventually("the replica has the releases", || async {
        let held: i64 = redis::cmd("EXISTS")
            .arg(&keys)
            .query_async(&mut on_replica.clone())
            .await
            .expect("EXISTS");
        held == 0
    })
    .await;
    let mut write_back = redis::pipe();
    write_back
        .cmd("CONFIG")
        .arg("SET")
        .arg("replica-read-only")
        .arg("no");
    for (key, hash) in keys.iter().zip(&held) {
        write_back.cmd("HSET").arg(key).arg(hash);
        write_back
            .cmd("PEXPIRE")
            .arg(key)
            .arg(LEASE.as_millis() as u64);
    }
    write_back
        .cmd("CONFIG")
        .arg("SET")
        .arg("replica-read-only")
        .arg("yes");
    let _: () = write_back
        .query_async(&mut on_replica)
        .await
        .expect("the holds written back on the replica");

    switch_over_and_follow(set, &backend).await;
    let new_master = set.master_port().await;
    assert_eq!(new_master, replica.port(), "the replica was promoted");
    let announced = Instant::now();
    let conn = set.data_conn(replica).await;
    eventually(
        "the lost releases are done again on the new master",
        || async {
            let held: i64 = redis::cmd("EXISTS")
                .arg(&keys)
                .query_async(&mut conn.clone())
                .await
                .expect("EXISTS");
            held == 0
        },
    )
    .await;
    println!(
        "a shared hold and a permit the switchover brought back were released {:?} after \
         the backend heard of it (lease {LEASE:?})",
        announced.elapsed()
    );
    let again = backend.lock("lost-permit").permits(1).try_once().await;
    again
        .expect("the only permit of a semaphore of one is free")
        .release()
        .await
        .expect("release");
    set.demote(old_master).await;
    set.wait_until_ready().await;
}

/// The sentinels lose the master while clients still reach it (a partition): they promote
/// the replica but cannot demote the old master, which keeps answering and taking writes.
/// Once the backend hears the promotion, its connections opened before it are retired
/// and its locks go to the new master only.
async fn a_master_cut_off_from_the_sentinels_is_left_at_their_announcement(set: &SentinelSet) {
    let backend = backend(set).await;
    // Pooled connections to the master that is about to be cut off.
    for _ in 0..4 {
        let guard = backend.lock("partition").try_once().await.expect("lock");
        guard.release().await.expect("release");
    }
    let subscribed = backend.stats().subscriber_connections_made;
    let switched = switch_master_watch(set).await;
    let old_master = set.cut_sentinels_off().await;
    switched
        .await
        .expect("switch watch")
        .expect("the sentinels promote the replica");
    // The backend heard it too: its subscriber moved.
    eventually("the subscriber reconnects after the promotion", || async {
        backend.stats().subscriber_connections_made > subscribed
    })
    .await;
    let new_master = set.master_port().await;
    assert_ne!(new_master, old_master);
    let mut old = set.data_conn(set.server(old_master)).await;
    let role: (String,) = redis::cmd("ROLE")
        .query_async::<Vec<redis::Value>>(&mut old)
        .await
        .map(|v| (redis::from_redis_value(v[0].clone()).expect("role"),))
        .expect("ROLE");
    assert_eq!(role.0, "master", "the old master still takes writes");
    let mut new = set.data_conn(set.server(new_master)).await;
    let lock = support::lock_key("partition");
    for _ in 0..4 {
        let guard = backend.lock("partition").try_once().await.expect("lock");
        let on_new: bool = redis::cmd("EXISTS")
            .arg(&lock)
            .query_async(&mut new)
            .await
            .expect("EXISTS");
        let on_old: bool = redis::cmd("EXISTS")
            .arg(&lock)
            .query_async(&mut old)
            .await
            .expect("EXISTS");
        assert!(
            on_new && !on_old,
            "held on the new master only (new {on_new}, old {on_old})"
        );
        guard.release().await.expect("release");
    }
    set.reconnect_sentinels(old_master).await;
}

#[tokio::test]
async fn master_credentials_are_refused_without_sentinel() {
    let error = RedisBackend::builder("redis://127.0.0.1:1")
        .master_password("pw")
        .build()
        .await
        .expect_err("a setting for Sentinel only");
    assert!(
        matches!(
            error,
            BuildError::Setting {
                name: "master_password",
                ..
            }
        ),
        "{error:?}"
    );
}

#[tokio::test]
async fn build_fails_when_no_sentinel_answers() {
    // Ports that were just free: nothing listens there.
    let urls: Vec<String> = (0..2)
        .map(|_| {
            let port = std::net::TcpListener::bind("127.0.0.1:0")
                .and_then(|l| l.local_addr())
                .map(|a| a.port())
                .expect("free port");
            format!("redis://127.0.0.1:{port}")
        })
        .collect();
    let error = tokio::time::timeout(
        Duration::from_secs(10),
        RedisBackend::sentinel(&urls, MASTER_NAME).build(),
    )
    .await
    .expect("build gives up by itself")
    .expect_err("no sentinel answers");
    assert!(matches!(error, BuildError::Sentinel { .. }), "{error:?}");
    let message = support::chain(&error);
    assert!(message.to_lowercase().contains("refused"), "{message}");
    println!("no sentinel: {message}");
}

#[tokio::test]
async fn build_refuses_an_empty_sentinel_list() {
    let error = RedisBackend::sentinel(Vec::<String>::new(), MASTER_NAME)
        .build()
        .await
        .expect_err("no sentinel given");
    assert!(
        matches!(
            error,
            BuildError::Setting {
                name: "sentinel",
                ..
            }
        ),
        "{error:?}"
    );
}

/// Makes `server` a replica of a server that does not exist: it stays up and answers, but
/// refuses every write with `READONLY`, as a master demoted in a failover does.
async fn demote(server: &RedisServer) {
    let nowhere = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("free port")
        .port();
    let _: () = redis::cmd("REPLICAOF")
        .arg("127.0.0.1")
        .arg(nowhere)
        .query_async(&mut server.conn().await)
        .await
        .expect("REPLICAOF");
}

/// Makes `server` a primary again.
async fn promote(server: &RedisServer) {
    let _: () = redis::cmd("REPLICAOF")
        .arg("NO")
        .arg("ONE")
        .query_async(&mut server.conn().await)
        .await
        .expect("REPLICAOF NO ONE");
}

/// Ids of the clients whose last command was `cmd`.
async fn clients_running(server: &RedisServer, cmd: &str) -> Vec<String> {
    let list: String = redis::cmd("CLIENT")
        .arg("LIST")
        .query_async(&mut server.conn().await)
        .await
        .expect("CLIENT LIST");
    list.lines()
        .filter(|line| line.split(' ').any(|f| f == format!("cmd={cmd}")))
        .filter_map(|line| line.split(' ').find_map(|f| f.strip_prefix("id=")))
        .map(str::to_owned)
        .collect()
}

/// How many commands `server` refused with `READONLY`.
async fn readonly_errors(server: &RedisServer) -> u64 {
    let info: String = redis::cmd("INFO")
        .arg("errorstats")
        .query_async(&mut server.conn().await)
        .await
        .expect("INFO errorstats");
    info.lines()
        .find_map(|l| l.strip_prefix("errorstat_READONLY:count="))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or(0)
}

#[tokio::test]
async fn a_readonly_reply_retires_the_connection() {
    crate::needs!(Redis);
    let server = RedisServer::start();
    let backend = RedisBackend::builder(server.url())
        .pool_size(1)
        .build()
        .await
        .expect("backend");
    let guard = backend.lock("a").try_once().await.expect("lock");
    guard.release().await.expect("release");
    let pooled = clients_running(&server, "evalsha").await;
    assert_eq!(pooled.len(), 1, "one pooled connection ran the scripts");

    demote(&server).await;
    let refused = backend.lock("a").try_once().await;
    assert!(matches!(refused, Err(LockError::Backend(_))), "{refused:?}");
    promote(&server).await;
    // The next request is served on a fresh connection (which, through Sentinel, would
    // go to the new primary), and the one that met READONLY is closed.
    let guard = backend.lock("a").try_once().await.expect("lock again");
    guard.release().await.expect("release");
    eventually("the refused connection is closed", || async {
        let now = clients_running(&server, "evalsha").await;
        now.len() == 1 && now[0] != pooled[0]
    })
    .await;
}

#[tokio::test]
async fn a_release_refused_as_readonly_lands_once_a_primary_is_back() {
    crate::needs!(Redis);
    let server = RedisServer::start();
    let backend = server.backend().await;
    let guard = backend.lock("b").try_once().await.expect("lock");
    demote(&server).await;
    let release = tokio::spawn(guard.release());
    eventually("the release is refused", || async {
        readonly_errors(&server).await > 0
    })
    .await;
    promote(&server).await;
    let _ = release.await;
    // Well before the 30 s lease would free it.
    server.wait_until_released("b").await;
}

const STOCK: i64 = 600;
/// Sales before the master is killed.
const SOLD_BEFORE_KILL: usize = 200;

/// The stock, kept in this process so that a failover cannot roll it back (asynchronous
/// replication may lose the last writes to the old master; a counter kept there could
/// come back higher and hide or fake an oversell). Every access is fenced: it is refused
/// when a holder with a newer token has already been here, so a holder whose lock was
/// lost in the failover (its acquisition never reached the replica) cannot oversell
/// either; such refusals are counted.
#[derive(Default)]
struct Shop {
    stock: i64,
    newest_token: u64,
    /// The token of every sale, in the order the sales were made.
    sales: Vec<u64>,
    refused: u64,
}

type SharedShop = Arc<Mutex<Shop>>;

impl Shop {
    fn access(shop: &SharedShop, token: u64, sell: bool) -> Result<i64, ()> {
        let mut shop = shop.lock().expect("shop");
        if token < shop.newest_token {
            shop.refused += 1;
            return Err(());
        }
        shop.newest_token = token;
        if sell {
            shop.stock -= 1;
            shop.sales.push(token);
        }
        Ok(shop.stock)
    }
}

/// Reads the stock, yields to other requests, then sells one: the read-check-write race
/// the lock must close.
async fn buy(State(shop): State<SharedShop>, Extension(lock): Extension<HeldLock>) -> StatusCode {
    let token = lock.fencing_token();
    let Ok(stock) = Shop::access(&shop, token, false) else {
        return StatusCode::CONFLICT;
    };
    if stock <= 0 {
        return StatusCode::GONE;
    }
    tokio::time::sleep(Duration::from_millis(2)).await;
    match Shop::access(&shop, token, true) {
        Ok(_) => StatusCode::OK,
        Err(()) => StatusCode::CONFLICT,
    }
}

fn stock_key(_: &Request) -> Option<&'static str> {
    Some("stock")
}

/// What the buyers saw.
#[derive(Default)]
struct Outcomes {
    statuses: BTreeMap<u16, u64>,
    /// When the first request sent after the kill was served.
    recovered_at: Option<Instant>,
}

async fn three_instances_sell_exactly_the_stock_across_a_failover(set: &mut SentinelSet) {
    let shop = SharedShop::default();
    shop.lock().expect("shop").stock = STOCK;
    let mut instances = Vec::new();
    for _ in 0..3 {
        let backend = backend(set).await;
        let key_fn: fn(&Request) -> Option<&'static str> = stock_key;
        let app = Router::new()
            .route("/buy", routing::post(buy))
            .with_state(shop.clone())
            .route_layer(LockLayer::new(backend, key_fn).wait(Duration::from_secs(2)));
        instances.push(serve(app).await);
    }
    let switched = switch_master_watch(set).await;
    let client = http_client();
    let killed_at: Arc<Mutex<Option<Instant>>> = Arc::default();
    let outcomes: Arc<Mutex<Outcomes>> = Arc::default();
    let sold_out = Arc::new(AtomicBool::new(false));
    let buyers: Vec<_> = (0..12)
        .map(|i| {
            let (client, addr) = (client.clone(), instances[i % 3]);
            let (killed_at, outcomes) = (killed_at.clone(), outcomes.clone());
            let sold_out = sold_out.clone();
            tokio::spawn(async move {
                buyer(&client, addr, &killed_at, &outcomes, &sold_out).await;
            })
        })
        .collect();

    wait_for_sales(&shop, SOLD_BEFORE_KILL).await;
    let killed_port = set.kill_master().await;
    let kill = Instant::now();
    *killed_at.lock().expect("kill time") = Some(kill);
    for buyer in buyers {
        tokio::time::timeout(FAILOVER_BOUND + Duration::from_secs(30), buyer)
            .await
            .expect("the stock sells out after the failover")
            .expect("buyer task");
    }

    let promoted = switched.await.expect("switch watch");
    let new_master = set.master_port().await;
    assert_ne!(
        new_master, killed_port,
        "the sentinels promoted the replica"
    );
    let outcomes = outcomes.lock().expect("outcomes");
    let shop = shop.lock().expect("shop");
    let recovered = outcomes
        .recovered_at
        .expect("a request sent after the kill was served")
        - kill;
    println!(
        "sentinel failover: kill -> +switch-master {:?}, kill -> first served request {:?} \
         ({:?} after the switch); statuses {:?}; fenced refusals {}",
        promoted.map(|at| at - kill),
        recovered,
        promoted.map(|at| (kill + recovered).saturating_duration_since(at)),
        outcomes.statuses,
        shop.refused,
    );
    assert!(
        recovered < FAILOVER_BOUND,
        "served again after {recovered:?}"
    );
    // No oversell: every sale took one item, the stock ends at zero, never below.
    assert_eq!(shop.stock, 0);
    assert_eq!(shop.sales.len() as i64, STOCK);
    assert_eq!(outcomes.statuses.get(&200).copied(), Some(STOCK as u64));
    let unexpected: Vec<_> = outcomes
        .statuses
        .keys()
        .filter(|s| ![200, 409, 410, 503].contains(*s))
        .collect();
    assert!(unexpected.is_empty(), "statuses {:?}", outcomes.statuses);
    // Tokens of the new master's locks continue above the old master's.
    assert!(
        shop.sales.windows(2).all(|w| w[0] < w[1]),
        "fencing tokens strictly increase across the failover"
    );
}

/// Buys until the stock is sold out; a 503 (no master yet) is retried shortly after.
async fn buyer(
    client: &HttpClient,
    addr: std::net::SocketAddr,
    killed_at: &Mutex<Option<Instant>>,
    outcomes: &Mutex<Outcomes>,
    sold_out: &AtomicBool,
) {
    while !sold_out.load(Ordering::Relaxed) {
        let sent = Instant::now();
        let status = post(client, addr, "/buy").await.status;
        let after_kill = killed_at
            .lock()
            .expect("kill time")
            .is_some_and(|k| sent > k);
        {
            let mut outcomes = outcomes.lock().expect("outcomes");
            *outcomes.statuses.entry(status).or_default() += 1;
            if status == 200 && after_kill && outcomes.recovered_at.is_none() {
                outcomes.recovered_at = Some(Instant::now());
            }
        }
        match status {
            410 => sold_out.store(true, Ordering::Relaxed),
            503 => tokio::time::sleep(Duration::from_millis(20)).await,
            _ => {}
        }
    }
}

async fn wait_for_sales(shop: &SharedShop, n: usize) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while shop.lock().expect("shop").sales.len() < n {
        assert!(Instant::now() < deadline, "{n} sales before the kill");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Resolves with when the first sentinel announced `+switch-master` (None if it never
/// did within the bound).
async fn switch_master_watch(set: &SentinelSet) -> tokio::task::JoinHandle<Option<Instant>> {
    let client = redis::Client::open(set.sentinel_urls()[0].as_str()).expect("sentinel url");
    let mut pubsub = client.get_async_pubsub().await.expect("sentinel pubsub");
    pubsub.subscribe("+switch-master").await.expect("subscribe");
    tokio::spawn(async move {
        let mut messages = pubsub.into_on_message();
        tokio::time::timeout(FAILOVER_BOUND, messages.next())
            .await
            .ok()
            .flatten()
            .map(|_| Instant::now())
    })
}

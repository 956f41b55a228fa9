//! The operator calls on what only Redis has: a fencing counter that can be gone while a
//! process's tasks take turns under a reserved block of tokens, values that are not locks,
//! ACL users, and a cluster's sharded admin channel. (What every store shares is in
//! `tests/it/inspect.rs`.)

use crate::support;

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use support::cluster::Cluster;
use support::{RedisServer, chain, eventually};
use tokio::sync::{Semaphore, mpsc};
use tokio::time::timeout;
use tower_lock::{HeldLock, LockError, LockMode, RedisBackend};

const HANG: Duration = Duration::from_secs(10);
/// Renewed every 20 s: a holder that sees `lost()` within [`LOST_BY`] learned it from the
/// force-release's announcement, not from a renewal.
const LEASE: Duration = Duration::from_secs(60);
const LOST_BY: Duration = Duration::from_secs(15);

async fn query<T: redis::FromRedisValue>(server: &RedisServer, cmd: &mut redis::Cmd) -> T {
    cmd.query_async(&mut server.conn().await)
        .await
        .expect("query the test server")
}

/// Tokens run ahead of the clock (as after bursts of more than one per microsecond) and a
/// process's tasks take turns in memory under one hold, with a block of tokens reserved
/// for them; then the fencing counter is deleted. A force-release still fences above the
/// whole block: the hold kept the block's size.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn force_release_fences_above_a_reserved_block_when_the_counter_is_gone() {
    crate::needs!(Redis);
    const KEY: &str = "hot";
    let server = RedisServer::start();
    let run = support::builder(&server.url())
        .max_local_handoff_time(Duration::from_secs(30))
        .build()
        .await
        .expect("backend");
    let other = server.backend().await;
    let fence = format!("{}:fence", support::lock_key(KEY));
    let clock = SystemTime::now().duration_since(UNIX_EPOCH).expect("clock");
    let ahead = u64::try_from(clock.as_micros()).expect("micros") + 1_000_000_000_000;
    let _: () = query(&server, redis::cmd("SET").arg(&fence).arg(ahead)).await;

    let blocker = other.lock(KEY).lease(LEASE).try_once().await.expect("free");
    let (held, mut holders) = mpsc::unbounded_channel::<HeldLock>();
    let turns = Arc::new(Semaphore::new(0));
    let mut tasks = Vec::new();
    for _ in 0..3 {
        let (run, held, turns) = (run.clone(), held.clone(), turns.clone());
        tasks.push(tokio::spawn(async move {
            let guard = run
                .lock(KEY)
                .lease(LEASE)
                .wait(HANG)
                .await
                .expect("the key");
            held.send(guard.held().clone()).expect("test alive");
            turns.acquire().await.expect("open").forget();
            let _ = guard.release().await;
        }));
    }
    support::queued(&run, 2).await;
    eventually("the run's contender subscribed", || async {
        run.stats().channels_with_waiters == 1
    })
    .await;
    blocker.release().await.expect("release");
    let first = timeout(HANG, holders.recv())
        .await
        .expect("first")
        .expect("held");
    assert_eq!(first.fencing_token(), ahead + 2);
    turns.add_permits(1);
    let second = timeout(HANG, holders.recv())
        .await
        .expect("second")
        .expect("held");
    assert_eq!(second.fencing_token(), first.fencing_token() + 1);
    let top: u64 = query(&server, redis::cmd("GET").arg(&fence)).await;
    assert!(
        top > second.fencing_token() + 1,
        "a block was reserved: {top}"
    );
    let _: () = query(&server, redis::cmd("DEL").arg(&fence)).await;
    let waiter = tokio::spawn({
        let other = other.clone();
        async move { other.lock(KEY).lease(LEASE).wait(HANG).await }
    });
    eventually("the waiter subscribed", || async {
        other.stats().channels_with_waiters == 1
    })
    .await;

    let freed = other.force_release(KEY).await.expect("force_release");
    timeout(LOST_BY, second.lost())
        .await
        .expect("the run sees lost()");
    turns.add_permits(10);
    let next = timeout(HANG, waiter).await.expect("served").expect("task");
    let next = next.expect("the waiter gets the key");
    assert!(
        next.fencing_token() > top,
        "{} above {top}",
        next.fencing_token()
    );
    assert_eq!(
        freed.fencing_token,
        Some(top),
        "the block's top, as reported"
    );
    next.release().await.expect("release");
    let third = timeout(HANG, holders.recv())
        .await
        .expect("third")
        .expect("held");
    assert!(third.fencing_token() > top);
    for task in tasks {
        timeout(HANG, task).await.expect("task ends").expect("task");
    }
}

#[tokio::test]
async fn a_value_that_is_not_a_lock_is_reported_and_left_alone() {
    crate::needs!(Redis);
    let server = RedisServer::start();
    let backend = server.backend().await;
    let name = support::lock_key("plain");
    let _: () = query(&server, redis::cmd("SET").arg(&name).arg("not a lock")).await;
    let seen = backend.inspect("plain").await;
    assert!(matches!(seen, Err(LockError::NotALock { .. })), "{seen:?}");
    let forced = backend.force_release("plain").await;
    assert!(
        matches!(forced, Err(LockError::NotALock { .. })),
        "{forced:?}"
    );
    let value: String = query(&server, redis::cmd("GET").arg(&name)).await;
    assert_eq!(value, "not a lock");
}

/// `ACL SETUSER app` with every right on the default namespace's keys, the `channels`
/// patterns, and `extra`.
async fn app_user(server: &RedisServer, channels: &[&str], extra: &[&str]) -> RedisBackend {
    let mut rules = vec!["reset", "on", ">secret", "~tower-lock:*", "+@all"];
    rules.extend_from_slice(channels);
    rules.extend_from_slice(extra);
    let _: () = query(
        server,
        redis::cmd("ACL").arg("SETUSER").arg("app").arg(&rules),
    )
    .await;
    let url = format!("redis://app:secret@127.0.0.1:{}", server.port());
    support::builder(&url)
        .build()
        .await
        .expect("a user who may lock builds")
}

/// A user who may lock but not run a command the operator scripts need (its rights cut
/// after `build()`, which probes the permit scripts, which need it too): the calls say
/// what is refused, and the lock is untouched.
#[tokio::test]
async fn a_user_who_may_lock_but_not_inspect_is_told_so_at_the_call() {
    crate::needs!(Redis);
    let server = RedisServer::start();
    let backend = app_user(&server, &["&tower-lock:*"], &[]).await;
    let _: () = query(
        &server,
        redis::cmd("ACL").arg("SETUSER").arg("app").arg("-hgetall"),
    )
    .await;
    let guard = backend.lock("order:1").try_once().await.expect("lock");
    for refused in [
        backend.inspect("order:1").await,
        backend.force_release("order:1").await,
    ] {
        let error = refused.expect_err("refused");
        let text = chain(&error);
        assert!(matches!(error, LockError::Backend(_)), "{text}");
        assert!(text.contains("may not run HGETALL (the "), "{text}");
    }
    assert!(!guard.is_lost());
    guard.release().await.expect("still held, and released");
}

/// A user whose channel rights cover its keys' channels but not the namespace's admin
/// channel: the subscriber carries on without it (no reconnects, waiters still woken),
/// and the holder of a force-released lock sees `lost()` at its next renewal, a third of
/// its lease after the last one (so well before two thirds, when it would otherwise run
/// out unrenewed).
#[tokio::test]
async fn without_the_admin_channel_the_holder_sees_lost_at_its_next_renewal() {
    crate::needs!(Redis);
    const LEASE: Duration = Duration::from_secs(15);
    let server = RedisServer::start();
    let channels = [
        "&tower-lock:{order*",
        "&tower-lock:{tower-lock-build-check*",
    ];
    let holder = app_user(&server, &channels, &[]).await;
    let waiter = app_user(&server, &channels, &[]).await;
    let guard = holder
        .lock("order:1")
        .lease(LEASE)
        .try_once()
        .await
        .expect("free");
    let waiting = tokio::spawn({
        let waiter = waiter.clone();
        async move { waiter.lock("order:1").wait(HANG).await }
    });
    eventually("the waiter subscribed", || async {
        waiter.stats().channels_with_waiters == 1
    })
    .await;
    let freed = waiter
        .force_release("order:1")
        .await
        .expect("force_release");
    assert_eq!(freed.mode, LockMode::Exclusive);
    let next = timeout(HANG, waiting).await.expect("woken").expect("task");
    let next = next.expect("the waiter gets the key");
    timeout(LEASE * 2 / 3, guard.held().lost())
        .await
        .expect("lost() at the next renewal");
    assert!(matches!(guard.release().await, Err(LockError::Lost { .. })));
    next.release().await.expect("release");
    assert_eq!(holder.stats().subscriber_connections_made, 1);
    assert_eq!(waiter.stats().subscriber_connections_made, 1);
}

/// On a cluster the scripts touch only the key's slot, waiters are woken by `SPUBLISH`,
/// and the announcement reaches every backend through the admin channel's shard.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_cluster_the_holder_hears_of_the_force_release_through_the_admin_shard() {
    crate::needs!(Redis);
    let cluster = tokio::task::spawn_blocking(Cluster::start)
        .await
        .expect("cluster");
    let b = [
        cluster.backend().await,
        cluster.backend().await,
        cluster.backend().await,
    ];
    let admin = support::ADMIN_CHANNEL;
    let shard = cluster.primary_of(admin);
    eventually("every backend subscribed to the admin channel", || async {
        cluster.shard_subscribers(shard, admin) == 3
    })
    .await;
    let guard = b[0]
        .lock("order:1")
        .lease(LEASE)
        .try_once()
        .await
        .expect("free");
    let waiting = tokio::spawn({
        let waiter = b[1].clone();
        async move { waiter.lock("order:1").lease(LEASE).wait(HANG).await }
    });
    eventually("the waiter subscribed", || async {
        b[1].stats().channels_with_waiters == 1
    })
    .await;
    let seen = b[2].inspect("order:1").await.expect("inspect");
    assert_eq!((seen.mode, seen.holders), (LockMode::Exclusive, 1));
    let freed = b[2].force_release("order:1").await.expect("force_release");
    assert_eq!(
        (freed.mode, freed.fencing_token),
        (seen.mode, seen.fencing_token)
    );
    timeout(LOST_BY, guard.held().lost())
        .await
        .expect("the holder sees lost() before its next renewal");
    let next = timeout(HANG, waiting).await.expect("woken").expect("task");
    let next = next.expect("the waiter gets the key");
    assert!(next.fencing_token() > guard.fencing_token());
    next.release().await.expect("release");
}

//! When Redis loses its data (restarted empty, no persistence), holders learn it at once,
//! and with the restart guard no second holder gets in while a first may still run.
//!
//! Windows are measured and printed (`cargo test --test it dataloss:: -- --nocapture`); the
//! assertions only bound them generously, or check an order of events.

use crate::support;

use std::time::Duration;

use support::replica::{ACK_TIMEOUT, Replicated};
use support::{RedisServer, lock_key};
use tokio::time::{Instant, timeout};
use tower_lock::{LockError, LockGuard, RedisBackend};

/// A lease whose first scheduled renewal (lease/3) is far beyond anything measured here,
/// so a holder that learns of the loss earlier learned it from the recheck.
const LEASE: Duration = Duration::from_secs(30);
/// Generous bound on anything that should end by a deadline of a few seconds.
const HANG: Duration = Duration::from_secs(20);

/// Restarts `server` empty from inside a multi-threaded test, without stalling the
/// backends' tasks while it waits for the new process; returns when it serves again.
fn restart(server: &mut RedisServer) {
    tokio::task::block_in_place(|| server.restart());
}

async fn hold(backend: &RedisBackend, key: &str) -> LockGuard {
    backend
        .lock(key)
        .lease(LEASE)
        .try_once()
        .await
        .expect("uncontended")
}

/// Waits for `key` on `backend`, as a client would: an attempt that fails while Redis is
/// down is tried again. Tells when it got the lock.
fn wait_for(backend: &RedisBackend, key: &str) -> tokio::task::JoinHandle<(Instant, LockGuard)> {
    let (backend, key) = (backend.clone(), key.to_owned());
    tokio::spawn(async move {
        let give_up = Instant::now() + HANG;
        loop {
            match backend.lock(&key).lease(LEASE).wait(HANG).await {
                Ok(guard) => return (Instant::now(), guard),
                Err(e) if e.is_transient() && Instant::now() < give_up => {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                Err(e) => panic!("the waiter gets the lock in the end: {e}"),
            }
        }
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_without_persistence_fires_lost_within_about_one_ping() {
    crate::needs!(Redis);
    support::init_tracing();
    let mut server = RedisServer::start();
    let (a, b) = (server.backend().await, server.backend().await);
    let guard = hold(&a, "k").await;
    let lost = guard.lost();
    // A hold without renewal is only checked, and found lost the same way.
    let unrenewed = a
        .lock("j")
        .lease(LEASE)
        .without_watchdog()
        .try_once()
        .await
        .expect("uncontended");
    let waiter = wait_for(&b, "k");
    server.wait_for_subscribers("k", 1).await;

    let killed = Instant::now();
    restart(&mut server);
    let serving = killed.elapsed();
    timeout(HANG, lost)
        .await
        .expect("the holder learns of the loss");
    let lost_after = killed.elapsed();
    let (acquired, second) = timeout(HANG, waiter)
        .await
        .expect("no hang")
        .expect("no panic");
    let second_after = acquired.duration_since(killed);
    println!(
        "without the guard: kill -> serving again {serving:?}, -> lost() {lost_after:?}, \
         -> second holder {second_after:?}; both held for {:?}",
        lost_after.saturating_sub(second_after)
    );
    // The next scheduled renewal is LEASE/3 = 10 s away: only the recheck explains less.
    assert!(lost_after < LEASE / 6, "lost() after {lost_after:?}");
    assert!(guard.is_lost());
    timeout(LEASE / 6, unrenewed.lost())
        .await
        .expect("the unrenewed hold is found lost long before its lease ends");
    drop(second);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn subscriber_killed_alone_rechecks_held_locks_without_losing_them() {
    crate::needs!(Redis);
    support::init_tracing();
    let server = RedisServer::start();
    let (backend, other) = (server.backend().await, server.backend().await);
    // Renewed every 20 s: far beyond this test, so only the recheck renews it here.
    let guard = backend
        .lock("k")
        .lease(2 * LEASE)
        .try_once()
        .await
        .expect("uncontended");
    // A waiter on the killed subscriber, served after it reconnects.
    let blocker = hold(&other, "busy").await;
    let waiter = wait_for(&backend, "busy");
    server.wait_for_subscribers("busy", 1).await;
    // Shortened from outside: a renewal puts the lease back to a minute.
    let mut conn = server.conn().await;
    let _: () = redis::cmd("PEXPIRE")
        .arg(lock_key("k"))
        .arg(LEASE.as_millis() as u64)
        .query_async(&mut conn)
        .await
        .expect("PEXPIRE");
    let connections = backend.stats().subscriber_connections_made;

    // Both backends' subscribers: each listens on the namespace's admin channel.
    assert_eq!(server.kill_subscribers().await, 2);
    support::eventually("the subscriber reconnected", || async {
        backend.stats().subscriber_connections_made > connections
    })
    .await;
    support::eventually("the held lock was rechecked (renewed)", || async {
        let pttl: u64 = redis::cmd("PTTL")
            .arg(lock_key("k"))
            .query_async(&mut server.conn().await)
            .await
            .expect("PTTL");
        pttl > LEASE.as_millis() as u64
    })
    .await;
    assert!(!guard.is_lost(), "a lock that is still held is not lost");
    let owner = guard.held().owner().as_str().to_owned();
    assert_eq!(server.hold_count(&lock_key("k"), &owner).await, Some(1));
    guard.release().await.expect("still held, so released");
    blocker.release().await.expect("release");
    let (_, guard) = timeout(HANG, waiter)
        .await
        .expect("no hang")
        .expect("no panic");
    drop(guard);
}

/// The longest lease of the guarded backends: what the restart guard waits out.
const GUARD: Duration = Duration::from_secs(2);

async fn guarded(server: &RedisServer) -> RedisBackend {
    guarded_for(server, GUARD).await
}

/// A backend whose restart guard outwaits `max_lease`.
async fn guarded_for(server: &RedisServer, max_lease: Duration) -> RedisBackend {
    RedisBackend::builder(server.url())
        .command_timeout(Duration::from_millis(500))
        .connect_timeout(Duration::from_millis(500))
        .restart_guard()
        .max_lease(max_lease)
        .build()
        .await
        .expect("backend connects to the test server")
}

/// A server that just started: the guard's refusals are announced once at INFO, naming the
/// server (an operator who sees every request wait after a start learns why), however
/// many acquisitions it refuses; and once more when the server grants again.
#[test]
fn the_restart_guard_is_announced_once_and_its_end_too() {
    crate::needs!(Redis);
    let server = RedisServer::start();
    let log = support::logged_on_this_thread("tower_lock=info", async |log| {
        // A guard as long as the bound on hangs: building and three tries take
        // milliseconds of it.
        let backend = guarded_for(&server, HANG).await;
        for _ in 0..3 {
            let refused = backend.lock("k").try_once().await;
            assert!(
                matches!(refused, Err(LockError::Contended { .. })),
                "{refused:?}"
            );
        }
        // The guard ends up to two seconds after `HANG` from the server's start.
        let held = backend
            .lock("k")
            .wait(HANG * 2)
            .await
            .expect("granted once guarded");
        held.release().await.expect("released");
        log.until("the restart guard has passed", 1).await;
    });
    let lines = |said: &str| {
        log.text()
            .lines()
            .filter(|l| l.contains(" INFO ") && l.contains(said))
            .map(str::to_owned)
            .collect::<Vec<_>>()
    };
    let refusals = lines("its restart guard grants nothing");
    assert_eq!(refusals.len(), 1, "{}", log.text());
    assert!(
        refusals[0].contains(&format!("server=127.0.0.1:{}", server.port())),
        "{}",
        refusals[0]
    );
    assert_eq!(
        lines("the restart guard has passed").len(),
        1,
        "{}",
        log.text()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_guard_grants_nothing_until_the_old_holder_has_stopped() {
    crate::needs!(Redis);
    support::init_tracing();
    let mut server = RedisServer::start();
    let (a, b) = (guarded(&server).await, guarded(&server).await);
    // A fresh server is guarded too: the first acquisition waits the guard out.
    let started = Instant::now();
    let guard = a.lock("k").wait(HANG).await.expect("granted once guarded");
    let first_after = started.elapsed();
    let lost = guard.lost();
    let lost = tokio::spawn(async move {
        lost.await;
        Instant::now()
    });
    let waiter = wait_for(&b, "k");
    server.wait_for_subscribers("k", 1).await;

    let killed = Instant::now();
    restart(&mut server);
    // Not waiting: refused like a held lock, with the guard's time left.
    match a.lock("other").try_once().await {
        Err(LockError::Contended { retry_after, .. }) => {
            assert!(
                retry_after.is_some_and(|left| left <= GUARD),
                "{retry_after:?}"
            )
        }
        other => panic!("the guard refuses a try: {other:?}"),
    }
    assert!(!server.exists(&lock_key("other")).await);
    // Tried again and again until granted: the uptime Redis reports is whole seconds, so a
    // guard that trusted it could grant a second early, at a moment that only a run of
    // tries catches (the waiter asks only when its wait ends).
    let probed = timeout(HANG, async {
        loop {
            match a.lock("other").try_once().await {
                Ok(guard) => return (Instant::now(), guard),
                Err(LockError::Contended { .. }) => {}
                Err(e) => panic!("the guard refuses a try: {e}"),
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("granted once guarded");
    let lost_at = timeout(HANG, lost).await.expect("lost").expect("no panic");
    let (acquired, second) = timeout(HANG, waiter)
        .await
        .expect("no hang")
        .expect("no panic");
    println!(
        "with the guard ({GUARD:?}): first acquisition on a fresh server after \
         {first_after:?}; kill -> lost() {:?}, -> second holder {:?}, -> a try granted {:?}",
        lost_at.duration_since(killed),
        acquired.duration_since(killed),
        probed.0.duration_since(killed)
    );
    assert!(
        lost_at < acquired,
        "the first holder stopped before the second got in"
    );
    // The server started after `killed`: one longest lease from there is the bound.
    for (what, at) in [("the waiter", acquired), ("a try", probed.0)] {
        assert!(
            at.duration_since(killed) >= GUARD,
            "nothing is granted before one longest lease after the restart: {what} \
             after {:?}",
            at.duration_since(killed)
        );
    }
    assert!(guard.is_lost());
    drop((second, probed.1));
}

// ---------------------------------------------------------------------------------------
// Replica acknowledgement

/// The key of `/quick/KEY`.
fn path_key(req: &axum::extract::Request) -> Option<String> {
    req.uri().path().strip_prefix("/quick/").map(str::to_owned)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sync_replicas_refuses_a_lock_the_replica_did_not_acknowledge_and_leaves_it_free() {
    support::init_tracing();
    let set = Replicated::start().await;
    let backend = acknowledged_backend(&set).await;
    let layer = tower_lock::LockLayer::new(backend.clone(), path_key).fail_fast();
    let app = axum::Router::new()
        .route("/quick/{key}", axum::routing::post(|| async { "done" }))
        .route_layer(layer);
    let addr = support::serve(app).await;

    let started = Instant::now();
    let guard = backend.lock("k").try_once().await.expect("acknowledged");
    println!(
        "replica healthy: acquired and acknowledged in {:?}",
        started.elapsed()
    );
    assert!(
        set.replica.exists(&lock_key("k")).await,
        "the replica has it"
    );
    guard.release().await.expect("release");
    let reply = support::post(&support::http_client(), addr, "/quick/k").await;
    assert_eq!(reply.status, 200, "{reply:?}");

    set.replica.pause();
    let started = Instant::now();
    let refused = backend.lock("k").try_once().await;
    let took = started.elapsed();
    let cause = unacknowledged(refused);
    println!("replica paused: refused after {took:?}: {cause}");
    assert!(
        !set.master.exists(&lock_key("k")).await,
        "given back on the master"
    );
    let reply = support::post(&support::http_client(), addr, "/quick/k").await;
    reply.problem(503);
    assert!(reply.body.contains("#variant.Backend"), "{reply:?}");
    assert!(
        !set.master.exists(&lock_key("k")).await,
        "given back on the master"
    );

    set.replica.resume();
    let guard = backend
        .lock("k")
        .try_once()
        .await
        .expect("acknowledged again");
    guard.release().await.expect("release");
}

/// A backend on `set`'s master whose writes must reach its replica within `ACK_TIMEOUT`.
async fn acknowledged_backend(set: &Replicated) -> RedisBackend {
    RedisBackend::builder(set.master.url())
        .command_timeout(2 * ACK_TIMEOUT)
        .sync_replicas(1, ACK_TIMEOUT)
        .build()
        .await
        .expect("connects")
}

/// Renewals are acknowledged too: with the replica paused, the master takes every renewal
/// but the replica, which a failover would promote, keeps the lease as it was last
/// acknowledged, so the holder is told its lock is lost once that lease has run out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sync_replicas_counts_an_unacknowledged_renewal_as_failed_and_the_hold_lost() {
    support::init_tracing();
    let set = Replicated::start().await;
    let backend = acknowledged_backend(&set).await;
    let lease = 3 * ACK_TIMEOUT;
    let guard = backend
        .lock("renewed")
        .lease(lease)
        .try_once()
        .await
        .expect("acknowledged");
    set.replica.pause();
    let paused = Instant::now();
    timeout(HANG, guard.lost())
        .await
        .expect("the holder learns its renewals were not acknowledged");
    println!(
        "replica paused: the hold lost {:?} later (lease {lease:?})",
        paused.elapsed()
    );
    assert!(
        set.master.exists(&lock_key("renewed")).await,
        "the master took the renewals: only their acknowledgement was missing"
    );
    set.replica.resume();
    drop(guard);
}

/// A release that hands the key to the next task of its process through Redis (here: the
/// task asked for another lease, so the hold cannot pass in memory) is a grant too: left
/// unacknowledged, it is undone, and the task goes to Redis as any waiter, where its own
/// acquisition is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sync_replicas_undoes_a_handoff_the_replica_did_not_acknowledge() {
    support::init_tracing();
    let set = Replicated::start().await;
    let backend = acknowledged_backend(&set).await;
    let first = backend
        .lock("handed")
        .lease(LEASE)
        .try_once()
        .await
        .expect("acknowledged");
    let next = {
        let backend = backend.clone();
        tokio::spawn(async move {
            backend
                .lock("handed")
                .lease(LEASE / 2)
                .wait(HANG)
                .await
                .map(|guard| guard.fencing_token())
        })
    };
    support::eventually("the next task is queued", || async {
        backend.stats().local_waiters == 1
    })
    .await;
    set.replica.pause();
    first.release().await.expect("the release itself is done");
    let refused = next.await.expect("the task ends");
    let cause = unacknowledged(refused);
    println!("replica paused: the next task refused: {cause}");
    assert!(
        !set.master.exists(&lock_key("handed")).await,
        "the handoff and the acquisition were given back on the master"
    );
    set.replica.resume();
}

/// The cause of an acquisition refused because the replica did not acknowledge it.
fn unacknowledged<T: std::fmt::Debug>(refused: Result<T, LockError>) -> String {
    let error = match refused {
        Err(error @ LockError::Backend(_)) => error,
        other => panic!("no hold is granted unacknowledged: {other:?}"),
    };
    let cause = format!("{:#}", ErrorChain(&error));
    assert!(
        cause.contains("acquired but acknowledged by 0 of 1 replicas within"),
        "{cause}"
    );
    cause
}

/// Every level of an error chain, joined by ": ".
struct ErrorChain<'a>(&'a dyn std::error::Error);

impl std::fmt::Display for ErrorChain<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)?;
        let mut source = self.0.source();
        while let Some(e) = source {
            write!(f, ": {e}")?;
            source = e.source();
        }
        Ok(())
    }
}

#[tokio::test]
async fn settings_that_would_fail_every_acquisition_are_refused_at_build() {
    crate::needs!(Redis);
    let server = RedisServer::start();
    let build = |builder: tower_lock::RedisBackendBuilder| async move {
        match builder.build().await {
            Err(tower_lock::BuildError::Setting { name, .. }) => name,
            other => panic!("refused at build: {other:?}"),
        }
    };
    let builder =
        || RedisBackend::builder(server.url()).command_timeout(Duration::from_millis(500));
    let refused = [
        build(builder().sync_replicas(0, ACK_TIMEOUT)).await,
        build(builder().sync_replicas(1, Duration::ZERO)).await,
        build(builder().sync_replicas(1, Duration::from_millis(500))).await,
        build(builder().restart_guard().max_lease(Duration::ZERO)).await,
    ];
    assert_eq!(
        refused,
        [
            "sync_replicas",
            "sync_replicas",
            "sync_replicas",
            "max_lease"
        ]
    );
}

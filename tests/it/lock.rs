//! The lock API without HTTP, against a real redis-server per test.

use crate::support;

use std::time::Duration;

use redis::AsyncCommands;
use support::{RedisServer, eventually};
use tower_lock::{KeyError, LockError, LockGuard, RedisBackend};

const KEY: &str = "order:42";
const LOCK: &str = "tower-lock:{order:42}";
/// The lease of a hold that must outlive it by renewals alone: renewed every third of it,
/// so a second of room for a renewal delayed on a loaded machine.
const RENEWED_LEASE: Duration = Duration::from_millis(1500);

#[tokio::test]
async fn fencing_tokens_strictly_increase_even_after_external_delete() {
    crate::needs!(Redis);
    let server = RedisServer::start();
    let backend = server.backend().await;
    let mut conn = server.conn().await;
    let mut last = 0;
    for i in 0..100 {
        let guard = backend.lock(KEY).try_once().await.expect("uncontended");
        let token = guard.fencing_token();
        assert!(
            token > last,
            "token {token} after {last} at acquisition {i}"
        );
        last = token;
        if i % 10 == 0 {
            // Someone deletes the lock (and at times its counter) from outside.
            let _: () = conn.del(LOCK).await.unwrap();
            if i % 20 == 0 {
                let _: () = conn.del(format!("{LOCK}:fence")).await.unwrap();
            }
            assert!(matches!(guard.release().await, Err(LockError::Lost { .. })));
        } else {
            guard.release().await.expect("release");
        }
    }
}

#[tokio::test]
async fn expired_guard_releases_nothing_of_the_new_owner() {
    crate::needs!(Redis);
    let server = RedisServer::start();
    let backend = server.backend().await;
    let stale = take_unrenewed(&backend, Duration::from_millis(200)).await;
    let fresh = backend
        .lock(KEY)
        .wait(Duration::from_secs(5))
        .await
        .unwrap();
    assert!(fresh.fencing_token() > stale.fencing_token());

    assert!(matches!(stale.release().await, Err(LockError::Lost { .. })));
    assert_eq!(
        server.hold_count(LOCK, fresh.held().owner().as_str()).await,
        Some(1),
        "the new owner's hold is untouched"
    );
    fresh
        .release()
        .await
        .expect("the new owner releases normally");
    assert!(!server.exists(LOCK).await);
}

#[tokio::test]
async fn leaked_guard_is_acquired_after_its_lease_without_a_release_message() {
    crate::needs!(Redis);
    let server = RedisServer::start();
    let backend = server.backend().await;
    // `build` published once, on its probe channel.
    let published = server.command_calls(&["publish"]).await;
    let leaked = take_unrenewed(&backend, Duration::from_secs(1)).await;
    std::mem::forget(leaked);

    let guard = backend.lock(KEY).wait(Duration::from_secs(10)).await;
    assert!(guard.is_ok(), "waiter acquires after the lease: {guard:?}");
    assert_eq!(
        server.command_calls(&["publish"]).await,
        published,
        "no release was published"
    );
}

#[tokio::test]
async fn watchdog_keeps_the_lock_through_three_leases() {
    crate::needs!(Redis);
    let server = RedisServer::start();
    let backend = server.backend().await;
    let other = server.backend().await;
    let guard = take(&backend, RENEWED_LEASE).await;
    tokio::time::sleep(3 * RENEWED_LEASE).await;
    assert!(!guard.is_lost());
    assert!(matches!(
        other.lock(KEY).try_once().await,
        Err(LockError::Contended { .. })
    ));
    guard
        .release()
        .await
        .expect("still held after three leases");
}

#[tokio::test]
async fn lost_fires_when_the_lock_is_deleted_from_outside() {
    crate::needs!(Redis);
    let server = RedisServer::start();
    let backend = server.backend().await;
    let guard = lost_by_deletion(&server, &backend).await;
    assert!(guard.is_lost());
}

/// Takes KEY uncontended with `lease`, renewed by the watchdog.
async fn take(backend: &RedisBackend, lease: Duration) -> LockGuard {
    backend.lock(KEY).lease(lease).try_once().await.unwrap()
}

/// Takes KEY uncontended with `lease` and no renewal: it expires after the lease.
async fn take_unrenewed(backend: &RedisBackend, lease: Duration) -> LockGuard {
    backend
        .lock(KEY)
        .lease(lease)
        .without_watchdog()
        .try_once()
        .await
        .unwrap()
}

/// Re-enters `outer`'s lock on KEY as its owner, with `lease`.
async fn reenter(backend: &RedisBackend, outer: &LockGuard, lease: Duration) -> LockGuard {
    backend
        .lock(KEY)
        .reentrant(outer.held())
        .lease(lease)
        .try_once()
        .await
        .unwrap()
}

/// Takes KEY, then re-enters it as the same owner.
async fn nested_holds(backend: &RedisBackend) -> (LockGuard, LockGuard) {
    let outer = backend.lock(KEY).try_once().await.unwrap();
    let inner = backend
        .lock(KEY)
        .reentrant(outer.held())
        .try_once()
        .await
        .unwrap();
    (outer, inner)
}

/// Takes KEY with a short lease, deletes it from outside and waits until the watchdog
/// has noticed.
async fn lost_by_deletion(server: &RedisServer, backend: &RedisBackend) -> LockGuard {
    let guard = take(backend, Duration::from_millis(600)).await;
    let _: () = server.conn().await.del(LOCK).await.unwrap();
    tokio::time::timeout(Duration::from_secs(5), guard.lost())
        .await
        .expect("lost() fires at the next renewal");
    guard
}

#[tokio::test]
async fn reentry_counts_up_and_the_last_release_frees_the_lock() {
    crate::needs!(Redis);
    let server = RedisServer::start();
    let backend = server.backend().await;
    let mut conn = server.conn().await;
    let (outer, inner) = nested_holds(&backend).await;
    assert_eq!(inner.fencing_token(), outer.fencing_token());
    let owner = outer.held().owner().as_str().to_owned();
    assert_eq!(conn.hget::<_, _, i64>(LOCK, &owner).await.unwrap(), 2);
    assert!(matches!(
        backend.lock(KEY).try_once().await,
        Err(LockError::Contended { .. })
    ));

    inner.release().await.unwrap();
    assert_eq!(conn.hget::<_, _, i64>(LOCK, &owner).await.unwrap(), 1);
    outer.release().await.unwrap();
    assert!(!conn.exists::<_, bool>(LOCK).await.unwrap());
}

#[tokio::test]
async fn contended_try_reports_the_holders_remaining_lease() {
    crate::needs!(Redis);
    let server = RedisServer::start();
    let backend = server.backend().await;
    let _held = take(&backend, Duration::from_secs(20)).await;
    match backend.lock(KEY).try_once().await {
        Err(LockError::Contended {
            retry_after: Some(left),
            ..
        }) => {
            assert!(
                left > Duration::from_secs(10) && left <= Duration::from_secs(20),
                "{left:?}"
            );
        }
        other => panic!("expected Contended, got {other:?}"),
    }
}

#[tokio::test]
async fn waiter_wakes_on_release_and_leaves_no_subscription() {
    crate::needs!(Redis);
    let server = RedisServer::start();
    let holder = server.backend().await;
    let waiter = server.backend().await;
    let guard = holder.lock(KEY).try_once().await.unwrap();
    let waiting = tokio::spawn(async move {
        waiter
            .lock(KEY)
            .wait(Duration::from_secs(10))
            .await
            .map(|g| (g, waiter))
    });
    server.wait_for_subscribers(KEY, 1).await;
    guard.release().await.unwrap();
    let (guard, waiter) = waiting.await.unwrap().expect("woken by the release");
    assert_eq!(
        server.numsub(&support::channel(KEY)).await,
        0,
        "unsubscribed after the last waiter left"
    );
    assert_eq!(waiter.stats().channels_with_waiters, 0);
    drop(guard);
}

#[tokio::test]
async fn dropped_guard_is_released_in_the_background() {
    crate::needs!(Redis);
    let server = RedisServer::start();
    let backend = server.backend().await;
    drop(backend.lock(KEY).try_once().await.unwrap());
    server.wait_until_released(KEY).await;
    assert!(backend.lock(KEY).try_once().await.is_ok());
}

#[tokio::test]
async fn empty_and_oversized_keys_are_rejected_before_redis() {
    crate::needs!(Redis);
    let server = RedisServer::start();
    let backend = server.backend().await;
    let before = server.command_calls(&["evalsha", "eval"]).await;
    assert!(matches!(
        backend.lock("").try_once().await,
        Err(LockError::InvalidKey(KeyError::Empty))
    ));
    assert!(matches!(
        backend.lock("k".repeat(100 * 1024)).try_once().await,
        Err(LockError::InvalidKey(KeyError::TooLong {
            len: 102400,
            max: 1024
        }))
    ));
    assert_eq!(server.command_calls(&["evalsha", "eval"]).await, before);
}

#[tokio::test]
async fn unreachable_redis_is_a_backend_error_not_a_hang() {
    crate::needs!(Redis);
    let mut server = RedisServer::start();
    let backend = server.backend().await;
    server.kill();
    let result = tokio::time::timeout(
        Duration::from_secs(5),
        backend.lock(KEY).wait(Duration::from_secs(2)),
    )
    .await
    .expect("returns within the wait");
    assert!(matches!(result, Err(LockError::Backend(_))), "{result:?}");
}

#[tokio::test]
async fn a_release_retried_after_a_lost_reply_decrements_once() {
    crate::needs!(Redis);
    let server = RedisServer::start();
    let backend = server.backend().await;
    let mut conn = server.conn().await;
    let (outer, inner) = nested_holds(&backend).await;
    let owner = outer.held().owner().as_str().to_owned();
    let scripts = ["evalsha", "eval"];
    let before = server.command_calls(&scripts).await;

    // The first release reaches a paused server, so its reply is lost to the 500 ms
    // command timeout and the release is sent again (then finished in the background);
    // all of them run once the server resumes.
    server.pause();
    let release = inner.release().await;
    assert!(
        release.is_err(),
        "no reply from a paused server: {release:?}"
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    server.resume();
    eventually("the release and its retries ran", || async {
        server.command_calls(&scripts).await - before >= 2
    })
    .await;
    assert_eq!(
        conn.hget::<_, _, i64>(LOCK, &owner).await.unwrap(),
        1,
        "one hold undone, not two"
    );
    assert!(matches!(
        backend.lock(KEY).try_once().await,
        Err(LockError::Contended { .. })
    ));
    outer
        .release()
        .await
        .expect("the outer hold is still there to release");
    assert!(!conn.exists::<_, bool>(LOCK).await.unwrap());
}

#[tokio::test]
async fn one_subscriber_connection_carries_every_channel_and_survives_its_pings() {
    crate::needs!(Redis);
    let server = RedisServer::start();
    let holder = server.backend().await;
    // A ping answered late on a loaded machine must not count as a lost connection.
    let waiter = RedisBackend::builder(server.url())
        .command_timeout(Duration::from_secs(5))
        .build()
        .await
        .unwrap();
    let keys: Vec<String> = (0..20).map(|i| format!("key:{i}")).collect();
    let mut guards = Vec::new();
    for key in &keys {
        guards.push(holder.lock(key).try_once().await.unwrap());
    }
    let waits: Vec<_> = keys
        .iter()
        .map(|key| {
            let request = waiter.lock(key.clone());
            tokio::spawn(request.wait(Duration::from_secs(30)))
        })
        .collect();
    for key in &keys {
        server.wait_for_subscribers(key, 1).await;
    }
    // Several ping intervals pass while the subscriptions sit idle.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let stats = waiter.stats();
    assert_eq!(
        (
            stats.subscriber_connected,
            stats.subscriber_connections_made
        ),
        (true, 1)
    );
    let pubsub_clients: String = redis::cmd("CLIENT")
        .arg("LIST")
        .arg("TYPE")
        .arg("pubsub")
        .query_async(&mut server.conn().await)
        .await
        .unwrap();
    // Every subscriber listens on the namespace's admin channel: the holder's on that
    // alone, the waiter's on it and every release channel.
    assert_eq!(pubsub_clients.lines().count(), 2, "{pubsub_clients}");
    assert!(pubsub_clients.contains(" sub=1 "), "{pubsub_clients}");
    assert!(pubsub_clients.contains(" sub=21 "), "{pubsub_clients}");
    drop(guards);
    for wait in waits {
        assert!(wait.await.unwrap().is_ok());
    }
}

#[tokio::test]
async fn a_shorter_reentry_lease_never_shortens_the_outer_hold() {
    crate::needs!(Redis);
    let server = RedisServer::start();
    let backend = server.backend().await;
    let other_instance = server.backend().await;
    let outer = take(&backend, Duration::from_secs(3)).await;
    let inner = reenter(&backend, &outer, Duration::from_millis(200)).await;
    // Well past the re-entry's own lease, with both guards alive.
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert!(matches!(
        other_instance.lock(KEY).try_once().await,
        Err(LockError::Contended { .. })
    ));
    inner.release().await.unwrap();
    outer.release().await.unwrap();
}

#[tokio::test]
async fn releasing_a_lost_guard_leaves_the_same_owners_new_hold_alone() {
    crate::needs!(Redis);
    let server = RedisServer::start();
    let backend = server.backend().await;
    let old = lost_by_deletion(&server, &backend).await;
    let new = reenter(&backend, &old, RENEWED_LEASE).await;

    assert!(matches!(old.release().await, Err(LockError::Lost { .. })));
    assert!(server.exists(LOCK).await, "the new hold is untouched");
    assert_eq!(backend.stats().watched_locks, 1, "and still renewed");
    // Past its lease: only renewal keeps it.
    tokio::time::sleep(2 * RENEWED_LEASE).await;
    assert!(matches!(
        server.backend().await.lock(KEY).try_once().await,
        Err(LockError::Contended { .. })
    ));
    assert!(!new.is_lost());
    new.release().await.unwrap();
}

#[tokio::test]
async fn unbounded_leases_and_waits_are_clamped_not_fatal() {
    crate::needs!(Redis);
    let server = RedisServer::start();
    let backend = server.backend().await;
    let guard = backend
        .lock(KEY)
        .lease(Duration::MAX)
        .try_once()
        .await
        .expect("a huge lease is clamped");
    let pttl: i64 = server.conn().await.pttl(LOCK).await.unwrap();
    assert!(pttl > 0, "the lock still expires (PTTL {pttl})");
    let waiter = backend.clone();
    let waiting = tokio::spawn(async move { waiter.lock(KEY).wait(Duration::MAX).await });
    guard.release().await.unwrap();
    let waited = waiting.await.expect("waiting forever does not panic");
    assert!(waited.is_ok(), "{waited:?}");
}

#[tokio::test]
async fn a_reentry_cancelled_in_flight_is_undone_exactly_once() {
    crate::needs!(Redis);
    let server = RedisServer::start();
    // A command timeout far beyond the wait below: the re-entry is cancelled by its
    // caller, never timed out by the backend.
    let backend = support::builder(&server.url())
        .command_timeout(Duration::from_secs(30))
        .build()
        .await
        .unwrap();
    let outer = backend.lock(KEY).try_once().await.unwrap();
    let owner = outer.held().owner().as_str().to_owned();
    let scripts = ["evalsha", "eval"];
    let before = server.command_calls(&scripts).await;
    // The re-entry's script reaches a paused server (its kernel takes the bytes) and its
    // caller gives up: the script runs on resume, for a hold nobody has a guard for. A
    // second is a generous bound on writing one command to a socket.
    server.pause();
    let cancelled = tokio::time::timeout(
        Duration::from_secs(1),
        backend.lock(KEY).reentrant(outer.held()).try_once(),
    )
    .await;
    assert!(cancelled.is_err(), "the re-entry was still in flight");
    server.resume();
    eventually("the re-entry ran and was given back", || async {
        // The two `command_calls` queries themselves are not scripts.
        server.command_calls(&scripts).await - before >= 2
    })
    .await;
    let mut conn = server.conn().await;
    assert_eq!(conn.hget::<_, _, i64>(LOCK, &owner).await.unwrap(), 1);
    outer.release().await.expect("the outer hold is intact");
    assert!(
        !conn.exists::<_, bool>(LOCK).await.unwrap(),
        "nothing is left held"
    );
}

#[tokio::test]
async fn an_unrenewed_hold_stops_being_renewed_when_a_renewing_reentry_leaves() {
    crate::needs!(Redis);
    let server = RedisServer::start();
    let backend = server.backend().await;
    let outer = take_unrenewed(&backend, Duration::from_secs(1)).await;
    let inner = reenter(&backend, &outer, Duration::from_secs(1)).await;
    inner.release().await.unwrap();
    tokio::time::timeout(Duration::from_secs(10), outer.lost())
        .await
        .expect("the outer hold's lease runs out as it promised");
    // `lost()` fires a little before the lease ends on the server; unrenewed, it ends.
    server.wait_until_released(KEY).await;
    assert!(server.backend().await.lock(KEY).try_once().await.is_ok());
}

#[tokio::test]
async fn a_renewal_never_shortens_a_longer_reentry_of_another_instance() {
    crate::needs!(Redis);
    let server = RedisServer::start();
    let backend = server.backend().await;
    let other_instance = server.backend().await;
    let short = RENEWED_LEASE;
    let outer = take(&backend, short).await;
    // The same owner re-enters through another backend (another layer's, another
    // process's): only that backend's watchdog knows the long lease.
    let inner = reenter(&other_instance, &outer, Duration::from_secs(60)).await;
    let scripts = ["evalsha", "eval"];
    let before = server.command_calls(&scripts).await;
    // The outer backend renews every third of its lease; nothing else runs a script now.
    eventually("the outer hold was renewed twice", || async {
        server.command_calls(&scripts).await - before >= 2
    })
    .await;
    tokio::time::sleep(short).await;
    assert!(server.exists(LOCK).await, "renewed past the short lease");
    let pttl: i64 = server.conn().await.pttl(LOCK).await.unwrap();
    assert!(
        pttl > 30_000,
        "a renewal shortened the 60 s re-entry's lease to PTTL {pttl} ms"
    );
    assert!(!outer.is_lost());
    inner.release().await.unwrap();
    outer.release().await.unwrap();
}

#[tokio::test]
async fn released_keys_leave_only_short_lived_fence_counters() {
    crate::needs!(Redis);
    const KEYS: usize = 2_000;
    let server = RedisServer::start();
    let backend = server.backend().await;
    // A new key per request, as a route keyed on an Idempotency-Key header sees them.
    for batch in (0..KEYS).collect::<Vec<_>>().chunks(200) {
        let takes = batch.iter().map(|i| {
            let backend = backend.clone();
            async move {
                let guard = backend.lock(format!("request:{i}")).try_once().await?;
                guard.release().await
            }
        });
        for released in futures_util::future::join_all(takes).await {
            released.expect("uncontended take and release");
        }
    }
    let left = namespace_ttls(&server).await;
    assert!(
        left.iter().all(|(key, _)| key.ends_with(":fence")),
        "only fence counters are left: {:?}",
        left.iter().find(|(key, _)| !key.ends_with(":fence"))
    );
    assert_eq!(left.len(), KEYS, "one counter per released key");
    // The documented default of `fence_ttl`, well under the hour the issue allows.
    let bound = 600;
    for (key, ttl) in &left {
        assert!(
            (1..=bound).contains(ttl),
            "{key} outlives its release by {ttl} s (bound {bound} s; -1: never expires)"
        );
    }
}

#[tokio::test]
async fn unbounded_and_zero_fence_ttls_are_clamped_not_fatal() {
    crate::needs!(Redis);
    let server = RedisServer::start();
    let mut conn = server.conn().await;
    let year = 365 * 24 * 3600;
    for (ttl, expected) in [(Duration::MAX, year - 60..=year), (Duration::ZERO, -2..=0)] {
        let backend = RedisBackend::builder(server.url())
            .fence_ttl(ttl)
            .build()
            .await
            .expect("builds");
        let first = backend.lock(KEY).try_once().await.expect("acquires");
        let first_token = first.fencing_token();
        first.release().await.expect("releases");
        let next = backend.lock(KEY).try_once().await.expect("acquires again");
        assert!(next.fencing_token() > first_token);
        next.release().await.expect("releases again");
        // -2: the counter is already gone, as a zero retention asks.
        let left: i64 = conn.ttl(format!("{LOCK}:fence")).await.unwrap();
        assert!(
            expected.contains(&left),
            "fence_ttl({ttl:?}) kept the counter for {left} s, not {expected:?}"
        );
        let _: () = conn.del(format!("{LOCK}:fence")).await.unwrap();
    }
}

/// Every key of the test backends' namespace with its TTL in seconds (-1: none), by SCAN
/// as an operator would look.
async fn namespace_ttls(server: &RedisServer) -> Vec<(String, i64)> {
    let mut conn = server.conn().await;
    let keys: Vec<String> = {
        let mut iter: redis::AsyncIter<String> =
            conn.scan_match("tower-lock:*").await.expect("SCAN");
        let mut keys = Vec::new();
        while let Some(key) = iter.next_item().await {
            keys.push(key.expect("SCAN reply"));
        }
        keys
    };
    let mut ttls = Vec::with_capacity(keys.len());
    for key in keys {
        let ttl: i64 = conn.ttl(&key).await.expect("TTL");
        ttls.push((key, ttl));
    }
    ttls
}

/// Tokens are exact below 2^53, what Lua's numbers and the scripts' integer replies hold:
/// a counter at that edge issues the last exact tokens, then refuses rather than issue one
/// that repeats; a counter that is not a whole number (set by hand) is refused, not
/// passed under. The refusal changes nothing: the counter is left for the operator.
#[tokio::test]
async fn fence_counters_past_exact_numbers_are_refused_instead_of_repeating_tokens() {
    crate::needs!(Redis);
    let server = RedisServer::start();
    let backend = server.backend().await;
    let mut conn = server.conn().await;
    let fence = format!("{LOCK}:fence");
    let _: () = conn.set(&fence, "9007199254740989").await.unwrap();
    for expected in [9_007_199_254_740_990_u64, 9_007_199_254_740_991] {
        let guard = backend.lock(KEY).try_once().await.expect("an exact token");
        assert_eq!(guard.fencing_token(), expected);
        guard.release().await.expect("release");
    }
    for stored in [
        "9007199254740991",
        "9007199254740993",
        "1e300",
        "-5",
        "12.5",
    ] {
        let _: () = conn.set(&fence, stored).await.unwrap();
        let refused = backend.lock(KEY).try_once().await;
        assert!(
            matches!(refused, Err(LockError::NotALock { .. })),
            "a counter of {stored}: {refused:?}"
        );
        let left: String = conn.get(&fence).await.unwrap();
        assert_eq!(left, stored, "the counter is left as it was");
        let held: bool = conn.exists(LOCK).await.unwrap();
        assert!(!held, "nothing is held after a counter of {stored}");
    }
}

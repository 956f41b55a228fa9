//! ACL users and servers that cannot keep locks, against real redis-server processes (one
//! per test): credentials and rights are checked at `build()`, an evicting
//! `maxmemory-policy` is refused unless allowed, and a user whose channel rights are revoked
//! later does not turn the subscriber into a reconnect loop.

use crate::support;

use std::time::Duration;

use support::{RedisServer, chain, lock_key, timed_build as build};
use tower_lock::{BuildError, LockError, RedisBackend, RedisBackendBuilder};

/// Generous bound on anything that should end within a few seconds.
const HANG: Duration = Duration::from_secs(20);

/// `ACL SETUSER name rules...` on the test server.
async fn set_user(server: &RedisServer, name: &str, rules: &[&str]) {
    let _: () = redis::cmd("ACL")
        .arg("SETUSER")
        .arg(name)
        .arg(rules)
        .query_async(&mut server.conn().await)
        .await
        .expect("ACL SETUSER");
}

/// A user with every right on the default namespace's keys and channels, plus `extra`.
async fn app_user(server: &RedisServer, extra: &[&str]) {
    let mut rules = vec![
        "reset",
        "on",
        ">secret",
        "~tower-lock:*",
        "&tower-lock:*",
        "+@all",
    ];
    rules.extend_from_slice(extra);
    set_user(server, "app", &rules).await;
}

/// A builder for `user:password` on the server. The connect timeout is long so that a
/// failure that only times out would read "timed out", not the refusal.
fn builder(server: &RedisServer, user: &str, password: &str) -> RedisBackendBuilder {
    RedisBackend::builder(format!(
        "redis://{user}:{password}@127.0.0.1:{}",
        server.port()
    ))
    .connect_timeout(Duration::from_secs(5))
}

#[tokio::test]
async fn acl_user_with_password_takes_and_releases_locks() {
    crate::needs!(Redis);
    let server = RedisServer::start();
    app_user(&server, &[]).await;
    let backend = build("app user", builder(&server, "app", "secret"))
        .await
        .expect("the app user may do everything the backend needs");
    assert!(
        server.keys().await.is_empty(),
        "the build-time checks leave nothing behind: {:?}",
        server.keys().await
    );
    let guard = backend.lock("order:1").try_once().await.expect("lock");
    let owner = guard.held().owner().as_str().to_owned();
    assert_eq!(
        server.hold_count(&lock_key("order:1"), &owner).await,
        Some(1)
    );
    guard.release().await.expect("release");
    assert!(!server.exists(&lock_key("order:1")).await);
}

/// Both are refused with WRONGPASS (Redis does not tell them apart).
#[tokio::test]
async fn wrong_password_and_unknown_user_are_refused_at_once() {
    crate::needs!(Redis);
    let server = RedisServer::start();
    app_user(&server, &[]).await;
    for (user, password) in [("app", "wrong"), ("nobody", "secret")] {
        let error = build(user, builder(&server, user, password))
            .await
            .expect_err("refused");
        let text = chain(&error);
        assert!(matches!(error, BuildError::Auth { .. }), "{text}");
        assert!(text.contains("refused") && text.contains(user), "{text}");
        assert!(!text.contains("timed out"), "{text}");
    }
    // No password where the default user needs one.
    set_user(&server, "default", &["resetpass", ">needed"]).await;
    let url = format!("redis://127.0.0.1:{}", server.port());
    let error = build("no password", RedisBackend::builder(url))
        .await
        .expect_err("refused");
    let text = chain(&error);
    assert!(matches!(error, BuildError::Auth { .. }), "{text}");
    assert!(text.contains("`default`"), "{text}");
}

/// Each right the backend needs, taken away in turn: `build()` names it (a command a
/// script calls by its name, not the script's whole list), the server, and the probes
/// leave nothing behind.
#[tokio::test]
async fn each_missing_right_is_named_at_build() {
    crate::needs!(Redis);
    let server = RedisServer::start();
    let at = format!("127.0.0.1:{}", server.port());
    let cases: [(&[&str], &str); 9] = [
        (&["-evalsha"], "may not run EVALSHA"),
        (&["-script"], "may not run SCRIPT LOAD"),
        (
            &["-pexpire"],
            "may not run PEXPIRE (the acquire script calls it)",
        ),
        (
            &["-publish"],
            "may not run PUBLISH (the release script calls it)",
        ),
        (
            &["resetkeys", "~other:*"],
            "may not access key `tower-lock:{",
        ),
        (&["-info"], "may not run INFO"),
        // Called by the permit scripts only.
        (
            &["-hlen"],
            "may not run HLEN (the permit release script calls it)",
        ),
        // Redis 7's default for a new user: no channels at all.
        (
            &["resetchannels"],
            "may not PUBLISH to channel `tower-lock:{",
        ),
        (&["-subscribe"], "may not run SUBSCRIBE"),
    ];
    for (rules, says) in cases {
        app_user(&server, rules).await;
        let what = rules.join(" ");
        let error = build(&what, builder(&server, "app", "secret"))
            .await
            .expect_err("refused");
        let text = chain(&error);
        assert!(
            matches!(&error, BuildError::Rights { user, addr, .. } if user == "app" && addr == &at),
            "{text}"
        );
        let message = error.to_string();
        assert!(
            message.starts_with(&format!("the user `app` of the server at {at} "))
                && message.contains(says),
            "{text}"
        );
        // One command, not the list of every command the script calls.
        assert!(!message.contains("HMGET"), "{text}");
        assert!(
            server.keys().await.is_empty(),
            "{what}: {:?}",
            server.keys().await
        );
    }
    // Nor is a right asked for that nothing uses: no lock operation runs `PUBSUB`.
    app_user(&server, &["-pubsub"]).await;
    build("-pubsub", builder(&server, "app", "secret"))
        .await
        .expect("PUBSUB is not needed");
}

#[tokio::test]
async fn evicting_policy_is_refused_unless_allowed() {
    crate::needs!(Redis);
    for policy in ["allkeys-lru", "volatile-ttl"] {
        let server = RedisServer::start_with(&["--maxmemory-policy", policy]);
        let error = build(policy, RedisBackend::builder(server.url()))
            .await
            .expect_err("refused");
        let text = chain(&error);
        let at = format!("127.0.0.1:{}", server.port());
        assert!(
            matches!(&error, BuildError::Eviction { policy: p, addr } if p == policy && addr == &at),
            "{text}"
        );
        assert!(text.contains(policy), "{text}");
        let backend = build(
            "allowed",
            RedisBackend::builder(server.url()).allow_eviction(),
        )
        .await
        .expect("allowed knowingly");
        backend
            .lock("k")
            .try_once()
            .await
            .expect("locks work")
            .release()
            .await
            .expect("release");
    }
}

/// Redis 7 disconnects a subscriber whose channel rights are revoked, and refuses its
/// SUBSCRIBE from then on: a waiter must not turn that into a reconnect loop (219
/// connections in 5 s before), and a release that may not publish must say it failed
/// while the lock is in fact still there.
#[tokio::test]
async fn revoked_channel_rights_back_off_and_fail_releases_truthfully() {
    crate::needs!(Redis);
    support::init_tracing();
    let server = RedisServer::start();
    app_user(&server, &[]).await;
    let app = builder(&server, "app", "secret")
        .build()
        .await
        .expect("build");
    let other = server.backend().await;
    let held_by_app = app.lock("mine").try_once().await.expect("lock");
    let held_elsewhere = other.lock("theirs").try_once().await.expect("lock");
    let waiter = {
        let app = app.clone();
        tokio::spawn(async move { app.lock("theirs").wait(HANG).await.map(drop) })
    };
    server.wait_for_subscribers("theirs", 1).await;

    app_user(&server, &["resetchannels"]).await;
    let before = app.stats().subscriber_connections_made;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let made = app.stats().subscriber_connections_made - before;
    println!("subscriber connections made in 3 s without channel rights: {made}");
    assert!(made <= 15, "{made} reconnects in 3 s");

    let error = held_by_app.release().await.expect_err("may not publish");
    let text = chain(&error);
    assert!(matches!(error, LockError::Backend(_)), "{text}");
    assert!(text.contains("publish"), "{text}");
    assert!(
        server.exists(&lock_key("mine")).await,
        "the failed release left the lock to its lease, as it says"
    );

    held_elsewhere.release().await.expect("release");
    let acquired = tokio::time::timeout(HANG, waiter)
        .await
        .expect("the waiter ends")
        .expect("no panic");
    acquired.expect("the waiter gets the lock without its subscription");
}

//! `build()` on a cluster checks every primary (ACL users, rights and settings are per
//! node): scenarios on the shared cluster, each undoing its ACL and CONFIG changes.

use std::time::Duration;

use tower_lock::{BuildError, RedisBackend, RedisBackendBuilder};

use crate::support::cluster::{Cluster, key_on};
use crate::support::cluster_acl::{APP_RULES, NodeChanges, attempts, builder_as};
use crate::support::{chain, timed_build as build, warnings_of};

/// Generous bound on anything that should end within a few seconds.
const HANG: Duration = Duration::from_secs(20);

/// Runs every scenario of this file.
pub async fn build_checks_hold_on_every_primary(cluster: &Cluster) {
    an_acl_user_with_namespace_rights_builds_and_locks_on_every_shard(cluster).await;
    each_missing_sharded_right_is_named_at_build(cluster).await;
    a_primary_that_denies_channels_is_named(cluster).await;
    a_user_missing_on_one_node_is_refused(cluster).await;
    an_evicting_node_is_refused_unless_allowed(cluster).await;
    full_coverage_is_warned_about_at_build(cluster).await;
    revoked_channel_rights_do_not_make_the_shard_subscriber_spin(cluster).await;
}

/// No probe key of the build checks is left on any primary.
fn assert_no_probe_keys(cluster: &Cluster, what: &str) {
    for port in cluster.primaries() {
        let keys = cluster.run(port, &["KEYS", "*tower-lock-build-check*"]);
        assert!(keys.trim().is_empty(), "{what}: left on {port}: {keys}");
    }
}

async fn an_acl_user_with_namespace_rights_builds_and_locks_on_every_shard(cluster: &Cluster) {
    let mut changes = NodeChanges::new(cluster);
    changes.set_user(&cluster.live(), "app", &APP_RULES);
    let backend = build("full rights", builder_as(cluster, "app", "secret"))
        .await
        .expect("the app user may do everything the backend needs");
    assert_no_probe_keys(cluster, "full rights");
    for port in cluster.primaries() {
        let key = key_on(cluster, port, "acl:");
        let guard = backend.lock(key.clone()).try_once().await.expect("lock");
        assert!(cluster.exists_on(port, &format!("tower-lock:{{{key}}}")));
        guard.release().await.expect("release");
        assert!(!cluster.exists_on(port, &format!("tower-lock:{{{key}}}")));
    }
}

/// Each sharded right the backend needs, taken away on every node in turn: `build()`
/// names it.
async fn each_missing_sharded_right_is_named_at_build(cluster: &Cluster) {
    let cases: [(&str, &str); 2] = [
        // Redis 7's default for a new user: no channels at all. The release script's
        // SPUBLISH is probed before the subscriber's SSUBSCRIBE.
        ("resetchannels", "may not SPUBLISH to channel `tower-lock:{"),
        ("-ssubscribe", "may not run SSUBSCRIBE"),
    ];
    for (rule, says) in cases {
        let mut changes = NodeChanges::new(cluster);
        let mut rules = APP_RULES.to_vec();
        rules.push(rule);
        changes.set_user(&cluster.live(), "app", &rules);
        let error = build(rule, builder_as(cluster, "app", "secret"))
            .await
            .expect_err("refused");
        let text = chain(&error);
        assert!(matches!(error, BuildError::Rights { .. }), "{text}");
        assert!(
            text.contains("the user `app` ") && text.contains(says),
            "{text}"
        );
        assert_no_probe_keys(cluster, rule);
    }
    // Nor is a right asked for that nothing uses: no lock operation runs `PUBSUB`.
    let mut changes = NodeChanges::new(cluster);
    let mut rules = APP_RULES.to_vec();
    rules.push("-pubsub");
    changes.set_user(&cluster.live(), "app", &rules);
    build("-pubsub", builder_as(cluster, "app", "secret"))
        .await
        .expect("PUBSUB is not needed");
}

/// One primary's copy of the user may not use the namespace's channels: whichever primary
/// it is, `build()` finds it (one probe per shard) and names it.
async fn a_primary_that_denies_channels_is_named(cluster: &Cluster) {
    for denying in cluster.primaries() {
        let mut changes = NodeChanges::new(cluster);
        changes.set_user(&cluster.live(), "app", &APP_RULES);
        let mut rules = APP_RULES.to_vec();
        rules.push("resetchannels");
        changes.set_user(&[denying], "app", &rules);
        let what = format!("no channels on {denying}");
        let error = build(&what, builder_as(cluster, "app", "secret"))
            .await
            .expect_err("refused");
        let text = chain(&error);
        assert!(matches!(error, BuildError::Rights { .. }), "{text}");
        assert!(text.contains(&format!(":{denying}")), "{text}");
    }
}

/// The user exists on every node but one: a primary, or a replica (which a failover would
/// make a primary that refuses it). That node refuses its credentials, and the error says
/// so and which node it is.
async fn a_user_missing_on_one_node_is_refused(cluster: &Cluster) {
    let primary = cluster.primaries()[1];
    let cases = [
        (primary, "missing on one primary"),
        (cluster.replica_of(primary), "missing on one replica"),
    ];
    for (missing, what) in cases {
        let mut changes = NodeChanges::new(cluster);
        let others: Vec<u16> = cluster
            .live()
            .into_iter()
            .filter(|&p| p != missing)
            .collect();
        changes.set_user(&others, "app", &APP_RULES);
        let error = build(what, builder_as(cluster, "app", "secret"))
            .await
            .expect_err("refused");
        let text = chain(&error);
        assert!(
            matches!(&error, BuildError::Auth { user, addr, .. }
                if user == "app" && addr == &format!("127.0.0.1:{missing}")),
            "{what}: {text}"
        );
    }
}

/// One node may evict keys: a primary, or a replica (which a failover would make a primary
/// that evicts held locks). Refused, naming the policy and the node, unless allowed; with
/// its policy set back, the build passes.
async fn an_evicting_node_is_refused_unless_allowed(cluster: &Cluster) {
    let primary = cluster.primaries()[2];
    let cases = [
        (primary, "allkeys-lru on one primary"),
        (cluster.replica_of(primary), "allkeys-lru on one replica"),
    ];
    for (evicting, what) in cases {
        let mut changes = NodeChanges::new(cluster);
        changes.set_policy(evicting, "allkeys-lru");
        let error = build(what, cluster_builder(cluster))
            .await
            .expect_err("refused");
        let text = chain(&error);
        assert!(
            matches!(&error, BuildError::Eviction { policy, addr }
                if policy == "allkeys-lru" && addr == &format!("127.0.0.1:{evicting}")),
            "{what}: {text}"
        );
        let backend = build("allowed", cluster_builder(cluster).allow_eviction())
            .await
            .expect("allowed knowingly");
        let key = key_on(cluster, primary, "evicting:");
        let guard = backend.lock(key).try_once().await.expect("lock");
        guard.release().await.expect("release");
        drop(changes);
        build("set back", cluster_builder(cluster))
            .await
            .expect("every node keeps its keys");
    }
}

/// `cluster-require-full-coverage yes` (Redis' default) on one primary makes every shard
/// refuse commands while any slot is uncovered: `build()` warns, naming that primary, what
/// it means and the setting that avoids it; not when every primary says `no`, and a user
/// who may not read the setting builds without a word.
async fn full_coverage_is_warned_about_at_build(cluster: &Cluster) {
    let requiring = cluster.primaries()[1];
    let mut changes = NodeChanges::new(cluster);
    changes.require_full_coverage(requiring);
    let (built, warnings) = build_logging(cluster_builder(cluster)).await;
    built.expect("a warning, not a refusal");
    let named = format!("primaries=127.0.0.1:{requiring}");
    let about = |text: &str| text.matches("cluster-require-full-coverage is").count();
    assert_eq!(
        about(&warnings),
        1,
        "one warning for the cluster: {warnings}"
    );
    for says in [
        "cluster-require-full-coverage is `yes`",
        "every lock answers 503",
        "set `cluster-require-full-coverage no`",
        named.as_str(),
    ] {
        assert!(warnings.contains(says), "{says:?} in {warnings}");
    }

    let mut rules = APP_RULES.to_vec();
    rules.push("-config");
    changes.set_user(&cluster.live(), "app", &rules);
    let (built, warnings) = build_logging(builder_as(cluster, "app", "secret")).await;
    built.expect("CONFIG GET is not needed");
    assert_eq!(
        about(&warnings),
        0,
        "a user who may not read it: {warnings}"
    );

    drop(changes);
    let (built, warnings) = build_logging(cluster_builder(cluster)).await;
    built.expect("builds");
    assert_eq!(about(&warnings), 0, "every primary says no: {warnings}");
}

/// Builds, returning the WARN and ERROR lines the build logged.
async fn build_logging(builder: RedisBackendBuilder) -> (Result<RedisBackend, BuildError>, String) {
    let (built, text) = warnings_of(tokio::time::timeout(HANG, builder.build())).await;
    (built.expect("build() ends"), text)
}

fn cluster_builder(cluster: &Cluster) -> RedisBackendBuilder {
    RedisBackend::cluster(cluster.urls())
        .command_timeout(Duration::from_millis(500))
        .connect_timeout(Duration::from_millis(500))
}

/// A waiter's channel rights are revoked on every node after build: Redis drops its
/// subscription and refuses every SSUBSCRIBE from then on. The subscriber must not turn
/// that into a loop (the issue saw 219 reconnects in 5 s on one server), and the waiter
/// still gets the lock once it is free.
async fn revoked_channel_rights_do_not_make_the_shard_subscriber_spin(cluster: &Cluster) {
    let mut changes = NodeChanges::new(cluster);
    changes.set_user(&cluster.live(), "app", &APP_RULES);
    let app = build("before the revoke", builder_as(cluster, "app", "secret"))
        .await
        .expect("full rights");
    let other = cluster.backend().await;
    let shard = cluster.primaries()[0];
    let key = key_on(cluster, shard, "revoked:");
    let channel = format!("tower-lock:{{{key}}}:released");
    let held = other
        .lock(key.clone())
        .lease(Duration::from_secs(2))
        .try_once()
        .await
        .expect("free");
    let waiter = tokio::spawn({
        let (app, key) = (app.clone(), key.clone());
        async move { app.lock(key).wait(HANG).await.map(drop) }
    });
    crate::support::eventually("the waiter subscribed on its shard", || async {
        cluster.shard_subscribers(shard, &channel) == 1
    })
    .await;

    changes.set_user(&cluster.live(), "app", &["resetchannels"]);
    let (before, connections) = (
        attempts(cluster, shard, "ssubscribe"),
        app.stats().subscriber_connections_made,
    );
    tokio::time::sleep(Duration::from_secs(3)).await;
    let tried = attempts(cluster, shard, "ssubscribe") - before;
    let reconnects = app.stats().subscriber_connections_made - connections;
    eprintln!("in 3 s without channel rights: {tried} SSUBSCRIBE, {reconnects} reconnects");
    // Each refusal waits the longest backoff (2 s): one SSUBSCRIBE at the revoke, one
    // more 2 s later, and maybe one by redis-rs when it reconnects the node.
    assert!(tried <= 5, "{tried} SSUBSCRIBE in 3 s");
    assert!(reconnects <= 15, "{reconnects} reconnects in 3 s");

    drop(held);
    let acquired = tokio::time::timeout(HANG, waiter)
        .await
        .expect("the waiter ends")
        .expect("no panic");
    acquired.expect("the waiter gets the lock without its subscription");
}

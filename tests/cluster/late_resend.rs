//! A copy of an acquisition that arrives after its owner released the lock.

use super::support::cluster::{Cluster, key_on};
use super::support::monitor::commands_sent;

/// The cluster client sends a call again when its connection drops before the reply, and
/// such a copy can arrive after the owner released the lock: it would take the lock again
/// with no holder, keeping everyone out for a lease. The acquisition's script call, as the
/// key's primary ran it (`MONITOR`), is sent again by hand after the release: refused as
/// overtaken by that release ({7}), it takes nothing, and the next holder gets the lock.
pub async fn an_acquisition_resent_after_the_release_takes_nothing(cluster: &Cluster) {
    let port = cluster.primaries()[0];
    let key = key_on(cluster, port, "late:");
    let lock = format!("tower-lock:{{{key}}}");
    let backend = cluster.backend().await;
    let node = format!("redis://127.0.0.1:{port}");
    let (guard, sent) = commands_sent(&node, &lock, backend.lock(key.clone()).try_once()).await;
    let guard = guard.expect("free");
    // Its EVALSHA (one refused with NOSCRIPT is followed by an EVAL that loads the script,
    // whose source MONITOR shows escaped).
    let acquire = sent
        .into_iter()
        .find(|words| {
            words
                .first()
                .is_some_and(|w| w.eq_ignore_ascii_case("evalsha"))
        })
        .expect("the acquisition's EVALSHA on the key's primary");
    guard.release().await.expect("release");
    assert!(!cluster.exists_on(port, &lock), "released");

    let mut copy = redis::cmd(&acquire[0]);
    for word in &acquire[1..] {
        copy.arg(word);
    }
    let reply: Vec<i64> = copy
        .query_async(&mut cluster.node_conn(port).await)
        .await
        .expect("the copy runs");
    assert_eq!(reply, [7], "refused: its owner released since");
    assert!(
        !cluster.exists_on(port, &lock),
        "the copy took nothing: the lock stays free"
    );
    let next = backend.lock(key).try_once().await;
    next.expect("the next holder gets the lock")
        .release()
        .await
        .expect("release");
}

/// An attempt that a release of its own instance overtook is sent again under a new serial,
/// a few times at most: with the instance's last release recorded far ahead (as no real
/// release can be), every try is refused, and `try_once` reports the key held, having
/// taken nothing, rather than sending again for ever.
pub async fn an_attempt_overtaken_again_and_again_takes_nothing_and_stops(cluster: &Cluster) {
    let port = cluster.primaries()[1];
    let key = key_on(cluster, port, "overtaken:");
    let lock = format!("tower-lock:{{{key}}}");
    let releases = format!("{lock}:releases");
    let backend = cluster.backend().await;
    let guard = backend.lock(key.clone()).try_once().await.expect("free");
    let owner = guard.held().owner().as_str().to_owned();
    let (instance, _) = owner.rsplit_once(':').expect("instance:sequence");
    guard.release().await.expect("release");
    cluster.run(port, &["HSET", &releases, instance, "1000000000000"]);
    let refused = tokio::time::timeout(
        std::time::Duration::from_secs(10),
        backend.lock(key.clone()).try_once(),
    )
    .await
    .expect("the attempt stops sending again");
    assert!(refused.is_err(), "refused every time: {refused:?}");
    assert!(!cluster.exists_on(port, &lock), "nothing taken");
    cluster.run(port, &["DEL", &releases]);
    let next = backend.lock(key).try_once().await;
    next.expect("taken once no release is ahead")
        .release()
        .await
        .expect("release");
}

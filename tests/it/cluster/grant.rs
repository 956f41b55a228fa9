//! Grant on release on a Redis Cluster: the release hands the key to the waiting instance
//! on the key's shard (its message on sharded pub/sub), which takes no acquire call.

use std::time::Duration;

use super::support::cluster::{Cluster, key_on};
use super::support::monitor::commands_sent;

/// An instance waits for a key another holds; as the key's primary runs it (`MONITOR`),
/// the holder's release is followed by no acquisition: the waiter holds the key on the
/// release's grant, under a token above the holder's.
pub async fn a_release_grants_the_key_to_the_waiting_instance(cluster: &Cluster) {
    let port = cluster.primaries()[1];
    let key = key_on(cluster, port, "granted:");
    let lock = format!("tower-lock:{{{key}}}");
    let (holder, waiter) = (cluster.backend().await, cluster.backend().await);
    let held = holder.lock(key.clone()).try_once().await.expect("free");
    let token = held.fencing_token();
    let before = evalsha_calls(cluster, port).await;
    let (taken_tx, taken) = tokio::sync::oneshot::channel();
    let waiting = tokio::spawn({
        let key = key.clone();
        async move {
            let guard = waiter.lock(key).wait(Duration::from_secs(20)).await;
            let _ = taken_tx.send(guard.map(|g| g.fencing_token()));
        }
    });
    // Its attempt before subscribing and the one after the subscription is confirmed,
    // on the key's primary (a third when the confirmation and the shard's `ssubscribe`
    // push wake it apart): then it sleeps until woken.
    super::support::eventually("the waiter made both its attempts", || async {
        evalsha_calls(cluster, port).await >= before + 2
    })
    .await;
    let node = format!("redis://127.0.0.1:{port}");
    let (granted, sent) = commands_sent(&node, &lock, async {
        held.release().await.expect("release");
        tokio::time::timeout(Duration::from_secs(10), taken)
            .await
            .expect("served")
            .expect("sent")
            .expect("acquired")
    })
    .await;
    assert!(granted > token, "{granted} after {token}");
    // Counted from the release: that third attempt may still come before it.
    let evalsha = |words: &Vec<String>, second_key: &str| {
        words
            .first()
            .is_some_and(|w| w.eq_ignore_ascii_case("evalsha"))
            && words.get(4).is_some_and(|k| k.ends_with(second_key))
    };
    let release = sent
        .iter()
        .position(|words| evalsha(words, ":line"))
        .expect("the release's EVALSHA");
    let acquisitions = sent[release..]
        .iter()
        .filter(|words| evalsha(words, ":fence"))
        .count();
    assert_eq!(acquisitions, 0, "granted without an acquire call: {sent:?}");
    waiting.await.expect("no panic");
}

async fn evalsha_calls(cluster: &Cluster, port: u16) -> u64 {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(&mut cluster.node_conn(port).await)
        .await
        .expect("INFO commandstats");
    super::support::calls_in(&info, &["evalsha"])
}

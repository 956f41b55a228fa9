//! A copy of a call that the cluster client sends again and that arrives after its owner
//! moved on: an acquisition after the release (exclusive, a re-entry, a shared hold, a
//! permit), an operator's force-release after the key was taken again.

use std::time::Duration;

use tower_lock::{LockError, LockGuard, LockMode};

use super::support::cluster::{Cluster, key_on};
use super::support::monitor::commands_sent;

/// Runs every scenario of this file.
pub async fn late_copies_take_nothing(cluster: &Cluster) {
    an_acquisition_resent_after_the_release_takes_nothing(cluster).await;
    an_attempt_overtaken_again_and_again_takes_nothing_and_stops(cluster).await;
    a_reentry_resent_after_its_owner_took_the_key_again_counts_no_hold(cluster).await;
    a_shared_hold_resent_after_its_release_takes_nothing(cluster).await;
    a_permit_resent_after_its_release_takes_nothing(cluster).await;
    a_force_release_resent_after_the_key_was_taken_again_frees_nothing(cluster).await;
    holders_of_one_instance_overtaking_each_other_all_get_their_holds(cluster).await;
}

/// The script call that `during` made on the node on `port` for the key named `name`, as
/// the node ran it (`MONITOR`): its EVALSHA with an argument that `marks` (one refused with
/// NOSCRIPT is followed by an EVAL that loads the script, whose source MONITOR shows
/// escaped; the EVALSHA runs once that is done). Other calls on the key may come in
/// between, such as a watchdog's re-check.
async fn script_call<F: Future>(
    port: u16,
    name: &str,
    marks: impl Fn(&str) -> bool,
    during: F,
) -> (F::Output, Vec<String>) {
    let node = format!("redis://127.0.0.1:{port}");
    let (output, sent) = commands_sent(&node, name, during).await;
    let call = sent
        .into_iter()
        .find(|words| {
            words
                .first()
                .is_some_and(|w| w.eq_ignore_ascii_case("evalsha"))
                && words.iter().any(|w| marks(w))
        })
        .expect("the script's EVALSHA on the key's primary");
    (output, call)
}

/// Sends the acquisition `call` again after its owner released what it took: refused as
/// overtaken by that release, it takes nothing (`name` stays free), and `next` gets the key.
async fn refused_taking_nothing(
    cluster: &Cluster,
    port: u16,
    name: &str,
    call: &[String],
    next: impl Future<Output = Result<LockGuard, LockError>>,
) {
    let reply = send_again(cluster, port, call).await;
    assert_eq!(reply, [7], "refused: its owner released since");
    assert!(!cluster.exists_on(port, name), "the copy took nothing");
    let next = next.await.expect("the next holder gets the key");
    next.release().await.expect("release");
}

/// An acquisition's argument: its attempt id, `holder@serial`.
fn attempt_id(word: &str) -> bool {
    word.contains('@')
}

/// Sends `call` (as [`script_call`] took it) again to the node on `port`, as the cluster
/// client would a copy, and returns the script's reply.
async fn send_again(cluster: &Cluster, port: u16, call: &[String]) -> Vec<i64> {
    let mut copy = redis::cmd(&call[0]);
    for word in &call[1..] {
        copy.arg(word);
    }
    copy.query_async(&mut cluster.node_conn(port).await)
        .await
        .expect("the copy runs")
}

/// The cluster client sends a call again when its connection drops before the reply, and
/// such a copy can arrive after the owner released the lock: it would take the lock again
/// with no holder, keeping everyone out for a lease. The acquisition's script call, as the
/// key's primary ran it (`MONITOR`), is sent again by hand after the release: refused as
/// overtaken by that release ({7}), it takes nothing, and the next holder gets the lock.
async fn an_acquisition_resent_after_the_release_takes_nothing(cluster: &Cluster) {
    let port = cluster.primaries()[0];
    let key = key_on(cluster, port, "late:");
    let lock = format!("tower-lock:{{{key}}}");
    let backend = cluster.backend().await;
    let (guard, acquire) = script_call(
        port,
        &lock,
        attempt_id,
        backend.lock(key.clone()).try_once(),
    )
    .await;
    guard.expect("free").release().await.expect("release");
    assert!(!cluster.exists_on(port, &lock), "released");

    let next = backend.lock(key).try_once();
    refused_taking_nothing(cluster, port, &lock, &acquire, next).await;
}

/// An attempt that a release of its own instance overtook is sent again under a new serial,
/// a few times at most: with the instance's last release recorded far ahead (as no real
/// release can be), every try is refused, and `try_once` reports the key held, having
/// taken nothing, rather than sending again for ever.
async fn an_attempt_overtaken_again_and_again_takes_nothing_and_stops(cluster: &Cluster) {
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

/// A re-entry's copy, sent again after the owner released both holds and took the key
/// again (a handler that locks the key twice in turn with its request's `HeldLock`): it
/// finds its owner holding the key, but under a hold it never made. Refused, it counts no
/// hold, so the owner's one release frees the key rather than leaving it held a lease
/// with no holder.
async fn a_reentry_resent_after_its_owner_took_the_key_again_counts_no_hold(cluster: &Cluster) {
    let port = cluster.primaries()[2];
    let key = key_on(cluster, port, "late-reentry:");
    let lock = format!("tower-lock:{{{key}}}");
    let backend = cluster.backend().await;
    let outer = backend.lock(key.clone()).try_once().await.expect("free");
    let held = outer.held().clone();
    let owner = held.owner().as_str().to_owned();
    let reentry = backend.lock(key.clone()).reentrant(&held).try_once();
    let (inner, reenter) = script_call(port, &lock, attempt_id, reentry).await;
    let inner = inner.expect("re-entered");
    assert_eq!(
        cluster.hold_count(port, &lock, &owner),
        Some(2),
        "a re-entry"
    );
    inner.release().await.expect("release");
    outer.release().await.expect("release");
    let again = backend.lock(key.clone()).reentrant(&held).try_once().await;
    let again = again.expect("the owner takes the key again");

    let reply = send_again(cluster, port, &reenter).await;
    assert_eq!(reply, [7], "refused: its owner released since");
    assert_eq!(
        cluster.hold_count(port, &lock, &owner),
        Some(1),
        "the copy counted no hold"
    );
    again.release().await.expect("release");
    assert!(!cluster.exists_on(port, &lock), "one release frees the key");
}

/// A shared hold's copy, sent again after the reader released while another reader still
/// holds the key: refused, it adds no reader, so the last reader's release frees the key
/// and a writer gets it.
async fn a_shared_hold_resent_after_its_release_takes_nothing(cluster: &Cluster) {
    let port = cluster.primaries()[0];
    let key = key_on(cluster, port, "late-shared:");
    let lock = format!("tower-lock:{{{key}}}");
    let (a, b) = (cluster.backend().await, cluster.backend().await);
    let read = a.lock(key.clone()).shared().try_once();
    let (first, acquire) = script_call(port, &lock, attempt_id, read).await;
    let first = first.expect("shared");
    let second = b.lock(key.clone()).shared().try_once().await;
    let second = second.expect("shared");
    first.release().await.expect("release");

    let reply = send_again(cluster, port, &acquire).await;
    assert_eq!(reply, [7], "refused: its owner released since");
    second.release().await.expect("release");
    assert!(
        !cluster.exists_on(port, &lock),
        "the last reader's release frees the key"
    );
    let writer = b.lock(key).try_once().await.expect("a writer gets the key");
    writer.release().await.expect("release");
}

/// A permit's copy, sent again after its release: refused, it takes no permit, and the
/// semaphore's one permit goes to the next holder.
async fn a_permit_resent_after_its_release_takes_nothing(cluster: &Cluster) {
    let port = cluster.primaries()[1];
    let key = key_on(cluster, port, "late-permit:");
    let semaphore = format!("tower-lock:{{{key}}}:permits");
    let (a, b) = (cluster.backend().await, cluster.backend().await);
    let take = a.lock(key.clone()).permits(1).try_once();
    let (permit, acquire) = script_call(port, &semaphore, attempt_id, take).await;
    permit.expect("a permit").release().await.expect("release");

    let next = b.lock(key).permits(1).try_once();
    refused_taking_nothing(cluster, port, &semaphore, &acquire, next).await;
}

/// An operator's force-release, sent again after the key was freed by it and taken by a
/// new holder: the copy answers as the call did and frees nothing, so the new holder keeps
/// the key and is not told it lost it.
async fn a_force_release_resent_after_the_key_was_taken_again_frees_nothing(cluster: &Cluster) {
    let port = cluster.primaries()[2];
    let key = key_on(cluster, port, "late-force:");
    let lock = format!("tower-lock:{{{key}}}");
    let (operator, holders) = (cluster.backend().await, cluster.backend().await);
    // The script loaded on the node first: the call to send again is one EVALSHA that ran.
    let loaded = operator
        .force_release(key_on(cluster, port, "late-force-load:"))
        .await;
    assert!(loaded.expect("nothing to free").is_free());
    let hung = holders.lock(key.clone()).try_once().await.expect("free");
    let channel = format!("{lock}:released");
    let force = operator.force_release(key.clone());
    let (freed, force) = script_call(port, &lock, |w| w == channel, force).await;
    let freed = freed.expect("force-released");
    assert_eq!(freed.mode, LockMode::Exclusive, "{freed:?}");
    tokio::time::timeout(Duration::from_secs(30), hung.lost())
        .await
        .expect("the holder learns it lost the key");
    // Another instance: the old holder's own may still have its hold queued in memory.
    let next = cluster.backend().await.lock(key.clone()).try_once().await;
    let next = next.expect("the key is taken again");

    let reply = send_again(cluster, port, &force).await;
    let token = i64::try_from(freed.fencing_token.expect("a token")).expect("i64");
    assert_eq!(
        (reply[0], reply[1], reply[4]),
        (1, 1, token),
        "answered as the call that freed: {reply:?}"
    );
    assert!(cluster.exists_on(port, &lock), "the new hold stays");
    assert!(!next.is_lost(), "the new holder holds on");
    next.release()
        .await
        .expect("the new holder releases its own hold");
    assert!(!cluster.exists_on(port, &lock), "released");
}

/// Shared holds and permits of one instance, taken and given back by many tasks at once
/// on one key: a release of the instance may reach the server before an attempt sent
/// earlier, which is then refused as overtaken and sent again. A release records its
/// holder's latest attempt, not its own serial, so this is rare. Every acquisition gets its
/// hold and the key is free at the end; the script calls beyond two per hold (attempts
/// sent again, and for permits the waits of the tasks beyond the 8) are printed.
async fn holders_of_one_instance_overtaking_each_other_all_get_their_holds(cluster: &Cluster) {
    const TASKS: usize = 16;
    const ROUNDS: usize = 50;
    let port = cluster.primaries()[0];
    let key = key_on(cluster, port, "late-churn:");
    let backend = cluster.backend().await;
    for (what, permits) in [("shared holds", None), ("permits (8)", Some(8))] {
        let before = cluster.command_calls(port, &["evalsha"]);
        let tasks: Vec<_> = (0..TASKS)
            .map(|_| {
                let (backend, key) = (backend.clone(), key.clone());
                tokio::spawn(async move {
                    for _ in 0..ROUNDS {
                        let lock = backend.lock(key.clone());
                        let lock = match permits {
                            Some(n) => lock.permits(n),
                            None => lock.shared(),
                        };
                        let held = lock.wait(Duration::from_secs(20)).await.expect("a hold");
                        held.release().await.expect("release");
                    }
                })
            })
            .collect();
        for task in tasks {
            task.await.expect("no panic");
        }
        let calls = cluster.command_calls(port, &["evalsha"]) - before;
        let holds = u64::try_from(TASKS * ROUNDS).expect("small");
        eprintln!(
            "{what}, {TASKS} tasks of one instance x {ROUNDS}: {holds} holds, {calls} script \
             calls on the key's primary ({} beyond two per hold)",
            calls.saturating_sub(2 * holds)
        );
        let name = match permits {
            Some(_) => format!("tower-lock:{{{key}}}:permits"),
            None => format!("tower-lock:{{{key}}}"),
        };
        assert!(!cluster.exists_on(port, &name), "{what}: the key is free");
    }
}

//! Locks on a slot that `redis-cli --cluster reshard` moves to another primary, the test
//! acting between its steps: while the slot is half-moved a lock's keys are split between
//! the two nodes, and Redis answers a script on them `TRYAGAIN` (some keys here, some
//! gone) or `ASK` (none here); once the new owner is announced, `MOVED`.

use std::time::Duration;

use redis::cluster_routing::Slot;
use tokio::time::Instant;
use tower_lock::LockError;

use super::patient_backend;
use super::support::cluster::{Cluster, key_on};
use super::support::eventually;
use super::support::reshard::Migration;

/// A lock held, renewed, released and waited for across a slot move done step by step:
///
/// - IMPORTING / MIGRATING, then the lock hashes moved with `MIGRATE` and their fencing
///   counters and lines left behind: the holder's renewal (one key, gone from the
///   source) follows `ASK` and extends the lease on the target; another instance's
///   `try_once` and a release (keys on both nodes: `TRYAGAIN`) are sent again until the
///   slot has settled, then the try finds the key held (nothing granted) and the release
///   frees its lock (not reported lost);
/// - the rest moved (`ASK` to the target, which answers `TRYAGAIN` to a script missing
///   keys there), then `SETSLOT NODE` on every primary: the source ends the waiter's
///   sharded subscription, which is made again on the target; renewals land there; the
///   release there wakes the waiter, whose token is above the first holder's; the source
///   keeps no key of the slot.
pub async fn a_lock_follows_its_slot_through_a_step_by_step_reshard(cluster: &Cluster) {
    let primaries = cluster.primaries();
    let (from, to) = (primaries[0], primaries[2]);
    let waited = key_on(cluster, from, "migrated:");
    let [renewed, released] = same_slot(&waited, ["migrated-renewed:", "migrated-released:"]);
    let channel = format!("{}:released", lock(&waited));
    // Their calls outlast the test's steps: a script refused while the slot is split is
    // sent again until it settles, within the command timeout.
    let holder = patient_backend(cluster).await;
    let waiter = patient_backend(cluster).await;
    let other = patient_backend(cluster).await;

    let held = holder.lock(waited.clone()).try_once().await.expect("free");
    let first = held.fencing_token();
    let short = holder
        .lock(renewed.clone())
        .lease(Duration::from_millis(1500));
    let short = short.try_once().await.expect("free");
    let doomed = holder
        .lock(released.clone())
        .try_once()
        .await
        .expect("free");
    let waiting = tokio::spawn({
        let waited = waited.clone();
        async move { waiter.lock(waited).wait(Duration::from_secs(60)).await }
    });
    eventually("the waiter subscribed on the source", || async {
        cluster.shard_subscribers(from, &channel) == 1
    })
    .await;

    // Half-moved: the lock hashes on the target, the rest on the source.
    let migration = Migration::begin(cluster, &lock(&waited), to);
    let hashes = [lock(&waited), lock(&renewed), lock(&released)];
    migration.migrate(&hashes.iter().map(String::as_str).collect::<Vec<_>>());
    let left = migration.left();
    assert!(
        left.contains(&format!("{}:fence", lock(&waited))),
        "split: {left:?}"
    );
    let moved = pttl_asking(cluster, to, &lock(&renewed)).await;
    eventually("a renewal reached the moved hash through ASK", || async {
        pttl_asking(cluster, to, &lock(&renewed)).await > moved
    })
    .await;
    assert!(!short.is_lost(), "renewed on the target");

    let tryagain = tryagain_count(cluster, from);
    let trying = tokio::spawn(other.lock(waited.clone()).try_once());
    let releasing = tokio::spawn(doomed.release());
    // redis-rs sends a command refused with TRYAGAIN three times in all: more refusals
    // than both calls' first three say they are being sent again.
    eventually(
        "the split lock's calls are refused with TRYAGAIN",
        || async { trying.is_finished() || tryagain_count(cluster, from) >= tryagain + 8 },
    )
    .await;
    assert!(
        !trying.is_finished(),
        "a try on a split lock waits for the slot to settle: {:?}",
        trying.await.expect("task").map(|g| g.fencing_token())
    );

    // Everything on the target; the source redirects with ASK.
    let refused_there = tryagain_count(cluster, to);
    migration.migrate_rest();
    assert!(migration.left().is_empty());
    eventually(
        "ASK followed to the target, which refuses with TRYAGAIN",
        || async { tryagain_count(cluster, to) > refused_there },
    )
    .await;

    // Announced: the waiter's subscription moves with the slot.
    let slot = migration.slot.clone();
    let resubscribed = tokio::spawn(subscribed_at(to, channel.clone()));
    let left_source = tokio::task::block_in_place(|| migration.finish());
    let resubscribed = tokio::time::timeout(Duration::from_secs(10), resubscribed)
        .await
        .expect("the waiter subscribed on the target")
        .expect("task");
    assert_eq!(cluster.shard_subscribers(from, &channel), 0);

    let tried = trying.await.expect("task");
    assert!(
        matches!(tried, Err(LockError::Contended { .. })),
        "held: {:?}",
        tried.map(|g| g.fencing_token())
    );
    releasing
        .await
        .expect("task")
        .expect("freed, not reported lost");
    assert!(
        !cluster.exists_on(to, &lock(&released)),
        "freed on the target"
    );

    let now = pttl(cluster, to, &lock(&renewed));
    eventually("a renewal reached the new owner", || async {
        pttl(cluster, to, &lock(&renewed)) > now
    })
    .await;
    assert!(!short.is_lost());
    let owner = held.held().owner().as_str().to_owned();
    assert_eq!(cluster.hold_count(to, &lock(&waited), &owner), Some(1));

    let releasing = Instant::now();
    held.release().await.expect("released on the new owner");
    let served = tokio::time::timeout(Duration::from_secs(10), waiting)
        .await
        .expect("the waiter is woken by the release on the new owner")
        .expect("task")
        .expect("the waiter gets the lock");
    let served_after = releasing.elapsed();
    assert!(
        served.fencing_token() > first,
        "tokens increase across the move"
    );
    let next = served.held().owner().as_str().to_owned();
    assert_eq!(cluster.hold_count(to, &lock(&waited), &next), Some(1));
    assert_eq!(cluster.hold_count(to, &lock(&waited), &owner), None);
    served.release().await.expect("release");
    short.release().await.expect("release");

    let slot = ["CLUSTER", "COUNTKEYSINSLOT", &slot];
    assert_eq!(
        cluster.run(from, &slot).trim(),
        "0",
        "nothing left on the source"
    );
    assert_ne!(
        cluster.run(to, &slot).trim(),
        "0",
        "the fencing counters moved"
    );
    eprintln!(
        "reshard: the waiter was without a subscription for {:?} (SETSLOT NODE sent to the \
         source -> SSUBSCRIBE confirmed on the target); release on the new owner -> waiter \
         served {:?}",
        resubscribed.saturating_duration_since(left_source.into()),
        served_after
    );
}

/// The lock hash of the user key `key`.
fn lock(key: &str) -> String {
    format!("tower-lock:{{{key}}}")
}

/// User keys, one per prefix, whose locks share the slot of `key`'s.
fn same_slot<const N: usize>(key: &str, prefixes: [&str; N]) -> [String; N] {
    let slot = Slot::for_key(lock(key));
    prefixes.map(|prefix| {
        (0..1_000_000)
            .map(|i| format!("{prefix}{i}"))
            .find(|k| Slot::for_key(lock(k)) == slot)
            .expect("a key in the slot")
    })
}

/// `errorstat_TRYAGAIN` of the node on `port`: the commands it refused with TRYAGAIN.
fn tryagain_count(cluster: &Cluster, port: u16) -> u64 {
    cluster
        .run(port, &["INFO", "errorstats"])
        .lines()
        .find_map(|l| l.strip_prefix("errorstat_TRYAGAIN:count="))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or(0)
}

/// `PTTL` of `key` on the node on `port`, which owns its slot.
fn pttl(cluster: &Cluster, port: u16, key: &str) -> i64 {
    let reply = cluster.run(port, &["PTTL", key]);
    reply.trim().parse().expect("PTTL")
}

/// `PTTL` of `key` on the node on `port` that imports its slot (after `ASKING`).
async fn pttl_asking(cluster: &Cluster, port: u16, key: &str) -> i64 {
    let mut conn = cluster.node_conn(port).await;
    let (pttl,): (i64,) = redis::pipe()
        .cmd("ASKING")
        .ignore()
        .cmd("PTTL")
        .arg(key)
        .query_async(&mut conn)
        .await
        .expect("ASKING PTTL");
    pttl
}

/// When the node on `port` first counts a subscriber of `channel` (asked every
/// millisecond).
async fn subscribed_at(port: u16, channel: String) -> Instant {
    let client = redis::Client::open(format!("redis://127.0.0.1:{port}")).expect("node url");
    let mut conn = client
        .get_multiplexed_async_connection()
        .await
        .expect("connect to the node");
    loop {
        let (_, n): (String, i64) = redis::cmd("PUBSUB")
            .arg("SHARDNUMSUB")
            .arg(&channel)
            .query_async(&mut conn)
            .await
            .expect("PUBSUB SHARDNUMSUB");
        if n > 0 {
            return Instant::now();
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

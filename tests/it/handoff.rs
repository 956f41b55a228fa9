//! Handoffs in memory on a hot key (one hold in Redis, a run of this process's tasks taking
//! turns under it): fencing tokens, re-entry, fairness to other instances, and a lost hold,
//! against a real redis-server per test.

use crate::support;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use support::{RedisServer, eventually, queued};
use tokio::sync::Mutex;
use tokio::task::JoinHandle;
use tower_lock::{LockError, LockGuard, RedisBackend};

const KEY: &str = "stock:7";
const LOCK: &str = "tower-lock:{stock:7}";
const FENCE: &str = "tower-lock:{stock:7}:fence";
const WAIT: Duration = Duration::from_secs(20);

/// A backend whose runs in memory are bounded by their count only (the default time bound
/// would end them early on a loaded machine, and the tests count Redis calls).
async fn backend(server: &RedisServer) -> RedisBackend {
    RedisBackend::builder(server.url())
        .max_local_handoff_time(Duration::from_secs(60))
        .build()
        .await
        .expect("backend")
}

/// A task of `backend` waiting for `KEY`.
fn spawn_waiter(backend: &RedisBackend) -> JoinHandle<Result<LockGuard, LockError>> {
    let backend = backend.clone();
    tokio::spawn(async move { backend.lock(KEY).wait(WAIT).await })
}

#[tokio::test]
async fn a_run_in_memory_keeps_one_hold_in_redis_and_gives_each_holder_its_own_token() {
    crate::needs!(Redis);
    let server = RedisServer::start();
    let backend = backend(&server).await;
    let first = backend.lock(KEY).try_once().await.expect("uncontended");
    let mut waiters = Vec::new();
    for i in 0..5 {
        waiters.push(spawn_waiter(&backend));
        queued(&backend, i + 1).await;
    }
    let scripts_before = server.command_calls(&["evalsha", "eval"]).await;
    first.release().await.unwrap();
    let mut holders = Vec::new();
    for waiter in waiters {
        let guard = waiter.await.unwrap().expect("handed over");
        // Each holder sees its own owner and token, while Redis knows the hold under the
        // owner it handed it to (the first waiter's).
        let redis_owners = redis_owners(&server).await;
        assert_eq!(redis_owners.len(), 1, "one hold in Redis: {redis_owners:?}");
        let fence: u64 = fence_value(&server).await;
        assert!(
            fence >= guard.fencing_token(),
            "the counter ({fence}) covers every token issued ({})",
            guard.fencing_token()
        );
        holders.push((guard.held().owner().clone(), guard.fencing_token()));
        guard.release().await.unwrap();
    }
    // One handoff through Redis, four in memory, one final release.
    assert_eq!(
        server.command_calls(&["evalsha", "eval"]).await - scripts_before,
        2
    );
    let owners: std::collections::HashSet<_> = holders.iter().map(|(o, _)| o.clone()).collect();
    assert_eq!(owners.len(), 5, "an owner per request");
    assert!(holders.windows(2).all(|w| w[0].1 < w[1].1), "{holders:?}");
    // The final release set the counter back to the last token issued.
    assert_eq!(fence_value(&server).await, holders[4].1);
    assert!(!server.exists(LOCK).await);
}

/// The owner fields of the lock hash (fields that are neither `token` nor ids).
async fn redis_owners(server: &RedisServer) -> Vec<String> {
    let fields: Vec<String> = redis::cmd("HKEYS")
        .arg(LOCK)
        .query_async(&mut server.conn().await)
        .await
        .expect("HKEYS");
    fields
        .into_iter()
        .filter(|f| f != "token" && f != "reserved" && !f.contains(['@', '#']))
        .collect()
}

async fn fence_value(server: &RedisServer) -> u64 {
    let value: Option<u64> = redis::cmd("GET")
        .arg(FENCE)
        .query_async(&mut server.conn().await)
        .await
        .expect("GET");
    value.unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_strictly_increase_over_local_and_remote_holders_even_with_the_counter_deleted() {
    crate::needs!(Redis);
    const PER_TASK: usize = 150;
    /// Every this many holds, a holder deletes the fencing counter while it holds.
    const DELETE_EVERY: usize = 5;
    let server = RedisServer::start();
    // Instance A's runs are bounded by their count only, so that the runs this test sets up
    // happen on a loaded machine too.
    let backends = [backend(&server).await, server.backend().await];
    // Tokens in the order the holds happened, and whether each was granted in memory:
    // pushed while holding.
    let log = Arc::new(Mutex::new(Vec::new()));
    // Deletes the counter at any moment, for interleavings the holders' own deletions miss;
    // nothing depends on how often it gets to.
    let stop = Arc::new(AtomicBool::new(false));
    let deleter = {
        let (stop, mut conn) = (stop.clone(), server.conn().await);
        tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                let _: i64 = redis::cmd("DEL")
                    .arg(FENCE)
                    .query_async(&mut conn)
                    .await
                    .expect("DEL");
                tokio::time::sleep(Duration::from_millis(3)).await;
            }
        })
    };
    // Everyone starts behind a hold of instance A, so that when it ends, instance B waits
    // (subscribed) and instance A has a queue to hand the lock over to in memory.
    let first = backends[0].lock(KEY).try_once().await.expect("uncontended");
    let scripts_before = server.command_calls(&["evalsha", "eval"]).await;
    // Four tasks on instance A (runs in memory), two on instance B (remote turns).
    let mut tasks = Vec::new();
    for i in 0..6 {
        let backend = backends[usize::from(i >= 4)].clone();
        let (log, mut conn) = (log.clone(), server.conn().await);
        tasks.push(tokio::spawn(async move {
            for n in 1..=PER_TASK {
                let guard = backend.lock(KEY).wait(WAIT).await.expect("acquired");
                // Redis knows a hold granted in memory under the run's first owner only.
                let owner = guard.held().owner().as_str();
                let in_redis: bool = redis::cmd("HEXISTS")
                    .arg(LOCK)
                    .arg(owner)
                    .query_async(&mut conn)
                    .await
                    .expect("HEXISTS");
                log.lock().await.push((i, guard.fencing_token(), !in_redis));
                if n % DELETE_EVERY == 0 {
                    let _: i64 = redis::cmd("DEL")
                        .arg(FENCE)
                        .query_async(&mut conn)
                        .await
                        .expect("DEL");
                }
                tokio::task::yield_now().await;
                guard.release().await.expect("released");
            }
        }));
    }
    queued(&backends[0], 4).await;
    server.wait_for_subscribers(KEY, 1).await;
    queued(&backends[1], 1).await;
    first.release().await.unwrap();
    for task in tasks {
        task.await.unwrap();
    }
    stop.store(true, Ordering::Relaxed);
    deleter.await.unwrap();
    let scripts = server.command_calls(&["evalsha", "eval"]).await - scripts_before;
    let log = log.lock().await.clone();
    assert_eq!(log.len(), 6 * PER_TASK);
    for pair in log.windows(2) {
        assert!(
            pair[0].1 < pair[1].1,
            "task {} got token {} after task {} had {}",
            pair[1].0,
            pair[1].1,
            pair[0].0,
            pair[0].1
        );
    }
    // The first holder of A got the lock from `first` with three tasks queued behind it,
    // and each of them found the others (and its predecessor, queued again) behind it.
    let in_memory = log.iter().filter(|(_, _, in_memory)| *in_memory).count();
    assert!(in_memory >= 3, "{in_memory} holds were granted in memory");
    // B waited from the start, so A's runs let it in long before A was done.
    let first_remote = log.iter().position(|(i, ..)| *i >= 4);
    let last_local = log.iter().rposition(|(i, ..)| *i < 4);
    assert!(
        first_remote < last_local,
        "the instances took turns: B first held at {first_remote:?}, A last at {last_local:?}"
    );
    // Deleted while the key is free, the counter leaves only the clock to order tokens.
    let mut last = log.last().expect("holds").1;
    for backend in &backends {
        let _: i64 = redis::cmd("DEL")
            .arg(FENCE)
            .query_async(&mut server.conn().await)
            .await
            .expect("DEL");
        let guard = backend.lock(KEY).try_once().await.expect("free");
        assert!(
            guard.fencing_token() > last,
            "{} after {last}",
            guard.fencing_token()
        );
        last = guard.fencing_token();
        guard.release().await.unwrap();
    }
    // A figure, not a claim: how many holds shared a call to Redis depends on scheduling.
    println!(
        "{scripts} scripts for {} acquisitions, {in_memory} granted in memory, the counter \
         deleted under {} of them",
        log.len(),
        log.len() / DELETE_EVERY
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_instance_is_served_within_a_quantum_of_a_local_stream() {
    crate::needs!(Redis);
    const QUANTUM: u32 = 8;
    let server = RedisServer::start();
    // Runs end by their count on any machine that does eight handoffs within seconds (one
    // ended earlier by time only lowers the counts). The time bound is also how long the
    // local stream leaves the key to the remote task after a run: long enough for a remote
    // task slowed by a loaded machine, short enough for a remote task that gave up (its
    // subscription still counted, though it will not take the key). One that took and
    // released the key between two tries of the local contender ends the yield at once
    // (the fencing counter moved: tests/it/yielding.rs).
    let local = RedisBackend::builder(server.url())
        .max_local_handoffs(QUANTUM)
        .max_local_handoff_time(Duration::from_secs(5))
        .build()
        .await
        .expect("backend");
    let remote = server.backend().await;
    let stop = Arc::new(AtomicBool::new(false));
    let local_acquisitions = Arc::new(AtomicU64::new(0));
    let stream: Vec<_> = (0..6)
        .map(|_| {
            let (local, stop, count) = (local.clone(), stop.clone(), local_acquisitions.clone());
            tokio::spawn(async move {
                while !stop.load(Ordering::Relaxed) {
                    let guard = local.lock(KEY).wait(WAIT).await.expect("local acquires");
                    count.fetch_add(1, Ordering::Relaxed);
                    tokio::task::yield_now().await;
                    guard.release().await.expect("local releases");
                }
            })
        })
        .collect();
    eventually("the local stream runs in memory", || async {
        local_acquisitions.load(Ordering::Relaxed) >= 100
    })
    .await;
    let channel = support::channel(KEY);
    let mut worst = 0;
    for _ in 0..20 {
        // The local stream subscribes only while the remote task holds the key: once it is
        // unsubscribed, the one subscriber Redis counts below is the remote task.
        eventually("the local stream is unsubscribed", || async {
            server.numsub(&channel).await == 0
        })
        .await;
        let waiting = {
            let remote = remote.clone();
            tokio::spawn(async move { remote.lock(KEY).wait(WAIT).await })
        };
        // From when Redis knows the remote task waits: a release sees it from then on.
        eventually("the remote task waits", || async {
            server.numsub(&channel).await == 1 || waiting.is_finished()
        })
        .await;
        let before = local_acquisitions.load(Ordering::Relaxed);
        let guard = waiting
            .await
            .unwrap()
            .expect("the other instance gets its turn");
        worst = worst.max(local_acquisitions.load(Ordering::Relaxed) - before);
        guard.release().await.unwrap();
        // Let the local stream take the key again before the next turn.
        let now = local_acquisitions.load(Ordering::Relaxed);
        eventually("the local stream goes on", || async {
            local_acquisitions.load(Ordering::Relaxed) > now
        })
        .await;
    }
    stop.store(true, Ordering::Relaxed);
    for task in stream {
        task.await.unwrap();
    }
    // The run in progress when Redis saw the remote task wait (at most a quantum and the
    // handoff through Redis that started it); then the key is released for real and the
    // remote task goes first.
    assert!(
        worst <= u64::from(QUANTUM + 1),
        "the remote task waited for {worst} local acquisitions (quantum {QUANTUM})"
    );
}

#[tokio::test]
async fn a_holder_that_got_the_lock_in_memory_reenters_and_keeps_the_next_out_until_done() {
    crate::needs!(Redis);
    let server = RedisServer::start();
    let backend = backend(&server).await;
    let (a, b_task) = {
        let first = backend.lock(KEY).try_once().await.expect("uncontended");
        let a = spawn_waiter(&backend);
        queued(&backend, 1).await;
        let b = spawn_waiter(&backend);
        queued(&backend, 2).await;
        first.release().await.unwrap();
        (a.await.unwrap().expect("handed over through Redis"), b)
    };
    let store_owner = a.held().owner().clone();
    a.release().await.unwrap();
    let b = b_task.await.unwrap().expect("handed over in memory");
    assert_eq!(
        server.hold_count(LOCK, store_owner.as_str()).await,
        Some(1),
        "Redis still knows the hold under the run's first owner"
    );
    assert_eq!(
        server.hold_count(LOCK, b.held().owner().as_str()).await,
        None
    );

    // B re-enters, exclusively and shared: no deadlock behind its own hold.
    let nested = tokio::time::timeout(
        Duration::from_secs(5),
        backend.lock(KEY).reentrant(b.held()).wait(WAIT),
    )
    .await
    .expect("a re-entry does not wait for itself")
    .expect("re-entered");
    assert_eq!(nested.fencing_token(), b.fencing_token());
    assert_eq!(nested.held().owner(), b.held().owner());
    assert_eq!(server.hold_count(LOCK, store_owner.as_str()).await, Some(2));
    let shared = tokio::time::timeout(
        Duration::from_secs(5),
        backend.lock(KEY).reentrant(b.held()).shared().wait(WAIT),
    )
    .await
    .expect("a shared hold by the holder does not wait for itself")
    .expect("taken shared");
    shared.release().await.unwrap();

    // C queues; B's outer hold ends first, its re-entry is still held: C must not get the
    // lock in memory (or at all) until the re-entry ends too.
    let c = spawn_waiter(&backend);
    queued(&backend, 1).await;
    let b_token = b.fencing_token();
    b.release().await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !c.is_finished(),
        "C got the lock while B's re-entry was held"
    );
    assert_eq!(server.hold_count(LOCK, store_owner.as_str()).await, Some(1));
    nested.release().await.unwrap();
    let c = c
        .await
        .unwrap()
        .expect("C gets the lock after B's last hold");
    assert!(c.fencing_token() > b_token);
    assert_eq!(
        server.hold_count(LOCK, c.held().owner().as_str()).await,
        Some(1),
        "C took the lock in Redis, under its own owner"
    );
    c.release().await.unwrap();
}

#[tokio::test]
async fn a_lost_hold_ends_the_run_and_the_queue_goes_back_to_redis() {
    crate::needs!(Redis);
    let server = RedisServer::start();
    // Renewed every second, so the loss is seen within one; and its last renewal stays
    // confirmed for over a second, so the hold passes in memory however slow the machine.
    let lease = Duration::from_secs(3);
    let backend = backend(&server).await;
    let first = backend
        .lock(KEY)
        .lease(lease)
        .try_once()
        .await
        .expect("uncontended");
    let waiter = |backend: &RedisBackend| {
        let backend = backend.clone();
        tokio::spawn(async move { backend.lock(KEY).lease(lease).wait(WAIT).await })
    };
    let mut queue = Vec::new();
    for n in 1..=3 {
        queue.push(waiter(&backend));
        queued(&backend, n).await;
    }
    let (next, b) = (queue.pop().unwrap(), queue.pop().unwrap());
    let a = queue.pop().unwrap();
    first.release().await.unwrap();
    let a = a.await.unwrap().expect("A through Redis");
    let store_owner = a.held().owner().clone();
    a.release().await.unwrap();
    // B holds in memory, C waits behind it.
    let holder = b.await.unwrap();
    let holder = holder.expect("held in memory");
    assert_eq!(server.hold_count(LOCK, store_owner.as_str()).await, Some(1));
    // The run's hold vanishes from Redis.
    let _: i64 = redis::cmd("DEL")
        .arg(LOCK)
        .query_async(&mut server.conn().await)
        .await
        .unwrap();
    tokio::time::timeout(WAIT, holder.held().lost())
        .await
        .expect("the holder sees the loss at the next renewal");
    let lost_token = holder.fencing_token();
    // The next task does not run under the lost hold: it takes the key in Redis, under its
    // own owner, with a newer token, even before the lost holder lets go.
    let next = next
        .await
        .unwrap()
        .expect("the next task takes the key in Redis");
    assert!(next.fencing_token() > lost_token);
    assert_eq!(
        server.hold_count(LOCK, next.held().owner().as_str()).await,
        Some(1)
    );
    assert!(matches!(
        holder.release().await,
        Err(LockError::Lost { .. })
    ));
    next.release().await.unwrap();
}

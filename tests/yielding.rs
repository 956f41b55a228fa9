//! The end of a run of handoffs in memory on a hot key: the process that released the key
//! to let other instances go first ("yields") must not leave it idle once that is done,
//! whatever Redis still counts on the key's channel. Against a real redis-server.

mod support;

use std::time::Duration;

use support::{RedisServer, eventually, queued};
use tokio::task::JoinHandle;
use tokio::time::timeout;
use tower_lock::{LockError, LockGuard, RedisBackend};

const KEY: &str = "stock:7";
const LOCK: &str = "tower-lock:{stock:7}";
const WAIT: Duration = Duration::from_secs(20);
/// How long a yield may last: far longer than the hang bound below, so a task still
/// yielding shows as a hang rather than as a delay.
const YIELD: Duration = Duration::from_secs(60);
/// Only to catch that hang.
const HANG: Duration = Duration::from_secs(5);

/// A task of `backend` waiting for `KEY`.
fn spawn_waiter(backend: &RedisBackend) -> JoinHandle<Result<LockGuard, LockError>> {
    let backend = backend.clone();
    tokio::spawn(async move { backend.lock(KEY).wait(WAIT).await })
}

/// The signal that another instance waits can be stale: its subscriber connection is still
/// subscribed to the key's channel after its waiter was served (took the key and gave it
/// back) and before its unsubscription arrives. A task that yielded must take the free key
/// at the next release message once another instance has had it (the fencing counter
/// moved), rather than stay refused until its yield runs out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_yielding_task_takes_the_free_key_once_another_instance_had_it_despite_a_stale_subscriber()
 {
    let server = RedisServer::start();
    // Runs of one handoff: the second holder's release ends the run.
    let local = RedisBackend::builder(server.url())
        .max_local_handoffs(1)
        .max_local_handoff_time(YIELD)
        .build()
        .await
        .expect("backend");
    let remote = server.backend().await;
    // The other instance's subscriber connection, left subscribed with nobody behind it.
    let mut stale = redis::Client::open(server.url())
        .expect("valid url")
        .get_async_pubsub()
        .await
        .expect("pubsub connection");
    stale
        .subscribe(support::channel(KEY))
        .await
        .expect("subscribe");

    let first = local.lock(KEY).try_once().await.expect("uncontended");
    let second = spawn_waiter(&local);
    queued(&local, 1).await;
    let third = spawn_waiter(&local);
    queued(&local, 2).await;
    first.release().await.expect("first releases");
    let second = second.await.unwrap().expect("handed over through Redis");
    let scripts = server.command_calls(&["evalsha", "eval"]).await;
    // The run is spent and Redis counts a subscriber: the key is freed for it, and the
    // third task yields.
    second.release().await.expect("second releases");
    // The release, then the third task's first attempt once its subscription is up (the
    // other instance has not come yet, so that attempt is refused and the key stays free);
    // it tries again only on the next release message.
    eventually("the yielding task tried once", || async {
        server.command_calls(&["evalsha", "eval"]).await >= scripts + 2
    })
    .await;
    assert!(!server.exists(LOCK).await, "the key is left to others");

    // The other instance takes the key and gives it back: its release wakes the third task.
    let other = remote.lock(KEY).try_once().await.expect("the free key");
    let other_token = other.fencing_token();
    other.release().await.expect("other instance releases");

    let third = timeout(HANG, third)
        .await
        .expect("the yielding task takes the free key at the release, not when its yield ends")
        .unwrap()
        .expect("third acquires");
    assert!(
        third.fencing_token() > other_token,
        "tokens increase: {} after {other_token}",
        third.fencing_token()
    );
    third.release().await.expect("third releases");
    drop(stale);
}

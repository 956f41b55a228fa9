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
    let local = RedisBackend::builder(server.url())
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
    // Queued after the first holder's run began: the run does not serve it.
    let second = spawn_waiter(&local);
    queued(&local, 1).await;
    let scripts = server.command_calls(&["evalsha", "eval"]).await;
    // The run is over and Redis counts a subscriber: the key is freed for it, and the
    // second task yields.
    first.release().await.expect("first releases");
    // The release, then the second task's first attempt once its subscription is up (the
    // other instance has not come yet, so that attempt is refused and the key stays free);
    // it tries again only on the next release message.
    eventually("the yielding task tried once", || async {
        server.command_calls(&["evalsha", "eval"]).await >= scripts + 2
    })
    .await;
    assert!(!server.exists(LOCK).await, "the key is left to others");

    // The other instance takes the key and gives it back: its release wakes the second task.
    let other = remote.lock(KEY).try_once().await.expect("the free key");
    let other_token = other.fencing_token();
    other.release().await.expect("other instance releases");

    let second = timeout(HANG, second)
        .await
        .expect("the yielding task takes the free key at the release, not when its yield ends")
        .unwrap()
        .expect("second acquires");
    assert!(
        second.fencing_token() > other_token,
        "tokens increase: {} after {other_token}",
        second.fencing_token()
    );
    second.release().await.expect("second releases");
    drop(stale);
}

/// A run of handoffs in memory serves the tasks that were queued when it began, each once:
/// a task that queues during the run waits for the next run, behind another instance that
/// began waiting meanwhile, instead of being served in memory ahead of it (no task waits
/// for more than one turn of every other task).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_serves_the_tasks_queued_when_it_began_and_a_later_one_waits_behind_other_instances()
{
    let server = RedisServer::start();
    let local = RedisBackend::builder(server.url())
        .max_local_handoff_time(YIELD)
        .build()
        .await
        .expect("backend");
    let remote = server.backend().await;
    let held = remote.lock(KEY).try_once().await.expect("uncontended");
    // Three tasks of the local instance wait: the first in Redis, the two others in line.
    let t1 = spawn_waiter(&local);
    server.wait_for_subscribers(KEY, 1).await;
    // One at a time: tasks spawned together may queue in either order.
    let t2 = spawn_waiter(&local);
    queued(&local, 1).await;
    let t3 = spawn_waiter(&local);
    queued(&local, 2).await;
    held.release().await.expect("remote releases");
    // The run begins with the first task's hold.
    let t1 = t1.await.unwrap().expect("first local task");
    let t4 = spawn_waiter(&local);
    queued(&local, 3).await;
    // The local instance's subscription went with its waiter.
    server.wait_for_subscribers(KEY, 0).await;
    // Another instance waits now, before the run is over.
    let other = {
        let remote = remote.clone();
        tokio::spawn(async move { remote.lock(KEY).wait(WAIT).await })
    };
    server.wait_for_subscribers(KEY, 1).await;

    let first = t1.fencing_token();
    t1.release().await.expect("t1 releases");
    let t2 = timeout(HANG, t2)
        .await
        .expect("t2 served")
        .unwrap()
        .expect("t2");
    let second = t2.fencing_token();
    t2.release().await.expect("t2 releases");
    let t3 = timeout(HANG, t3)
        .await
        .expect("t3 served")
        .unwrap()
        .expect("t3");
    assert_eq!(
        (second, t3.fencing_token()),
        (first + 1, first + 2),
        "the tasks queued before the run are served in it, in memory"
    );
    let third = t3.fencing_token();
    t3.release().await.expect("t3 releases");
    let other = timeout(HANG, other)
        .await
        .expect("the other instance is served when the run is over")
        .unwrap()
        .expect("other");
    assert!(
        other.fencing_token() > third,
        "the other instance takes the key after the run"
    );
    assert!(
        !t4.is_finished(),
        "the task that queued during the run waits behind the other instance"
    );
    let other_token = other.fencing_token();
    other.release().await.expect("other releases");
    let t4 = timeout(HANG, t4)
        .await
        .expect("t4 served")
        .unwrap()
        .expect("t4");
    assert!(
        t4.fencing_token() > other_token,
        "t4 comes after the other instance"
    );
    t4.release().await.expect("t4 releases");
}

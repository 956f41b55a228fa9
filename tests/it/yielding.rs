//! The end of a run of handoffs in memory on a hot key: the instances that wait go first,
//! in line, and the key is never left idle for a waiter that is not there, whatever Redis
//! still counts on the key's channel. Against a real redis-server.

use crate::support;

use std::time::Duration;

use support::{RedisServer, queued};
use tokio::task::JoinHandle;
use tokio::time::timeout;
use tower_lock::{LockError, LockGuard, RedisBackend};

const KEY: &str = "stock:7";
const WAIT: Duration = Duration::from_secs(20);
/// The time bound of a run (and of a yield): far longer than the hang bound below, so a
/// task that waits for either to run out shows as a hang rather than as a delay.
const YIELD: Duration = Duration::from_secs(60);
/// Only to catch that hang.
const HANG: Duration = Duration::from_secs(5);

/// A task of `backend` waiting for `KEY`.
fn spawn_waiter(backend: &RedisBackend) -> JoinHandle<Result<LockGuard, LockError>> {
    let backend = backend.clone();
    tokio::spawn(async move { backend.lock(KEY).wait(WAIT).await })
}

/// The sign that another instance waits is its place in the key's line, not a
/// subscription: a subscriber connection can still be subscribed to the key's channel after
/// its waiter was served (or with nobody behind it). A run that is over hands the key to
/// the next task of its process when nobody is in line, rather than free it for a stale
/// subscriber and leave it idle.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_that_is_over_goes_on_despite_a_stale_subscriber_when_nobody_is_in_line() {
    crate::needs!(Redis);
    let server = RedisServer::start();
    let local = RedisBackend::builder(server.url())
        .max_local_handoff_time(YIELD)
        .build()
        .await
        .expect("backend");
    // Another instance's subscriber connection, left subscribed with nobody behind it.
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
    // Queued after the first holder's run began: the run does not serve it in memory.
    let second = spawn_waiter(&local);
    queued(&local, 1).await;
    let first_token = first.fencing_token();
    let published = server.command_calls(&["publish"]).await;
    first.release().await.expect("first releases");
    let second = timeout(HANG, second)
        .await
        .expect("the next task takes the key at the release, not when a yield ends")
        .unwrap()
        .expect("second acquires");
    assert!(
        second.fencing_token() > first_token,
        "tokens increase: {} after {first_token}",
        second.fencing_token()
    );
    assert_eq!(
        server.command_calls(&["publish"]).await,
        published,
        "handed over in Redis, never freed"
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
    crate::needs!(Redis);
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

    let first = released(t1, "t1").await;
    let (second, third) = (
        released(served(t2, "t2").await, "t2").await,
        released(served(t3, "t3").await, "t3").await,
    );
    assert_eq!(
        (second, third),
        (first + 1, first + 2),
        "the tasks queued before the run are served in it, in memory"
    );
    let other = served(other, "the other instance, when the run is over").await;
    assert!(
        other.fencing_token() > third,
        "the other instance takes the key after the run"
    );
    assert!(
        !t4.is_finished(),
        "the task that queued during the run waits behind the other instance"
    );
    let other = released(other, "other").await;
    let fourth = released(served(t4, "t4").await, "t4").await;
    assert!(fourth > other, "t4 comes after the other instance");
}

/// The hold `task` waits for (the bound catches a hang only).
async fn served(task: JoinHandle<Result<LockGuard, LockError>>, who: &str) -> LockGuard {
    timeout(HANG, task)
        .await
        .unwrap_or_else(|_| panic!("{who} is served"))
        .expect("no panic")
        .unwrap_or_else(|e| panic!("{who}: {e}"))
}

/// Gives `guard` back; returns its fencing token.
async fn released(guard: LockGuard, who: &str) -> u64 {
    let token = guard.fencing_token();
    guard
        .release()
        .await
        .unwrap_or_else(|e| panic!("{who} releases: {e}"));
    token
}

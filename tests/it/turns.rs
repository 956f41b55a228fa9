//! The line of waiting instances: a free key goes to the instances in the order they began
//! waiting for it, and an instance that died while waiting loses its turn. Against a real
//! redis-server per test; the dead instance is a child process killed with SIGKILL.

use crate::support;

use std::time::Duration;

use support::RedisServer;
use support::child::{self, ChildProcess};
use tokio::task::JoinHandle;
use tokio::time::timeout;
use tower_lock::{LockError, LockGuard, RedisBackend};

const KEY: &str = "stock:7";
const WAIT: Duration = Duration::from_secs(20);
/// Only to catch a hang.
const HANG: Duration = Duration::from_secs(10);
/// Passed to the child process.
const URL: &str = "TOWER_LOCK_TEST_REDIS_URL";

/// A task of `backend` waiting for `KEY`.
fn spawn_waiter(backend: &RedisBackend) -> JoinHandle<Result<LockGuard, LockError>> {
    let backend = backend.clone();
    tokio::spawn(async move { backend.lock(KEY).wait(WAIT).await })
}

/// The holders in the key's line, head first.
async fn line(server: &RedisServer) -> Vec<String> {
    server.line(KEY).await
}

async fn served(waiter: JoinHandle<Result<LockGuard, LockError>>) -> LockGuard {
    timeout(HANG, waiter)
        .await
        .expect("served")
        .unwrap()
        .expect("acquires")
}

#[tokio::test]
async fn waiting_instances_take_a_free_key_in_the_order_they_began_waiting() {
    crate::needs!(Redis);
    let server = RedisServer::start();
    let holder = server.backend().await;
    let mut instances = Vec::new();
    for _ in 0..4 {
        instances.push(server.backend().await);
    }
    // The line of the key the shared body uses.
    let in_line = |key: &'static str| {
        let server = &server;
        async move {
            let line: Vec<String> = redis::cmd("ZRANGE")
                .arg(format!("tower-lock:{{{key}}}:line"))
                .arg(0)
                .arg(-1)
                .query_async(&mut server.conn().await)
                .await
                .expect("ZRANGE");
            line.len()
        }
    };
    support::turns::instances_take_the_lock_in_the_order_they_began_waiting(
        holder, instances, in_line,
    )
    .await;
}

#[tokio::test]
#[ignore = "entry point of the child process that the tests spawn"]
async fn child_process() {
    if child::role().as_deref() == Some("waiter") {
        let backend = support::backend(&child::setting(URL)).await;
        child::report("waiting");
        let _ = backend.lock(KEY).wait(WAIT).await;
        std::future::pending::<()>().await;
    }
}

#[tokio::test]
async fn an_instance_killed_at_the_head_of_the_line_loses_its_turn_and_the_next_one_takes_the_key()
{
    crate::needs!(Redis);
    let server = RedisServer::start();
    let holder = server.backend().await;
    let next = server.backend().await;
    let held = holder.lock(KEY).try_once().await.expect("uncontended");
    let mut dead = ChildProcess::spawn("turns::child_process", "waiter", &[(URL, server.url())]);
    assert_eq!(dead.next_report().await.as_deref(), Some("waiting"));
    server.wait_for_subscribers(KEY, 1).await;
    let waiter = spawn_waiter(&next);
    server.wait_for_subscribers(KEY, 2).await;
    let lined = line(&server).await;
    assert_eq!(lined.len(), 2, "two instances in line: {lined:?}");
    // The child is the head of the line when it dies.
    dead.kill().await;
    server.wait_for_subscribers(KEY, 1).await;
    assert_eq!(
        line(&server).await,
        lined,
        "a dead instance keeps its place"
    );

    let last = held.fencing_token();
    held.release().await.expect("holder releases");
    // Its turn runs out with the grace after the release: the next instance is woken by
    // nothing else, and takes the key.
    let guard = served(waiter).await;
    assert!(
        guard.fencing_token() > last,
        "tokens increase: {} after {last}",
        guard.fencing_token()
    );
    assert!(
        line(&server).await.is_empty(),
        "the dead instance dropped out"
    );
    guard.release().await.expect("releases");
}

#[tokio::test]
async fn a_waiter_that_gives_up_at_the_head_of_the_line_lets_the_next_one_in() {
    crate::needs!(Redis);
    let server = RedisServer::start();
    let holder = server.backend().await;
    let (first, second) = (server.backend().await, server.backend().await);
    let held = holder.lock(KEY).try_once().await.expect("uncontended");
    let head = spawn_waiter(&first);
    server.wait_for_subscribers(KEY, 1).await;
    let waiter = spawn_waiter(&second);
    server.wait_for_subscribers(KEY, 2).await;
    // The head stops waiting (cancelled) and leaves the line.
    head.abort();
    assert!(head.await.unwrap_err().is_cancelled());
    support::eventually("the head left the line", || async {
        line(&server).await.len() == 1
    })
    .await;
    let last = held.fencing_token();
    held.release().await.expect("holder releases");
    let guard = served(waiter).await;
    assert!(guard.fencing_token() > last, "tokens increase");
    guard.release().await.expect("releases");
}

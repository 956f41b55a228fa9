//! The in-process queue per key and the local handoff, against a real redis-server.

use crate::support;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::Router;
use axum::extract::Request;
use axum::routing::post;
use futures_util::StreamExt;
use support::{RedisServer, eventually, http_client, post as post_to, queued, serve};
use tokio::sync::{Mutex, Notify};
use tokio::task::JoinHandle;
use tower_lock::{LockError, LockGuard, LockLayer, RedisBackend};

const KEY: &str = "order:42";
const LOCK: &str = "tower-lock:{order:42}";
const WAIT: Duration = Duration::from_secs(10);

/// A fresh server and backend, with `KEY` held by the backend.
async fn holding_key() -> (RedisServer, RedisBackend, LockGuard) {
    let server = RedisServer::start();
    let backend = server.backend().await;
    let holder = backend.lock(KEY).try_once().await.expect("uncontended");
    (server, backend, holder)
}

/// A task of `backend` waiting for `KEY`.
fn spawn_waiter(backend: &RedisBackend) -> JoinHandle<Result<LockGuard, LockError>> {
    let backend = backend.clone();
    tokio::spawn(async move { backend.lock(KEY).wait(WAIT).await })
}

#[tokio::test]
async fn local_waiters_get_the_lock_in_fifo_order_by_handoff_in_memory() {
    crate::needs!(Redis);
    let server = RedisServer::start();
    // Runs bounded by their count only: the default time bound could end one early on a
    // loaded machine, and the test counts Redis calls.
    let backend = RedisBackend::builder(server.url())
        .max_local_handoff_time(Duration::from_secs(60))
        .build()
        .await
        .expect("backend");
    let holder = backend.lock(KEY).try_once().await.expect("uncontended");
    let order = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for i in 0..10 {
        let (task_backend, order) = (backend.clone(), order.clone());
        tasks.push(tokio::spawn(async move {
            let guard = task_backend.lock(KEY).wait(WAIT).await.expect("acquired");
            order.lock().await.push((i, guard.fencing_token()));
            guard.release().await.expect("released");
        }));
        queued(&backend, i + 1).await;
    }
    let calls_before = server.command_calls(&["evalsha", "eval"]).await;
    let published_before = server.command_calls(&["publish"]).await;
    assert_eq!(
        server.numsub(&format!("{LOCK}:released")).await,
        0,
        "queued tasks do not subscribe: only the holder talks to Redis"
    );

    let first_token = holder.fencing_token();
    holder.release().await.unwrap();
    for task in tasks {
        task.await.unwrap();
    }
    let order = order.lock().await.clone();
    assert_eq!(
        order.iter().map(|(i, _)| *i).collect::<Vec<_>>(),
        (0..10).collect::<Vec<_>>()
    );
    let mut last = first_token;
    for (i, token) in order {
        assert!(token > last, "task {i}: token {token} after {last}");
        last = token;
    }
    // Eleven releases, ten of them handoffs, and two scripts: the holder took the key
    // with nobody queued, so its release hands over through Redis (reserving tokens for
    // the run); the nine handoffs after it happen in memory; the last task frees the key.
    // No waiter ran an acquire script.
    assert_eq!(
        server.command_calls(&["evalsha", "eval"]).await - calls_before,
        2
    );
    assert_eq!(
        server.command_calls(&["publish"]).await - published_before,
        1
    );
    assert_eq!(backend.stats().local_queues, 0);
}

#[tokio::test]
async fn a_waiter_past_the_bound_is_shed_with_queue_full() {
    crate::needs!(Redis);
    let (server, backend, holder) = holding_key().await;
    let mut tasks = Vec::new();
    for _ in 0..3 {
        let backend = backend.clone();
        tasks.push(tokio::spawn(async move {
            let guard = backend.lock(KEY).max_local_waiters(3).wait(WAIT).await?;
            guard.release().await
        }));
    }
    queued(&backend, 3).await;
    let calls_before = server.command_calls(&["evalsha", "eval"]).await;
    let shed = backend.lock(KEY).max_local_waiters(3).wait(WAIT).await;
    assert!(
        matches!(&shed, Err(LockError::QueueFull { key }) if key == KEY),
        "{shed:?}"
    );
    assert_eq!(
        server.command_calls(&["evalsha", "eval"]).await,
        calls_before,
        "shed before Redis"
    );
    holder.release().await.unwrap();
    for task in tasks {
        task.await.unwrap().expect("the queued tasks are served");
    }
}

#[tokio::test]
async fn the_layer_answers_503_past_its_local_queue_bound() {
    crate::needs!(Redis);
    let server = RedisServer::start();
    let backend = server.backend().await;
    let gate = Arc::new(Notify::new());
    let handler_gate = gate.clone();
    let app = Router::new()
        .route(
            "/pay",
            post(move || {
                let gate = handler_gate.clone();
                async move {
                    gate.notified().await;
                    "paid"
                }
            }),
        )
        .route_layer(LockLayer::new(backend.clone(), |_: &Request| Some(KEY)).max_local_waiters(1));
    let addr = serve(app).await;
    let client = http_client();
    let first = tokio::spawn(post_to_owned(client.clone(), addr));
    eventually("the first request holds the lock", || async {
        backend.stats().watched_locks == 1
    })
    .await;
    let second = tokio::spawn(post_to_owned(client.clone(), addr));
    queued(&backend, 1).await;

    let shed = post_to(&client, addr, "/pay").await;
    assert_eq!(shed.status, 503);
    assert_eq!(shed.headers["retry-after"], "1");
    assert!(shed.body.contains("QueueFull"), "{}", shed.body);

    gate.notify_one();
    assert_eq!(first.await.unwrap(), 200);
    gate.notify_one();
    assert_eq!(second.await.unwrap(), 200);
}

async fn post_to_owned(client: support::HttpClient, addr: std::net::SocketAddr) -> u16 {
    post_to(&client, addr, "/pay").await.status
}

#[tokio::test]
async fn the_registry_is_empty_after_100k_distinct_keys() {
    crate::needs!(Redis);
    let server = RedisServer::start();
    // 100k keys keep Redis busy: a generous command timeout keeps a loaded machine from
    // failing an acquisition, which is not what this test is about.
    let backend = RedisBackend::builder(server.url())
        .command_timeout(Duration::from_secs(10))
        .build()
        .await
        .unwrap();
    futures_util::stream::iter(0..100_000u32)
        .for_each_concurrent(64, |i| {
            let backend = backend.clone();
            async move {
                let key = format!("item:{i}");
                // Every 16th key also has a second local contender, so that its queue is
                // used, not only created and removed.
                let contenders = if i % 16 == 0 { 2 } else { 1 };
                futures_util::future::join_all((0..contenders).map(|_| async {
                    let guard = backend.lock(key.as_str()).wait(WAIT).await.unwrap();
                    guard.release().await.unwrap();
                }))
                .await;
            }
        })
        .await;
    let stats = backend.stats();
    assert_eq!(stats.local_queues, 0);
    assert_eq!(stats.local_waiters, 0);
    assert_eq!(stats.channels_with_waiters, 0);
    assert_eq!(stats.watched_locks, 0);
    // Only the fencing counters remain in Redis: every lock was freed.
    let size: u64 = redis::cmd("DBSIZE")
        .query_async(&mut server.conn().await)
        .await
        .unwrap();
    assert_eq!(size, 100_000);
}

#[tokio::test]
async fn a_cancelled_waiter_passes_its_turn_on() {
    crate::needs!(Redis);
    let (server, backend, holder) = holding_key().await;
    let doomed = spawn_waiter(&backend);
    queued(&backend, 1).await;
    let next = spawn_waiter(&backend);
    queued(&backend, 2).await;
    doomed.abort();
    queued(&backend, 1).await;
    holder.release().await.unwrap();
    let guard = next
        .await
        .unwrap()
        .expect("the second waiter gets the lock");
    assert_eq!(
        server.hold_count(LOCK, guard.held().owner().as_str()).await,
        Some(1)
    );
    guard.release().await.unwrap();
    assert!(!server.exists(LOCK).await);
    assert_eq!(backend.stats().local_queues, 0);
}

#[tokio::test]
async fn reentry_bypasses_the_local_queue() {
    crate::needs!(Redis);
    let (_server, backend, outer) = holding_key().await;
    let waiter = spawn_waiter(&backend);
    queued(&backend, 1).await;
    let inner = backend
        .lock(KEY)
        .reentrant(outer.held())
        .wait(WAIT)
        .await
        .expect("re-entry does not queue behind itself");
    assert_eq!(inner.fencing_token(), outer.fencing_token());
    inner.release().await.unwrap();
    assert_eq!(
        backend.stats().local_waiters,
        1,
        "still held by the outer hold"
    );
    let outer_token = outer.fencing_token();
    outer.release().await.unwrap();
    let guard = waiter
        .await
        .unwrap()
        .expect("handed over after the outer release");
    assert!(guard.fencing_token() > outer_token);
}

#[tokio::test]
async fn a_handed_over_lock_keeps_being_renewed() {
    crate::needs!(Redis);
    let (server, backend, holder) = holding_key().await;
    // Renewed every third of it: a second of room for a renewal delayed on a loaded machine.
    let lease = Duration::from_millis(1500);
    let waiter = {
        let backend = backend.clone();
        tokio::spawn(async move { backend.lock(KEY).lease(lease).wait(WAIT).await })
    };
    queued(&backend, 1).await;
    holder.release().await.unwrap();
    let guard = waiter.await.unwrap().expect("handed over");
    tokio::time::sleep(lease * 3).await;
    assert!(!guard.is_lost());
    assert_eq!(
        server.hold_count(LOCK, guard.held().owner().as_str()).await,
        Some(1),
        "still held three leases after the handoff"
    );
    guard.release().await.unwrap();
    assert!(!server.exists(LOCK).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn timeouts_and_cancellations_in_the_queue_lose_no_turn_and_leave_no_trace() {
    crate::needs!(Redis);
    let server = RedisServer::start();
    let backend = server.backend().await;
    let counter = Arc::new(AtomicU64::new(0));
    let acquired = Arc::new(AtomicU64::new(0));
    let tasks: Vec<_> = (0..40u64)
        .map(|t| {
            let (backend, counter, acquired) = (backend.clone(), counter.clone(), acquired.clone());
            tokio::spawn(async move {
                for i in 0..25u64 {
                    let mut cut = Duration::from_millis(1 + (t * 7 + i * 3) % 15);
                    let mut wait = Duration::from_millis(5 + i % 20);
                    // Each task's last attempt waits as long as it takes, among the others:
                    // at least one acquisition per task, however slow the machine.
                    if i == 24 {
                        (cut, wait) = (2 * WAIT, WAIT);
                    }
                    let attempt = backend.lock(KEY).wait(wait);
                    // Some waits time out inside the lock, others are cancelled from
                    // outside at an arbitrary point: queued, granted, or holding.
                    let Ok(Ok(guard)) = tokio::time::timeout(cut, attempt).await else {
                        assert!(i < 24, "task {t}: the last attempt waits until it acquires");
                        continue;
                    };
                    let read = counter.load(Ordering::SeqCst);
                    tokio::task::yield_now().await;
                    counter.store(read + 1, Ordering::SeqCst);
                    acquired.fetch_add(1, Ordering::SeqCst);
                    if i % 2 == 0 {
                        guard.release().await.expect("released");
                    } else {
                        drop(guard);
                    }
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap();
    }
    assert!(acquired.load(Ordering::SeqCst) >= 40);
    assert_eq!(
        counter.load(Ordering::SeqCst),
        acquired.load(Ordering::SeqCst),
        "no update lost"
    );
    eventually("the queue and the lock are gone", || async {
        let stats = backend.stats();
        stats.local_queues == 0 && stats.watched_locks == 0 && !server.exists(LOCK).await
    })
    .await;
    let guard = backend.lock(KEY).try_once().await.expect("the key is free");
    guard.release().await.unwrap();
}

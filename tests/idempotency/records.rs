//! Where records live and how long: beside the lock in Redis with their retention, the
//! memory store's expiry, the record script's check, what a replay costs.

use std::time::Duration;

use super::support::{RedisServer, eventually, lock_key};
use super::{Payments, app, pay_with, scoped};
use tower_lock::{IdempotencyLayer, MemoryBackend};

async fn pttl(server: &RedisServer, key: &str) -> i64 {
    redis::cmd("PTTL")
        .arg(key)
        .query_async(&mut server.conn().await)
        .await
        .expect("PTTL")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_record_sits_beside_the_lock_with_its_retention_and_nothing_else_stays() {
    let server = RedisServer::start();
    let payments = Payments::default();
    let retention = Duration::from_secs(600);
    let app = app(
        IdempotencyLayer::new(server.backend().await).retention(retention),
        &payments,
    );
    assert_eq!(pay_with(&app, "k1", "{}").await.status, 201);
    let lock = lock_key(&scoped("acme", "k1"));
    let record = format!("{lock}:record");
    // The record, and the fencing counter every lock leaves (with its own expiry); the
    // lock itself is gone.
    assert_eq!(
        server.keys().await,
        [format!("{lock}:fence"), record.clone()]
    );
    let left = pttl(&server, &record).await;
    assert!(
        left > 0 && left <= 600_000,
        "the record expires within its retention: PTTL {left}"
    );
    assert!(pttl(&server, &format!("{lock}:fence")).await > 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_redis_record_is_gone_and_the_key_runs_again() {
    let server = RedisServer::start();
    let payments = Payments::default();
    let app = app(
        IdempotencyLayer::new(server.backend().await).retention(Duration::from_millis(1)),
        &payments,
    );
    assert_eq!(pay_with(&app, "k1", "{}").await.status, 201);
    let record = format!("{}:record", lock_key(&scoped("acme", "k1")));
    server.wait_until_gone(&record).await;
    assert_eq!(pay_with(&app, "k1", "{}").await.body, "charged 2 for {}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_records_expire_after_their_retention_and_nothing_else_stays() {
    let backend = MemoryBackend::new();
    let payments = Payments::default();
    let app = app(
        IdempotencyLayer::new(backend.clone()).retention(Duration::from_millis(1)),
        &payments,
    );
    assert_eq!(pay_with(&app, "k1", "{}").await.status, 201);
    assert_eq!(backend.held(), 0, "the lock is released");
    eventually("the record expires", || async {
        backend.idempotency_records() == 0
    })
    .await;
    assert_eq!(pay_with(&app, "k1", "{}").await.body, "charged 2 for {}");
}

#[tokio::test]
async fn the_redis_record_script_stores_only_under_the_hold_that_ran_the_handler() {
    let server = RedisServer::start();
    let mut conn = server.conn().await;
    let script = redis::Script::new(include_str!(
        "../../src/redis/scripts/writes/record_store.lua"
    ));
    let mut store = async |token: u64| -> i64 {
        script
            .key("lock")
            .key("record")
            .arg(token)
            .arg(60_000)
            .arg("r")
            .invoke_async(&mut conn)
            .await
            .expect("record_store.lua")
    };
    assert_eq!(store(5).await, 0, "no lock: nothing stored");
    let () = redis::cmd("HSET")
        .arg(&["lock", "owner", "1", "token", "6"])
        .query_async(&mut server.conn().await)
        .await
        .expect("HSET");
    assert_eq!(store(5).await, 0, "a later holder (token 6) has the key");
    assert!(!server.exists("record").await);
    // The hold itself, and a task it was passed to in memory (a token above the hash's).
    assert_eq!(store(6).await, 1);
    assert_eq!(store(7).await, 1);
    let left = pttl(&server, "record").await;
    assert!(left > 0 && left <= 60_000, "PTTL {left}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_costs_one_get_and_never_touches_the_lock() {
    let server = RedisServer::start();
    let payments = Payments::default();
    let app = app(IdempotencyLayer::new(server.backend().await), &payments);
    let calls = async || {
        let reads = server.command_calls(&["get"]).await;
        let scripts = server.command_calls(&["evalsha", "eval"]).await;
        (reads, scripts)
    };
    // Warmed up: the record script loaded (EVALSHA, NOSCRIPT, EVAL the first time).
    assert_eq!(pay_with(&app, "k0", "{}").await.status, 201);
    let before = calls().await;
    assert_eq!(pay_with(&app, "k1", "{}").await.status, 201);
    let first = calls().await;
    assert_eq!(pay_with(&app, "k1", "{}").await.body, "charged 2 for {}");
    let replay = calls().await;
    println!(
        "first request: {} GET, {} scripts; replay: {} GET, {} scripts",
        first.0 - before.0,
        first.1 - before.1,
        replay.0 - first.0,
        replay.1 - first.1
    );
    // Take, store, release. (Its GETs are the two reads of the record, before and after
    // taking the lock, and those the lock's scripts make: Redis counts those too.)
    assert_eq!(first.1 - before.1, 3);
    assert_eq!((replay.0 - first.0, replay.1 - first.1), (1, 0));
}

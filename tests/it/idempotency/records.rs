//! Where records live and how long: beside the lock in Redis with their retention, the
//! memory store's expiry, the record script's check, what a first request and a replay
//! cost, and a record that appears while a request waits for the lock.

use std::time::Duration;

use super::support::monitor::commands_sent;
use super::support::{RedisServer, eventually, lock_key};
use super::{Payments, app, first_inside, pay_with, scoped};
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
    crate::needs!(Redis);
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
    crate::needs!(Redis);
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
    crate::needs!(Redis);
    let server = RedisServer::start();
    let mut conn = server.conn().await;
    let script = redis::Script::new(include_str!(
        "../../../src/redis/scripts/writes/record_store.lua"
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
async fn a_first_request_costs_a_get_and_one_script_before_its_handler_and_a_replay_one_get() {
    crate::needs!(Redis);
    let server = RedisServer::start();
    let payments = Payments::default();
    let app = app(IdempotencyLayer::new(server.backend().await), &payments);
    // Warmed up: the scripts loaded (EVALSHA, NOSCRIPT, EVAL the first time).
    assert_eq!(pay_with(&app, "k0", "{}").await.status, 201);
    let lock = lock_key(&scoped("acme", "k1"));
    let (first, sent) = commands_sent(&server.url(), &lock, pay_with(&app, "k1", "{}")).await;
    assert_eq!(first.status, 201);
    let (replay, replay_sent) =
        commands_sent(&server.url(), &lock, pay_with(&app, "k1", "{}")).await;
    assert_eq!(replay.body, "charged 2 for {}");
    let names = |sent: &[Vec<String>]| -> Vec<String> {
        sent.iter().map(|c| c[0].to_lowercase()).collect()
    };
    println!(
        "first request: {} round trips ({:?}), {} before its handler; replay: {:?}",
        sent.len(),
        names(&sent),
        sent.len() - 2,
        names(&replay_sent)
    );
    // The record read, then one script that checks it and takes the lock (its record key
    // is its sixth key); then the record stored and the lock released.
    assert_eq!(names(&sent), ["get", "evalsha", "evalsha", "evalsha"]);
    assert_eq!(
        sent[1].get(2).map(String::as_str),
        Some("6"),
        "{:?}",
        sent[1]
    );
    assert_eq!(sent[1].get(8), Some(&format!("{lock}:record")));
    assert_eq!(
        names(&replay_sent),
        ["get"],
        "a replay never touches the lock"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_stored_while_a_request_waits_for_the_lock_is_replayed_not_run_again() {
    crate::needs!(Redis);
    let server = RedisServer::start();
    let payments = Payments::default();
    let (backend, other) = (server.backend().await, server.backend().await);
    let wait = Duration::from_secs(20);
    let app = app(
        IdempotencyLayer::new(backend.clone()).wait_for_first(wait),
        &payments,
    );
    // A record for k1's request: k0's, of the same tenant, path and body.
    assert_eq!(pay_with(&app, "k0", "{}").await.status, 201);
    let held = other
        .lock(scoped("acme", "k1"))
        .wait(wait)
        .await
        .expect("k1 held by another instance");
    let request = tokio::spawn({
        let app = app.clone();
        async move { pay_with(&app, "k1", "{}").await }
    });
    // Past its lookup (which found nothing) and its first attempt: it waits for a release.
    eventually("the request waits for the lock", || async {
        backend.stats().channels_with_waiters == 1
    })
    .await;
    // The record appears between its lookup and the attempt that finds the lock free.
    let mut conn = server.conn().await;
    let record: Vec<u8> = redis::cmd("GET")
        .arg(format!("{}:record", lock_key(&scoped("acme", "k0"))))
        .query_async(&mut conn)
        .await
        .expect("k0's record");
    let () = redis::cmd("SET")
        .arg(format!("{}:record", lock_key(&scoped("acme", "k1"))))
        .arg(record)
        .query_async(&mut conn)
        .await
        .expect("k1's record");
    held.release().await.expect("released");
    let reply = tokio::time::timeout(wait, request)
        .await
        .expect("answered")
        .expect("request");
    assert_eq!(reply.body, "charged 1 for {}");
    assert_eq!(reply.headers["idempotency-replayed"], "true");
    assert_eq!(payments.runs(), 1, "the handler ran for k0 only");
    assert!(
        server.keys().await.iter().all(|k| !k.contains(":line")),
        "the request left the line of waiting holders: {:?}",
        server.keys().await
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_handed_the_hold_in_the_same_instance_reads_the_record_and_replays() {
    crate::needs!(Redis);
    let server = RedisServer::start();
    let payments = Payments::gated();
    let gate = payments.gate.clone().expect("gated");
    let backend = server.backend().await;
    let app = app(
        IdempotencyLayer::new(backend.clone()).wait_for_first(Duration::from_secs(20)),
        &payments,
    );
    let first = first_inside(&app, &gate).await;
    let duplicate = tokio::spawn({
        let app = app.clone();
        async move { pay_with(&app, "k1", "{}").await }
    });
    // Queued in this process behind the first: its hold comes from the first's release
    // (in memory, or by the release script), not from an attempt that checked the record.
    eventually("the duplicate queues behind the first", || async {
        backend.stats().local_waiters == 1
    })
    .await;
    gate.open();
    assert_eq!(first.await.expect("first").status, 201);
    let reply = duplicate.await.expect("duplicate");
    assert_eq!(reply.body, "charged 1 for {}");
    assert_eq!(reply.headers["idempotency-replayed"], "true");
    assert_eq!(payments.runs(), 1);
}

//! Multi-key locks: `lock_many` and a layer whose key closure returns several keys. All or
//! none, in canonical order (no deadlock however the keys are ordered), one token per key.

use crate::support;

use std::time::Duration;

use axum::Router;
use axum::extract::{Path, Request, State};
use axum::http::StatusCode;
use axum::routing::post;
use redis::AsyncCommands;
use redis::aio::MultiplexedConnection;
use support::{RedisServer, http_client, lock_key, post as post_to, serve};
use tower_lock::lock::MAX_KEYS;
use tower_lock::{
    HeldLock, KeyError, LockBackend, LockError, LockLayer, MemoryBackend, PathParams,
};

const OPENING: i64 = 100;

fn account(i: usize) -> String {
    format!("test:balance:{i}")
}

/// Moves `amount` from one account to another: reads both balances, yields (other requests
/// run meanwhile), then writes both. Without both locks, transfers lose money or overdraw.
async fn transfer(
    State(mut redis): State<MultiplexedConnection>,
    Path((from, to, amount)): Path<(usize, usize, i64)>,
    lock: HeldLock,
) -> StatusCode {
    assert_eq!(lock.keys().count(), 2, "a token per account: {lock:?}");
    let balances: redis::RedisResult<(i64, i64)> = async {
        Ok((
            redis.get(account(from)).await?,
            redis.get(account(to)).await?,
        ))
    }
    .await;
    let Ok((from_balance, to_balance)) = balances else {
        return StatusCode::INTERNAL_SERVER_ERROR;
    };
    if from_balance < amount {
        return StatusCode::UNPROCESSABLE_ENTITY;
    }
    tokio::time::sleep(Duration::from_millis(1)).await;
    let written: redis::RedisResult<()> = redis
        .mset(&[
            (account(from), from_balance - amount),
            (account(to), to_balance + amount),
        ])
        .await;
    match written {
        Ok(()) => StatusCode::OK,
        Err(_) => StatusCode::INTERNAL_SERVER_ERROR,
    }
}

async fn bank(server: &RedisServer, wait: bool) -> Router {
    let backend = server.backend().await;
    // Both accounts, in the order the request names them (not sorted: the layer sorts).
    let layer = LockLayer::new(backend, PathParams::new(["from", "to"]).prefix("account"));
    let layer = if wait {
        layer.wait(Duration::from_secs(30))
    } else {
        layer.fail_fast()
    };
    Router::new()
        .route("/transfer/{from}/{to}/{amount}", post(transfer))
        .route_layer(layer)
        .with_state(server.conn().await)
}

/// Every segment of the path, as a key each.
fn path_keys(req: &Request) -> Vec<String> {
    req.uri()
        .path()
        .split('/')
        .filter(|s| !s.is_empty())
        .map(str::to_owned)
        .collect()
}

/// The lock hashes in Redis (fencing counters outlive their locks by design).
async fn locks(server: &RedisServer) -> Vec<String> {
    let keys = server.keys().await;
    keys.into_iter()
        .filter(|k| k.starts_with("tower-lock:") && !k.ends_with(":fence"))
        .collect()
}

#[tokio::test]
async fn a_fail_fast_transfer_whose_second_key_is_held_gets_409_and_holds_neither() {
    crate::needs!(Redis);
    let server = RedisServer::start();
    let mut conn = server.conn().await;
    for i in 0..2 {
        let _: () = conn.set(account(i), OPENING).await.expect("SET");
    }
    let addr = serve(bank(&server, false).await).await;
    // `account:1` sorts after `account:0`: the request takes the first, then finds the
    // second held.
    let other = server.backend().await;
    let held = other.lock("account:1").try_once().await.expect("free");
    let reply = post_to(&http_client(), addr, "/transfer/0/1/10").await;
    assert_eq!(reply.status, 409, "{reply:?}");
    assert!(reply.headers.contains_key("retry-after"), "{reply:?}");
    assert!(
        !server.exists(&lock_key("account:0")).await,
        "the first key was given back"
    );
    held.release().await.expect("released");
    let reply = post_to(&http_client(), addr, "/transfer/1/0/10").await;
    assert_eq!(reply.status, 200, "{reply:?}");
    assert_eq!(locks(&server).await, Vec::<String>::new(), "both released");
}

#[tokio::test]
async fn lock_many_gives_a_token_per_key_and_releases_them_together() {
    crate::needs!(Redis);
    let server = RedisServer::start();
    let backend = server.backend().await;
    let guard = backend
        .lock_many(["b", "a", "c"])
        .try_once()
        .await
        .expect("free keys");
    let keys: Vec<(String, u64)> = guard
        .held()
        .keys()
        .map(|(k, t)| (k.to_owned(), t))
        .collect();
    assert_eq!(
        keys.iter().map(|(k, _)| k.as_str()).collect::<Vec<_>>(),
        ["a", "b", "c"],
        "canonical order"
    );
    assert_eq!(guard.key(), "a");
    assert_eq!(guard.held().fencing_token_of("c"), Some(keys[2].1));
    for key in ["a", "b", "c"] {
        assert!(server.exists(&lock_key(key)).await, "{key} held");
    }
    // Another owner gets none of them: "0" sorts first and is free, so it is taken, then
    // given back when "c" is found held.
    let busy = backend.lock_many(["c", "0"]).try_once().await;
    assert!(
        matches!(&busy, Err(LockError::Contended { key, .. }) if key == "c"),
        "{busy:?}"
    );
    assert!(!server.exists(&lock_key("0")).await, "0 given back");
    guard.release().await.expect("released");
    for key in ["a", "b", "c"] {
        assert!(!server.exists(&lock_key(key)).await, "{key} released");
    }
}

#[tokio::test]
async fn a_multi_key_lock_is_lost_when_one_of_its_keys_is() {
    crate::needs!(Redis);
    let server = RedisServer::start();
    let backend = server.backend().await;
    let guard = backend
        .lock_many(["x", "y"])
        .lease(Duration::from_millis(300))
        .try_once()
        .await
        .expect("free keys");
    assert!(!guard.is_lost());
    let _: () = redis::cmd("DEL")
        .arg(lock_key("y"))
        .query_async(&mut server.conn().await)
        .await
        .expect("DEL");
    tokio::time::timeout(Duration::from_secs(5), guard.lost())
        .await
        .expect("the watchdog finds y gone, and the lock is lost");
    assert!(guard.is_lost());
    let released = guard.release().await;
    assert!(
        matches!(&released, Err(LockError::Lost { key }) if key == "y"),
        "{released:?}"
    );
    assert!(!server.exists(&lock_key("x")).await, "x released");
}

#[tokio::test]
async fn a_wait_that_runs_out_on_the_second_key_gives_the_first_back() {
    crate::needs!(Redis);
    let server = RedisServer::start();
    let backend = server.backend().await;
    let other = server.backend().await;
    let held = other.lock("w2").try_once().await.expect("free");
    let started = std::time::Instant::now();
    let waited = backend
        .lock_many(["w2", "w1"])
        .wait(Duration::from_millis(300))
        .await;
    assert!(
        matches!(&waited, Err(LockError::TimedOut { key, .. }) if key == "w2"),
        "{waited:?}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "within the wait"
    );
    assert!(!server.exists(&lock_key("w1")).await, "w1 given back");
    held.release().await.expect("released");
    // A wait with no end is accepted, as for one key.
    let forever = backend
        .lock_many(["w1", "w2"])
        .wait(Duration::MAX)
        .await
        .expect("free now");
    forever.release().await.expect("released");
}

#[tokio::test]
async fn bad_key_lists_are_refused_and_take_nothing() {
    crate::needs!(Redis);
    let server = RedisServer::start();
    let backend = server.backend().await;
    let refused = |result: Result<tower_lock::LockGuard, LockError>| match result {
        Err(LockError::InvalidKey(e)) => e,
        other => panic!("expected InvalidKey, got {other:?}"),
    };
    let none: [&str; 0] = [];
    assert_eq!(
        refused(backend.lock_many(none).try_once().await),
        KeyError::NoKeys
    );
    let many: Vec<String> = (0..=MAX_KEYS).map(|i| format!("k{i}")).collect();
    assert_eq!(
        refused(backend.lock_many(many).try_once().await),
        KeyError::TooManyKeys {
            count: MAX_KEYS + 1,
            max: MAX_KEYS
        }
    );
    assert_eq!(
        refused(backend.lock_many(["ok", "bad\n"]).try_once().await),
        KeyError::ControlCharacter
    );
    // Checked before anything is taken, though "a" sorts first.
    let long = "z".repeat(2000);
    assert!(matches!(
        refused(backend.lock_many(["a", long.as_str()]).try_once().await),
        KeyError::TooLong { len: 2000, .. }
    ));
    assert_eq!(locks(&server).await, Vec::<String>::new(), "nothing taken");

    // On the layer: an empty list is 400, before anything is locked.
    let app = Router::new()
        .route("/", post(|| async {}))
        .route("/{a}/{b}", post(|| async {}))
        .route_layer(LockLayer::new(backend, path_keys));
    let addr = serve(app).await;
    let client = http_client();
    let empty = post_to(&client, addr, "/").await;
    assert!(empty.problem(400).contains("no lock key"), "{empty:?}");
    assert_eq!(post_to(&client, addr, "/x/y").await.status, 200);
    assert_eq!(locks(&server).await, Vec::<String>::new(), "all released");
}

for_each_store!(a_key_given_twice_is_taken_once);

/// A transfer from an account to itself: one lock of the account, held once (another owner
/// is refused it) and free after the one release.
async fn a_key_given_twice_is_taken_once<B: LockBackend>([mine, other, _]: [B; 3]) {
    let guard = mine
        .lock_many(["A", "B", "A"])
        .try_once()
        .await
        .expect("A and B are free");
    let keys: Vec<&str> = guard.held().keys().map(|(key, _)| key).collect();
    assert_eq!(keys, ["A", "B"], "A once");
    let busy = other.lock("A").try_once().await;
    assert!(
        matches!(&busy, Err(LockError::Contended { .. })),
        "{busy:?}"
    );
    guard.release().await.expect("released");
    for key in ["A", "B"] {
        let free = other.lock(key).try_once().await;
        free.expect("free after the one release")
            .release()
            .await
            .expect("released");
    }
    // Only one key after all: a plain lock of it. The limit counts different keys.
    let copies = vec!["A"; MAX_KEYS + 1];
    let solo = mine.lock_many(copies).try_once().await.expect("one key");
    assert_eq!(solo.held().keys().count(), 1);
    assert_eq!((solo.key(), solo.is_lost()), ("A", false));
    let busy = other.lock("A").try_once().await;
    assert!(
        matches!(&busy, Err(LockError::Contended { .. })),
        "{busy:?}"
    );
    solo.release().await.expect("released");
    other
        .lock("A")
        .try_once()
        .await
        .expect("free again")
        .release()
        .await
        .expect("released");
}

#[tokio::test]
async fn a_layer_given_one_key_twice_locks_it_once() {
    crate::needs!(Redis);
    let server = RedisServer::start();
    let backend = server.backend().await;
    let owners = server.conn().await;
    // The handler reports its keys and its owner's count in the key's lock hash (no other
    // request runs: the hold is its own in Redis, not a run's in memory).
    let handler = |State(mut redis): State<MultiplexedConnection>, lock: HeldLock| async move {
        let owner = lock.owner().as_str();
        let count: Option<i64> = redis.hget(lock_key("x"), owner).await.unwrap_or_default();
        format!("{} key(s), count {count:?}", lock.keys().count())
    };
    let app = Router::new()
        .route("/{a}/{b}", post(handler))
        .route_layer(LockLayer::new(backend, path_keys))
        .with_state(owners);
    let addr = serve(app).await;
    let client = http_client();
    let twice = post_to(&client, addr, "/x/x").await;
    assert_eq!(
        (twice.status, twice.body.as_str()),
        (200, "1 key(s), count Some(1)")
    );
    assert_eq!(locks(&server).await, Vec::<String>::new(), "released");
    // `PathParams` decodes the segments as axum does: `%78` is `x`, the same key.
    let decoded = LockLayer::new(MemoryBackend::new(), PathParams::new(["a", "b"]));
    let decoded = Router::new()
        .route(
            "/{a}/{b}",
            post(|lock: HeldLock| async move { lock.keys().count().to_string() }),
        )
        .route_layer(decoded);
    let same = post_to(&client, serve(decoded).await, "/%78/x").await;
    assert_eq!((same.status, same.body.as_str()), (200, "1"));
}

#[tokio::test]
async fn memory_backend_takes_many_keys_in_canonical_order_too() {
    let backend = MemoryBackend::new();
    let first = backend
        .lock_many(["q", "p"])
        .try_once()
        .await
        .expect("free");
    // "o" sorts before "p": taken, then given back when "p" is found held.
    let second = backend.lock_many(["p", "o"]).try_once().await;
    assert!(
        matches!(&second, Err(LockError::Contended { key, .. }) if key == "p"),
        "{second:?}"
    );
    assert_eq!(backend.held(), 2, "o was given back");
    first.release().await.expect("released");
    assert_eq!(backend.held(), 0);
}

#[tokio::test]
async fn a_layer_that_waits_without_end_takes_several_keys() {
    crate::needs!(Redis);
    let server = RedisServer::start();
    let backend = server.backend().await;
    let app = Router::new()
        .route(
            "/{a}/{b}",
            post(|lock: HeldLock| async move { lock.keys().count().to_string() }),
        )
        .route_layer(LockLayer::new(backend, path_keys).wait(Duration::MAX));
    let addr = serve(app).await;
    let reply = post_to(&http_client(), addr, "/m/n").await;
    assert_eq!((reply.status, reply.body.as_str()), (200, "2"), "{reply:?}");
}

#[tokio::test]
async fn a_handler_under_several_keys_is_stopped_when_one_of_them_is_lost() {
    crate::needs!(Redis);
    let server = RedisServer::start();
    let backend = server.backend().await;
    let gate = support::Gate::default();
    let inside = gate.clone();
    let app = Router::new()
        .route(
            "/{a}/{b}",
            post(move || {
                let gate = inside.clone();
                async move { gate.pass().await }
            }),
        )
        .route_layer(LockLayer::new(backend, path_keys).lease(Duration::from_millis(300)));
    let addr = serve(app).await;
    let request = tokio::spawn(async move { post_to(&http_client(), addr, "/p/q").await });
    gate.wait_inside(1).await;
    let _: () = redis::cmd("DEL")
        .arg(lock_key("q"))
        .query_async(&mut server.conn().await)
        .await
        .expect("DEL");
    let reply = tokio::time::timeout(Duration::from_secs(5), request)
        .await
        .expect("the handler is stopped, not left running")
        .expect("task");
    reply.problem(503);
    assert_eq!(locks(&server).await, Vec::<String>::new(), "p released too");
}

//! Read/write locks: `lock(key).shared()` and the layer's `.read_write()`. Many readers at
//! once, a writer alone, writers not starved by readers, re-entry, downgrade, upgrade
//! refused, and the last writer's fencing token; every body runs on Redis (three backends
//! of one server), in memory, on the SQL stores, on etcd and on ZooKeeper.

use crate::support;

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Duration;

use axum::Router;
use axum::extract::Request;
use axum::extract::State;
use axum::routing::get;
use http::Method;
use support::{Gate, call, eventually};
use tower_lock::lock::policy::{Exclusive, HoldPolicy};
use tower_lock::{LockBackend, LockError, LockLayer};

/// Generous bound on any wait that should end: catches hangs only.
const HANG: Duration = Duration::from_secs(10);

// On etcd and ZooKeeper every hold lives under its backend's lease or session, whatever
// lease it asked for: the bodies of a shared hold whose own lease runs out do not apply.
for_each_store_and_consensus!(
    twenty_readers_hold_one_key_at_once,
    a_writer_waits_for_the_readers_and_then_excludes_them,
    a_writer_queued_behind_readers_goes_before_readers_that_came_after_it,
    a_get_and_a_post_on_one_key_through_read_write,
    readers_never_see_a_half_written_pair,
    a_reader_asking_for_the_key_exclusively_is_refused_not_deadlocked,
    a_nested_exclusive_layer_under_a_shared_hold_answers_500,
    a_writer_downgrades_and_its_shared_hold_outlives_the_exclusive_one,
    shared_holders_see_the_last_writers_token_and_the_next_writer_a_higher_one,
    shared_holds_are_reentrant_per_owner,
    a_multi_key_request_takes_every_key_the_same_way;
    not on etcd or zookeeper:
    a_crashed_reader_keeps_a_waiting_writer_out_only_until_its_own_lease_ends,
    a_reader_whose_lease_ran_out_is_not_refused_as_an_upgrade,
);

type DocLayer<P = Exclusive> = LockLayer<fn(&Request) -> Option<&'static str>, P>;

/// One route, `/doc`, locked by `layer`, whose handler passes `gate`.
fn gated<P: HoldPolicy<axum::body::Body>>(layer: DocLayer<P>, gate: &Gate) -> Router {
    let gate = gate.clone();
    let pass = move || {
        let gate = gate.clone();
        async move { gate.pass().await }
    };
    Router::new()
        .route("/doc", get(pass.clone()).post(pass))
        .route_layer(layer)
}

fn doc_key(_: &Request) -> Option<&'static str> {
    Some("doc")
}

/// A layer that locks every request on the key `doc`.
fn doc_layer<B: LockBackend>(b: &B) -> DocLayer {
    LockLayer::new(b.clone(), doc_key as fn(&Request) -> Option<&'static str>)
}

/// Whether a fresh reader is turned away from `key` (a writer holds or waits for it).
async fn readers_turned_away<B: LockBackend>(b: &B, key: &str) -> bool {
    match b.lock(key).shared().try_once().await {
        Ok(guard) => {
            guard.release().await.expect("released");
            false
        }
        Err(LockError::Contended { .. }) => true,
        Err(other) => panic!("unexpected {other:?}"),
    }
}

async fn twenty_readers_hold_one_key_at_once<B: LockBackend>(b: [B; 3]) {
    let gate = Gate::default();
    let apps: Vec<Router> = b
        .iter()
        .map(|b| gated(doc_layer(b).read_write().wait(HANG), &gate))
        .collect();
    let readers: Vec<_> = (0..20)
        .map(|i| {
            let app = apps[i % apps.len()].clone();
            tokio::spawn(async move { call(&app, Method::GET, "/doc").await.status })
        })
        .collect();
    // Counted inside the handler: all twenty are in at once, or this times out.
    gate.wait_inside(20).await;
    gate.open();
    for reader in readers {
        assert_eq!(reader.await.expect("no panic"), 200);
    }
}

async fn a_writer_waits_for_the_readers_and_then_excludes_them<B: LockBackend>(b: [B; 3]) {
    let r1 = b[0].lock("doc").shared().try_once().await.expect("free");
    let r2 = b[1]
        .lock("doc")
        .shared()
        .try_once()
        .await
        .expect("shared with r1");
    assert!(r1.held().is_shared() && r2.held().is_shared());
    let refused = b[2].lock("doc").try_once().await;
    assert!(
        matches!(refused, Err(LockError::Contended { .. })),
        "{refused:?}"
    );
    let writer = tokio::spawn(b[2].lock("doc").wait(HANG));
    eventually("the writer waits", || readers_turned_away(&b[0], "doc")).await;
    r1.release().await.expect("released");
    // r2 still reads: the writer cannot have the key.
    assert!(!writer.is_finished(), "the writer waits for r2");
    r2.release().await.expect("released");
    let writer = writer
        .await
        .expect("no panic")
        .expect("the writer gets the key");
    assert!(!writer.held().is_shared());
    assert!(
        readers_turned_away(&b[1], "doc").await,
        "the writer excludes readers"
    );
    let reader = tokio::spawn(b[1].lock("doc").shared().wait(HANG));
    writer.release().await.expect("released");
    let reader = reader.await.expect("no panic").expect("readers are let in");
    reader.release().await.expect("released");
}

async fn a_writer_queued_behind_readers_goes_before_readers_that_came_after_it<B: LockBackend>(
    b: [B; 3],
) {
    let early = b[0].lock("doc").shared().try_once().await.expect("free");
    let (served_tx, mut served) = tokio::sync::mpsc::unbounded_channel();
    let writer = {
        let (b, served_tx) = (b[1].clone(), served_tx.clone());
        tokio::spawn(async move {
            let guard = b
                .lock("doc")
                .wait(HANG)
                .await
                .expect("the writer is served");
            served_tx.send("writer").expect("receiver lives");
            guard.release().await.expect("released");
        })
    };
    // Once the writer waits, new readers queue behind it.
    eventually("the writer waits", || readers_turned_away(&b[2], "doc")).await;
    let late = {
        let b = b[2].clone();
        tokio::spawn(async move {
            let guard = b.lock("doc").shared().wait(HANG).await.expect("served");
            served_tx.send("late reader").expect("receiver lives");
            guard.release().await.expect("released");
        })
    };
    early.release().await.expect("released");
    writer.await.expect("no panic");
    late.await.expect("no panic");
    let order = [served.recv().await, served.recv().await];
    assert_eq!(order, [Some("writer"), Some("late reader")]);
}

async fn a_get_and_a_post_on_one_key_through_read_write<B: LockBackend>(b: [B; 3]) {
    let gate = Gate::default();
    let readers = gated(doc_layer(&b[0]).read_write().fail_fast(), &gate);
    let other = gated(doc_layer(&b[1]).read_write().fail_fast(), &Gate::default());
    let gets: Vec<_> = [readers.clone(), readers.clone()]
        .into_iter()
        .map(|app| tokio::spawn(async move { call(&app, Method::GET, "/doc").await.status }))
        .collect();
    gate.wait_inside(2).await;
    let post = call(&other, Method::POST, "/doc").await;
    assert_eq!(post.status, 409, "a POST waits for no GET: {post:?}");
    gate.open();
    for get in gets {
        assert_eq!(get.await.expect("no panic"), 200);
    }

    let gate = Gate::default();
    let writers = gated(doc_layer(&b[0]).read_write().fail_fast(), &gate);
    let post = tokio::spawn(async move { call(&writers, Method::POST, "/doc").await.status });
    gate.wait_inside(1).await;
    let get = call(&other, Method::GET, "/doc").await;
    assert_eq!(get.status, 409, "a POST excludes GETs: {get:?}");
    gate.open();
    assert_eq!(post.await.expect("no panic"), 200);
}

/// Two numbers that writers bump one after the other and readers read one after the
/// other, yielding in between: a reader that runs beside a writer sees them differ, and
/// writers beside each other lose increments.
#[derive(Clone, Default)]
struct Pair(Arc<(AtomicI64, AtomicI64)>);

async fn bump(State(pair): State<Pair>) {
    let (a, b) = &*pair.0;
    let first = a.load(Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(1)).await;
    a.store(first + 1, Ordering::SeqCst);
    tokio::task::yield_now().await;
    let second = b.load(Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(1)).await;
    b.store(second + 1, Ordering::SeqCst);
}

async fn read(State(pair): State<Pair>) -> Result<String, (http::StatusCode, String)> {
    let (a, b) = &*pair.0;
    let first = a.load(Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(1)).await;
    let second = b.load(Ordering::SeqCst);
    if first == second {
        Ok(first.to_string())
    } else {
        Err((
            http::StatusCode::CONFLICT,
            format!("half written: {first}/{second}"),
        ))
    }
}

async fn readers_never_see_a_half_written_pair<B: LockBackend>(b: [B; 3]) {
    let pair = Pair::default();
    let apps: Vec<Router> = b
        .iter()
        .map(|b| {
            Router::new()
                .route("/pair", get(read).post(bump))
                .route_layer(doc_layer(b).read_write().wait(Duration::from_secs(60)))
                .with_state(pair.clone())
        })
        .collect();
    let requests: Vec<_> = (0..120)
        .map(|i| {
            let app = apps[i % apps.len()].clone();
            let method = if i % 3 == 0 {
                Method::POST
            } else {
                Method::GET
            };
            tokio::spawn(async move { call_long(&app, method, "/pair").await })
        })
        .collect();
    for request in requests {
        let reply = request.await.expect("no panic");
        assert_eq!(reply.status, 200, "{reply:?}");
    }
    let (a, b) = &*pair.0;
    assert_eq!(a.load(Ordering::SeqCst), 40, "no lost update");
    assert_eq!(b.load(Ordering::SeqCst), 40, "no lost update");
}

/// [`call`] for a request that may queue behind many others.
async fn call_long(app: &Router, method: Method, path: &str) -> support::Reply {
    tokio::time::timeout(Duration::from_secs(60), call(app, method, path))
        .await
        .expect("served within a minute")
}

async fn a_reader_asking_for_the_key_exclusively_is_refused_not_deadlocked<B: LockBackend>(
    b: [B; 3],
) {
    let reader = b[0].lock("doc").shared().try_once().await.expect("free");
    let other = b[1].lock("doc").shared().try_once().await.expect("shared");
    let try_once = b[0].lock("doc").reentrant(reader.held()).try_once();
    // Refused at once, not after the wait: it would wait for itself.
    let wait = b[0]
        .lock("doc")
        .reentrant(reader.held())
        .wait(Duration::MAX);
    for refused in [
        tokio::time::timeout(HANG, try_once).await,
        tokio::time::timeout(HANG, wait).await,
    ] {
        let refused = refused.expect("no deadlock");
        assert!(
            matches!(&refused, Err(LockError::UpgradeRefused { key }) if key == "doc"),
            "{refused:?}"
        );
    }
    assert!(!reader.is_lost(), "the refusal left the shared hold alone");
    reader.release().await.expect("released");
    other.release().await.expect("released");
    let writer = b[0]
        .lock("doc")
        .try_once()
        .await
        .expect("nothing was taken");
    writer.release().await.expect("released");
}

async fn a_nested_exclusive_layer_under_a_shared_hold_answers_500<B: LockBackend>(b: [B; 3]) {
    let app = Router::new()
        .route(
            "/doc",
            get(|| async { "read" }).post(|| async { "written" }),
        )
        // The inner layer is exclusive whatever the method; the outer one shares GETs.
        .route_layer(doc_layer(&b[0]).wait(HANG))
        .route_layer(doc_layer(&b[0]).read_write().wait(HANG));
    let get = call(&app, Method::GET, "/doc").await;
    assert_eq!(get.status, 500, "{get:?}");
    let problem: serde_json::Value = serde_json::from_str(&get.body).expect("problem+json");
    assert!(
        problem["type"]
            .as_str()
            .is_some_and(|t| t.ends_with("UpgradeRefused")),
        "{problem}"
    );
    // A POST is exclusive in both layers: the inner one re-enters.
    assert_eq!(call(&app, Method::POST, "/doc").await.status, 200);
    let writer = b[1]
        .lock("doc")
        .try_once()
        .await
        .expect("both requests released");
    writer.release().await.expect("released");
}

async fn a_writer_downgrades_and_its_shared_hold_outlives_the_exclusive_one<B: LockBackend>(
    b: [B; 3],
) {
    let writer = b[0].lock("doc").try_once().await.expect("free");
    let shared = b[0]
        .lock("doc")
        .reentrant(writer.held())
        .shared()
        .try_once()
        .await
        .expect("a writer takes a shared hold of its own key");
    assert!(shared.held().is_shared());
    assert_eq!(shared.fencing_token(), writer.fencing_token());
    assert!(
        readers_turned_away(&b[1], "doc").await,
        "still held exclusively"
    );
    writer.release().await.expect("released");
    // Now only shared: other readers come in, writers do not.
    let reader = b[1]
        .lock("doc")
        .shared()
        .try_once()
        .await
        .expect("shared now");
    let refused = b[2].lock("doc").try_once().await;
    assert!(
        matches!(refused, Err(LockError::Contended { .. })),
        "{refused:?}"
    );
    assert!(!shared.is_lost());
    shared
        .release()
        .await
        .expect("the shared hold outlived the exclusive one");
    reader.release().await.expect("released");
    let next = b[2].lock("doc").try_once().await.expect("free at last");
    next.release().await.expect("released");
}

async fn shared_holders_see_the_last_writers_token_and_the_next_writer_a_higher_one<
    B: LockBackend,
>(
    b: [B; 3],
) {
    let first = b[0].lock("doc").try_once().await.expect("free");
    let written = first.fencing_token();
    first.release().await.expect("released");
    let mut readers = Vec::new();
    for b in &b[1..] {
        readers.push(b.lock("doc").shared().try_once().await.expect("shared"));
    }
    for reader in &readers {
        assert_eq!(reader.fencing_token(), written, "{:?}", reader.held());
    }
    for reader in readers {
        reader.release().await.expect("released");
    }
    let next = b[0].lock("doc").try_once().await.expect("free");
    assert!(next.fencing_token() > written);
    let downgrade = b[0]
        .lock("doc")
        .reentrant(next.held())
        .shared()
        .try_once()
        .await
        .expect("downgrade");
    assert_eq!(downgrade.fencing_token(), next.fencing_token());
    downgrade.release().await.expect("released");
    next.release().await.expect("released");
}

async fn shared_holds_are_reentrant_per_owner<B: LockBackend>(b: [B; 3]) {
    let outer = b[0].lock("doc").shared().try_once().await.expect("free");
    let writer = tokio::spawn(b[1].lock("doc").wait(HANG));
    eventually("the writer waits", || readers_turned_away(&b[2], "doc")).await;
    // A new reader queues behind the writer; the holder's own second hold does not (it
    // would wait for a writer that waits for it).
    let inner = b[0]
        .lock("doc")
        .shared()
        .reentrant(outer.held())
        .try_once()
        .await
        .expect("re-entered despite the waiting writer");
    assert_eq!(inner.held().owner(), outer.held().owner());
    inner.release().await.expect("released");
    assert!(!writer.is_finished(), "the outer hold remains");
    outer.release().await.expect("released");
    let writer = writer
        .await
        .expect("no panic")
        .expect("the writer is served");
    writer.release().await.expect("released");
}

async fn a_multi_key_request_takes_every_key_the_same_way<B: LockBackend>(b: [B; 3]) {
    let gate = Gate::default();
    let both = |_: &Request| vec!["left", "right"];
    let pass = {
        let gate = gate.clone();
        move |lock: tower_lock::HeldLock| {
            let gate = gate.clone();
            async move {
                assert_eq!(lock.keys().count(), 2);
                assert!(lock.is_shared(), "{lock:?}");
                gate.pass().await
            }
        }
    };
    let app = Router::new()
        .route("/pair", get(pass))
        .route_layer(LockLayer::new(b[0].clone(), both).read_write().wait(HANG));
    let gets: Vec<_> = (0..2)
        .map(|_| {
            let app = app.clone();
            tokio::spawn(async move { call(&app, Method::GET, "/pair").await })
        })
        .collect();
    // Both GETs hold both keys shared at once; a writer of either key is kept out.
    gate.wait_inside(2).await;
    for key in ["left", "right"] {
        let refused = b[1].lock(key).try_once().await;
        assert!(
            matches!(refused, Err(LockError::Contended { .. })),
            "{refused:?}"
        );
    }
    let shared = b[1].lock_many(["right", "left"]).shared().try_once().await;
    let shared = shared.expect("readers share both keys");
    assert!(shared.held().is_shared());
    gate.open();
    for get in gets {
        let reply = get.await.expect("no panic");
        assert_eq!(reply.status, 200, "{reply:?}");
    }
    shared.release().await.expect("released");
    let writer = b[2].lock_many(["left", "right"]).try_once().await;
    writer
        .expect("all released")
        .release()
        .await
        .expect("released");
}

/// A shared hold that stopped being renewed (its process crashed; here: no watchdog)
/// keeps a waiting writer out only until its own lease ends, although another reader kept
/// the key alive with a 30 s lease and then left without it.
async fn a_crashed_reader_keeps_a_waiting_writer_out_only_until_its_own_lease_ends<
    B: LockBackend,
>(
    b: [B; 3],
) {
    let crashed = b[0]
        .lock("doc")
        .shared()
        .lease(Duration::from_millis(500))
        .without_watchdog()
        .try_once()
        .await
        .expect("free");
    let live = b[1].lock("doc").shared().try_once().await.expect("shared");
    // The writer would wait out the key's 30 s; the test gives it HANG.
    let writer = tokio::spawn(b[2].lock("doc").wait(Duration::from_secs(60)));
    eventually("the writer waits", || readers_turned_away(&b[1], "doc")).await;
    live.release().await.expect("released");
    let writer = tokio::time::timeout(HANG, writer)
        .await
        .expect("served once the crashed reader's lease ended, long before the key's 30 s")
        .expect("no panic")
        .expect("served");
    assert!(crashed.is_lost(), "the crashed reader's hold ran out");
    writer.release().await.expect("released");
}

/// An owner whose shared hold ran out (and was not released) may ask for the key
/// exclusively: it is a writer like any other, kept out by the other reader, not refused
/// as an upgrade.
async fn a_reader_whose_lease_ran_out_is_not_refused_as_an_upgrade<B: LockBackend>(b: [B; 3]) {
    let lease = Duration::from_millis(300);
    let expired = b[0]
        .lock("doc")
        .shared()
        .lease(lease)
        .without_watchdog()
        .try_once()
        .await
        .expect("free");
    // The store counts the lease from when it took the hold, before the call returned
    // (and in whole milliseconds: one more).
    let ended = tokio::time::Instant::now() + lease + Duration::from_millis(1);
    let other = b[1].lock("doc").shared().try_once().await.expect("shared");
    eventually("the short shared hold runs out", || {
        let lost = expired.is_lost();
        async move { lost }
    })
    .await;
    // `lost()` fires a little before the lease ends in the store (see `HeldLock::is_lost`).
    tokio::time::sleep_until(ended).await;
    let exclusive = b[0].lock("doc").reentrant(expired.held()).try_once().await;
    assert!(
        matches!(exclusive, Err(LockError::Contended { .. })),
        "{exclusive:?}"
    );
    other.release().await.expect("released");
    let exclusive = b[0].lock("doc").reentrant(expired.held()).try_once().await;
    exclusive
        .expect("free once the other reader left")
        .release()
        .await
        .expect("released");
}

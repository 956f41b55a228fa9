//! A quorum of five independent redis-servers (RedLock), started once for this binary
//! (`support/quorum.rs`): build-time refusals and waiters that do not poll.
//! `quorum/faults.rs`: masters killed and restarted under load; `quorum/pause.rs`: a holder
//! paused past its validity; `quorum/records.rs`: idempotency records on every master. The
//! semantics every store keeps run on the quorum in the conformance suite (conformance.rs
//! and the files it names: `on_quorum::*`).

#[path = "quorum/faults.rs"]
mod faults;
#[path = "quorum/pause.rs"]
mod pause;
#[path = "quorum/records.rs"]
mod records;
use crate::support;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::extract::{Request, State};
use axum::routing::post;
use tower_lock::{BuildError, HeldLock, LockLayer, RedisBackend};

use support::RedisServer;
use support::quorum;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn build_refuses_too_few_masters_a_replica_a_cluster_node_and_one_server_twice() {
    crate::needs!(Redis);
    let quorum = quorum::shared();
    let _turn = quorum.shared_turn().await;
    let urls = quorum.urls();
    let refused = |built: Result<RedisBackend, BuildError>| match built {
        Err(e @ BuildError::Quorum { .. }) => e,
        other => panic!("refused as a quorum: {other:?}"),
    };
    let two = refused(RedisBackend::quorum(&urls[..2]).build().await);
    support::assert_says(&two, &["at least three masters"]);

    let twice = [
        urls[0].clone(),
        urls[1].clone(),
        urls[0].replace("127.0.0.1", "localhost"),
    ];
    let twice = refused(RedisBackend::quorum(twice).build().await);
    support::assert_says(
        &twice,
        &[
            &urls[0]["redis://".len()..].replace("127.0.0.1", "localhost"),
            "same server",
        ],
    );

    let replicated = support::replica::Replicated::start().await;
    let with_replica = [urls[0].clone(), urls[1].clone(), replicated.replica.url()];
    let replica = refused(RedisBackend::quorum(with_replica).build().await);
    let replica_addr = format!("127.0.0.1:{}", replicated.replica.port());
    support::assert_says(&replica, &[&replica_addr, "replica"]);

    let node = RedisServer::start_with(&["--cluster-enabled", "yes"]);
    let with_node = [urls[0].clone(), urls[1].clone(), node.url()];
    let node_error = refused(RedisBackend::quorum(with_node).build().await);
    let node_addr = format!("127.0.0.1:{}", node.port());
    support::assert_says(&node_error, &[&node_addr, "Redis Cluster"]);
}

/// What the shop's instances share: the stock and the sales in a separate Redis (the
/// application's database), and who is inside the critical section.
#[derive(Clone)]
pub struct Shop {
    db: redis::aio::MultiplexedConnection,
    /// Sales made so far (the database's list of sales is the record).
    pub sold: Arc<AtomicU64>,
    inside: Arc<AtomicUsize>,
}

/// One handler inside the critical section; leaves it when dropped (also when the layer
/// drops a handler whose lock was lost).
struct Inside(Arc<AtomicUsize>);

impl Drop for Inside {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Shop {
    pub async fn open(db: &RedisServer, stock: i64) -> Self {
        let mut conn = db.conn().await;
        let _: () = redis::pipe()
            .cmd("SET")
            .arg("stock")
            .arg(stock)
            .ignore()
            .cmd("DEL")
            .arg("sales")
            .ignore()
            .query_async(&mut conn)
            .await
            .expect("stock");
        Shop {
            db: conn,
            sold: Arc::default(),
            inside: Arc::default(),
        }
    }

    /// Serves one instance of the shop on `backend`: POST /buy reads the stock, yields,
    /// and writes it back less one, as a careless handler would (the write and the sale's
    /// record, its fencing token, in one transaction).
    pub async fn serve(&self, backend: RedisBackend) -> SocketAddr {
        async fn buy(
            State(shop): State<Shop>,
            axum::Extension(held): axum::Extension<HeldLock>,
        ) -> &'static str {
            let others = shop.inside.fetch_add(1, Ordering::SeqCst);
            let _inside = Inside(shop.inside.clone());
            assert_eq!(others, 0, "two holders of the stock's lock at once");
            let mut db = shop.db.clone();
            let stock: i64 = redis::cmd("GET")
                .arg("stock")
                .query_async(&mut db)
                .await
                .expect("read");
            if stock <= 0 {
                return "sold out";
            }
            tokio::task::yield_now().await;
            let _: () = redis::pipe()
                .atomic()
                .cmd("SET")
                .arg("stock")
                .arg(stock - 1)
                .ignore()
                .cmd("RPUSH")
                .arg("sales")
                .arg(held.fencing_token())
                .ignore()
                .query_async(&mut db)
                .await
                .expect("write");
            shop.sold.fetch_add(1, Ordering::SeqCst);
            "sold"
        }
        let app = Router::new()
            .route("/buy", post(buy))
            .route_layer(
                LockLayer::new(backend, |_: &Request| Some("stock".to_owned()))
                    .wait(Duration::from_secs(30)),
            )
            .with_state(self.clone());
        support::serve(app).await
    }

    /// What is left of the stock, and the fencing token of each sale in order.
    pub async fn state(&self) -> (i64, Vec<u64>) {
        let (left, sales): (i64, Vec<u64>) = redis::pipe()
            .cmd("GET")
            .arg("stock")
            .cmd("LRANGE")
            .arg("sales")
            .arg(0)
            .arg(-1)
            .query_async(&mut self.db.clone())
            .await
            .expect("stock and sales");
        (left, sales)
    }

    /// Asserts that `stock` was sold exactly, once per sale recorded, under strictly
    /// increasing fencing tokens.
    pub async fn assert_sold_out(&self, stock: i64) {
        let (left, sales) = self.state().await;
        assert_eq!((left, sales.len()), (0, stock as usize), "{sales:?}");
        assert!(
            sales.windows(2).all(|w| w[0] < w[1]),
            "fencing tokens strictly increase: {sales:?}"
        );
    }
}

/// The conformance suite's no-polling test, with the hold taken by hand: a quorum
/// shortens every lease to its `max_lease` (2 s here), so a real holder's renewals would
/// fall in the window.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_behind_a_hold_that_never_renews_make_no_call_until_it_is_released() {
    crate::needs!(Redis);
    let quorum = quorum::shared();
    let _turn = quorum.exclusive().await;
    let backends = quorum.backends(3).await;
    // A holder that never renews and never ends on its own, so that the only script calls
    // are the waiters'.
    let lock = format!("{}:{{k}}", backends[0].namespace());
    let mut conns = hold_by_hand(quorum, &lock).await;
    let calls = || {
        let conns = conns.clone();
        async move {
            let mut total = 0;
            for mut conn in conns {
                let info: String = redis::cmd("INFO")
                    .arg("commandstats")
                    .query_async(&mut conn)
                    .await
                    .expect("INFO");
                total += support::calls_in(&info, &["evalsha", "eval"]);
            }
            total
        }
    };
    let before = calls().await;
    let waiters: Vec<_> = (0..9)
        .map(|i| {
            let backend = backends[i % 3].clone();
            tokio::spawn(async move {
                backend
                    .lock("k")
                    .wait(Duration::from_secs(30))
                    .await
                    .map(|g| g.fencing_token())
            })
        })
        .collect();
    let channel = format!("{lock}:released");
    listening(&conns, &channel, 3).await;
    // Each waiter tries again once per confirmed subscription at most: let those settle.
    let mut settled = calls().await;
    loop {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let now = calls().await;
        if now == settled {
            break;
        }
        settled = now;
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let after_waiting = calls().await;
    // One waiter per instance talks to Redis: a try, and a try per subscription
    // confirmed, on five masters; the others wait in their instance's queue.
    assert!(
        settled - before <= 3 * 6 * 5,
        "{} script calls to start 9 waiters",
        settled - before
    );
    assert_eq!(after_waiting, settled, "no script calls while waiting");
    release_by_hand(&mut conns, &lock, &channel).await;
    for waiter in waiters {
        let token = tokio::time::timeout(Duration::from_secs(30), waiter)
            .await
            .expect("served")
            .expect("no panic")
            .expect("acquired once released");
        assert!(token > 1);
    }
}

/// Holds the lock hash `lock` on every master by hand, for a minute, for an owner that no
/// backend has; returns a connection to each master.
async fn hold_by_hand(
    quorum: &quorum::Quorum,
    lock: &str,
) -> Vec<redis::aio::MultiplexedConnection> {
    let mut conns = Vec::new();
    for url in quorum.urls() {
        let mut conn = redis::Client::open(url.as_str())
            .expect("url")
            .get_multiplexed_async_connection()
            .await
            .expect("connect");
        let _: () = redis::pipe()
            .cmd("HSET")
            .arg(lock)
            .arg("someone")
            .arg(1)
            .arg("token")
            .arg(1)
            .ignore()
            .cmd("PEXPIRE")
            .arg(lock)
            .arg(60_000)
            .ignore()
            .query_async(&mut conn)
            .await
            .expect("hold by hand");
        conns.push(conn);
    }
    conns
}

/// Releases the hold of [`hold_by_hand`] as the release script would: deleted and
/// announced on `channel` on every master.
async fn release_by_hand(
    conns: &mut [redis::aio::MultiplexedConnection],
    lock: &str,
    channel: &str,
) {
    for conn in conns {
        let _: () = redis::pipe()
            .cmd("DEL")
            .arg(lock)
            .ignore()
            .cmd("PUBLISH")
            .arg(channel)
            .arg("released")
            .ignore()
            .query_async(conn)
            .await
            .expect("release by hand");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_tries_again_when_one_masters_subscriber_reconnects() {
    crate::needs!(Redis);
    let quorum = quorum::shared();
    let _turn = quorum.exclusive().await;
    let backend = quorum.builder().build().await.expect("backend");
    let lock = format!("{}:{{k}}", backend.namespace());
    let mut conns = hold_by_hand(quorum, &lock).await;
    let waiter = {
        let backend = backend.clone();
        tokio::spawn(async move { backend.lock("k").wait(Duration::from_secs(30)).await })
    };
    let channel = format!("{lock}:released");
    listening(&conns, &channel, 1).await;
    // Freed without a release message, as a message lost while a subscriber was down is:
    // only the reconnect of one master's subscriber tells the waiter to try again (the hold
    // by hand had a minute to run).
    for conn in &mut conns {
        let _: () = redis::cmd("DEL")
            .arg(&lock)
            .query_async(conn)
            .await
            .expect("DEL");
    }
    let killed: i64 = redis::cmd("CLIENT")
        .arg("KILL")
        .arg("TYPE")
        .arg("pubsub")
        .query_async(&mut conns[2])
        .await
        .expect("CLIENT KILL TYPE pubsub");
    assert!(killed >= 1);
    let guard = tokio::time::timeout(Duration::from_secs(20), waiter)
        .await
        .expect("woken by the reconnect, not by the minute's end")
        .expect("no panic")
        .expect("acquired");
    guard.release().await.expect("released");
}

/// Waits until `n` connections subscribe to `channel` on every master of `conns`.
async fn listening(conns: &[redis::aio::MultiplexedConnection], channel: &str, n: i64) {
    for conn in conns {
        support::eventually("every instance listens on every master", || {
            let mut conn = conn.clone();
            async move {
                let (_, subscribers): (String, i64) = redis::cmd("PUBSUB")
                    .arg("NUMSUB")
                    .arg(channel)
                    .query_async(&mut conn)
                    .await
                    .expect("NUMSUB");
                subscribers == n
            }
        })
        .await;
    }
}

/// A grant's token is written back to the masters that granted it: a master whose counter
/// lagged behind the majority's highest issues above it at the next grant. Two masters
/// are set far ahead; a grant by all five takes their token; the next grant, by the three
/// others alone (the two are held by hand), must still be above it, which only the
/// write-back to those three makes true.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grants_token_is_written_back_so_a_lagging_majority_issues_above_it() {
    crate::needs!(Redis);
    let quorum = quorum::shared();
    let _turn = quorum.shared_turn().await;
    let backend = quorum.builder().build().await.expect("backend");
    let (lock, fence) = {
        let lock = format!("{}:{{k}}", backend.namespace());
        let fence = format!("{lock}:fence");
        (lock, fence)
    };
    // Far above any clock-derived token (microseconds since 1970: about 1.8e15).
    const AHEAD: u64 = 9_000_000_000_000_000;
    let mut conns = Vec::new();
    for url in quorum.urls() {
        conns.push(
            redis::Client::open(url.as_str())
                .expect("url")
                .get_multiplexed_async_connection()
                .await
                .expect("connect"),
        );
    }
    for conn in &mut conns[..2] {
        let _: () = redis::cmd("SET")
            .arg(&fence)
            .arg(AHEAD)
            .arg("PX")
            .arg(600_000)
            .query_async(conn)
            .await
            .expect("SET the counter ahead");
    }
    let first = backend.lock("k").try_once().await.expect("granted by all");
    let first_token = first.fencing_token();
    assert!(
        first_token > AHEAD,
        "the highest of the majority's: {first_token}"
    );
    first.release().await.expect("release");
    // Masters 0 and 1 refuse the next grant: only 2, 3 and 4 grant it.
    for conn in &mut conns[..2] {
        let _: () = redis::pipe()
            .cmd("HSET")
            .arg(&lock)
            .arg("someone")
            .arg(1)
            .arg("token")
            .arg(1)
            .ignore()
            .cmd("PEXPIRE")
            .arg(&lock)
            .arg(60_000)
            .ignore()
            .query_async(conn)
            .await
            .expect("hold by hand");
    }
    let second = backend
        .lock("k")
        .try_once()
        .await
        .expect("granted by three");
    assert!(
        second.fencing_token() > first_token,
        "a majority without the two masters ahead issues above the written-back token: {} after {first_token}",
        second.fencing_token()
    );
    second.release().await.expect("release");
    for conn in &mut conns[..2] {
        let _: () = redis::cmd("DEL")
            .arg(&lock)
            .query_async(conn)
            .await
            .expect("DEL");
    }
}

/// Four fresh backends (nothing subscribed, no connection used yet) on masters past their
/// restart guard, 32 tasks waiting for one key that a hold by hand keeps for a minute:
/// released (by hand, as the release script would), the key goes to each task in turn
/// within its wait of 30 s. A fresh backend's waiters not woken by that release would
/// sleep until the minute's end, past their wait.
///
/// (Fresh masters, which the guard keeps from granting anything for one `max_lease` after
/// their start, make the first waits of any backend wait that out: that is the guard, see
/// `restart_guard`, not a missed wake-up.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_first_contention_of_fresh_backends_is_served_by_wakeups() {
    crate::needs!(Redis);
    let quorum = quorum::shared();
    let _turn = quorum.exclusive().await;
    let backends = quorum.backends(4).await;
    let lock = format!("{}:{{k}}", backends[0].namespace());
    let mut conns = hold_by_hand(quorum, &lock).await;
    let inside = Arc::new(AtomicUsize::new(0));
    let tasks: Vec<_> = (0..32)
        .map(|i| {
            let (backend, inside) = (backends[i % 4].clone(), inside.clone());
            tokio::spawn(async move {
                let held = backend.lock("k").wait(Duration::from_secs(30)).await?;
                assert_eq!(inside.fetch_add(1, Ordering::SeqCst), 0, "two holders");
                tokio::time::sleep(Duration::from_millis(1)).await;
                inside.fetch_sub(1, Ordering::SeqCst);
                held.release().await
            })
        })
        .collect();
    // Every backend's contender waits, subscribed on every master.
    let channel = format!("{lock}:released");
    listening(&conns, &channel, 4).await;
    release_by_hand(&mut conns, &lock, &channel).await;
    let mut failures = Vec::new();
    for (i, task) in tasks.into_iter().enumerate() {
        if let Err(e) = task.await.expect("no panic") {
            failures.push(format!("task {i}: {}", support::chain(&e)));
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

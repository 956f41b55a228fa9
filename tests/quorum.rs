//! A quorum of five independent redis-servers (RedLock), started once for this binary
//! (`support/quorum.rs`): build-time refusals, the flash sale across three instances, and
//! waiters that do not poll. `quorum/faults.rs`: masters killed and restarted under load;
//! `quorum/pause.rs`: a holder paused past its validity. The shared semantics bodies run on
//! the quorum in their own binaries (`on_quorum::*`, `quorum::*`).

#[path = "quorum/faults.rs"]
mod faults;
#[path = "quorum/pause.rs"]
mod pause;
mod support;

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

/// What the shop's instances share: the stock in a separate Redis (the application's
/// database), what was sold, and who is inside the critical section.
#[derive(Clone)]
pub struct Shop {
    db: redis::aio::MultiplexedConnection,
    pub sold: Arc<AtomicU64>,
    inside: Arc<AtomicUsize>,
    /// Each sale's fencing token, in the order of the sales.
    pub tokens: Arc<std::sync::Mutex<Vec<u64>>>,
}

impl Shop {
    pub async fn open(db: &RedisServer, stock: i64) -> Self {
        let mut conn = db.conn().await;
        let _: () = redis::cmd("SET")
            .arg("stock")
            .arg(stock)
            .query_async(&mut conn)
            .await
            .expect("stock");
        Shop {
            db: conn,
            sold: Arc::default(),
            inside: Arc::default(),
            tokens: Arc::default(),
        }
    }

    /// Serves one instance of the shop on `backend`: POST /buy reads the stock, yields,
    /// and writes it back less one, as a careless handler would.
    pub async fn serve(&self, backend: RedisBackend) -> SocketAddr {
        async fn buy(
            State(shop): State<Shop>,
            axum::Extension(held): axum::Extension<HeldLock>,
        ) -> &'static str {
            let others = shop.inside.fetch_add(1, Ordering::SeqCst);
            assert_eq!(others, 0, "two holders of the stock's lock at once");
            let mut db = shop.db.clone();
            let stock: i64 = redis::cmd("GET")
                .arg("stock")
                .query_async(&mut db)
                .await
                .expect("read");
            let sold = if stock > 0 {
                tokio::task::yield_now().await;
                let _: () = redis::cmd("SET")
                    .arg("stock")
                    .arg(stock - 1)
                    .query_async(&mut db)
                    .await
                    .expect("write");
                shop.sold.fetch_add(1, Ordering::SeqCst);
                shop.tokens
                    .lock()
                    .expect("tokens")
                    .push(held.fencing_token());
                "sold"
            } else {
                "sold out"
            };
            shop.inside.fetch_sub(1, Ordering::SeqCst);
            sold
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

    /// What is left of the stock.
    pub async fn left(&self) -> i64 {
        redis::cmd("GET")
            .arg("stock")
            .query_async(&mut self.db.clone())
            .await
            .expect("stock")
    }

    /// Asserts the sales' tokens strictly increase.
    pub fn assert_tokens_increase(&self) {
        let tokens = self.tokens.lock().expect("tokens");
        assert!(
            tokens.windows(2).all(|w| w[0] < w[1]),
            "fencing tokens strictly increase: {tokens:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_instances_sell_exactly_the_stock() {
    const STOCK: i64 = 30;
    let quorum = quorum::shared();
    let _turn = quorum.shared_turn().await;
    let db = RedisServer::start();
    let shop = Shop::open(&db, STOCK).await;
    let mut addrs = Vec::new();
    for backend in quorum.backends(3).await {
        addrs.push(shop.serve(backend).await);
    }
    support::all_served(support::buy_all(&addrs, 90)).await;
    assert_eq!(
        (shop.sold.load(Ordering::SeqCst), shop.left().await),
        (STOCK as u64, 0)
    );
    shop.assert_tokens_increase();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_do_not_poll_while_the_lock_is_held() {
    let quorum = quorum::shared();
    let _turn = quorum.exclusive().await;
    let backends = quorum.backends(3).await;
    // A holder that never renews and never ends on its own: the lock hash written on every
    // master by hand, so that the only script calls are the waiters'.
    let lock = format!("{}:{{k}}", backends[0].namespace());
    let servers: Vec<redis::Client> = quorum
        .urls()
        .iter()
        .map(|u| redis::Client::open(u.as_str()).expect("url"))
        .collect();
    let mut conns = Vec::new();
    for client in &servers {
        let mut conn = client
            .get_multiplexed_async_connection()
            .await
            .expect("connect");
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
            .query_async(&mut conn)
            .await
            .expect("hold by hand");
        conns.push(conn);
    }
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
    for conn in &conns {
        support::eventually("every instance listens on every master", || {
            let (mut conn, channel) = (conn.clone(), channel.clone());
            async move {
                let (_, n): (String, i64) = redis::cmd("PUBSUB")
                    .arg("NUMSUB")
                    .arg(&channel)
                    .query_async(&mut conn)
                    .await
                    .expect("NUMSUB");
                n == 3
            }
        })
        .await;
    }
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
    // Released by hand, as the release script would: deleted and announced everywhere.
    for conn in &mut conns {
        let _: () = redis::pipe()
            .cmd("DEL")
            .arg(&lock)
            .ignore()
            .cmd("PUBLISH")
            .arg(&channel)
            .arg("released")
            .ignore()
            .query_async(conn)
            .await
            .expect("release by hand");
    }
    for waiter in waiters {
        let token = tokio::time::timeout(Duration::from_secs(30), waiter)
            .await
            .expect("served")
            .expect("no panic")
            .expect("acquired once released");
        assert!(token > 1);
    }
}

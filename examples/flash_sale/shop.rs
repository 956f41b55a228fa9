//! The shop each instance runs: one item on sale, its stock and sold counter shared by
//! every instance (in Redis, or in this process's memory), and a buy handler that reads the
//! stock, awaits the payment, then writes the stock back.
//!
//! `tests/it/flash_sale_svg.rs` includes this file with `#[path]`; it depends only on
//! `timeline`, its sibling module.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::routing::post;
use redis::AsyncCommands;
use redis::aio::MultiplexedConnection;
use tower_lock::{LockBackend, LockLayer};

use super::timeline::Recorder;

/// The lock key every buy takes: there is one item on sale.
const ITEM: &str = "item";

/// The routes under `LockLayer`: each layer's `metrics_label`, and the path.
pub const LOCKED_ROUTES: [(&str, &str); 2] = [("buy", "/buy"), ("try-buy", "/try-buy")];

/// How long the payment call takes: the window in which other buyers read the same stock.
const PAYMENT: Duration = Duration::from_millis(5);

/// Where the stock and the sold counter live.
#[derive(Clone)]
pub enum Store {
    /// In Redis, under the run's namespace; each instance has its own connection.
    Redis {
        conn: MultiplexedConnection,
        namespace: Arc<str>,
    },
    /// In this process, shared by the instances it runs.
    Memory(Arc<Mutex<Counts>>),
}

/// The stock and the sold counter of a [`Store::Memory`].
#[derive(Debug, Default)]
pub struct Counts {
    stock: i64,
    sold: i64,
}

/// Namespaces tried before giving up (each attempt draws a new one).
const CLAIMS: usize = 10;

/// A namespace of this run's own on a Redis that others use: a random suffix, claimed with
/// `SETNX` before the run writes anything under it, so that no other run of the demo (nor
/// one that was killed and left its keys) shares it. [`Store::clean_up`] deletes the claim
/// with the rest. `None` if every namespace drawn was taken.
pub async fn claim_namespace(url: &str) -> redis::RedisResult<Option<String>> {
    let mut conn = redis::Client::open(url)?
        .get_multiplexed_async_connection()
        .await?;
    for _ in 0..CLAIMS {
        let suffix = uuid::Uuid::new_v4().simple().to_string();
        let namespace = format!("tower-lock-demo-flash-sale-{}", &suffix[..8]);
        if conn
            .set_nx(format!("{namespace}:claim"), "the flash_sale demo")
            .await?
        {
            return Ok(Some(namespace));
        }
    }
    Ok(None)
}

impl Store {
    /// A store in the Redis at `url`, with a connection of its own.
    pub async fn redis(url: &str, namespace: &str) -> redis::RedisResult<Self> {
        let conn = redis::Client::open(url)?
            .get_multiplexed_async_connection()
            .await?;
        Ok(Store::Redis {
            conn,
            namespace: namespace.into(),
        })
    }

    /// A store in this process's memory; clones share it.
    pub fn memory() -> Self {
        Store::Memory(Arc::default())
    }

    /// Puts `stock` items on sale and sets the sold counter to zero.
    pub async fn restock(&self, stock: i64) -> redis::RedisResult<()> {
        match self {
            Store::Redis { conn, namespace } => {
                let mut conn = conn.clone();
                let _: () = conn.set(format!("{namespace}:stock"), stock).await?;
                conn.del(format!("{namespace}:sold")).await
            }
            Store::Memory(counts) => {
                *lock(counts) = Counts { stock, sold: 0 };
                Ok(())
            }
        }
    }

    /// Items sold since the last restock.
    pub async fn sold(&self) -> redis::RedisResult<i64> {
        match self {
            Store::Redis { conn, namespace } => {
                let sold: Option<i64> = conn.clone().get(format!("{namespace}:sold")).await?;
                Ok(sold.unwrap_or(0))
            }
            Store::Memory(counts) => Ok(lock(counts).sold),
        }
    }

    /// Check-then-act across an await: correct with one request at a time, wrong as soon
    /// as two requests interleave (both read the same stock and sell the same item).
    async fn sell_one(&self) -> redis::RedisResult<StatusCode> {
        let stock = self.stock().await?;
        if stock <= 0 {
            return Ok(StatusCode::GONE);
        }
        tokio::time::sleep(PAYMENT).await;
        match self {
            Store::Redis { conn, namespace } => {
                let mut conn = conn.clone();
                let _: () = conn.set(format!("{namespace}:stock"), stock - 1).await?;
                let _: () = conn.incr(format!("{namespace}:sold"), 1).await?;
            }
            Store::Memory(counts) => {
                let mut counts = lock(counts);
                counts.stock = stock - 1;
                counts.sold += 1;
            }
        }
        Ok(StatusCode::OK)
    }

    async fn stock(&self) -> redis::RedisResult<i64> {
        match self {
            Store::Redis { conn, namespace } => {
                conn.clone().get(format!("{namespace}:stock")).await
            }
            Store::Memory(counts) => Ok(lock(counts).stock),
        }
    }

    /// Deletes every Redis key of the run (stock, counter, locks, fencing counters).
    pub async fn clean_up(&self) -> redis::RedisResult<()> {
        let Store::Redis { conn, namespace } = self else {
            return Ok(());
        };
        let mut conn = conn.clone();
        let mut keys = Vec::new();
        let mut iter = conn
            .scan_match::<_, String>(format!("{namespace}:*"))
            .await?;
        while let Some(key) = futures_util::StreamExt::next(&mut iter).await {
            keys.push(key?);
        }
        drop(iter);
        if !keys.is_empty() {
            let _: () = conn.del(keys).await?;
        }
        Ok(())
    }
}

fn lock(counts: &Mutex<Counts>) -> std::sync::MutexGuard<'_, Counts> {
    // The counts are two integers, always whole: a panic elsewhere cannot break them.
    counts.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Where the handlers of the two pictured routes record their runs.
#[derive(Clone, Default)]
pub struct Recorders {
    /// `/unsafe/buy`.
    pub unlocked: Arc<Recorder>,
    /// `/buy`.
    pub locked: Arc<Recorder>,
}

/// One instance's handler state.
#[derive(Clone)]
struct Till {
    store: Store,
    instance: usize,
    recorder: Option<Arc<Recorder>>,
}

async fn buy(State(till): State<Till>) -> StatusCode {
    let start = Instant::now();
    let status = till
        .store
        .sell_one()
        .await
        .unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    if let Some(recorder) = &till.recorder {
        recorder.record(till.instance, start, status == StatusCode::OK);
    }
    status
}

/// Instance `instance` (from 1) of the shop: `/unsafe/buy` is the handler alone, `/buy`
/// the same handler under `LockLayer` (waits up to 10 s), `/try-buy` under
/// `LockLayer::fail_fast()`.
pub fn app<B: LockBackend>(
    backend: B,
    store: Store,
    instance: usize,
    recorders: &Recorders,
) -> Router {
    let till = |recorder: Option<&Arc<Recorder>>| Till {
        store: store.clone(),
        instance,
        recorder: recorder.cloned(),
    };
    let item = |_: &Request| Some(ITEM);
    let [(buy_label, buy_path), (try_label, try_path)] = LOCKED_ROUTES;
    let waiting = Router::new()
        .route(buy_path, post(buy))
        .route_layer(
            LockLayer::new(backend.clone(), item)
                .wait(Duration::from_secs(10))
                .metrics_label(buy_label),
        )
        .with_state(till(Some(&recorders.locked)));
    let fail_fast = Router::new()
        .route(try_path, post(buy))
        .route_layer(
            LockLayer::new(backend, item)
                .fail_fast()
                .metrics_label(try_label),
        )
        .with_state(till(None));
    Router::new()
        .route("/unsafe/buy", post(buy))
        .with_state(till(Some(&recorders.unlocked)))
        .merge(waiting)
        .merge(fail_fast)
}

/// Serves `app` on a free loopback port until the runtime ends.
pub async fn serve(app: Router) -> std::io::Result<SocketAddr> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move { axum::serve(listener, app).await });
    Ok(addr)
}

//! The oversell test of a store without a database of its own (etcd, ZooKeeper): three
//! instances sell one stock kept in this process, each request reading and writing it in
//! two steps with a yield between, as a careless handler would. Only the lock keeps the
//! sale exact.

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::time::Duration;

use axum::Router;
use axum::extract::{Request, State};
use axum::routing::post;
use tower_lock::{LockBackend, LockLayer};

type Shelf = (Arc<AtomicI64>, Arc<AtomicU64>);

/// One instance's shop: POST /buy sells one item of `stock`, counting it in `sold`.
fn shop(backend: impl LockBackend, (stock, sold): Shelf) -> Router {
    async fn buy(State((stock, sold)): State<Shelf>) -> &'static str {
        let left = stock.load(Ordering::SeqCst);
        if left <= 0 {
            return "sold out";
        }
        tokio::task::yield_now().await;
        tokio::time::sleep(Duration::from_millis(1)).await;
        stock.store(left - 1, Ordering::SeqCst);
        sold.fetch_add(1, Ordering::Relaxed);
        "sold"
    }
    Router::new()
        .route("/buy", post(buy))
        .route_layer(
            LockLayer::new(backend, |_: &Request| Some("stock")).wait(Duration::from_secs(60)),
        )
        .with_state((stock, sold))
}

/// 150 buyers over one shop per backend of `instances`, for a stock of 50: every buyer is
/// served, and exactly the stock is sold.
pub async fn sell_exactly_the_stock(instances: Vec<impl LockBackend>) {
    const STOCK: i64 = 50;
    const BUYERS: usize = 150;
    let shelf: Shelf = (Arc::new(AtomicI64::new(STOCK)), Arc::new(AtomicU64::new(0)));
    let mut addrs = Vec::new();
    for backend in instances {
        addrs.push(super::serve(shop(backend, shelf.clone())).await);
    }
    super::all_served(super::buy_all(&addrs, BUYERS)).await;
    let (stock, sold) = shelf;
    assert_eq!(
        (sold.load(Ordering::Relaxed), stock.load(Ordering::SeqCst)),
        (STOCK as u64, 0)
    );
}

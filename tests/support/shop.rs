//! The oversell test, on any store: three instances sell one stock kept in this process,
//! each request reading and writing it in two steps with a yield between, as a careless
//! handler would. Only the lock keeps the sale exact; each sale records its lock's fencing
//! token, which must strictly increase in the order of the sales.

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::extract::{Request, State};
use axum::routing::post;
use tower_lock::{HeldLock, LockBackend, LockLayer};

/// The stock left, and the fencing token of each sale in the order of the sales.
type Shelf = (Arc<AtomicI64>, Arc<Mutex<Vec<u64>>>);

/// One instance's shop: POST /buy sells one item of the stock, recording its token.
fn shop(backend: impl LockBackend, shelf: Shelf) -> Router {
    async fn buy(lock: HeldLock, State((stock, sales)): State<Shelf>) -> &'static str {
        let left = stock.load(Ordering::SeqCst);
        if left <= 0 {
            return "sold out";
        }
        tokio::task::yield_now().await;
        tokio::time::sleep(Duration::from_millis(1)).await;
        stock.store(left - 1, Ordering::SeqCst);
        sales
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(lock.fencing_token());
        "sold"
    }
    Router::new()
        .route("/buy", post(buy))
        .route_layer(
            LockLayer::new(backend, |_: &Request| Some("stock")).wait(Duration::from_secs(60)),
        )
        .with_state(shelf)
}

/// 150 buyers over one shop per backend of `instances`, for a stock of 50: every buyer is
/// served, exactly the stock is sold, and the sales' tokens strictly increase.
pub async fn sell_exactly_the_stock(instances: Vec<impl LockBackend>) {
    const STOCK: i64 = 50;
    const BUYERS: usize = 150;
    let shelf: Shelf = (Arc::new(AtomicI64::new(STOCK)), Arc::default());
    let mut addrs = Vec::new();
    for backend in instances {
        addrs.push(super::serve(shop(backend, shelf.clone())).await);
    }
    super::all_served(super::buy_all(&addrs, BUYERS)).await;
    let (stock, sales) = shelf;
    let sales = sales.lock().unwrap_or_else(|e| e.into_inner()).clone();
    assert_eq!(
        (sales.len(), stock.load(Ordering::SeqCst)),
        (STOCK as usize, 0)
    );
    assert!(
        sales.windows(2).all(|w| w[0] < w[1]),
        "fencing tokens strictly increase in the order of the sales: {sales:?}"
    );
}

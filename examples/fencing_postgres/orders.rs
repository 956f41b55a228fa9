//! The pattern itself: a table whose rows carry the fencing token of their last write, the
//! guarded `UPDATE`, and a route that writes under `LockLayer`. Shared with
//! `tests/it/fencing_postgres.rs`, which proves its effect.

use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Path, Request, State};
use axum::http::StatusCode;
use axum::routing::post;
use axum::{Extension, Router};
use sqlx::PgPool;
use tokio::sync::Notify;
use tower_lock::{HeldLock, LockBackend, LockLayer, OnLockLost};

/// `token` is the fencing token of the write that set `status` (0: none yet). A token is a
/// `u64` and fits a `BIGINT` (`i64`): tokens are the lock store's clock in microseconds
/// (about 1.8e15 now, below 2^53 until the year 2255) or a counter just above it, and
/// `i64::MAX` is about 9.2e18.
pub const SCHEMA: &str = "CREATE TABLE IF NOT EXISTS fencing_demo_orders (
    id     BIGINT PRIMARY KEY,
    status TEXT   NOT NULL,
    token  BIGINT NOT NULL DEFAULT 0
)";

/// The guarded write: it applies only if no write with this token or a newer one came
/// first. One statement, so no transaction and no row lock is held across the check.
pub const GUARDED_UPDATE: &str = "UPDATE fencing_demo_orders
    SET status = $3, token = $1
    WHERE id = $2 AND token < $1";

/// What a guarded write did.
#[derive(Debug, PartialEq, Eq)]
pub enum Written {
    Yes,
    /// Refused: a write under `newer`, a later holder's token, came first.
    Stale {
        newer: i64,
    },
    NoSuchOrder,
}

/// Sets order `id`'s status under the fencing `token` of the lock held for it.
pub async fn set_status(
    db: &PgPool,
    id: i64,
    status: &str,
    token: u64,
) -> Result<Written, sqlx::Error> {
    // Never fails for a token of this crate (see SCHEMA); an error beats a wrapped value.
    let token = i64::try_from(token).map_err(|e| sqlx::Error::Encode(Box::new(e)))?;
    let updated = sqlx::query(GUARDED_UPDATE)
        .bind(token)
        .bind(id)
        .bind(status)
        .execute(db)
        .await?;
    if updated.rows_affected() == 1 {
        return Ok(Written::Yes);
    }
    let newer = sqlx::query_scalar("SELECT token FROM fencing_demo_orders WHERE id = $1")
        .bind(id)
        .fetch_optional(db)
        .await?;
    Ok(newer.map_or(Written::NoSuchOrder, |newer| Written::Stale { newer }))
}

/// One app instance: its database pool, its name (it pays as "paid by NAME"), and its
/// payment provider, which answers at once or, when slow, only once notified.
#[derive(Clone)]
pub struct Shop {
    pub db: PgPool,
    pub name: &'static str,
    pub slow_provider: Option<Arc<Notify>>,
}

/// `POST /orders/{id}/pay` under the order's lock.
pub fn router(backend: impl LockBackend, shop: Shop) -> Router {
    let lock = LockLayer::new(backend, order_key)
        .wait(Duration::from_secs(5))
        // A handler that lost its lock runs on here, as a paused process would not know
        // it lost it: the token keeps its late write from overwriting a newer one. (The
        // default drops the handler and answers 503.)
        .on_lock_lost(OnLockLost::Continue);
    Router::new()
        .route("/orders/{id}/pay", post(pay))
        .route_layer(lock)
        .with_state(shop)
}

fn order_key(req: &Request) -> Option<String> {
    let id = req
        .uri()
        .path()
        .strip_prefix("/orders/")?
        .split('/')
        .next()?;
    Some(format!("order:{id}"))
}

async fn pay(
    State(shop): State<Shop>,
    Path(id): Path<i64>,
    Extension(lock): Extension<HeldLock>,
) -> (StatusCode, String) {
    if let Some(provider) = &shop.slow_provider {
        provider.notified().await;
    }
    let status = format!("paid by {}", shop.name);
    let token = lock.fencing_token();
    match set_status(&shop.db, id, &status, token).await {
        Ok(Written::Yes) => (StatusCode::OK, format!("{status} under token {token}")),
        Ok(Written::Stale { newer }) => (
            StatusCode::CONFLICT,
            format!("refused: token {token} is older than {newer}, which wrote first"),
        ),
        Ok(Written::NoSuchOrder) => (StatusCode::NOT_FOUND, format!("no order {id}")),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, format!("database: {e}")),
    }
}

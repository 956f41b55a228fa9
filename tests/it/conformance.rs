//! The conformance suite: what every store keeps, written once and run on every store
//! (Redis, the quorum, memory, PostgreSQL, MariaDB, etcd and ZooKeeper). The bodies that
//! take three instances of a store run from the one list of stores of
//! [`for_each_store_and_consensus!`] (here across instances, `semantics` on one); those
//! that count a server's calls run on a server of their own
//! ([`Counted`](crate::support::counted::Counted)). Shared holds, permits, multi-key
//! locks, inspect and force-release, and idempotency records run from the same list in
//! rwlock.rs, semaphore.rs, many.rs, inspect.rs and idempotency.rs.

mod semantics;

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Duration;

use axum::Router;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::routing::post;
use tower_lock::{HeldLock, LockBackend, LockLayer, PathParams};

use crate::support;

/// Three instances under `LockLayer` sell a stock kept in this process, each buyer
/// reading and writing it in two steps: exactly the stock is sold, every buyer is served,
/// and the sales' fencing tokens strictly increase.
async fn three_instances_sell_exactly_the_stock<B: LockBackend>(b: [B; 3]) {
    support::shop::sell_exactly_the_stock(b.to_vec()).await;
}

type Accounts = Arc<Vec<AtomicI64>>;

/// Moves `amount` between two accounts kept in this process: reads both balances, yields
/// (other requests run meanwhile), then writes both. Without both locks, transfers lose
/// money or overdraw.
async fn transfer(
    State(accounts): State<Accounts>,
    Path((from, to, amount)): Path<(usize, usize, i64)>,
    lock: HeldLock,
) -> StatusCode {
    assert_eq!(lock.keys().count(), 2, "a token per account: {lock:?}");
    let (from_balance, to_balance) = (
        accounts[from].load(Ordering::SeqCst),
        accounts[to].load(Ordering::SeqCst),
    );
    if from_balance < amount {
        return StatusCode::UNPROCESSABLE_ENTITY;
    }
    tokio::time::sleep(Duration::from_millis(1)).await;
    accounts[from].store(from_balance - amount, Ordering::SeqCst);
    accounts[to].store(to_balance + amount, Ordering::SeqCst);
    StatusCode::OK
}

/// 150 transfers between five accounts over three instances, each taking both accounts'
/// locks in the order the request names them (the layer sorts them): every transfer
/// finishes (no deadlock), none overdraws, and no money is lost or made.
async fn concurrent_transfers_in_random_order_neither_deadlock_nor_lose_money<B: LockBackend>(
    b: [B; 3],
) {
    const ACCOUNTS: usize = 5;
    const OPENING: i64 = 100;
    let accounts: Accounts = Arc::new((0..ACCOUNTS).map(|_| AtomicI64::new(OPENING)).collect());
    let mut addrs = Vec::new();
    for backend in b {
        let layer = LockLayer::new(backend, PathParams::new(["from", "to"]).prefix("account"))
            .wait(Duration::from_secs(30));
        let app = Router::new()
            .route("/transfer/{from}/{to}/{amount}", post(transfer))
            .route_layer(layer)
            .with_state(accounts.clone());
        addrs.push(support::serve(app).await);
    }
    let client = support::http_client();
    let transfers: Vec<_> = (0..150)
        .map(|n| {
            let from = fastrand::usize(0..ACCOUNTS);
            let to = (from + fastrand::usize(1..ACCOUNTS)) % ACCOUNTS;
            let amount = fastrand::i64(1..=60);
            let (client, addr) = (client.clone(), addrs[n % addrs.len()]);
            tokio::spawn(async move {
                let path = format!("/transfer/{from}/{to}/{amount}");
                support::post(&client, addr, &path).await.status
            })
        })
        .collect();
    for transfer in transfers {
        let status = tokio::time::timeout(Duration::from_secs(60), transfer)
            .await
            .expect("no deadlock: every transfer finishes")
            .expect("no panic");
        assert!(
            [200, 422].contains(&status),
            "every transfer ran (200) or found too little money (422): {status}"
        );
    }
    let balances: Vec<i64> = accounts.iter().map(|a| a.load(Ordering::SeqCst)).collect();
    assert!(balances.iter().all(|b| *b >= 0), "overdrawn: {balances:?}");
    assert_eq!(balances.iter().sum::<i64>(), OPENING * ACCOUNTS as i64);
}

for_each_store_and_consensus!(
    three_instances_sell_exactly_the_stock,
    concurrent_transfers_in_random_order_neither_deadlock_nor_lose_money;
    not on etcd or zookeeper:
);

/// `on_STORE::NAME` for each body `async fn NAME<S: Counted>()`, on every store but
/// memory (which has no server to count the calls of) and the quorum, whose own test holds
/// by hand (quorum.rs: it shortens leases to its `max_lease`, so a holder's renewals
/// would be counted).
macro_rules! on_each_counted_store {
    ($($name:ident),* $(,)?) => {
        on_each_counted_store!(@ on_redis, Redis, crate::support::RedisServer; $($name),*);
        on_each_counted_store!(
            @ on_postgres, Postgres, crate::support::postgres::PostgresServer; $($name),*
        );
        on_each_counted_store!(
            @ on_mariadb, MariaDb, crate::support::mariadb::MariaDbServer; $($name),*
        );
        #[cfg(feature = "etcd")]
        on_each_counted_store!(@ on_etcd, Etcd, crate::support::etcd::EtcdServer; $($name),*);
        on_each_counted_store!(
            @ on_zookeeper, ZooKeeper, crate::support::zookeeper::ZkServer; $($name),*
        );
    };
    (@ $module:ident, $store:ident, $server:ty; $($name:ident),*) => {
        mod $module {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    crate::needs!($store);
                    super::$name::<$server>().await;
                }
            )*
        }
    };
}

/// The bodies that count a server's calls, each on a server of its own.
mod counted {
    use super::*;
    use crate::support::counted::{Counted, FAR, all_served, spawn_waiters};

    /// Ten waiters over two instances behind a third's hold: each instance has one contender
    /// waiting in the store and four tasks queued behind it in memory; once the contenders
    /// have tried, registered for wake-ups and tried again, the server sees no attempt while
    /// the lock is held. The release wakes them all.
    async fn waiters_do_not_poll_while_the_lock_is_held<S: Counted>() {
        let server = S::start().await;
        let holder = server.instance().await;
        let waiting = [server.instance().await, server.instance().await];
        let guard = holder.lock("k").lease(FAR).try_once().await;
        let guard = guard.expect("uncontended");
        let start = server.attempts().await;
        let waiters = spawn_waiters(&waiting, "k", 10);
        server.registered(&waiting, 4).await;
        server.settled(start, 2).await;
        let before = server.attempts().await;
        // Far longer than any polling interval, far shorter than the lease: an attempt in
        // this window was not asked for by the lock.
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert_eq!(
            server.attempts().await,
            before,
            "no attempt while the lock is held"
        );
        guard.release().await.expect("release");
        all_served(waiters).await;
        // Woken through the connection that listened all along.
        for backend in &waiting {
            assert_eq!(S::stats(backend).subscriber_connections_made, 1);
        }
    }

    on_each_counted_store!(waiters_do_not_poll_while_the_lock_is_held);
}
